use std::collections::{BTreeSet, HashMap};

use crate::{Attr, Attribute, IrError, IrResult, Tensor, ValueType};

/// Index of a value in its graph's value arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// Index of a node in its graph's node arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// Where a value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// A graph input (it may also carry an initializer, which is then its default).
    Input,
    /// A constant initializer that is not a graph input.
    Initializer,
    /// Produced by a node.
    NodeOutput,
    /// Defined in an enclosing graph and read here by name (subgraph capture).
    Outer,
}

/// A value (an edge of the dataflow graph).
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    pub name: String,
    /// Declared or inferred type.
    pub ty: Option<ValueType>,
    pub doc_string: String,
    pub metadata_props: Vec<(String, String)>,
    /// Whether the value is listed in the graph's `value_info` when saved.
    pub in_value_info: bool,
    kind: ValueKind,
    initializer: Option<Tensor>,
    producer: Option<(NodeId, usize)>,
    /// Node inputs reading this value, as (node, input index). Implicit reads by subgraphs
    /// (captures) use index `usize::MAX`.
    uses: Vec<(NodeId, usize)>,
}

impl Value {
    pub fn kind(&self) -> ValueKind {
        self.kind
    }
    /// The constant data of an initializer (or the default of an input).
    pub fn initializer(&self) -> Option<&Tensor> {
        self.initializer.as_ref()
    }
    pub fn producer(&self) -> Option<(NodeId, usize)> {
        self.producer
    }
    pub fn uses(&self) -> &[(NodeId, usize)] {
        &self.uses
    }
    /// A constant: an initializer that no graph input can override.
    pub fn is_constant(&self) -> bool {
        self.kind == ValueKind::Initializer
    }
}

/// Input index recorded in [`Value::uses`] for a subgraph's implicit read.
pub const CAPTURE_USE: usize = usize::MAX;

/// An operator application.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Node {
    pub name: String,
    pub op_type: String,
    /// Operator domain; `""` is the default ONNX domain (`ai.onnx`).
    pub domain: String,
    pub overload: String,
    /// Inputs; `None` is an omitted optional input.
    pub inputs: Vec<Option<ValueId>>,
    /// Outputs; `None` is an omitted optional output.
    pub outputs: Vec<Option<ValueId>>,
    pub attrs: Vec<Attribute>,
    pub doc_string: String,
    pub metadata_props: Vec<(String, String)>,
    /// Values of this graph that the node's subgraphs read by name. Maintained by the graph.
    captures: Vec<ValueId>,
}

impl Node {
    pub fn new(op_type: impl Into<String>, name: impl Into<String>) -> Node {
        Node { op_type: op_type.into(), name: name.into(), ..Default::default() }
    }
    pub fn with_inputs(mut self, inputs: impl IntoIterator<Item = ValueId>) -> Node {
        self.inputs = inputs.into_iter().map(Some).collect();
        self
    }
    pub fn with_outputs(mut self, outputs: impl IntoIterator<Item = ValueId>) -> Node {
        self.outputs = outputs.into_iter().map(Some).collect();
        self
    }
    pub fn with_attr(mut self, name: &str, value: Attr) -> Node {
        self.attrs.push(Attribute::new(name, value));
        self
    }
    pub fn attr(&self, name: &str) -> Option<&Attr> {
        self.attrs.iter().find(|a| a.name == name).map(|a| &a.value)
    }
    pub fn attr_int(&self, name: &str) -> Option<i64> {
        match self.attr(name)? {
            Attr::Int(v) => Some(*v),
            _ => None,
        }
    }
    pub fn attr_float(&self, name: &str) -> Option<f32> {
        match self.attr(name)? {
            Attr::Float(v) => Some(*v),
            _ => None,
        }
    }
    pub fn attr_ints(&self, name: &str) -> Option<&[i64]> {
        match self.attr(name)? {
            Attr::Ints(v) => Some(v),
            _ => None,
        }
    }
    pub fn attr_str(&self, name: &str) -> Option<&str> {
        match self.attr(name)? {
            Attr::String(v) => std::str::from_utf8(v).ok(),
            _ => None,
        }
    }
    /// The i-th input, if present.
    pub fn input(&self, i: usize) -> Option<ValueId> {
        self.inputs.get(i).copied().flatten()
    }
    /// The i-th output, if present.
    pub fn output(&self, i: usize) -> Option<ValueId> {
        self.outputs.get(i).copied().flatten()
    }
    /// Values of the enclosing graph that this node's subgraphs read.
    pub fn captures(&self) -> &[ValueId] {
        &self.captures
    }
    /// Subgraphs held in attributes, with the attribute name.
    pub fn subgraphs(&self) -> impl Iterator<Item = (&str, &Graph)> {
        self.attrs.iter().flat_map(|a| a.value.graphs().into_iter().map(move |g| (a.name.as_str(), g)))
    }
    /// Whether the node is an operator of the default ONNX domain (`""` or `ai.onnx`).
    pub fn is_default_domain(&self) -> bool {
        self.domain.is_empty() || self.domain == "ai.onnx"
    }
    /// The tensor a `Constant` node (default domain) produces, from whichever value attribute
    /// it carries; `None` for other nodes and for sparse values.
    pub fn constant_tensor(&self) -> Option<Tensor> {
        if self.op_type != "Constant" || !self.is_default_domain() || self.attrs.len() != 1 {
            return None;
        }
        let a = &self.attrs[0];
        match (&a.value, a.name.as_str()) {
            (Attr::Tensor(t), "value") => Some(t.clone()),
            (Attr::Float(f), "value_float") => Some(Tensor::scalar(*f)),
            (Attr::Int(i), "value_int") => Some(Tensor::scalar(*i)),
            (Attr::Floats(v), "value_floats") => Tensor::from_slice(&[v.len()], v).ok(),
            (Attr::Ints(v), "value_ints") => Tensor::from_slice(&[v.len()], v).ok(),
            (Attr::String(s), "value_string") => Tensor::from_strings(&[], vec![s.clone()]).ok(),
            (Attr::Strings(v), "value_strings") => Tensor::from_strings(&[v.len()], v.clone()).ok(),
            _ => None,
        }
    }
    /// `domain::op_type`, or just `op_type` in the default domain.
    pub fn qualified_op(&self) -> String {
        if self.is_default_domain() {
            self.op_type.clone()
        } else {
            format!("{}::{}", self.domain, self.op_type)
        }
    }
    /// The node's name, or a description when it has none.
    pub fn display_name(&self, id: NodeId) -> String {
        if self.name.is_empty() { format!("#{} ({})", id.0, self.op_type) } else { self.name.clone() }
    }
}

/// An SSA dataflow graph: ONNX `GraphProto`.
///
/// Nodes and values live in arenas indexed by [`NodeId`] and [`ValueId`]; removed entries
/// leave holes so ids stay stable. The producer and uses of every value are maintained by the
/// graph; nodes are added with [`Graph::add_node`] and edited with [`Graph::apply`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Graph {
    pub name: String,
    pub doc_string: String,
    pub metadata_props: Vec<(String, String)>,
    /// Encoded `GraphProto` fields the IR does not model (kept by the ONNX layer for round trips).
    pub extra: Vec<u8>,
    pub(crate) nodes: Vec<Option<Node>>,
    pub(crate) values: Vec<Option<Value>>,
    pub(crate) inputs: Vec<ValueId>,
    pub(crate) outputs: Vec<ValueId>,
    pub(crate) by_name: HashMap<String, ValueId>,
}

/// Steps `(node, graph attribute)` from a graph to one of its nested subgraphs; empty for the
/// graph itself.
pub type GraphPath = Vec<(NodeId, String)>;

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Default::default() }
    }

    fn err(&self, what: impl Into<String>) -> IrError {
        IrError::Invalid { graph: self.name.clone(), what: what.into() }
    }

    fn push_value(&mut self, name: String, kind: ValueKind, ty: Option<ValueType>, init: Option<Tensor>) -> IrResult<ValueId> {
        if !name.is_empty() && self.by_name.contains_key(&name) {
            return Err(IrError::DuplicateValue { graph: self.name.clone(), value: name });
        }
        let id = ValueId(u32::try_from(self.values.len()).map_err(|_| self.err("too many values"))?);
        if !name.is_empty() {
            self.by_name.insert(name.clone(), id);
        }
        self.values.push(Some(Value {
            name,
            ty,
            doc_string: String::new(),
            metadata_props: vec![],
            in_value_info: false,
            kind,
            initializer: init,
            producer: None,
            uses: vec![],
        }));
        Ok(id)
    }

    /// Adds a graph input (appended to the input list).
    pub fn add_input(&mut self, name: impl Into<String>, ty: Option<ValueType>) -> IrResult<ValueId> {
        let id = self.push_value(name.into(), ValueKind::Input, ty, None)?;
        self.inputs.push(id);
        Ok(id)
    }

    /// Adds a constant initializer; its type is taken from the tensor.
    pub fn add_initializer(&mut self, name: impl Into<String>, tensor: Tensor) -> IrResult<ValueId> {
        let ty = ValueType::tensor_of(tensor.dtype(), &tensor.shape().iter().map(|&d| d as i64).collect::<Vec<_>>());
        self.push_value(name.into(), ValueKind::Initializer, Some(ty), Some(tensor))
    }

    /// Sets the default value of a graph input, or replaces the data of an initializer.
    pub fn set_initializer(&mut self, id: ValueId, tensor: Tensor) -> IrResult<()> {
        let graph = self.name.clone();
        let v = self.value_mut(id)?;
        match v.kind {
            ValueKind::Input | ValueKind::Initializer => {
                v.initializer = Some(tensor);
                Ok(())
            }
            _ => Err(IrError::Invalid { graph, what: format!("value '{}' cannot hold an initializer", v.name) }),
        }
    }

    /// Declares a value defined in an enclosing graph and read here by name.
    pub fn add_outer(&mut self, name: impl Into<String>) -> IrResult<ValueId> {
        self.push_value(name.into(), ValueKind::Outer, None, None)
    }

    /// Creates a value to be produced by a node added later. An empty name makes an anonymous
    /// value; [`Graph::check`] rejects values left without a producer.
    pub fn new_value(&mut self, name: impl Into<String>, ty: Option<ValueType>) -> IrResult<ValueId> {
        self.push_value(name.into(), ValueKind::NodeOutput, ty, None)
    }

    /// A name starting with `prefix` that no value of this graph has yet.
    pub fn unique_name(&self, prefix: &str) -> String {
        if !self.by_name.contains_key(prefix) {
            return prefix.to_string();
        }
        (1..).map(|i| format!("{prefix}_{i}")).find(|n| !self.by_name.contains_key(n)).expect("unbounded")
    }

    /// Appends a node. Its inputs must exist; its outputs must be values made with
    /// [`Graph::new_value`] that no other node produces. Subgraph captures are resolved here:
    /// names not defined in this graph become [`ValueKind::Outer`] values.
    pub fn add_node(&mut self, mut node: Node) -> IrResult<NodeId> {
        let id = NodeId(u32::try_from(self.nodes.len()).map_err(|_| self.err("too many nodes"))?);
        let label = node.display_name(id);
        for v in node.inputs.iter().flatten() {
            if self.value_opt(*v).is_none() {
                return Err(IrError::DanglingValue { graph: self.name.clone(), node: label, op: node.op_type.clone(), value: v.0 });
            }
        }
        for (i, v) in node.outputs.iter().enumerate() {
            let Some(v) = v else { continue };
            let val = self.value_opt(*v).ok_or_else(|| IrError::DanglingValue {
                graph: self.name.clone(), node: label.clone(), op: node.op_type.clone(), value: v.0,
            })?;
            if val.kind != ValueKind::NodeOutput || val.producer.is_some() || node.outputs[..i].contains(&Some(*v)) {
                return Err(IrError::DuplicateValue { graph: self.name.clone(), value: val.name.clone() });
            }
        }
        let mut captured = BTreeSet::new();
        for a in &node.attrs {
            for g in a.value.graphs() {
                captured.extend(g.outer_names());
            }
        }
        node.captures.clear();
        for name in captured {
            let v = match self.by_name.get(&name) {
                Some(v) => *v,
                None => self.add_outer(name)?,
            };
            node.captures.push(v);
        }
        for (i, v) in node.inputs.iter().enumerate() {
            if let Some(v) = v {
                self.values[v.0 as usize].as_mut().unwrap().uses.push((id, i));
            }
        }
        for v in &node.captures {
            self.values[v.0 as usize].as_mut().unwrap().uses.push((id, CAPTURE_USE));
        }
        for (i, v) in node.outputs.iter().enumerate() {
            if let Some(v) = v {
                self.values[v.0 as usize].as_mut().unwrap().producer = Some((id, i));
            }
        }
        self.nodes.push(Some(node));
        Ok(id)
    }

    /// Names read from enclosing scopes by this graph or its nested subgraphs.
    pub fn outer_names(&self) -> Vec<String> {
        self.values().filter(|(_, v)| v.kind == ValueKind::Outer).map(|(_, v)| v.name.clone()).collect()
    }

    pub fn set_inputs(&mut self, inputs: Vec<ValueId>) -> IrResult<()> {
        for v in &inputs {
            if self.value(*v)?.kind != ValueKind::Input {
                return Err(self.err(format!("'{}' is not an input value", self.value(*v)?.name)));
            }
        }
        self.inputs = inputs;
        Ok(())
    }

    /// Turns graph input `v` into a value read by name from an enclosing graph under `name`:
    /// it leaves the input list, loses any default, and its readers keep reading it. Fails when
    /// a nested subgraph reads `v` (it does so by the old name) or `name` is taken.
    pub fn input_to_outer(&mut self, v: ValueId, name: &str) -> IrResult<()> {
        let val = self.value(v)?;
        if val.kind != ValueKind::Input || !self.inputs.contains(&v) {
            return Err(self.err(format!("'{}' is not an input", val.name)));
        }
        if val.uses.iter().any(|u| u.1 == CAPTURE_USE) {
            return Err(self.err(format!("input '{}' is read by name by a nested graph", val.name)));
        }
        self.rename_value(v, name)?;
        self.inputs.retain(|i| *i != v);
        let val = self.value_mut(v)?;
        val.kind = ValueKind::Outer;
        val.initializer = None;
        Ok(())
    }

    /// Removes node `id` and makes each of its outputs a value read by name from an enclosing
    /// graph, under the same name, so that every reader, nested subgraphs included, keeps
    /// reading it: the enclosing graph must define it from then on. Fails when an output is a
    /// graph output.
    pub fn detach_node_to_outer(&mut self, id: NodeId) -> IrResult<()> {
        let node = self.node(id)?;
        if let Some(v) = node.outputs.iter().flatten().find(|v| self.outputs.contains(v)) {
            return Err(self.err(format!("'{}' is a graph output", self.value_name(*v))));
        }
        let node = self.remove_node_raw(id);
        for v in node.outputs.iter().flatten() {
            let val = self.values[v.0 as usize].as_mut().expect("a live node's output");
            val.kind = ValueKind::Outer;
        }
        Ok(())
    }

    /// The data of a constant value: a constant initializer's, or the tensor a `Constant`
    /// node makes.
    pub fn constant_data(&self, v: ValueId) -> Option<Tensor> {
        let val = self.value(v).ok()?;
        if val.is_constant() {
            return val.initializer().cloned();
        }
        let (p, _) = val.producer()?;
        self.node(p).ok()?.constant_tensor()
    }

    /// Removes node `id` and makes each of its outputs an initializer holding the matching
    /// tensor of `outputs`, under the same id and name, so that every reader, nested subgraphs
    /// included, keeps reading it. Fails when an output is a graph output or `outputs` has
    /// fewer tensors than the node has outputs.
    pub fn replace_node_by_constants(&mut self, id: NodeId, outputs: Vec<Tensor>) -> IrResult<()> {
        let node = self.node(id)?;
        if outputs.len() < node.outputs.len() {
            return Err(self.err(format!("node '{}' has {} outputs, not {}", node.name, node.outputs.len(), outputs.len())));
        }
        if let Some(v) = node.outputs.iter().flatten().find(|v| self.outputs.contains(v)) {
            return Err(self.err(format!("'{}' is a graph output", self.value_name(*v))));
        }
        let node = self.remove_node_raw(id);
        for (v, t) in node.outputs.iter().zip(outputs) {
            let Some(v) = v else { continue };
            let val = self.values[v.0 as usize].as_mut().expect("a live node's output");
            val.ty = Some(ValueType::tensor_of(t.dtype(), &t.shape().iter().map(|&d| d as i64).collect::<Vec<_>>()));
            val.kind = ValueKind::Initializer;
            val.initializer = Some(t);
        }
        Ok(())
    }

    /// Turns every graph input that carries a default (an initializer also listed as an input)
    /// into a constant initializer, dropping it from the input list. Returns the values turned.
    pub fn make_input_defaults_constant(&mut self) -> Vec<ValueId> {
        let turned: Vec<ValueId> = self.inputs.iter().copied()
            .filter(|v| self.values[v.0 as usize].as_ref().is_some_and(|x| x.initializer.is_some()))
            .collect();
        for v in &turned {
            if let Some(x) = self.values[v.0 as usize].as_mut() {
                x.kind = ValueKind::Initializer;
            }
        }
        self.inputs.retain(|v| !turned.contains(v));
        turned
    }

    pub fn set_outputs(&mut self, outputs: Vec<ValueId>) -> IrResult<()> {
        for v in &outputs {
            self.value(*v)?;
        }
        self.outputs = outputs;
        Ok(())
    }

    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    /// Inputs that have no initializer (the ones a caller must feed).
    pub fn real_inputs(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.inputs.iter().copied().filter(|v| self.values[v.0 as usize].as_ref().is_some_and(|x| x.initializer.is_none()))
    }

    /// Values with constant data (initializers and input defaults), in arena order.
    pub fn initializers(&self) -> impl Iterator<Item = (ValueId, &Value)> {
        self.values().filter(|(_, v)| v.initializer.is_some())
    }

    pub fn node(&self, id: NodeId) -> IrResult<&Node> {
        self.nodes.get(id.0 as usize).and_then(|n| n.as_ref()).ok_or_else(|| self.err(format!("no node #{}", id.0)))
    }

    /// Live nodes in arena order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| n.as_ref().map(|n| (NodeId(i as u32), n)))
    }

    pub fn node_count(&self) -> usize {
        self.nodes.iter().filter(|n| n.is_some()).count()
    }

    fn value_opt(&self, id: ValueId) -> Option<&Value> {
        self.values.get(id.0 as usize).and_then(|v| v.as_ref())
    }

    pub fn value(&self, id: ValueId) -> IrResult<&Value> {
        self.value_opt(id).ok_or_else(|| self.err(format!("no value #{}", id.0)))
    }

    /// Mutable access to a value's descriptive fields (type, docs, metadata).
    pub fn value_mut(&mut self, id: ValueId) -> IrResult<&mut Value> {
        let name = self.name.clone();
        self.values.get_mut(id.0 as usize).and_then(|v| v.as_mut())
            .ok_or(IrError::Invalid { graph: name, what: format!("no value #{}", id.0) })
    }

    /// Live values in arena order.
    pub fn values(&self) -> impl Iterator<Item = (ValueId, &Value)> {
        self.values.iter().enumerate().filter_map(|(i, v)| v.as_ref().map(|v| (ValueId(i as u32), v)))
    }

    pub fn value_by_name(&self, name: &str) -> Option<ValueId> {
        self.by_name.get(name).copied()
    }

    /// The value's name, or `#id` for anonymous and missing values.
    pub fn value_name(&self, id: ValueId) -> String {
        match self.value_opt(id) {
            Some(v) if !v.name.is_empty() => v.name.clone(),
            _ => format!("#{}", id.0),
        }
    }

    /// Renames a value. Names read by subgraphs cannot be changed this way.
    pub fn rename_value(&mut self, id: ValueId, name: impl Into<String>) -> IrResult<()> {
        let name = name.into();
        if let Some(other) = self.by_name.get(&name) {
            if *other == id {
                return Ok(());
            }
            return Err(IrError::DuplicateValue { graph: self.name.clone(), value: name });
        }
        let v = self.value(id)?;
        if v.kind == ValueKind::Outer || v.uses.iter().any(|u| u.1 == CAPTURE_USE) {
            return Err(self.err(format!("value '{}' is read by name across graph scopes and cannot be renamed", v.name)));
        }
        let old = v.name.clone();
        self.by_name.remove(&old);
        self.by_name.insert(name.clone(), id);
        self.value_mut(id)?.name = name;
        Ok(())
    }

    /// This graph and every subgraph nested in it (If/Loop/Scan bodies, depth-first, nodes
    /// in id order), each with its [`GraphPath`] from this graph; this graph comes first.
    pub fn graphs(&self) -> Vec<(GraphPath, &Graph)> {
        fn walk<'a>(g: &'a Graph, path: GraphPath, out: &mut Vec<(GraphPath, &'a Graph)>) {
            out.push((path.clone(), g));
            let mut nodes: Vec<_> = g.nodes().collect();
            nodes.sort_by_key(|(id, _)| *id);
            for (id, n) in nodes {
                for a in &n.attrs {
                    if let Attr::Graph(sub) = &a.value {
                        let mut p = path.clone();
                        p.push((id, a.name.clone()));
                        walk(sub, p, out);
                    }
                }
            }
        }
        let mut out = vec![];
        walk(self, vec![], &mut out);
        out
    }

    /// The subgraph at `path` (from [`Graph::graphs`]), mutably; `None` when the path does not
    /// lead to a graph attribute.
    pub fn graph_at_mut(&mut self, path: &[(NodeId, String)]) -> Option<&mut Graph> {
        let Some(((id, attr), rest)) = path.split_first() else { return Some(self) };
        let attrs = self.node_attrs_mut(*id).ok()?;
        let a = attrs.iter_mut().find(|a| a.name == *attr)?;
        match &mut a.value {
            Attr::Graph(sub) => sub.graph_at_mut(rest),
            _ => None,
        }
    }

    /// Mutable access to a node's attributes. Subgraphs edited through this must not change
    /// which outer names they read; use [`Graph::apply`] for structural edits.
    pub fn node_attrs_mut(&mut self, id: NodeId) -> IrResult<&mut Vec<Attribute>> {
        let name = self.name.clone();
        self.nodes.get_mut(id.0 as usize).and_then(|n| n.as_mut()).map(|n| &mut n.attrs)
            .ok_or(IrError::Invalid { graph: name, what: format!("no node #{}", id.0) })
    }

    /// Sets a node's name, doc string or other descriptive fields.
    pub fn node_name_mut(&mut self, id: NodeId) -> IrResult<&mut String> {
        let name = self.name.clone();
        self.nodes.get_mut(id.0 as usize).and_then(|n| n.as_mut()).map(|n| &mut n.name)
            .ok_or(IrError::Invalid { graph: name, what: format!("no node #{}", id.0) })
    }

    /// The node producing a value, with the output index.
    pub fn producer(&self, v: ValueId) -> Option<(NodeId, usize)> {
        self.value_opt(v)?.producer
    }

    /// Node inputs that read a value (captures included, with index [`CAPTURE_USE`]).
    pub fn consumers(&self, v: ValueId) -> &[(NodeId, usize)] {
        self.value_opt(v).map(|v| v.uses.as_slice()).unwrap_or(&[])
    }

    /// Whether a value is one of the graph outputs.
    pub fn is_output(&self, v: ValueId) -> bool {
        self.outputs.contains(&v)
    }

    /// Nodes in a topological order. Among ready nodes, the one earliest in arena order comes
    /// first, so a graph that is already sorted keeps its order.
    pub fn topo_order(&self) -> IrResult<Vec<NodeId>> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let mut pending = vec![0usize; self.nodes.len()];
        let mut heap = BinaryHeap::new();
        for (id, n) in self.nodes() {
            let deps = n.inputs.iter().flatten().chain(n.captures.iter())
                .filter(|v| self.values[v.0 as usize].as_ref().is_some_and(|v| v.producer.is_some()))
                .count();
            pending[id.0 as usize] = deps;
            if deps == 0 {
                heap.push(Reverse(id.0));
            }
        }
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some(Reverse(i)) = heap.pop() {
            let n = self.nodes[i as usize].as_ref().unwrap();
            order.push(NodeId(i));
            for out in n.outputs.iter().flatten() {
                for (user, _) in &self.values[out.0 as usize].as_ref().unwrap().uses {
                    let p = &mut pending[user.0 as usize];
                    *p -= 1;
                    if *p == 0 {
                        heap.push(Reverse(user.0));
                    }
                }
            }
        }
        if order.len() != self.node_count() {
            let done: BTreeSet<_> = order.iter().collect();
            let nodes = self.nodes().filter(|(id, _)| !done.contains(id)).map(|(id, n)| n.display_name(id)).take(10).collect();
            return Err(IrError::Cycle { graph: self.name.clone(), nodes });
        }
        Ok(order)
    }

    /// Reorders the node arena into topological order (ids change; values keep theirs).
    pub fn sort_nodes(&mut self) -> IrResult<()> {
        let order = self.topo_order()?;
        let mut remap = vec![u32::MAX; self.nodes.len()];
        for (new, old) in order.iter().enumerate() {
            remap[old.0 as usize] = new as u32;
        }
        let mut old_nodes = std::mem::take(&mut self.nodes);
        self.nodes = order.iter().map(|id| old_nodes[id.0 as usize].take()).collect();
        for v in self.values.iter_mut().flatten() {
            if let Some((n, i)) = v.producer {
                v.producer = Some((NodeId(remap[n.0 as usize]), i));
            }
            for u in &mut v.uses {
                u.0 = NodeId(remap[u.0 .0 as usize]);
            }
        }
        Ok(())
    }

    pub(crate) fn remove_node_raw(&mut self, id: NodeId) -> Node {
        let node = self.nodes[id.0 as usize].take().expect("live node");
        for v in node.inputs.iter().flatten().chain(node.captures.iter()) {
            if let Some(val) = self.values[v.0 as usize].as_mut() {
                val.uses.retain(|u| u.0 != id);
            }
        }
        for v in node.outputs.iter().flatten() {
            if let Some(val) = self.values[v.0 as usize].as_mut() {
                val.producer = None;
            }
        }
        node
    }

    pub(crate) fn remove_value_raw(&mut self, id: ValueId) {
        if let Some(v) = self.values[id.0 as usize].take() {
            self.by_name.remove(&v.name);
        }
    }

    pub(crate) fn set_input_raw(&mut self, node: NodeId, index: usize, v: ValueId) {
        let n = self.nodes[node.0 as usize].as_mut().unwrap();
        let old = n.inputs[index].replace(v);
        if let Some(old) = old {
            let uses = &mut self.values[old.0 as usize].as_mut().unwrap().uses;
            if let Some(pos) = uses.iter().position(|u| *u == (node, index)) {
                uses.swap_remove(pos);
            }
        }
        self.values[v.0 as usize].as_mut().unwrap().uses.push((node, index));
    }

    pub(crate) fn values_len(&self) -> usize {
        self.values.len()
    }

    pub(crate) fn nodes_len(&self) -> usize {
        self.nodes.len()
    }

    /// Removes nodes whose outputs are unused and not graph outputs, repeatedly, and then
    /// initializers and outer values nothing reads. Returns the number of nodes removed.
    pub fn remove_dead_nodes(&mut self) -> usize {
        let mut removed = 0;
        loop {
            let dead: Vec<NodeId> = self.nodes()
                .filter(|(_, n)| n.outputs.iter().flatten().all(|v| {
                    let val = self.values[v.0 as usize].as_ref().unwrap();
                    val.uses.is_empty() && !self.outputs.contains(v)
                }))
                .map(|(id, _)| id)
                .collect();
            if dead.is_empty() {
                break;
            }
            for id in dead {
                let n = self.remove_node_raw(id);
                for v in n.outputs.iter().flatten() {
                    self.remove_value_raw(*v);
                }
                removed += 1;
            }
        }
        let unused: Vec<ValueId> = self.values()
            .filter(|(_, v)| matches!(v.kind, ValueKind::Initializer | ValueKind::Outer) && v.uses.is_empty())
            .map(|(id, _)| id)
            .filter(|id| !self.outputs.contains(id))
            .collect();
        for v in unused {
            self.remove_value_raw(v);
        }
        removed
    }
}
