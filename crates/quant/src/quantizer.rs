//! Quantizers decide what each node's inputs and outputs are quantized to, as
//! [`Annotations`]. Everything after annotation (prepare, calibrate, convert) is shared by
//! every quantizer.
//!
//! [`ConfigQuantizer`] is the FX-style front end: a [`QConfigMapping`] says what the user
//! wants per node, a [`BackendConfig`] says what the target supports, and the patterns of the
//! backend are matched anchored at their last op, in reverse topological order, largest first.

use std::collections::{HashMap, HashSet};

use qforge_ir::{DType, Graph, Node, NodeId, ValueId, CAPTURE_USE};

use crate::annotation::{Annotations, FloatKind, NodeAnnotation};
use crate::backend::{BackendConfig, BackendPatternConfig, DTypeConfig, ObservationType};
use crate::qconfig::{QConfig, QConfigMapping, RangeName, TensorQConfig};
use crate::qparams::QScheme;
use crate::spec::{Derivation, Edge, FixedQParams, Spec};

/// A node annotation that breaks a target's rules: the node, the rule broken, and what to do.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    pub node: NodeId,
    pub rule: String,
    pub fix: String,
}

/// Decides the quantization of a graph.
pub trait Quantizer {
    /// Annotates the nodes of `g` to quantize; every node left in float is listed in
    /// [`Annotations::float`] with the reason.
    fn annotate(&self, g: &Graph) -> Annotations;

    /// Rewrites `g` into the form the quantizer annotates (before annotation, after constant
    /// and BatchNormalization folding); the function computed must not change.
    fn transform_for_annotation(&self, _g: &mut Graph) {}

    /// Checks annotations against the target's constraints.
    fn validate(&self, _g: &Graph, _a: &Annotations) -> Vec<Violation> {
        vec![]
    }

    /// Whether the target's ops write their outputs in the integer type annotated, so that a
    /// reader taking another type must convert the quantized value (QNN's Convert). Otherwise
    /// (the default) such a reader quantizes the float value, which ONNX Runtime computes
    /// anyway: one rounding, not two.
    fn typed_outputs(&self) -> bool {
        false
    }

    /// Annotates `g` as [`Quantizer::annotate`] does, except that nodes of `wider` take the
    /// target's wider activation type (16 bits where they had 8) where the quantizer allows it.
    /// `None` when it widens none of them (the default: the target has no wider type).
    fn annotate_wider(&self, _g: &Graph, _wider: &HashSet<NodeId>) -> Option<Annotations> {
        None
    }
}

/// The output-channel axis and the reduction (block) axis of a weight of rank `rank` read
/// as input 1 of `node`: Conv `[M, C/g, k..]` (0, 1), ConvTranspose `[C, M/g, k..]` (1, 0),
/// Gemm `[N, K]` with transB (0, 1) else (1, 0), MatMul `[K, N]` (1, 0). A MatMul weight of
/// higher rank `[.., K, N]` (a batched product) has no channel axis, only the block axis (last
/// but one): ONNX Runtime's QLinearMatMul and MatMulIntegerToFloat take one zero point per
/// column only for a 2-D B, and fail at run time on a 1-D one of a batched B.
pub fn weight_axes(node: &Node, rank: usize) -> (Option<usize>, Option<usize>) {
    match node.op_type.as_str() {
        "Conv" if rank >= 2 => (Some(0), Some(1)),
        "ConvTranspose" if rank >= 2 => (Some(1), Some(0)),
        "Gemm" if rank == 2 => if node.attr_int("transB").unwrap_or(0) != 0 { (Some(0), Some(1)) } else { (Some(1), Some(0)) },
        "MatMul" if rank == 2 => (Some(1), Some(0)),
        "MatMul" if rank > 2 => (None, Some(rank - 2)),
        _ => (None, None),
    }
}

/// The QConfig a backend suggests: its first weighted dtype config's activation and weight
/// dtypes, symmetry and integer bounds (x86's 7-bit activations), per-channel weights when
/// asked for and allowed, activations observed with `method`.
pub fn default_qconfig(backend: &BackendConfig, method: RangeName, per_channel: bool) -> QConfig {
    let weighted = backend.patterns.iter().flat_map(|p| &p.dtype_configs).filter_map(|n| backend.dtype_config(n))
        .find(|d| d.weight.is_some() && d.input.is_some());
    let first = backend.patterns.iter().flat_map(|p| &p.dtype_configs).filter_map(|n| backend.dtype_config(n)).find(|d| d.input.is_some());
    let activation = weighted.or(first).and_then(|d| d.input.as_ref()).and_then(|c| {
        let mut t = TensorQConfig::of(c.dtype.qtype()?);
        t.symmetric = c.symmetric.unwrap_or(false);
        t.quant_range = c.bounds();
        t.range = method;
        t.observer = if method == RangeName::Minmax { crate::qconfig::ObserverName::Minmax } else { crate::qconfig::ObserverName::Histogram };
        Some(t)
    });
    let weight = weighted.and_then(|d| d.weight.as_ref()).and_then(|c| {
        let mut t = TensorQConfig::of(c.dtype.qtype()?);
        t.symmetric = c.symmetric.unwrap_or(true);
        t.quant_range = c.bounds();
        let allows = |k| c.granularity.as_ref().is_none_or(|g| g.contains(&k));
        t.per_channel = per_channel && allows(crate::backend::GranularityKind::PerChannel);
        Some(t)
    });
    QConfig { activation, weight }
}

/// Ops kept in float by [`default_mapping`] although backends may quantize them: their
/// outputs depend on their inputs through an exponential, a power or a normalization by
/// statistics, so input quantization error is amplified (Softmax input error moves every
/// probability of the row; LayerNormalization and Pow/Sqrt see the variance of outliers).
pub const SENSITIVE_OPS: &[&str] = &["Softmax", "LogSoftmax", "LayerNormalization", "Pow", "Sqrt", "Reciprocal", "Exp", "Log"];

/// The mapping used when the user gives none: [`default_qconfig`] globally, with the
/// [`SENSITIVE_OPS`] kept in float (a config file's `[[op_type]]` entry quantizes them).
pub fn default_mapping(backend: &BackendConfig, method: RangeName, per_channel: bool) -> QConfigMapping {
    let mut m = QConfigMapping::global(default_qconfig(backend, method, per_channel));
    m.op_type = SENSITIVE_OPS.iter().map(|op| (op.to_string(), None)).collect();
    m
}

/// The FX-style quantizer: QConfigMapping (what the user wants) checked against a
/// BackendConfig (what the target supports).
pub struct ConfigQuantizer {
    pub backend: BackendConfig,
    pub mapping: QConfigMapping,
}

/// Whether `v` holds float data: its declared or inferred element type, or its constant's.
pub(crate) fn is_float(g: &Graph, v: ValueId) -> bool {
    let Ok(val) = g.value(v) else { return false };
    if let Some(t) = val.initializer() {
        return t.dtype() == DType::F32;
    }
    val.ty.as_ref().and_then(|t| t.elem()).is_none_or(|e| e == DType::F32)
}

/// Ops that compute an index-valued output from index-valued inputs: arithmetic, rounding and
/// data movement. See [`index_valued`].
const INDEX_ARITHMETIC: &[&str] = &[
    "Abs", "Add", "Ceil", "Clip", "Concat", "Div", "Expand", "Flatten", "Floor", "Gather", "Identity", "Max", "Min", "Mod",
    "Mul", "Neg", "Reshape", "Round", "Slice", "Squeeze", "Sub", "Sum", "Tile", "Transpose", "Unsqueeze", "Where",
];

/// Float values of `g` that stand for integers: every read of one converts it to an integer
/// type (Cast, or CastLike to an integer target), reads only its type or shape (CastLike's
/// target, Shape, Size), reads it as a Resize or Upsample size or scale, or computes from it,
/// through [`INDEX_ARITHMETIC`], float outputs that are all such values. A graph output is
/// data. Exporters count loop steps and compute sizes this way (`Cast(Cast(i) + 1.0)` to
/// int64); a quantization step would move the index, count or size, so no quantizer treats
/// these values as activations.
pub fn index_valued(g: &Graph) -> HashSet<ValueId> {
    let mut set = HashSet::new();
    let order = g.topo_order().unwrap_or_default();
    let float_outputs = |n: &Node| n.outputs.iter().flatten().copied().filter(|&v| is_float(g, v)).collect::<Vec<_>>();
    let integer_target = |n: &Node| match n.op_type.as_str() {
        "Cast" => n.attr_int("to").and_then(|t| DType::from_onnx(t as i32)).is_some_and(|d| !d.is_float()),
        _ => n.input(1).is_some_and(|t| !is_float(g, t)),
    };
    let produced = order.iter().rev().flat_map(|&n| float_outputs(g.node(n).expect("topological order lists live nodes")));
    let inputs = g.inputs().iter().copied().filter(|&v| is_float(g, v)).collect::<Vec<_>>();
    for v in produced.collect::<Vec<_>>().into_iter().chain(inputs) {
        let uses = g.consumers(v);
        let bound = !uses.is_empty() && !g.is_output(v) && uses.iter().all(|&(c, i)| {
            let Ok(node) = g.node(c) else { return false };
            match (node.op_type.as_str(), i) {
                (_, CAPTURE_USE) => false,
                ("Shape" | "Size", _) | ("CastLike", 1) | ("Resize" | "Upsample", 1..) => true,
                ("Cast" | "CastLike", 0) if integer_target(node) => true,
                (op, _) if op == "Cast" || op == "CastLike" || INDEX_ARITHMETIC.contains(&op) => {
                    let outs = float_outputs(node);
                    !outs.is_empty() && outs.iter().all(|o| set.contains(o))
                }
                _ => false,
            }
        });
        if bound {
            set.insert(v);
        }
    }
    set
}

/// Why `node` computes no data worth quantizing, given the [`index_valued`] values of its
/// graph: it reads no float activation (a float value computed at run time that is not
/// index-valued), or every float output it has is index-valued.
pub(crate) fn index_arithmetic(g: &Graph, index: &HashSet<ValueId>, node: &Node) -> Option<&'static str> {
    let activation = |v: ValueId| is_float(g, v) && !g.value(v).is_ok_and(|x| x.is_constant()) && !index.contains(&v);
    if !node.inputs.iter().flatten().any(|&v| activation(v)) {
        return Some("it reads no float activation (shape or index arithmetic, or constants only)");
    }
    let mut float_outputs = node.outputs.iter().flatten().filter(|&&v| is_float(g, v)).peekable();
    (float_outputs.peek().is_some() && float_outputs.all(|v| index.contains(v)))
        .then_some("its float outputs are only read as integers (indices, counts, sizes) or for their shape: quantizing them would only move those")
}

impl ConfigQuantizer {
    /// The annotations of a match's nodes under a dtype config, or why the config does not fit.
    fn annotate_match(&self, g: &Graph, p: &BackendPatternConfig, matched: &[NodeId], dc: &DTypeConfig, q: &QConfig) -> Result<Vec<NodeAnnotation>, String> {
        let conv = self.backend.convention;
        let (Some(input_c), Some(act)) = (dc.input.as_ref(), q.activation.as_ref()) else {
            return Err(if dc.input.is_none() { "the dtype config keeps inputs in float".into() } else { "the qconfig has no activation config".into() });
        };
        let mut act_spec = act.spec(conv, None, None);
        act_spec.scale_min = input_c.scale_min_lower_bound;
        if let Some(v) = input_c.violation(&act_spec) {
            return Err(format!("activation: {v}"));
        }
        let root_pos = p.pattern.root_index().min(matched.len() - 1);
        let root = matched[root_pos];
        let root_node = g.node(root).map_err(|e| e.to_string())?;
        let group: Vec<NodeId> = std::iter::once(root).chain(matched.iter().copied().filter(|&n| n != root)).collect();
        let mut anns: Vec<NodeAnnotation> = matched.iter().map(|_| NodeAnnotation { group: group.clone(), float_output: p.float_output, ..Default::default() }).collect();
        let internal = |v: ValueId| g.producer(v).is_some_and(|(n, _)| matched.contains(&n));
        let mut first_activation: Option<Edge> = None;
        for (pos, &n) in matched.iter().enumerate() {
            let node = g.node(n).map_err(|e| e.to_string())?;
            for (i, v) in node.inputs.iter().enumerate() {
                let Some(v) = *v else { continue };
                if internal(v) || !is_float(g, v) {
                    continue;
                }
                let is_root = pos == root_pos;
                // A weight input that is not a constant (attention's keys in `Q x K^T`) is an
                // activation: quantized like the others, so two activations meet in the
                // target's activation type, as ONNX Runtime's and PyTorch's quantizers do.
                let weight = is_root && p.weight_inputs.contains(&i);
                let constant = g.value(v).is_ok_and(|x| x.is_constant());
                if weight && constant {
                    let Some(wq) = q.weight.as_ref() else { return Err("the qconfig has no weight config".into()) };
                    let Some(wc) = dc.weight.as_ref() else { return Err("the dtype config keeps weights in float".into()) };
                    let rank = g.value(v).ok().and_then(|x| x.initializer().map(|t| t.rank())).unwrap_or(2);
                    let (ch, block) = weight_axes(root_node, rank);
                    let mut spec = wq.spec(conv, ch, block);
                    spec.pair_sum_max = wc.pair_sum_max;
                    if let Some(why) = wc.violation(&spec) {
                        return Err(format!("weight: {why}"));
                    }
                    anns[pos].set_input(i, Spec::Quantize(spec));
                    anns.iter_mut().for_each(|a| a.weighted = true);
                } else if is_root && p.bias_inputs.contains(&i) {
                    if dc.bias.and_then(|b| b.qtype()) == Some(crate::QType::S32) && constant {
                        let weight = p.weight_inputs.first().copied().unwrap_or(1);
                        anns[pos].set_input(i, Spec::Derived { from: vec![Edge::Input { node: root, index: 0 }, Edge::Input { node: root, index: weight }], how: Derivation::BiasScale });
                    }
                } else if !is_root || weight || p.activation_inputs.as_ref().is_none_or(|a| a.contains(&i)) {
                    let edge = Edge::Input { node: n, index: i };
                    let spec = match (p.observation, first_activation) {
                        (ObservationType::OutputShareObserverWithInput, Some(first)) => Spec::Shared(first),
                        _ => Spec::Quantize(act_spec.clone()),
                    };
                    first_activation.get_or_insert(edge);
                    anns[pos].set_input(i, spec);
                    // The op computes on integers as a weighted one does whether its weight
                    // position holds an activation (`Q x K^T`) or its weight is a constant in
                    // an activation position (`W x`).
                    if is_root && (weight || constant && !p.weight_inputs.is_empty()) {
                        anns.iter_mut().for_each(|a| a.weighted = true);
                    }
                }
            }
        }
        if first_activation.is_none() {
            return Err("no float activation input to quantize".into());
        }
        let output = match (p.observation, dc.output.as_ref()) {
            (ObservationType::InputOutputNotObserved, _) | (_, None) => None,
            (ObservationType::OutputShareObserverWithInput, Some(_)) => Some(Spec::Shared(first_activation.unwrap())),
            (ObservationType::OutputUseDifferentObserverAsInput, Some(c)) => {
                let Some(qt) = c.dtype.qtype() else { return Err("output dtype".into()) };
                if qt != act.dtype {
                    return Err(format!("output: dtype {:?} is requested, the target takes {qt:?}", act.dtype));
                }
                match c.scale_exact_match {
                    Some(scale) => {
                        // The fixed qparams span the output constraint's range, not the bounds
                        // the target's other activations take (x86's [0, 127]).
                        let scheme = QScheme { quant_range: c.bounds(), reduce_range: false, ..act_spec.scheme };
                        Some(Spec::Fixed(FixedQParams { scheme, scale, zero_point: c.zero_point_exact_match.unwrap_or(0) }))
                    }
                    None => {
                        let mut s = act_spec.clone();
                        s.scale_min = c.scale_min_lower_bound;
                        Some(Spec::Quantize(s))
                    }
                }
            }
        };
        if let Some(spec) = output {
            anns[0].set_output(0, spec);
        }
        Ok(anns)
    }
}

impl Quantizer for ConfigQuantizer {
    fn annotate(&self, g: &Graph) -> Annotations {
        let mut out = Annotations::default();
        let order = g.topo_order().unwrap_or_default();
        let qconfigs = self.mapping.assign(g);
        let index = index_valued(g);
        let mut taken: HashMap<NodeId, NodeId> = HashMap::new();
        for &id in order.iter().rev() {
            if taken.contains_key(&id) {
                continue;
            }
            let node = g.node(id).expect("live node");
            let (qc, level) = qconfigs.get(&id).cloned().unwrap_or((None, "global"));
            let Some(qc) = qc else {
                let why = if level == "op_type" && SENSITIVE_OPS.contains(&node.op_type.as_str()) {
                    format!("the qconfig mapping keeps {} in float (op_type): its output amplifies input quantization error; a --config [[op_type]] entry quantizes it", node.op_type)
                } else {
                    format!("the qconfig mapping keeps it in float ({level})")
                };
                out.keep_float(id, FloatKind::Requested, why);
                continue;
            };
            if let Some(why) = index_arithmetic(g, &index, node) {
                out.keep_float(id, FloatKind::NoBenefit, why);
                continue;
            }
            let patterns = self.backend.patterns_for(&node.op_type);
            if patterns.is_empty() || !(node.domain.is_empty() || node.domain == "ai.onnx") {
                out.keep_float(id, FloatKind::NotSupported, format!("backend '{}' has no quantized pattern for {}", self.backend.name, node.qualified_op()));
                continue;
            }
            let mut reasons = vec![];
            let mut done = false;
            for p in patterns {
                let Some(matched) = p.pattern.match_at(g, id) else { continue };
                if matched.iter().any(|n| taken.contains_key(n) || qconfigs.get(n).is_none_or(|q| q.0.is_none())) {
                    continue;
                }
                for name in &p.dtype_configs {
                    let dc = self.backend.dtype_config(name).expect("validated on load");
                    match self.annotate_match(g, p, &matched, dc, &qc) {
                        Ok(anns) => {
                            for (&n, mut ann) in matched.iter().zip(anns) {
                                ann.rule = format!("{} [{name}]", p.pattern);
                                taken.insert(n, id);
                                out.nodes.insert(n, ann);
                            }
                            done = true;
                            break;
                        }
                        Err(why) => reasons.push(format!("{} [{name}]: {why}", p.pattern)),
                    }
                }
                if done {
                    break;
                }
            }
            if !done {
                if reasons.is_empty() {
                    out.keep_float(id, FloatKind::NotSupported, "no pattern of the backend matches here");
                } else {
                    out.keep_float(id, FloatKind::ConfigRejected, format!("the backend does not support the requested qconfig: {}", reasons.join("; ")));
                }
            }
        }
        drop_isolated_units(g, &order, &mut out);
        fix_bounded_float_outputs(g, &self.backend, &mut out);
        out
    }
}

/// A quantized input whose value a float node produces takes the target's fixed qparams for
/// that producer's op (Softmax, Sigmoid, Tanh: outputs bounded by the op's definition), looking
/// through float data movement (the target's shared-observer ops, except multi-input Concat).
/// The op's own output would get them if it were quantized; and ONNX Runtime fuses
/// DQ -> Softmax -> Q into its QLinearSoftmax even where qforge keeps Softmax float, a kernel
/// built for those qparams.
fn fix_bounded_float_outputs(g: &Graph, backend: &BackendConfig, a: &mut Annotations) {
    let nodes: Vec<NodeId> = a.nodes.keys().copied().collect();
    for n in nodes {
        let Ok(node) = g.node(n) else { continue };
        let quantized: Vec<(usize, crate::spec::QuantizationSpec)> = a.nodes[&n].inputs.iter().enumerate()
            .filter_map(|(i, s)| match s { Some(Spec::Quantize(q)) => Some((i, q.clone())), _ => None }).collect();
        for (i, q) in quantized {
            let Some(op) = node.input(i).and_then(|v| float_producer_through_data_movement(g, a, backend, v)) else { continue };
            if let Some((scale, zero_point)) = backend.fixed_output(op, q.scheme.qtype) {
                a.nodes.get_mut(&n).expect("listed").set_input(i, Spec::Fixed(FixedQParams { scheme: q.scheme, scale, zero_point }));
            }
        }
    }
}

/// The op type of the float node that computes `v`, past float single-input data movement.
fn float_producer_through_data_movement<'g>(g: &'g Graph, a: &Annotations, backend: &BackendConfig, mut v: ValueId) -> Option<&'g str> {
    let moves = |op: &str| op != "Concat" && backend.patterns_for(op).iter().any(|p| p.pattern.size() == 1 && p.observation == ObservationType::OutputShareObserverWithInput);
    loop {
        let (p, _) = g.producer(v)?;
        if a.get(p).is_some() {
            return None;
        }
        let node = g.node(p).ok()?;
        if !moves(&node.op_type) {
            return Some(&node.op_type);
        }
        v = node.input(0)?;
    }
}

/// Units without weights that no integer kernel chain passes through stay in float: their
/// Q/DQ would only add error. A unit is isolated when
/// * its float inputs are not quantized by their producers: a unit whose output shares its
///   input's observer (data movement, Concat) needs every input quantized, other units (Add,
///   Sigmoid, pooling, ...) at least one; or
/// * its quantized outputs have no quantized reader (only float nodes and graph outputs read
///   them), e.g. the attention-mask Add in front of a float Softmax, whose range would span
///   the mask's huge negative values.
///
/// A weighted unit whose quantized outputs have no quantized reader keeps its quantized
/// inputs and loses its output Q/DQ when the target runs it with a float output
/// ([`NodeAnnotation::float_output`]): a classifier's logits before a float Softmax or
/// Sigmoid.
///
/// Applied forward (topological order) and backward until nothing changes, so chains of such
/// units fall back together.
fn drop_isolated_units(g: &Graph, order: &[NodeId], a: &mut Annotations) {
    loop {
        let mut changed = false;
        for &id in order.iter().chain(order.iter().rev()) {
            let Some(ann) = a.get(id) else { continue };
            if ann.group.first() != Some(&id) {
                continue;
            }
            let group = ann.group.clone();
            if ann.weighted {
                if ann.float_output && !outputs_read_quantized(g, a, &group) {
                    for n in &group {
                        a.nodes.get_mut(n).expect("annotated group").outputs.clear();
                    }
                    changed = true;
                }
                continue;
            }
            let why = if !inputs_quantized(g, a, &group) {
                "none of its inputs is quantized by its producer and it has no weight: Q/DQ here would only add error"
            } else if !outputs_read_quantized(g, a, &group) {
                "only float nodes or graph outputs read its output and it has no weight: Q/DQ here would only add error"
            } else {
                continue;
            };
            for n in group {
                a.nodes.remove(&n);
                a.keep_float(n, FloatKind::NoBenefit, why);
            }
            changed = true;
        }
        if !changed {
            break;
        }
    }
}

/// Whether a unit's non-constant quantized inputs come quantized from their producers: all of
/// them when the unit shares its input's observer, at least one otherwise.
fn inputs_quantized(g: &Graph, a: &Annotations, group: &[NodeId]) -> bool {
    let shares = group.iter().any(|n| a.get(*n).is_some_and(|x| matches!(x.output(0), Some(Spec::Shared(_)))));
    let mut inputs = vec![];
    for &n in group {
        let node = g.node(n).expect("live node");
        let na = a.get(n).expect("annotated group");
        for (i, s) in na.inputs.iter().enumerate() {
            let Some(v) = node.input(i).filter(|_| s.is_some()) else { continue };
            if g.value(v).is_ok_and(|x| x.is_constant()) {
                continue;
            }
            inputs.push(g.producer(v).is_some_and(|(p, k)| a.get(p).is_some_and(|pa| pa.output(k).is_some())));
        }
    }
    if shares { !inputs.is_empty() && inputs.iter().all(|&q| q) } else { inputs.iter().any(|&q| q) }
}

/// Whether some quantized output of a unit is read, outside the unit, as a quantized input
/// (or by a subgraph). A unit without quantized outputs counts as read.
fn outputs_read_quantized(g: &Graph, a: &Annotations, group: &[NodeId]) -> bool {
    let mut any_output = false;
    for &n in group {
        let node = g.node(n).expect("live node");
        let na = a.get(n).expect("annotated group");
        for (k, s) in na.outputs.iter().enumerate() {
            let Some(v) = node.output(k).filter(|_| s.is_some()) else { continue };
            any_output = true;
            let quantized_reader = g.consumers(v).iter().any(|&(r, i)| {
                !group.contains(&r) && (i == qforge_ir::CAPTURE_USE || a.get(r).is_some_and(|ra| ra.input(i).is_some()))
            });
            if quantized_reader {
                return true;
            }
        }
    }
    !any_output
}

#[cfg(test)]
mod tests {
    use qforge_ir::{Attr, Tensor, ValueType};

    use super::*;

    fn op(g: &mut Graph, op: &str, inputs: &[ValueId], attrs: &[(&str, Attr)]) -> ValueId {
        let name = g.unique_name(op);
        let out = g.new_value(name.as_str(), None).unwrap();
        let node = attrs.iter().fold(Node::new(op, name.as_str()).with_inputs(inputs.iter().copied()).with_outputs([out]), |n, (k, v)| n.with_attr(k, v.clone()));
        g.add_node(node).unwrap();
        out
    }

    fn cast(g: &mut Graph, v: ValueId, to: DType) -> ValueId {
        op(g, "Cast", &[v], &[("to", Attr::Int(to.onnx_code() as i64))])
    }

    #[test]
    fn floats_that_only_become_integers_are_index_valued_and_data_is_not() {
        let mut g = Graph::new("g");
        let image = g.add_input("image", Some(ValueType::tensor_of(DType::U8, &[1, 3, 8, 8]))).unwrap();
        let counter = g.add_input("counter", Some(ValueType::tensor_of(DType::I64, &[1]))).unwrap();
        let one = g.add_initializer("one", Tensor::from_vec(&[1], vec![1f32]).unwrap()).unwrap();
        let mean = g.add_initializer("mean", Tensor::scalar(127f32)).unwrap();
        let w = g.add_initializer("w", Tensor::from_vec(&[2, 3, 1, 1], vec![0.5f32; 6]).unwrap()).unwrap();
        // A u8 image made float is data: it reaches a Conv.
        let pixels = cast(&mut g, image, DType::F32);
        let centred = op(&mut g, "Sub", &[pixels, mean], &[]);
        let features = op(&mut g, "Conv", &[centred, w], &[]);
        // A counter incremented in float and cast back.
        let count = cast(&mut g, counter, DType::F32);
        let next = op(&mut g, "Add", &[count, one], &[]);
        let next_int = cast(&mut g, next, DType::I64);
        // Resize scales from the feature map's shape, in float.
        let shape = op(&mut g, "Shape", &[features], &[]);
        let dims = cast(&mut g, shape, DType::F32);
        let scales = op(&mut g, "Div", &[dims, dims], &[]);
        let resized = op(&mut g, "Resize", &[features, one, scales], &[]);
        // The counter read as data by one reader and as an index by another.
        let both = cast(&mut g, counter, DType::F32);
        let both_int = cast(&mut g, both, DType::I64);
        let scaled = op(&mut g, "Mul", &[features, both], &[]);
        // A float graph output is data even when it is also cast to an integer.
        let out = cast(&mut g, counter, DType::F32);
        let out_int = cast(&mut g, out, DType::I64);
        g.set_outputs(vec![next_int, resized, both_int, scaled, out, out_int]).unwrap();
        let index = index_valued(&g);
        for v in [count, next, dims, scales] {
            assert!(index.contains(&v), "{} is index-valued", g.value_name(v));
        }
        for v in [pixels, centred, features, resized, both, scaled, out] {
            assert!(!index.contains(&v), "{} is data", g.value_name(v));
        }
        let node = |v: ValueId| g.node(g.producer(v).unwrap().0).unwrap();
        assert!(index_arithmetic(&g, &index, node(next)).is_some_and(|why| why.contains("reads no float activation")));
        assert_eq!(index_arithmetic(&g, &index, node(centred)), None);
    }

    #[test]
    fn a_node_reading_data_whose_outputs_only_become_integers_is_index_arithmetic() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[4]))).unwrap();
        let cells = g.add_initializer("cells", Tensor::scalar(8f32)).unwrap();
        let position = op(&mut g, "Mul", &[x, cells], &[]);
        let cell = op(&mut g, "Floor", &[position], &[]);
        let cell_int = cast(&mut g, cell, DType::I64);
        let y = op(&mut g, "Relu", &[x], &[]);
        g.set_outputs(vec![cell_int, y]).unwrap();
        let index = index_valued(&g);
        assert!(index.contains(&position) && index.contains(&cell) && !index.contains(&x));
        let mul = g.node(g.producer(position).unwrap().0).unwrap();
        assert!(index_arithmetic(&g, &index, mul).is_some_and(|why| why.contains("read as integers")));
    }
}
