use std::collections::HashSet;

use crate::graph::CAPTURE_USE;
use crate::{Graph, IrError, IrResult, Node, NodeId, Tensor, ValueId, ValueKind, ValueType};

/// A set of graph edits built by a rewrite and committed atomically by [`Graph::apply`].
///
/// A patch may add values and nodes (their ids are handed out at once, so new nodes can refer
/// to new values), remove nodes, and redirect every reader of a value to another value.
/// It is validated as a whole before the graph changes; a rejected patch leaves the graph as
/// it was. A patch must be applied to the graph it was created from, before any other edit.
#[derive(Debug, Clone)]
pub struct Patch {
    /// Who made the patch (a pass or rule name), for error messages.
    pub origin: String,
    base_values: usize,
    base_nodes: usize,
    new_values: Vec<(String, Option<ValueType>, Option<Tensor>)>,
    new_nodes: Vec<Node>,
    removed: Vec<NodeId>,
    replacements: Vec<(ValueId, ValueId)>,
    redirects: Vec<(NodeId, usize, ValueId)>,
    reserved: HashSet<String>,
}

impl Patch {
    pub fn new(graph: &Graph, origin: impl Into<String>) -> Patch {
        Patch {
            origin: origin.into(),
            base_values: graph.values_len(),
            base_nodes: graph.nodes_len(),
            new_values: vec![],
            new_nodes: vec![],
            removed: vec![],
            replacements: vec![],
            redirects: vec![],
            reserved: HashSet::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.new_values.is_empty() && self.new_nodes.is_empty() && self.removed.is_empty() && self.replacements.is_empty() && self.redirects.is_empty()
    }

    /// A name starting with `prefix` that is free in `graph` and in this patch.
    pub fn unique_name(&mut self, graph: &Graph, prefix: &str) -> String {
        let mut name = graph.unique_name(prefix);
        let mut i = 1;
        while self.reserved.contains(&name) {
            name = graph.unique_name(&format!("{prefix}_p{i}"));
            i += 1;
        }
        self.reserved.insert(name.clone());
        name
    }

    /// Keeps [`Patch::unique_name`] from handing out `names` (e.g. the graph's node names,
    /// which ONNX keeps apart from value names).
    pub fn reserve(&mut self, names: impl IntoIterator<Item = String>) {
        self.reserved.extend(names);
    }

    /// A new value to be produced by a node of this patch.
    pub fn new_value(&mut self, name: impl Into<String>, ty: Option<ValueType>) -> ValueId {
        let name = name.into();
        self.reserved.insert(name.clone());
        self.new_values.push((name, ty, None));
        ValueId((self.base_values + self.new_values.len() - 1) as u32)
    }

    /// A new constant initializer.
    pub fn new_initializer(&mut self, name: impl Into<String>, tensor: Tensor) -> ValueId {
        let name = name.into();
        self.reserved.insert(name.clone());
        let ty = ValueType::tensor_of(tensor.dtype(), &tensor.shape().iter().map(|&d| d as i64).collect::<Vec<_>>());
        self.new_values.push((name, Some(ty), Some(tensor)));
        ValueId((self.base_values + self.new_values.len() - 1) as u32)
    }

    /// A new node; returns the id it will have once applied.
    pub fn add_node(&mut self, node: Node) -> NodeId {
        self.new_nodes.push(node);
        NodeId((self.base_nodes + self.new_nodes.len() - 1) as u32)
    }

    /// Removes a node. Its outputs must have no readers left once the patch is applied.
    pub fn remove_node(&mut self, id: NodeId) {
        if !self.removed.contains(&id) {
            self.removed.push(id);
        }
    }

    /// Redirects every input of the graph's existing nodes and every graph output reading
    /// `old` to `new`; nodes added by this patch keep reading `old`, so a node inserted after
    /// `old` is one patch. When `old` is a graph output, `new` takes over its name so the
    /// graph's interface is unchanged.
    pub fn replace_uses(&mut self, old: ValueId, new: ValueId) {
        self.replacements.push((old, new));
    }

    /// Makes input `index` of the existing node `node` read `new`; other readers of the value
    /// it read are unaffected. Applied after [`Patch::replace_uses`].
    pub fn redirect_input(&mut self, node: NodeId, index: usize, new: ValueId) {
        self.redirects.push((node, index, new));
    }
}

impl Graph {
    /// Commits a patch: validates it whole, then edits the graph. See [`Patch`].
    pub fn apply(&mut self, patch: Patch) -> IrResult<()> {
        let reject = |reason: String| IrError::Patch { graph: self.name.clone(), reason: format!("{}: {reason}", patch.origin) };
        if patch.base_values != self.values_len() || patch.base_nodes != self.nodes_len() {
            return Err(reject("the graph changed after the patch was created".into()));
        }
        let new_range = patch.base_values..patch.base_values + patch.new_values.len();
        let exists = |v: ValueId| self.value(v).is_ok() || new_range.contains(&(v.0 as usize));
        let mut names = HashSet::new();
        for (name, _, _) in &patch.new_values {
            if !name.is_empty() && (self.value_by_name(name).is_some() || !names.insert(name.as_str())) {
                return Err(reject(format!("value name '{name}' is already taken")));
            }
        }
        for id in &patch.removed {
            self.node(*id).map_err(|e| reject(e.to_string()))?;
        }
        for (old, new) in &patch.replacements {
            if !exists(*old) || !exists(*new) {
                return Err(reject(format!("replacement #{} -> #{} names a missing value", old.0, new.0)));
            }
            if let Ok(v) = self.value(*old) {
                if v.uses().iter().any(|u| u.1 == CAPTURE_USE && !patch.removed.contains(&u.0)) {
                    return Err(reject(format!("value '{}' is read by a subgraph and cannot be replaced", v.name)));
                }
                if self.is_output(*old) && (self.value(*new).is_ok_and(|n| n.kind() != ValueKind::NodeOutput)) {
                    return Err(reject(format!("graph output '{}' can only be replaced by a node output", v.name)));
                }
            }
        }
        for (node, index, new) in &patch.redirects {
            let n = self.node(*node).map_err(|e| reject(e.to_string()))?;
            if patch.removed.contains(node) || *index >= n.inputs.len() || !exists(*new) {
                return Err(reject(format!("cannot redirect input {index} of node '{}'", n.name)));
            }
        }
        let produced: HashSet<ValueId> = patch.new_nodes.iter().flat_map(|n| n.outputs.iter().flatten().copied()).collect();
        for (k, (name, _, init)) in patch.new_values.iter().enumerate() {
            let id = ValueId((patch.base_values + k) as u32);
            if init.is_none() && !produced.contains(&id) {
                return Err(reject(format!("new value '{name}' has no producer")));
            }
        }
        for n in &patch.new_nodes {
            for v in n.inputs.iter().flatten().chain(n.outputs.iter().flatten()) {
                if !exists(*v) {
                    return Err(reject(format!("node '{}' names missing value #{}", n.name, v.0)));
                }
            }
            for v in n.outputs.iter().flatten() {
                if (v.0 as usize) < patch.base_values {
                    let owner = self.producer(*v);
                    if owner.is_some_and(|(p, _)| !patch.removed.contains(&p)) || self.value(*v).is_ok_and(|x| x.kind() != ValueKind::NodeOutput) {
                        return Err(reject(format!("node '{}' would redefine value '{}'", n.name, self.value_name(*v))));
                    }
                }
            }
        }
        // Readers each value will have once the patch is in: remaining readers of old values
        // must not be removed nodes' outputs.
        let replaced: HashSet<ValueId> = patch.replacements.iter().map(|r| r.0).collect();
        let reused: HashSet<ValueId> = patch.new_nodes.iter().flat_map(|n| n.outputs.iter().flatten().copied()).collect();
        for id in &patch.removed {
            let node = self.node(*id).unwrap();
            for v in node.outputs.iter().flatten() {
                if replaced.contains(v) || reused.contains(v) {
                    continue;
                }
                let val = self.value(*v).unwrap();
                if val.uses().iter().any(|u| !patch.removed.contains(&u.0)) || self.is_output(*v) {
                    return Err(reject(format!("removed node '{}' output '{}' still has readers", node.name, val.name)));
                }
                if patch.new_nodes.iter().any(|n| n.inputs.contains(&Some(*v))) {
                    return Err(reject(format!("a new node reads '{}', an output of removed node '{}'", val.name, node.name)));
                }
            }
        }

        // Validation passed: edit.
        let Patch { new_values, new_nodes, removed, replacements, redirects, .. } = patch;
        let mut removed_outputs = vec![];
        for id in &removed {
            let node = self.remove_node_raw(*id);
            removed_outputs.extend(node.outputs.into_iter().flatten());
        }
        for (name, ty, init) in new_values {
            let kind = if init.is_some() { ValueKind::Initializer } else { ValueKind::NodeOutput };
            let id = match kind {
                ValueKind::Initializer => self.add_initializer(name, init.unwrap())?,
                _ => self.new_value(name, ty.clone())?,
            };
            if ty.is_some() {
                self.value_mut(id)?.ty = ty;
            }
        }
        let readers: Vec<Vec<_>> = replacements.iter()
            .map(|(old, _)| self.value(*old).map(|v| v.uses().to_vec()).unwrap_or_default())
            .collect();
        for n in new_nodes {
            self.add_node(n)?;
        }
        for ((old, new), readers) in replacements.into_iter().zip(readers) {
            for (node, index) in readers {
                self.set_input_raw(node, index, new);
            }
            if self.is_output(old) {
                for o in self.outputs.iter_mut().filter(|o| **o == old) {
                    *o = new;
                }
                let name = self.value(old)?.name.clone();
                let spare = self.unique_name(&format!("{name}_replaced"));
                self.rename_value(old, spare)?;
                self.rename_value(new, name)?;
            }
        }
        for (node, index, new) in redirects {
            self.set_input_raw(node, index, new);
        }
        for v in removed_outputs {
            let val = self.value(v)?;
            if val.producer().is_none() && val.uses().is_empty() && !self.is_output(v) {
                self.remove_value_raw(v);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn chain() -> (Graph, ValueId, NodeId, ValueId) {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[4]))).unwrap();
        let y = g.new_value("y", None).unwrap();
        let relu = g.add_node(Node::new("Relu", "relu").with_inputs([x]).with_outputs([y])).unwrap();
        g.set_outputs(vec![y]).unwrap();
        (g, x, relu, y)
    }

    #[test]
    fn replacing_a_graph_output_keeps_its_name() {
        let (mut g, x, relu, y) = chain();
        let mut p = Patch::new(&g, "test");
        let z = p.new_value("z", None);
        p.add_node(Node::new("Sigmoid", "sig").with_inputs([x]).with_outputs([z]));
        p.remove_node(relu);
        p.replace_uses(y, z);
        g.apply(p).unwrap();
        g.check().unwrap();
        assert_eq!(g.value(g.outputs()[0]).unwrap().name, "y");
        assert_eq!(g.node_count(), 1);
        assert!(g.value(y).is_err(), "the old output was dropped");
    }

    #[test]
    fn rejected_patch_leaves_graph_untouched() {
        let (mut g, _x, relu, _y) = chain();
        let before = g.clone();
        let mut p = Patch::new(&g, "test");
        p.remove_node(relu);
        let e = g.apply(p).unwrap_err();
        assert!(e.to_string().contains("still has readers"), "{e}");
        assert_eq!(g, before);
    }

    #[test]
    fn stale_patch_is_rejected() {
        let (mut g, x, _, _) = chain();
        let p = Patch::new(&g, "stale");
        g.add_initializer("c", Tensor::scalar(1f32)).unwrap();
        let _ = x;
        assert!(g.apply(p).is_err());
    }

    #[test]
    fn insert_between_producer_and_readers() {
        let (mut g, x, relu, _y) = chain();
        let mut p = Patch::new(&g, "insert");
        let q = p.new_value("x_q", None);
        let id = p.add_node(Node::new("Identity", "id").with_inputs([x]).with_outputs([q]));
        p.replace_uses(x, q);
        g.apply(p).unwrap();
        g.check().unwrap();
        assert_eq!(g.node(id).unwrap().input(0), Some(x));
        assert_eq!(g.node(relu).unwrap().input(0), Some(q));
        assert_eq!(g.topo_order().unwrap(), vec![id, relu]);
    }
}
