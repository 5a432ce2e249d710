use std::collections::{HashMap, HashSet};

use qforge_ir::{infer, Attr, DType, Graph, Model, Node, NodeId, OpsetImport, Patch, Tensor, ValueId, ValueType};

/// The highest default-domain opset whose changes [`upgrade_opset`] knows.
pub const MAX_OPSET: i64 = 21;

/// One node that [`upgrade_opset`] rewrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewrite {
    /// Name of the graph holding the node (a subgraph's own name for If/Loop/Scan bodies).
    pub graph: String,
    /// The node's name, or `#id (op)` when it has none.
    pub node: String,
    /// The node's op type before the upgrade.
    pub op: String,
    /// What changed, one `opset: change` entry per crossed version, joined by `"; "`.
    pub change: String,
}

/// Why [`upgrade_opset`] refused; the model is then unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpgradeError {
    /// A node whose upgrade cannot be expressed, or that the rewrite could not apply.
    #[error("cannot upgrade node '{node}' ({op}) of graph '{graph}' to opset {target}: {reason}")]
    Node { graph: String, node: String, op: String, target: i64, reason: String },
    /// The request as a whole cannot be met (target out of range, no default-domain import,
    /// upgraded graph failing `Graph::check`).
    #[error("cannot upgrade the model to opset {target}: {reason}")]
    Model { target: i64, reason: String },
}

/// Raises the default-domain opset of `model` to `target` (<= 21), rewriting every node
/// (subgraphs of If/Loop/Scan included) whose op changed signature or semantics between the
/// model's opset and `target`, so the model computes exactly the same function. Returns the
/// nodes rewritten (node name, op, what changed). Fails, naming the node, on an op whose
/// upgrade cannot be expressed (the model is then left unchanged).
///
/// A target at or below the current opset is a no-op. Constants a rewrite needs (axes, split
/// sizes, pads, ...) become initializers of the graph holding the node (`Constant` nodes in
/// model-local function bodies, which are upgraded the same way when they import the default
/// domain below `target`). The IR version is raised to the minimum `target` requires.
pub fn upgrade_opset(model: &mut Model, target: i64) -> Result<Vec<Rewrite>, UpgradeError> {
    let fail = |reason: String| UpgradeError::Model { target, reason };
    if target > MAX_OPSET {
        return Err(fail(format!("the highest supported opset is {MAX_OPSET}")));
    }
    let from = model.opset("").ok_or_else(|| fail("the model does not import the default ONNX domain".into()))?;
    if target <= from {
        return Ok(vec![]);
    }
    let mut m = model.clone();
    let mut probe = model.clone();
    infer::infer_model(&mut probe);
    let mut st = State { names: HashSet::new(), types: HashMap::new(), const_nodes: false, target, log: vec![] };
    st.scan(&probe.graph);
    for f in &m.functions {
        st.scan(&f.body);
    }
    upgrade_graph(&mut m.graph, from, &mut st)?;
    st.const_nodes = true;
    st.types.clear();
    for f in &mut m.functions {
        if let Some(fv) = default_import(&mut f.opset_imports).filter(|v| **v < target) {
            let fv_from = *fv;
            *fv = target;
            upgrade_graph(&mut f.body, fv_from, &mut st)?;
        }
    }
    *default_import(&mut m.opset_imports).expect("checked above") = target;
    m.ir_version = m.ir_version.max(min_ir_version(target));
    m.graph.check().map_err(|e| fail(format!("the upgraded graph fails its check: {e}")))?;
    *model = m;
    Ok(st.log)
}

/// The version of the default-domain entry of an opset import list.
fn default_import(imports: &mut [OpsetImport]) -> Option<&mut i64> {
    imports.iter_mut().find(|o| o.domain.is_empty() || o.domain == "ai.onnx").map(|o| &mut o.version)
}

/// The lowest IR version that may import `opset` (onnx's release table).
fn min_ir_version(opset: i64) -> i64 {
    match opset {
        ..=8 => 3,
        9 => 4,
        10 => 5,
        11 => 6,
        12..=14 => 7,
        15..=18 => 8,
        19..=20 => 9,
        _ => 10,
    }
}

/// A rewrite rule: edits `Cx::node` (and may add constants and nodes); returns what changed,
/// `None` when the node needs nothing, or why the upgrade cannot be expressed.
type Rule = fn(&mut Cx<'_, '_>) -> Result<Option<String>, String>;

/// Every op whose signature or semantics changed between opsets 7 and 21, with the opset of
/// the change. Rules for one op run in version order; a node is rewritten when its graph's
/// opset is below the version and the target at or above it.
const RULES: &[(&str, i64, Rule)] = &[
    ("BatchNormalization", 9, batch_norm_spatial),
    ("Scan", 9, scan_8),
    ("Affine", 10, removed_experimental),
    ("Crop", 10, removed_experimental),
    ("DynamicSlice", 10, removed_experimental),
    ("GRUUnit", 10, removed_experimental),
    ("GivenTensorFill", 10, removed_experimental),
    ("ImageScaler", 10, removed_experimental),
    ("ParametricSoftplus", 10, removed_experimental),
    ("Scale", 10, removed_experimental),
    ("ScaledTanh", 10, removed_experimental),
    ("Dropout", 10, dropout_mask),
    ("Upsample", 10, upsample),
    ("Slice", 10, slice),
    ("TopK", 10, topk),
    ("Clip", 11, clip),
    ("Pad", 11, pad),
    ("Resize", 11, resize_10),
    ("Scatter", 11, scatter),
    ("Dropout", 12, dropout_ratio),
    ("Split", 13, split_sizes),
    ("Squeeze", 13, axes_to_input),
    ("Unsqueeze", 13, axes_to_input),
    ("ReduceSum", 13, axes_to_input),
    ("Softmax", 13, softmax),
    ("LogSoftmax", 13, softmax),
    ("Hardmax", 13, softmax),
    ("Resize", 13, resize_11),
    ("BatchNormalization", 14, batch_norm_outputs),
    ("RoiAlign", 16, roi_align),
    ("Split", 18, split_count),
    ("ReduceMean", 18, axes_to_input),
    ("ReduceMax", 18, axes_to_input),
    ("ReduceMin", 18, axes_to_input),
    ("ReduceProd", 18, axes_to_input),
    ("ReduceL1", 18, axes_to_input),
    ("ReduceL2", 18, axes_to_input),
    ("ReduceLogSum", 18, axes_to_input),
    ("ReduceLogSumExp", 18, axes_to_input),
    ("ReduceSumSquare", 18, axes_to_input),
    ("DFT", 20, dft),
    ("GridSample", 20, grid_sample),
    ("GroupNormalization", 21, group_norm),
];

/// State shared by every graph of one upgrade.
struct State {
    /// Every value and node name of the model, so new names are unique across all scopes.
    names: HashSet<String>,
    /// Value types by name from shape inference on the original model (`None`: ambiguous).
    types: HashMap<String, Option<ValueType>>,
    /// Make constants `Constant` nodes instead of initializers (function bodies).
    const_nodes: bool,
    target: i64,
    log: Vec<Rewrite>,
}

impl State {
    fn scan(&mut self, g: &Graph) {
        for (_, v) in g.values() {
            self.names.insert(v.name.clone());
            if let Some(ty) = &v.ty {
                let e = self.types.entry(v.name.clone()).or_insert_with(|| Some(ty.clone()));
                if e.as_ref() != Some(ty) {
                    *e = None;
                }
            }
        }
        for (_, n) in g.nodes() {
            self.names.insert(n.name.clone());
            for (_, s) in n.subgraphs() {
                self.scan(s);
            }
        }
    }

    fn fresh(&mut self, base: &str) -> String {
        let name = (0..).map(|i| if i == 0 { base.to_string() } else { format!("{base}_{i}") }).find(|n| !self.names.contains(n)).expect("unbounded");
        self.names.insert(name.clone());
        name
    }
}

/// Upgrades the subgraphs of every node, then applies the rules due between `from` and the
/// target to each default-domain node, one patch per rewritten node.
fn upgrade_graph(g: &mut Graph, from: i64, st: &mut State) -> Result<(), UpgradeError> {
    let ids: Vec<NodeId> = g.nodes().map(|(id, _)| id).collect();
    let node_err = |g: &Graph, id: NodeId, n: &Node, reason: String, st: &State| UpgradeError::Node {
        graph: g.name.clone(), node: n.display_name(id), op: n.op_type.clone(), target: st.target, reason,
    };
    for &id in &ids {
        let node = g.node(id).expect("live node");
        if node.subgraphs().next().is_none() {
            continue;
        }
        let attrs = g.node_attrs_mut(id).expect("live node");
        for a in attrs.iter_mut() {
            for sub in a.value.graphs_mut() {
                upgrade_graph(sub, from, st)?;
            }
        }
    }
    for id in ids {
        let node = g.node(id).expect("live node").clone();
        if !(node.domain.is_empty() || node.domain == "ai.onnx") {
            continue;
        }
        let mut rules: Vec<&(&str, i64, Rule)> = RULES.iter().filter(|r| r.0 == node.op_type && from < r.1 && r.1 <= st.target).collect();
        if rules.is_empty() {
            continue;
        }
        rules.sort_by_key(|r| r.1);
        let mut cx = Cx { g, patch: Patch::new(g, "upgrade_opset"), node: node.clone(), extra: vec![], st, id };
        let mut changes = vec![];
        for (_, version, rule) in rules {
            match rule(&mut cx) {
                Ok(Some(change)) => changes.push(format!("{version}: {change}")),
                Ok(None) => {}
                Err(reason) => return Err(node_err(g, id, &node, reason, cx.st)),
            }
        }
        let Cx { mut patch, node: new, extra, st: st_back, .. } = cx;
        if changes.is_empty() {
            continue;
        }
        patch.remove_node(id);
        for n in extra {
            patch.add_node(n);
        }
        patch.add_node(new);
        let graph = g.name.clone();
        g.apply(patch).map_err(|e| UpgradeError::Node {
            graph: graph.clone(), node: node.display_name(id), op: node.op_type.clone(), target: st_back.target, reason: e.to_string(),
        })?;
        st_back.log.push(Rewrite { graph, node: node.display_name(id), op: node.op_type.clone(), change: changes.join("; ") });
    }
    Ok(())
}

/// The rewrite of one node: the replacement node being built and what it needs.
struct Cx<'g, 's> {
    g: &'g Graph,
    patch: Patch,
    /// The replacement of the original node; it keeps the original outputs unless a rule
    /// moves them to an added node.
    node: Node,
    /// Nodes added next to the replacement.
    extra: Vec<Node>,
    st: &'s mut State,
    id: NodeId,
}

impl Cx<'_, '_> {
    fn base(&self) -> String {
        if self.node.name.is_empty() { format!("{}_{}", self.node.op_type.to_lowercase(), self.id.0) } else { self.node.name.clone() }
    }

    /// Removes attribute `name` and returns its value; an attribute referring to a calling
    /// function's attribute has no known value and fails.
    fn take(&mut self, name: &str) -> Result<Option<Attr>, String> {
        let Some(i) = self.node.attrs.iter().position(|a| a.name == name) else { return Ok(None) };
        let a = self.node.attrs.remove(i);
        match a.ref_attr_name {
            Some(r) => Err(format!("attribute '{name}' takes the value of function attribute '{r}', which is unknown here")),
            None => Ok(Some(a.value)),
        }
    }

    fn take_as<T>(&mut self, name: &str, kind: &str, get: fn(Attr) -> Option<T>) -> Result<Option<T>, String> {
        match self.take(name)? {
            None => Ok(None),
            Some(a) => {
                let found = a.kind();
                get(a).map(Some).ok_or_else(|| format!("attribute '{name}' is {found}, expected {kind}"))
            }
        }
    }

    fn take_int(&mut self, name: &str) -> Result<Option<i64>, String> {
        self.take_as(name, "INT", |a| if let Attr::Int(v) = a { Some(v) } else { None })
    }

    fn take_ints(&mut self, name: &str) -> Result<Option<Vec<i64>>, String> {
        self.take_as(name, "INTS", |a| if let Attr::Ints(v) = a { Some(v) } else { None })
    }

    fn take_float(&mut self, name: &str) -> Result<Option<f32>, String> {
        self.take_as(name, "FLOAT", |a| if let Attr::Float(v) = a { Some(v) } else { None })
    }

    fn take_floats(&mut self, name: &str) -> Result<Option<Vec<f32>>, String> {
        self.take_as(name, "FLOATS", |a| if let Attr::Floats(v) = a { Some(v) } else { None })
    }

    fn take_str(&mut self, name: &str) -> Result<Option<String>, String> {
        self.take_as(name, "STRING", |a| if let Attr::String(v) = a { String::from_utf8(v).ok() } else { None })
    }

    /// The string attribute `name`, left in place.
    fn peek_str(&mut self, name: &str) -> Result<Option<String>, String> {
        let v = self.take_str(name)?;
        if let Some(s) = &v {
            self.set_attr(name, Attr::String(s.clone().into_bytes()));
        }
        Ok(v)
    }

    fn set_attr(&mut self, name: &str, value: Attr) {
        self.node.attrs.retain(|a| a.name != name);
        self.node.attrs.push(qforge_ir::Attribute::new(name, value));
    }

    fn set_input(&mut self, i: usize, v: Option<ValueId>) {
        if self.node.inputs.len() <= i {
            self.node.inputs.resize(i + 1, None);
        }
        self.node.inputs[i] = v;
        while self.node.inputs.last() == Some(&None) {
            self.node.inputs.pop();
        }
    }

    fn input(&self, i: usize) -> Result<ValueId, String> {
        self.node.input(i).ok_or_else(|| format!("input {i} is missing"))
    }

    /// A new value to be produced by an added node.
    fn value(&mut self, what: &str) -> ValueId {
        let name = self.st.fresh(&format!("{}_{what}", self.base()));
        self.patch.new_value(name, None)
    }

    /// A new constant: an initializer of this graph, or a `Constant` node in function bodies.
    fn constant(&mut self, what: &str, t: Tensor) -> ValueId {
        let name = self.st.fresh(&format!("{}_{what}", self.base()));
        if self.st.const_nodes {
            let v = self.patch.new_value(name.clone(), None);
            self.extra.push(Node::new("Constant", name).with_outputs([v]).with_attr("value", Attr::Tensor(t)));
            v
        } else {
            self.patch.new_initializer(name, t)
        }
    }

    fn ints(&mut self, what: &str, v: &[i64]) -> ValueId {
        self.constant(what, Tensor::from_slice(&[v.len()], v).expect("1-D"))
    }

    /// Adds a node `op(inputs) -> one new value` next to the replacement.
    fn add(&mut self, op: &str, inputs: &[ValueId], attrs: Vec<(&str, Attr)>) -> ValueId {
        let out = self.value(&op.to_lowercase());
        let name = self.st.fresh(&format!("{}_{op}", self.base()));
        let mut n = Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out]);
        for (k, a) in attrs {
            n = n.with_attr(k, a);
        }
        self.extra.push(n);
        out
    }

    /// The type of a value: inferred on the original model, else declared.
    fn ty(&self, v: ValueId) -> Option<ValueType> {
        let val = self.g.value(v).ok()?;
        self.st.types.get(&val.name).cloned().flatten().or_else(|| val.ty.clone())
    }

    fn rank(&self, v: ValueId) -> Option<usize> {
        self.ty(v)?.shape().map(|s| s.len())
    }

    /// Constant data of a value held by an initializer or made by a `Constant` node.
    fn const_data(&self, v: ValueId) -> Option<Tensor> {
        self.g.constant_data(v)
    }

    /// A scalar of the element type of `like` holding `v`: direct for float32/float64, else
    /// a float32 constant cast to the type.
    fn scalar_like(&mut self, like: ValueId, what: &str, v: f32) -> Result<ValueId, String> {
        match self.ty(like).and_then(|t| t.elem()) {
            Some(DType::F32) => Ok(self.constant(what, Tensor::scalar(v))),
            Some(DType::F64) => Ok(self.constant(what, Tensor::scalar(v as f64))),
            Some(d) => {
                let c = self.constant(what, Tensor::scalar(v));
                Ok(self.add("Cast", &[c], vec![("to", Attr::Int(d as i64))]))
            }
            None => Err(format!("the element type of '{}' is unknown, so the {what} constant cannot be typed", self.g.value_name(like))),
        }
    }

    /// Drops optional outputs from index `first` on; fails if any of them is read.
    fn drop_outputs(&mut self, first: usize, why: &str) -> Result<bool, String> {
        let mut dropped = false;
        for i in first..self.node.outputs.len() {
            if let Some(v) = self.node.outputs[i] {
                if !self.g.consumers(v).is_empty() || self.g.is_output(v) {
                    return Err(format!("output '{}' is read, but {why}", self.g.value_name(v)));
                }
                self.node.outputs[i] = None;
                dropped = true;
            }
        }
        self.node.outputs.truncate(first.min(self.node.outputs.len()));
        Ok(dropped)
    }
}

/// Squeeze/Unsqueeze/ReduceSum at 13, the other Reduce ops at 18: the `axes` attribute
/// becomes the int64 input 1 with the same values; no `axes` attribute stays no input (all
/// axes, as before, since `noop_with_empty_axes` defaults to 0).
fn axes_to_input(cx: &mut Cx) -> Result<Option<String>, String> {
    let Some(axes) = cx.take_ints("axes")? else { return Ok(None) };
    let c = cx.ints("axes", &axes);
    cx.set_input(1, Some(c));
    Ok(Some(format!("axes {axes:?} attribute -> input")))
}

/// Split at 13: the `split` attribute becomes the int64 input 1.
fn split_sizes(cx: &mut Cx) -> Result<Option<String>, String> {
    let Some(split) = cx.take_ints("split")? else { return Ok(None) };
    let c = cx.ints("split", &split);
    cx.set_input(1, Some(c));
    Ok(Some(format!("split {split:?} attribute -> input")))
}

/// Split at 18: without split sizes, `num_outputs` is set to the number of outputs (equal
/// parts, as before; 18 also accepts a smaller last part, which the old op rejected).
fn split_count(cx: &mut Cx) -> Result<Option<String>, String> {
    if cx.node.input(1).is_some() || cx.node.attr("num_outputs").is_some() {
        return Ok(None);
    }
    let n = cx.node.outputs.len() as i64;
    cx.set_attr("num_outputs", Attr::Int(n));
    Ok(Some(format!("num_outputs = {n}")))
}

/// Softmax/LogSoftmax/Hardmax at 13: the old op flattens the input to 2-D at `axis`
/// (default 1) and normalizes each row; the new one works along `axis` (default -1). When `axis` is
/// the last axis (-1, or rank - 1 with the rank known) the two agree and `axis` is written
/// explicitly; otherwise the op is wrapped as Flatten(axis) -> op(axis = -1) -> Reshape to
/// Shape(input) (with `allowzero` at 14+ so empty dimensions survive).
fn softmax(cx: &mut Cx) -> Result<Option<String>, String> {
    let axis = cx.take_int("axis")?.unwrap_or(1);
    let x = cx.input(0)?;
    let rank = cx.rank(x).map(|r| r as i64);
    if axis == -1 || rank.is_some_and(|r| axis == r - 1) {
        cx.set_attr("axis", Attr::Int(axis));
        return Ok(Some(format!("axis {axis} is the last axis: explicit axis")));
    }
    let flat = cx.add("Flatten", &[x], vec![("axis", Attr::Int(axis))]);
    let shape = cx.add("Shape", &[x], vec![]);
    let y = cx.node.output(0).ok_or("output 0 is missing")?;
    let y2 = cx.value("2d");
    cx.node.outputs[0] = Some(y2);
    cx.set_input(0, Some(flat));
    cx.set_attr("axis", Attr::Int(-1));
    let mut reshape = Node::new("Reshape", cx.st.fresh(&format!("{}_Reshape", cx.base()))).with_inputs([y2, shape]).with_outputs([y]);
    if cx.st.target >= 14 {
        reshape = reshape.with_attr("allowzero", Attr::Int(1));
    }
    cx.extra.push(reshape);
    Ok(Some(format!("axis {axis} (rank {}): Flatten -> {}(axis=-1) -> Reshape", rank.map_or("?".into(), |r| r.to_string()), cx.node.op_type)))
}

/// Pad at 11: `pads` becomes the int64 input 1; a nonzero `value` (constant mode) becomes the
/// scalar input 2 of the data's element type; `mode` stays an attribute.
fn pad(cx: &mut Cx) -> Result<Option<String>, String> {
    let pads = cx.take_ints("pads")?.ok_or("the 'pads' attribute is missing")?;
    let value = cx.take_float("value")?.unwrap_or(0.0);
    let mode = cx.peek_str("mode")?.unwrap_or_else(|| "constant".into());
    let p = cx.ints("pads", &pads);
    cx.set_input(1, Some(p));
    if mode == "constant" && value.to_bits() != 0 {
        let x = cx.input(0)?;
        let c = cx.scalar_like(x, "value", value)?;
        cx.set_input(2, Some(c));
    }
    Ok(Some(format!("pads {pads:?}, value {value} attributes -> inputs")))
}

/// Clip at 11: `min`/`max` become scalar inputs 1/2 of the data's element type; an absent one
/// becomes the old default (the lowest/highest float32), so infinities clip as before.
fn clip(cx: &mut Cx) -> Result<Option<String>, String> {
    let lo = cx.take_float("min")?.unwrap_or(f32::MIN);
    let hi = cx.take_float("max")?.unwrap_or(f32::MAX);
    let x = cx.input(0)?;
    let (a, b) = (cx.scalar_like(x, "min", lo)?, cx.scalar_like(x, "max", hi)?);
    cx.set_input(1, Some(a));
    cx.set_input(2, Some(b));
    Ok(Some(format!("min {lo:e}, max {hi:e} attributes -> inputs")))
}

/// Dropout at 10: the mask output becomes boolean; an unread mask is dropped, a read one fails.
fn dropout_mask(cx: &mut Cx) -> Result<Option<String>, String> {
    Ok(cx.drop_outputs(1, "the mask changes from the input type to bool at opset 10")?.then(|| "unread mask output dropped".into()))
}

/// Dropout at 12: `ratio` becomes the float32 scalar input 1 (training_mode stays absent, so
/// the op is still the identity).
fn dropout_ratio(cx: &mut Cx) -> Result<Option<String>, String> {
    let Some(ratio) = cx.take_float("ratio")? else { return Ok(None) };
    let c = cx.constant("ratio", Tensor::scalar(ratio));
    cx.set_input(1, Some(c));
    Ok(Some(format!("ratio {ratio} attribute -> input")))
}

/// Upsample (deprecated at 10) becomes Resize of the target's version with the opset-9
/// arithmetic: `asymmetric` coordinates and, for nearest, `floor` rounding (Upsample only
/// scales up); `scales` (attribute in Upsample-7, input in 9) is input 2 after an omitted
/// roi at 13+ (an empty roi at 11/12), input 1 for Resize-10.
fn upsample(cx: &mut Cx) -> Result<Option<String>, String> {
    let mode = match cx.take_str("mode")?.as_deref().unwrap_or("nearest") {
        "nearest" => "nearest",
        "linear" | "bilinear" => "linear",
        m => return Err(format!("unknown mode '{m}'")),
    };
    let scales = match cx.take_floats("scales")? {
        Some(s) => cx.constant("scales", Tensor::from_slice(&[s.len()], &s).expect("1-D")),
        None => cx.input(1)?,
    };
    cx.node.op_type = "Resize".into();
    cx.set_attr("mode", Attr::String(mode.into()));
    if cx.st.target >= 11 {
        set_opset10_resize_modes(cx, mode, "floor");
        let roi = (cx.st.target < 13).then(|| cx.constant("roi", Tensor::from_vec::<f32>(&[0], vec![]).expect("empty")));
        cx.set_input(1, roi);
        cx.set_input(2, Some(scales));
    } else {
        cx.set_input(1, Some(scales));
    }
    Ok(Some(format!("Upsample -> Resize ({mode}, asymmetric)")))
}

/// Sets the Resize-11 attributes that reproduce opset-10 arithmetic: `asymmetric`
/// coordinates and, for nearest, the given rounding.
fn set_opset10_resize_modes(cx: &mut Cx, mode: &str, nearest: &str) {
    cx.set_attr("coordinate_transformation_mode", Attr::String("asymmetric".into()));
    if mode == "nearest" {
        cx.set_attr("nearest_mode", Attr::String(nearest.into()));
    }
}

/// Resize at 11: input 1 becomes `roi` (empty at 11/12, omitted at 13+) and `scales` moves
/// to input 2; the opset-10 arithmetic is made explicit: `asymmetric` coordinates and, for
/// nearest, ORT's opset-10 rounding (truncate when scaling up, ceil when scaling down), which
/// is `floor` when every constant scale is >= 1 and `ceil` when every one is <= 1. Nearest
/// with mixed or non-constant scales fails.
fn resize_10(cx: &mut Cx) -> Result<Option<String>, String> {
    let mode = cx.peek_str("mode")?.unwrap_or_else(|| "nearest".into());
    let scales = cx.input(1)?;
    let mut rounding = "";
    if mode == "nearest" {
        let s = cx.const_data(scales).and_then(|t| t.to_f64_vec().ok()).ok_or("nearest Resize-10 rounds differently up and down; its scales must be constant")?;
        rounding = if s.iter().all(|&v| v >= 1.0) {
            "floor"
        } else if s.iter().all(|&v| v <= 1.0) {
            "ceil"
        } else {
            return Err(format!("nearest Resize-10 with scales {s:?} both up- and downsamples; no opset-11 nearest_mode rounds that way"));
        };
    }
    set_opset10_resize_modes(cx, &mode, rounding);
    let roi = (cx.st.target < 13).then(|| cx.constant("roi", Tensor::from_vec::<f32>(&[0], vec![]).expect("empty")));
    cx.set_input(1, roi);
    cx.set_input(2, Some(scales));
    Ok(Some(format!("roi input added, asymmetric {mode} {rounding}").trim_end().to_string()))
}

/// Resize at 13: `tf_half_pixel_for_nn` is gone and fails; everything else is unchanged.
fn resize_11(cx: &mut Cx) -> Result<Option<String>, String> {
    match cx.peek_str("coordinate_transformation_mode")?.as_deref() {
        Some("tf_half_pixel_for_nn") => Err("coordinate_transformation_mode 'tf_half_pixel_for_nn' was removed at opset 13".into()),
        _ => Ok(None),
    }
}

/// TopK at 10: the `k` attribute becomes the int64 input 1 of shape [1].
fn topk(cx: &mut Cx) -> Result<Option<String>, String> {
    let k = cx.take_int("k")?.ok_or("the 'k' attribute is missing")?;
    let c = cx.ints("k", &[k]);
    cx.set_input(1, Some(c));
    Ok(Some(format!("k {k} attribute -> input")))
}

/// Slice at 10: `starts`, `ends` and `axes` become int64 inputs 1, 2, 3 (no `steps`: 1).
fn slice(cx: &mut Cx) -> Result<Option<String>, String> {
    let starts = cx.take_ints("starts")?.ok_or("the 'starts' attribute is missing")?;
    let ends = cx.take_ints("ends")?.ok_or("the 'ends' attribute is missing")?;
    let axes = cx.take_ints("axes")?;
    let (s, e) = (cx.ints("starts", &starts), cx.ints("ends", &ends));
    let a = axes.as_ref().map(|a| cx.ints("axes", a));
    cx.set_input(1, Some(s));
    cx.set_input(2, Some(e));
    cx.set_input(3, a);
    Ok(Some(format!("starts {starts:?}, ends {ends:?}, axes {axes:?} attributes -> inputs")))
}

/// Scatter (deprecated at 11) is ScatterElements with the same inputs and `axis`.
fn scatter(cx: &mut Cx) -> Result<Option<String>, String> {
    cx.node.op_type = "ScatterElements".into();
    Ok(Some("Scatter -> ScatterElements".into()))
}

/// BatchNormalization at 9: `spatial` is removed; 1 (the default) is the only behaviour
/// left, so `spatial = 0` (per-activation statistics) fails.
fn batch_norm_spatial(cx: &mut Cx) -> Result<Option<String>, String> {
    match cx.take_int("spatial")? {
        Some(0) => Err("spatial = 0 (statistics per activation) was removed at opset 9".into()),
        Some(_) => Ok(Some("spatial attribute dropped".into())),
        None => Ok(None),
    }
}

/// BatchNormalization at 14: the optional training outputs changed meaning; unread ones are
/// dropped, read ones fail.
fn batch_norm_outputs(cx: &mut Cx) -> Result<Option<String>, String> {
    Ok(cx.drop_outputs(1, "the optional outputs changed at opset 14")?.then(|| "unread optional outputs dropped".into()))
}

/// RoiAlign at 16: the new default `half_pixel` shifts coordinates; the old behaviour is made
/// explicit as `output_half_pixel`.
fn roi_align(cx: &mut Cx) -> Result<Option<String>, String> {
    if cx.node.attr("coordinate_transformation_mode").is_some() {
        return Ok(None);
    }
    cx.set_attr("coordinate_transformation_mode", Attr::String("output_half_pixel".into()));
    Ok(Some("coordinate_transformation_mode = output_half_pixel".into()))
}

/// DFT at 20: the `axis` attribute (default 1) becomes the int64 scalar input 2 (whose own
/// default would be -2).
fn dft(cx: &mut Cx) -> Result<Option<String>, String> {
    let axis = cx.take_int("axis")?.unwrap_or(1);
    let c = cx.constant("axis", Tensor::scalar(axis));
    cx.set_input(2, Some(c));
    Ok(Some(format!("axis {axis} attribute -> input")))
}

/// GridSample at 20: modes `bilinear`/`bicubic` are renamed `linear`/`cubic`.
fn grid_sample(cx: &mut Cx) -> Result<Option<String>, String> {
    let new = match cx.peek_str("mode")?.as_deref() {
        Some("bilinear") => "linear",
        Some("bicubic") => "cubic",
        _ => return Ok(None),
    };
    cx.set_attr("mode", Attr::String(new.into()));
    Ok(Some(format!("mode -> {new}")))
}

/// GroupNormalization at 21: scale and bias go from one value per group to one per channel;
/// constant float32 ones are repeated C / num_groups times (C known from the input type);
/// anything else fails.
fn group_norm(cx: &mut Cx) -> Result<Option<String>, String> {
    let groups = cx.node.attr_int("num_groups").ok_or("the 'num_groups' attribute is missing")?;
    let x = cx.input(0)?;
    let c = cx.ty(x).and_then(|t| t.shape().and_then(|s| s.get(1).and_then(|d| d.known())))
        .ok_or("the channel count of the input is unknown, so per-group scale and bias cannot be expanded")?;
    if groups <= 0 || c % groups != 0 {
        return Err(format!("{c} channels do not split into {groups} groups"));
    }
    for (i, what) in [(1, "scale"), (2, "bias")] {
        let v = cx.input(i)?;
        let t = cx.const_data(v).filter(|t| t.dtype() == DType::F32 && t.len() == groups as usize)
            .ok_or(format!("{what} is not a constant float32 tensor of {groups} values"))?;
        let per: Vec<f32> = t.as_slice::<f32>().expect("f32").iter().flat_map(|&s| std::iter::repeat_n(s, (c / groups) as usize)).collect();
        let nv = cx.constant(what, Tensor::from_vec(&[c as usize], per).expect("1-D"));
        cx.set_input(i, Some(nv));
    }
    Ok(Some(format!("scale and bias expanded from {groups} groups to {c} channels")))
}

/// Scan at 9: Scan-8 batches its inputs and takes `sequence_lens`; Scan-9 has neither.
fn scan_8(_: &mut Cx) -> Result<Option<String>, String> {
    Err("Scan-8 (batched, with sequence_lens) has no Scan-9 equivalent".into())
}

/// The experimental ops removed at 10 have no replacement.
fn removed_experimental(_: &mut Cx) -> Result<Option<String>, String> {
    Err("experimental op removed at opset 10".into())
}
