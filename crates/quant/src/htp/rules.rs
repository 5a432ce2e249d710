//! The HTP rule registry, modeled on the QNN quantizer's `register_annotator`: one line per
//! op type, each naming an [`OpRule`] (an annotate function and a validate function).
//!
//! Annotation walks the graph in reverse topological order, so a rule anchored at the last op
//! of a unit (Relu after Conv) annotates the unit before the rule of its first op runs; nodes
//! already annotated are left alone. [`RuleRegistry::register`] replaces one op's rule, so rules
//! compose: a later entry, or a user's `[rules]` line in the HTP config, wins.
//!
//! Math-invariant ops (every quantized output shared with an input) take their encoding from
//! their producers: when none of their inputs is quantized by its producer (they read float
//! nodes only), they stay float, in topological order so chains of them fall back together.

use std::collections::{BTreeMap, HashMap, HashSet};

use qforge_ir::{Graph, NodeId, ValueId};

use super::precision::Precision;
use super::soc::{Generation, SocTable};
use crate::annotation::{Annotations, FloatKind, NodeAnnotation};
use crate::prepare::{qtype_of, resolve};
use crate::qconfig::{QConfig, TensorQConfig};
use crate::quantizer::{index_arithmetic, index_valued, is_float, weight_axes, Violation};
use crate::spec::{Derivation, Edge, FixedQParams, Granularity, QuantizationSpec, Spec};
use crate::{Convention, QScheme, QType};

/// The qparams convention of HTP specs: PyTorch's observers, as in the QNN quantizer.
pub const CONVENTION: Convention = Convention::PyTorch;

/// Why a rule leaves a node in float.
#[derive(Debug, Clone, PartialEq)]
pub struct Unquantized {
    pub kind: FloatKind,
    pub reason: String,
}

impl Unquantized {
    fn unsupported(reason: impl Into<String>) -> Unquantized {
        Unquantized { kind: FloatKind::NotSupported, reason: reason.into() }
    }
}

/// Annotates one node (and possibly the nodes of its unit) into the context's annotations, or
/// says why it stays float.
pub type AnnotateFn = fn(&mut AnnotationContext<'_>, NodeId) -> Result<(), Unquantized>;

/// The violations of one annotated node against the chosen HTP generation.
pub type ValidateFn = fn(&ValidationContext<'_>, NodeId) -> Vec<Violation>;

/// One op type's rule.
#[derive(Debug, Clone, Copy)]
pub struct OpRule {
    /// The name reports and `[rules]` config lines use.
    pub name: &'static str,
    pub annotate: AnnotateFn,
    pub validate: ValidateFn,
}

/// Input 0 and output 0 with the node's activation spec (other inputs stay float: parameters
/// such as Clip bounds, Pad values, Pow exponents, Resize scales).
pub const SINGLE: OpRule = OpRule { name: "single", annotate: annotate_single, validate: validate_op_constraints };
/// Every float input and output 0 with the activation spec (Add, Mul, comparisons, ...).
pub const BINARY: OpRule = OpRule { name: "binary", annotate: annotate_binary, validate: validate_op_constraints };
/// Activation input 0, weight input 1 (per channel, or per block when the input channels span
/// more than one block), int32 bias input 2 derived as input scale x weight scale, output 0.
/// A weight that is not a constant is an activation: with 16-bit activations it is quantized
/// 16-bit symmetric, as the HTP's MatMul requires.
pub const WEIGHTED: OpRule = OpRule { name: "weighted", annotate: annotate_weighted, validate: validate_weighted };
/// Relu or Clip: fused with the weighted op producing its input when that op has no other
/// reader and the same precision (no Q/DQ between them); otherwise [`SINGLE`].
pub const ACTIVATION: OpRule = OpRule { name: "activation", annotate: annotate_activation, validate: validate_op_constraints };
/// Math-invariant data movement: input 0 quantized, every float output shares its qparams.
pub const SHARED: OpRule = OpRule { name: "shared", annotate: annotate_shared, validate: validate_shared };
/// Concat: all float inputs and the output share one group.
pub const CONCAT: OpRule = OpRule { name: "concat", annotate: annotate_concat, validate: validate_shared };
/// Output in [0, 1] with fixed qparams: scale 1 / (qmax - qmin + 1), zero point qmin.
pub const UNIT_INTERVAL: OpRule = OpRule { name: "unit_interval", annotate: annotate_unit_interval, validate: validate_fixed };
/// Output in [-1, 1] with fixed symmetric qparams: scale 2 / (qmax - qmin + 1), zero point at
/// the middle of the range.
pub const SYMMETRIC_UNIT: OpRule = OpRule { name: "symmetric_unit", annotate: annotate_symmetric_unit, validate: validate_fixed };
/// LayerNormalization: activation input 0, scale input 1 (16-bit symmetric with 16-bit
/// activations, else the activation spec), int32 bias input 2 derived from both, output 0.
pub const LAYER_NORM: OpRule = OpRule { name: "layer_norm", annotate: annotate_layer_norm, validate: validate_op_constraints };

/// The common rules, by name.
pub const NAMED_RULES: &[OpRule] = &[SINGLE, BINARY, WEIGHTED, ACTIVATION, SHARED, CONCAT, UNIT_INTERVAL, SYMMETRIC_UNIT, LAYER_NORM];

/// The HTP's rules, one line per op type.
const HTP_RULES: &[(&str, OpRule)] = &[
    ("Abs", SINGLE),
    ("Add", BINARY),
    ("ArgMax", SINGLE),
    ("ArgMin", SINGLE),
    ("AveragePool", SINGLE),
    ("BatchNormalization", SINGLE),
    ("Ceil", SINGLE),
    ("Clip", ACTIVATION),
    ("Concat", CONCAT),
    ("Conv", WEIGHTED),
    ("ConvTranspose", WEIGHTED),
    ("Cos", SINGLE),
    ("DepthToSpace", SHARED),
    ("Div", BINARY),
    ("Dropout", SHARED),
    ("Elu", SINGLE),
    ("Equal", BINARY),
    ("Erf", SINGLE),
    ("Exp", SINGLE),
    ("Expand", SHARED),
    ("Flatten", SHARED),
    ("Floor", SINGLE),
    ("Gather", SHARED),
    ("GatherElements", SHARED),
    ("Gelu", SINGLE),
    ("Gemm", WEIGHTED),
    ("GlobalAveragePool", SINGLE),
    ("GlobalMaxPool", SHARED),
    ("Greater", BINARY),
    ("GreaterOrEqual", BINARY),
    ("HardSigmoid", UNIT_INTERVAL),
    ("HardSwish", SINGLE),
    ("Identity", SHARED),
    ("InstanceNormalization", SINGLE),
    ("LayerNormalization", LAYER_NORM),
    ("LeakyRelu", SINGLE),
    ("Less", BINARY),
    ("LessOrEqual", BINARY),
    ("Log", SINGLE),
    ("LogSoftmax", SINGLE),
    ("MatMul", WEIGHTED),
    ("Max", BINARY),
    ("MaxPool", SHARED),
    ("Mean", BINARY),
    ("Min", BINARY),
    ("Mul", BINARY),
    ("Neg", SINGLE),
    ("PRelu", BINARY),
    ("Pad", SINGLE),
    ("Pow", SINGLE),
    ("Reciprocal", SINGLE),
    ("ReduceMax", SHARED),
    ("ReduceMean", SINGLE),
    ("ReduceMin", SHARED),
    ("ReduceSum", SINGLE),
    ("Relu", ACTIVATION),
    ("Reshape", SHARED),
    ("Resize", SINGLE),
    ("Round", SINGLE),
    ("Sigmoid", UNIT_INTERVAL),
    ("Sign", SINGLE),
    ("Sin", SINGLE),
    ("Slice", SHARED),
    ("Softmax", UNIT_INTERVAL),
    ("SpaceToDepth", SHARED),
    ("Split", SHARED),
    ("Sqrt", SINGLE),
    ("Squeeze", SHARED),
    ("Sub", BINARY),
    ("Sum", BINARY),
    ("Tanh", SYMMETRIC_UNIT),
    ("Tile", SHARED),
    ("TopK", SHARED),
    ("Transpose", SHARED),
    ("Unsqueeze", SHARED),
    ("Where", BINARY),
];

/// Op type to rule.
#[derive(Debug, Clone)]
pub struct RuleRegistry {
    rules: BTreeMap<String, OpRule>,
}

impl RuleRegistry {
    /// The HTP's rules.
    pub fn htp() -> RuleRegistry {
        RuleRegistry { rules: HTP_RULES.iter().map(|(op, r)| (op.to_string(), *r)).collect() }
    }

    /// Sets the rule of `op_type`, replacing any earlier one.
    pub fn register(&mut self, op_type: &str, rule: OpRule) {
        self.rules.insert(op_type.to_string(), rule);
    }

    /// The rule of `op_type`.
    pub fn get(&self, op_type: &str) -> Option<&OpRule> {
        self.rules.get(op_type)
    }

    /// A common rule by name (`"shared"`, `"binary"`, ...).
    pub fn named(name: &str) -> Option<OpRule> {
        NAMED_RULES.iter().copied().find(|r| r.name == name)
    }

    /// Annotates `g`: every node with a rule and a QConfig (from `qconfigs`, `None`: keep float,
    /// with the level that decided it) reading a float activation; every other node is listed
    /// in float with the reason.
    pub fn annotate(&self, g: &Graph, qconfigs: &HashMap<NodeId, (Option<QConfig>, &'static str)>) -> Annotations {
        let order = g.topo_order().unwrap_or_default();
        let mut cx = AnnotationContext { graph: g, registry: self, qconfigs, index_valued: index_valued(g), annotations: Annotations::default() };
        for &n in order.iter().rev() {
            if cx.annotations.is_annotated(n) {
                continue;
            }
            if let Err(u) = self.annotate_node(&mut cx, n) {
                cx.annotations.keep_float(n, u.kind, u.reason);
            }
        }
        drop_unencoded_data_movement(g, &order, &mut cx.annotations);
        let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        cx.annotations.float.sort_by_key(|f| position.get(&f.node).copied());
        cx.annotations
    }

    fn annotate_node(&self, cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
        let node = cx.graph.node(n).expect("topological order lists live nodes");
        if let (None, level) = cx.qconfigs.get(&n).cloned().unwrap_or((None, "global")) {
            return Err(Unquantized { kind: FloatKind::Requested, reason: format!("an override keeps it in float ({level})") });
        }
        if !(node.domain.is_empty() || node.domain == "ai.onnx") {
            return Err(Unquantized::unsupported(format!("the HTP rule registry has no rule for {}", node.qualified_op())));
        }
        if let Some(why) = index_arithmetic(cx.graph, &cx.index_valued, node) {
            return Err(Unquantized { kind: FloatKind::NoBenefit, reason: why.into() });
        }
        let Some(rule) = self.get(&node.op_type) else {
            return Err(Unquantized::unsupported(format!("the HTP rule registry has no rule for {}", node.op_type)));
        };
        (rule.annotate)(cx, n)
    }

    /// Checks every annotated node of `g` against `generation`, in topological order.
    pub fn validate(&self, g: &Graph, a: &Annotations, table: &SocTable, generation: &Generation) -> Vec<Violation> {
        let vx = ValidationContext { graph: g, annotations: a, table, generation };
        let order = g.topo_order().unwrap_or_else(|_| a.nodes.keys().copied().collect());
        order.into_iter().filter(|n| a.is_annotated(*n)).flat_map(|n| {
            let op = &g.node(n).expect("annotated nodes are live").op_type;
            let validate = self.get(op).map_or(validate_op_constraints as ValidateFn, |r| r.validate);
            validate(&vx, n)
        }).collect()
    }
}

/// Leaves in float, in topological order, every node whose quantized outputs all share an
/// input's qparams and none of whose quantized activation inputs is quantized by its producer
/// (graph inputs count as quantized).
fn drop_unencoded_data_movement(g: &Graph, order: &[NodeId], a: &mut Annotations) {
    for &n in order {
        let Some(ann) = a.get(n) else { continue };
        if ann.outputs.iter().flatten().next().is_none() || !ann.outputs.iter().flatten().all(|s| matches!(s, Spec::Shared(_))) {
            continue;
        }
        let node = g.node(n).expect("annotated nodes are live");
        let encoded = ann.inputs.iter().enumerate().filter(|(_, s)| s.is_some()).filter_map(|(i, _)| node.input(i))
            .filter(|&v| !g.value(v).is_ok_and(|x| x.is_constant()))
            .any(|v| match g.producer(v) {
                Some((p, k)) => a.get(p).is_some_and(|pa| pa.output(k).is_some()),
                None => true,
            });
        if !encoded {
            a.nodes.remove(&n);
            a.keep_float(n, FloatKind::NoBenefit, "it only moves data and reads float nodes: there is no encoding to share");
        }
    }
}

/// What an annotate function works on: the graph, each node's QConfig, and the annotations
/// made so far.
pub struct AnnotationContext<'a> {
    pub graph: &'a Graph,
    pub registry: &'a RuleRegistry,
    qconfigs: &'a HashMap<NodeId, (Option<QConfig>, &'static str)>,
    /// The graph's [`index_valued`] values.
    index_valued: HashSet<ValueId>,
    pub annotations: Annotations,
}

impl AnnotationContext<'_> {
    /// The QConfig of node `n` (`None`: keep float).
    pub fn qconfig(&self, n: NodeId) -> Option<&QConfig> {
        self.qconfigs.get(&n).and_then(|(q, _)| q.as_ref())
    }

    /// The activation spec of node `n`.
    pub fn activation(&self, n: NodeId) -> Result<QuantizationSpec, Unquantized> {
        let q = self.qconfig(n).and_then(|q| q.activation.as_ref()).ok_or_else(|| Unquantized::unsupported("its precision has no activation config"))?;
        Ok(q.spec(CONVENTION, None, None))
    }

    /// Whether `v` holds float data computed at run time that is not [`index_valued`].
    pub fn is_activation(&self, v: ValueId) -> bool {
        is_float(self.graph, v) && !self.is_constant(v) && !self.index_valued.contains(&v)
    }

    /// Whether `v` can be quantized: it holds float data.
    pub fn is_quantizable(&self, v: ValueId) -> bool {
        is_float(self.graph, v)
    }

    /// Input `i` of `n` when it can be quantized, or why not.
    pub fn quantizable_input(&self, n: NodeId, i: usize) -> Result<ValueId, Unquantized> {
        self.input(n, i).filter(|&v| self.is_quantizable(v)).ok_or_else(|| Unquantized::unsupported(format!("its input {i} is not float")))
    }

    /// Whether `v` is a float initializer.
    pub fn is_float_constant(&self, v: ValueId) -> bool {
        is_float(self.graph, v) && self.is_constant(v)
    }

    fn is_constant(&self, v: ValueId) -> bool {
        self.graph.value(v).is_ok_and(|x| x.is_constant())
    }

    /// An empty annotation of `n` by `rule`, labelled with the node's precision.
    pub fn annotation(&self, n: NodeId, rule: &str) -> NodeAnnotation {
        let precision = self.qconfig(n).and_then(Precision::of_qconfig).map_or_else(|| "custom".to_string(), |p| p.to_string());
        NodeAnnotation { rule: format!("htp {rule} [{precision}]"), group: vec![n], ..Default::default() }
    }

    /// The float outputs of `n`, by index.
    fn float_outputs(&self, n: NodeId) -> Vec<usize> {
        let node = self.graph.node(n).expect("live node");
        node.outputs.iter().enumerate().filter(|(_, v)| v.is_some_and(|v| is_float(self.graph, v))).map(|(k, _)| k).collect()
    }

    fn input(&self, n: NodeId, i: usize) -> Option<ValueId> {
        self.graph.node(n).ok()?.input(i)
    }
}

/// 16-bit symmetric per-tensor quantization: the second activation of a MatMul and the scale
/// of a LayerNormalization when activations are 16-bit.
fn symmetric_16bit() -> QuantizationSpec {
    TensorQConfig { symmetric: true, quant_range: Some((-32767, 32767)), eps: Some(2f32.powi(-20)), ..TensorQConfig::of(QType::S16) }.spec(CONVENTION, None, None)
}

fn annotate_single(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    let act = cx.activation(n)?;
    cx.quantizable_input(n, 0)?;
    let mut ann = cx.annotation(n, SINGLE.name);
    ann.set_input(0, Spec::Quantize(act.clone()));
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Quantize(act));
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

fn annotate_binary(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    let act = cx.activation(n)?;
    let mut ann = cx.annotation(n, BINARY.name);
    let node = cx.graph.node(n).expect("live node");
    for (i, v) in node.inputs.iter().enumerate() {
        if v.is_some_and(|v| cx.is_quantizable(v)) {
            ann.set_input(i, Spec::Quantize(act.clone()));
        }
    }
    if ann.inputs.is_empty() {
        return Err(Unquantized::unsupported("it has no float input"));
    }
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Quantize(act));
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

/// The annotation of a weighted op with a constant float weight, or `None` when input 1 is
/// not one.
fn weighted_annotation(cx: &AnnotationContext<'_>, n: NodeId) -> Result<Option<NodeAnnotation>, Unquantized> {
    let node = cx.graph.node(n).expect("live node");
    let Some(w) = node.input(1).filter(|&v| cx.is_float_constant(v)) else { return Ok(None) };
    cx.quantizable_input(n, 0)?;
    let act = cx.activation(n)?;
    let wq = cx.qconfig(n).and_then(|q| q.weight.as_ref()).ok_or_else(|| Unquantized::unsupported("its precision has no weight config"))?;
    let shape = cx.graph.value(w).ok().and_then(|x| x.initializer()).map(|t| t.shape().to_vec()).unwrap_or_default();
    let (channel_axis, block_axis) = weight_axes(node, shape.len());
    let mut weight = wq.spec(CONVENTION, channel_axis, block_axis);
    let mut ann = cx.annotation(n, WEIGHTED.name);
    if let (Granularity::PerBlock { axis, block_size }, Some(channel)) = (weight.granularity, channel_axis) {
        if shape.get(axis).is_some_and(|&len| len <= block_size) {
            weight.granularity = Granularity::PerAxis { axis: channel };
            ann.rule.push_str(", weights per channel: the input channels fit in one block");
        }
    }
    let blockwise = matches!(weight.granularity, Granularity::PerBlock { .. });
    ann.set_input(0, Spec::Quantize(act.clone()));
    ann.set_input(1, Spec::Quantize(weight));
    ann.weighted = true;
    if node.input(2).is_some_and(|b| cx.is_float_constant(b)) {
        if blockwise {
            ann.rule.push_str(", bias float: block-wise weights have no per-channel scale");
        } else {
            ann.set_input(2, Spec::Derived { from: vec![Edge::Input { node: n, index: 0 }, Edge::Input { node: n, index: 1 }], how: Derivation::BiasScale });
        }
    }
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Quantize(act));
    }
    Ok(Some(ann))
}

fn annotate_weighted(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    if let Some(ann) = weighted_annotation(cx, n)? {
        cx.annotations.nodes.insert(n, ann);
        return Ok(());
    }
    let act = cx.activation(n)?;
    let mut ann = cx.annotation(n, "activation product");
    for i in 0..2 {
        let v = cx.quantizable_input(n, i)?;
        let spec = if i == 1 && act.scheme.qtype == QType::U16 && !cx.is_float_constant(v) { symmetric_16bit() } else { act.clone() };
        ann.set_input(i, Spec::Quantize(spec));
    }
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Quantize(act));
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

/// The weighted op producing input 0 of `n` that can be fused with it: not yet annotated,
/// annotated by [`WEIGHTED`], with a constant weight, the same QConfig, and `n` as the only
/// reader of its output.
fn fusable_producer(cx: &AnnotationContext<'_>, n: NodeId) -> Option<NodeId> {
    let v = cx.input(n, 0)?;
    let (p, _) = cx.graph.producer(v)?;
    let producer = cx.graph.node(p).ok()?;
    let fusable = !cx.annotations.is_annotated(p)
        && cx.registry.get(&producer.op_type).is_some_and(|r| r.name == WEIGHTED.name)
        && producer.input(1).is_some_and(|w| cx.is_float_constant(w))
        && cx.graph.consumers(v).len() == 1
        && !cx.graph.is_output(v)
        && cx.qconfig(p).is_some()
        && cx.qconfig(p) == cx.qconfig(n);
    fusable.then_some(p)
}

fn annotate_activation(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    let Some(p) = fusable_producer(cx, n) else { return annotate_single(cx, n) };
    let Some(mut producer) = weighted_annotation(cx, p).ok().flatten() else { return annotate_single(cx, n) };
    let act = cx.activation(n)?;
    let group = vec![p, n];
    producer.outputs.clear();
    producer.group = group.clone();
    let mut ann = cx.annotation(n, ACTIVATION.name);
    ann.rule = format!("{} + {}", producer.rule, ann.rule);
    producer.rule = ann.rule.clone();
    ann.group = group;
    ann.weighted = true;
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Quantize(act));
    }
    cx.annotations.nodes.insert(p, producer);
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

fn annotate_shared(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    let act = cx.activation(n)?;
    cx.quantizable_input(n, 0)?;
    let mut ann = cx.annotation(n, SHARED.name);
    ann.set_input(0, Spec::Quantize(act));
    for k in cx.float_outputs(n) {
        ann.set_output(k, Spec::Shared(Edge::Input { node: n, index: 0 }));
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

fn annotate_concat(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    let act = cx.activation(n)?;
    let node = cx.graph.node(n).expect("live node");
    let float: Vec<(usize, ValueId)> = node.inputs.iter().enumerate().filter_map(|(i, v)| v.filter(|&v| cx.is_quantizable(v)).map(|v| (i, v))).collect();
    let Some(&(anchor, _)) = float.iter().find(|(_, v)| cx.is_activation(*v)).or(float.first()) else {
        return Err(Unquantized::unsupported("it has no float input"));
    };
    let shared = Spec::Shared(Edge::Input { node: n, index: anchor });
    let mut ann = cx.annotation(n, CONCAT.name);
    for &(i, _) in &float {
        ann.set_input(i, if i == anchor { Spec::Quantize(act.clone()) } else { shared.clone() });
    }
    for k in cx.float_outputs(n) {
        ann.set_output(k, shared.clone());
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

/// Fixed qparams for an output in [0, 1]: scale 1 / (qmax - qmin + 1), zero point qmin.
pub fn unit_interval_qparams(scheme: QScheme) -> FixedQParams {
    let (qmin, qmax) = scheme.qrange();
    FixedQParams { scheme, scale: (1.0 / (qmax - qmin + 1) as f64) as f32, zero_point: qmin }
}

/// Fixed qparams for an output in [-1, 1]: scale 2 / (qmax - qmin + 1), zero point in the
/// middle of the range.
pub fn symmetric_unit_qparams(scheme: QScheme) -> FixedQParams {
    let (qmin, qmax) = scheme.qrange();
    let levels = qmax - qmin + 1;
    FixedQParams { scheme, scale: (2.0 / levels as f64) as f32, zero_point: qmin + levels / 2 }
}

fn annotate_fixed(cx: &mut AnnotationContext<'_>, n: NodeId, rule: &str, fixed: fn(QScheme) -> FixedQParams) -> Result<(), Unquantized> {
    let act = cx.activation(n)?;
    cx.quantizable_input(n, 0)?;
    let mut ann = cx.annotation(n, rule);
    ann.set_input(0, Spec::Quantize(act.clone()));
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Fixed(fixed(act.scheme)));
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

fn annotate_unit_interval(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    annotate_fixed(cx, n, UNIT_INTERVAL.name, unit_interval_qparams)
}

fn annotate_symmetric_unit(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    annotate_fixed(cx, n, SYMMETRIC_UNIT.name, symmetric_unit_qparams)
}

fn annotate_layer_norm(cx: &mut AnnotationContext<'_>, n: NodeId) -> Result<(), Unquantized> {
    let act = cx.activation(n)?;
    cx.quantizable_input(n, 0)?;
    let mut ann = cx.annotation(n, LAYER_NORM.name);
    ann.set_input(0, Spec::Quantize(act.clone()));
    if cx.input(n, 1).is_some_and(|v| cx.is_quantizable(v)) {
        ann.set_input(1, Spec::Quantize(if act.scheme.qtype == QType::U16 { symmetric_16bit() } else { act.clone() }));
        if cx.input(n, 2).is_some_and(|v| cx.is_float_constant(v)) && cx.input(n, 1).is_some_and(|v| cx.is_float_constant(v)) {
            ann.set_input(2, Spec::Derived { from: vec![Edge::Input { node: n, index: 0 }, Edge::Input { node: n, index: 1 }], how: Derivation::BiasScale });
        }
    }
    if cx.float_outputs(n).contains(&0) {
        ann.set_output(0, Spec::Quantize(act));
    }
    cx.annotations.nodes.insert(n, ann);
    Ok(())
}

/// What a validate function checks against: the graph, its annotations, and the chosen
/// generation of the table.
pub struct ValidationContext<'a> {
    pub graph: &'a Graph,
    pub annotations: &'a Annotations,
    pub table: &'a SocTable,
    pub generation: &'a Generation,
}

impl ValidationContext<'_> {
    /// The integer type an edge resolves to (following shared specs).
    pub fn qtype(&self, e: Edge) -> Option<QType> {
        resolve(self.annotations, e, 0).and_then(qtype_of)
    }
}

fn bits(q: QType) -> u32 {
    match q {
        QType::U4 | QType::S4 => 4,
        QType::U8 | QType::S8 => 8,
        QType::U16 | QType::S16 => 16,
        QType::S32 => 32,
    }
}

/// The table's op constraints on node `n`: how many of its quantized activation inputs have
/// the constraint's width, against the generation the constraint needs.
pub fn validate_op_constraints(vx: &ValidationContext<'_>, n: NodeId) -> Vec<Violation> {
    let node = vx.graph.node(n).expect("annotated nodes are live");
    vx.table.op_constraint.iter().filter(|c| c.ops.contains(&node.op_type)).filter_map(|c| {
        let count = node.inputs.iter().enumerate().filter(|(i, v)| {
            v.is_some_and(|v| !vx.graph.value(v).is_ok_and(|x| x.is_constant()))
                && vx.qtype(Edge::Input { node: n, index: *i }).is_some_and(|q| bits(q) == c.activation_bits)
        }).count();
        (count >= c.activation_inputs && !vx.table.at_least(vx.generation, &c.since)).then(|| Violation {
            node: n,
            rule: format!("{} needs HTP {} or newer ({} is older)", c.rule, c.since, vx.generation.name),
            fix: format!("use --soc {}, or give this node 8-bit activations (--precision 8a8w, or a [[name]] entry with precision = \"8a8w\" in --config)", c.since),
        })
    }).collect()
}

/// [`validate_op_constraints`], and the precision of a constant weight against the
/// generation's precisions.
pub fn validate_weighted(vx: &ValidationContext<'_>, n: NodeId) -> Vec<Violation> {
    let mut out = validate_op_constraints(vx, n);
    let weight = match vx.annotations.spec(Edge::Input { node: n, index: 1 }) {
        Some(Spec::Quantize(w)) if vx.graph.node(n).ok().and_then(|x| x.input(1)).is_some_and(|v| vx.graph.value(v).is_ok_and(|x| x.is_constant())) => w,
        _ => return out,
    };
    let Some(act) = vx.qtype(Edge::Input { node: n, index: 0 }) else { return out };
    let blockwise = matches!(weight.granularity, Granularity::PerBlock { .. });
    let gen = vx.generation;
    let list = gen.precisions.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ");
    match Precision::of(act, weight.scheme.qtype, blockwise) {
        Some(p) if gen.precisions.contains(&p) => {}
        Some(p) => {
            let alternative = gen.closest(p).map(|c| format!("--precision {c}"));
            let newer = vx.table.oldest_with(p).map(|g| format!("--soc {}", g.name));
            out.push(Violation {
                node: n,
                rule: format!("{p} is not supported on HTP {} (its weighted ops run {list})", gen.name),
                fix: format!("use {}", alternative.into_iter().chain(newer).collect::<Vec<_>>().join(" or ")),
            });
        }
        None => out.push(Violation {
            node: n,
            rule: format!("{act:?} activations with {:?} {} weights are not an HTP precision", weight.scheme.qtype, if blockwise { "block-wise" } else { "per-channel" }),
            fix: format!("use one of {list}"),
        }),
    }
    out
}

/// [`validate_op_constraints`], and every quantized output shares its input's qparams (the
/// HTP keeps the encoding of math-invariant ops).
pub fn validate_shared(vx: &ValidationContext<'_>, n: NodeId) -> Vec<Violation> {
    let mut out = validate_op_constraints(vx, n);
    let ann = vx.annotations.get(n).expect("annotated node");
    if ann.outputs.iter().flatten().any(|s| !matches!(s, Spec::Shared(_))) {
        let op = &vx.graph.node(n).expect("live node").op_type;
        out.push(Violation { node: n, rule: format!("{op} is math-invariant: its output must share its input's qparams"), fix: format!("annotate {op} with the '{}' rule", SHARED.name) });
    }
    out
}

/// [`validate_op_constraints`], and the output has the fixed qparams of its op for its type
/// (Sigmoid, HardSigmoid, Softmax: [0, 1]; Tanh: [-1, 1]).
pub fn validate_fixed(vx: &ValidationContext<'_>, n: NodeId) -> Vec<Violation> {
    let mut out = validate_op_constraints(vx, n);
    let node = vx.graph.node(n).expect("live node");
    let (rule, expected): (OpRule, fn(QScheme) -> FixedQParams) = if node.op_type == "Tanh" { (SYMMETRIC_UNIT, symmetric_unit_qparams) } else { (UNIT_INTERVAL, unit_interval_qparams) };
    let output = resolve(vx.annotations, Edge::Output { node: n, index: 0 }, 0);
    let ok = match output {
        None => true,
        Some(Spec::Fixed(f)) => {
            let want = expected(f.scheme);
            (f.scale, f.zero_point) == (want.scale, want.zero_point)
        }
        Some(_) => false,
    };
    if !ok {
        out.push(Violation {
            node: n,
            rule: format!("{} output must have the fixed qparams of its range", node.op_type),
            fix: format!("annotate {} with the '{}' rule", node.op_type, rule.name),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_names_a_known_rule_once() {
        for (i, (op, rule)) in HTP_RULES.iter().enumerate() {
            assert!(HTP_RULES[..i].iter().all(|(o, _)| o != op), "{op} is listed twice");
            assert!(RuleRegistry::named(rule.name).is_some(), "{op}: rule {} is not named", rule.name);
        }
        assert!(HTP_RULES.windows(2).all(|w| w[0].0 < w[1].0), "lines are sorted by op type");
    }

    #[test]
    fn fixed_qparams_follow_the_type() {
        let s8 = unit_interval_qparams(QScheme::new(QType::U8, false, CONVENTION));
        assert_eq!((s8.scale, s8.zero_point), (1.0 / 256.0, 0));
        let t16 = symmetric_unit_qparams(QScheme::new(QType::U16, false, CONVENTION));
        assert_eq!((t16.scale, t16.zero_point), (1.0 / 32768.0, 32768));
    }
}
