//! Lowering a QDQ model to integer operators (ONNX Runtime's `QuantFormat.QOperator`).
//!
//! A QDQ *unit* is a node whose inputs come from `DequantizeLinear` and whose output goes to
//! a `QuantizeLinear`. [`lower_qoperator`] rewrites each unit it can into the integer operator
//! that computes it, reading the quantized tensors directly and writing the `QuantizeLinear`'s
//! output (same value, same name), one [`Patch`] per unit:
//!
//! | unit | becomes |
//! |---|---|
//! | `Conv` (8-bit input, per-tensor or per-output-channel 8-bit weight, int32 bias), output quantized | `QLinearConv` |
//! | same, output float | `ConvInteger` (+ int32 bias `Add`) -> `Cast` -> `Mul` by `sx·sw` |
//! | `MatMul` (both inputs quantized; a constant B per-tensor or per-column), output quantized | `QLinearMatMul` |
//! | same, output float, or A from `DynamicQuantizeLinear` | `MatMulInteger` -> `Cast` -> `Mul` by `sa·sb` (a `Mul` of the run-time scale) |
//! | `Gemm` (constant B, optional int32 C), output quantized or float | `com.microsoft` `QGemm` |
//! | `Add`, `Mul` | `com.microsoft` `QLinearAdd`, `QLinearMul` |
//! | `Sigmoid`, `LeakyRelu`, `Softmax` | `com.microsoft` `QLinearSigmoid`, `QLinearLeakyRelu`, `QLinearSoftmax` |
//! | `GlobalAveragePool`, `AveragePool` | `com.microsoft` `QLinearGlobalAveragePool`, `QLinearAveragePool` |
//! | `Concat` | `Concat` of the integers when every input has the output's qparams, else `com.microsoft` `QLinearConcat` |
//! | data movement (`MaxPool`, `Reshape`, `Transpose`, `Resize` nearest, `Pad`, ...) with equal input and output qparams | the same op on the integers |
//! | `Relu`/`Clip` with equal input and output qparams | nothing (the range already clamps) or `Clip` of the integers |
//!
//! A `Relu` or `Clip` between a unit and its `QuantizeLinear` is absorbed when the quantized
//! range already clamps, with ONNX Runtime's rules (`ReluQuantFusion`: the zero point is the
//! type minimum; `ClipQuantFusion`: the representable range lies within the clip bounds up to
//! `f32::EPSILON`). A unit that cannot be lowered stays QDQ and is listed with its reason
//! ([`NotLowered`]). Afterwards `DequantizeLinear -> QuantizeLinear` pairs with equal
//! per-tensor qparams are removed (the integer tensor is read directly, as ONNX Runtime's
//! QDQ-to-QOperator conversion does); pairs that requantize stay explicit. If/Loop bodies are
//! lowered too (innermost first), and every graph passes `Graph::check` after the pass.
//!
//! For qforge's own sessions only ([`LowerOptions::lookup_tables`]), a unit of a pointwise op
//! (HardSwish, HardSigmoid, Tanh, Erf, Exp, Clip, ...) that has no other integer form becomes a
//! [`LOOKUP_TABLE`] of its 256 possible results, computed by the unit's own kernels.

use std::collections::HashMap;

use qforge_ir::{Attr, DType, Graph, Model, Node, NodeId, OpsetImport, Patch, Tensor, ValueId, ValueType, CAPTURE_USE, MS_DOMAIN};

use crate::kernels::elementwise::is_pointwise;
use crate::{LOOKUP_TABLE, QLINEAR_CONV_LOOKUP, RUNTIME_DOMAIN};

/// A unit rewritten into integer operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lowered {
    /// The name of the graph holding the unit (a subgraph's own name for If/Loop bodies).
    pub graph: String,
    /// The unit's node (its name, or `#id (op)`).
    pub node: String,
    /// The node's op before lowering (`domain::op` outside the default domain).
    pub op: String,
    /// What it became, e.g. `QLinearConv` or `ConvInteger+Cast+Mul`.
    pub into: String,
}

/// A QDQ unit left as it was, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotLowered {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub reason: String,
}

/// A chain of elementwise nodes over one 8-bit value that runs as one lookup table
/// ([`LowerOptions::lookup_tables`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Composed {
    /// The name of the graph holding the chain.
    pub graph: String,
    /// The nodes of the chain (names, or `#id (op)`), first to last, ending with the node
    /// whose output the table computes; those without other readers are removed.
    pub chain: Vec<String>,
}

impl Composed {
    /// The node whose output the table computes: the last of the chain.
    pub fn node(&self) -> &str {
        self.chain.last().map_or("", String::as_str)
    }
}

/// What [`lower_qoperator`] did.
#[derive(Debug, Clone, Default)]
pub struct LowerLog {
    pub lowered: Vec<Lowered>,
    pub not_lowered: Vec<NotLowered>,
    /// Chains of elementwise nodes composed into lookup tables, after the units were lowered.
    pub composed: Vec<Composed>,
    /// QLinearConv nodes (names, or `#id (op)`) whose output is mapped through a lookup table
    /// inside the convolution ([`QLINEAR_CONV_LOOKUP`]), replacing the table's node.
    pub tables_in_convs: Vec<String>,
    /// `DequantizeLinear -> QuantizeLinear` pairs with equal qparams that were removed.
    pub pairs_removed: usize,
    /// Whether `com.microsoft` operators were written (the model then imports that domain).
    pub contrib: bool,
}

/// Why [`lower_qoperator`] failed; the model is then unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// A rewrite that was built but could not be applied (a bug in the pass, reported with the
    /// node rather than left half done).
    #[error("cannot lower node '{node}' ({op}) of graph '{graph}': {reason}")]
    Node { graph: String, node: String, op: String, reason: String },
    /// The model as a whole (no default-domain import, a graph failing its check).
    #[error("cannot lower the model: {0}")]
    Model(String),
}

/// Choices of [`lower_qoperator_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LowerOptions {
    /// Rewrites each unit of a pointwise op ([`crate::kernels::elementwise::is_pointwise`])
    /// that has no other integer form, with per-tensor 8-bit input and output and constant
    /// other inputs, into a [`crate::LOOKUP_TABLE`] of the 256 results of its
    /// `DequantizeLinear`, op and `QuantizeLinear` kernels (so it computes exactly what the
    /// unit does). The result is then for qforge sessions only: no other runtime has the op.
    pub lookup_tables: bool,
}

/// Lowers every QDQ unit of `model` (main graph and If/Loop bodies) that has an integer form
/// into it; see the module documentation for the patterns. Units that cannot be lowered stay
/// QDQ and are listed in the log with the reason. Adds the `com.microsoft` opset import when
/// contrib operators were written. On error the model is left unchanged.
pub fn lower_qoperator(model: &mut Model) -> Result<LowerLog, LowerError> {
    lower_qoperator_with(model, LowerOptions::default())
}

/// [`lower_qoperator`] with [`LowerOptions`].
pub fn lower_qoperator_with(model: &mut Model, options: LowerOptions) -> Result<LowerLog, LowerError> {
    let opset = model.opset("").ok_or_else(|| LowerError::Model("the model does not import the default ONNX domain".into()))?;
    let mut m = model.clone();
    let mut log = LowerLog::default();
    let paths: Vec<_> = m.graph.graphs().into_iter().map(|(p, _)| p).collect();
    for path in paths.iter().rev() {
        let outer = outer_constants(&m.graph, path);
        let g = m.graph.graph_at_mut(path).ok_or_else(|| LowerError::Model("a subgraph disappeared while lowering".into()))?;
        lower_graph(g, &outer, (opset, &model.opset_imports), options, &mut log)?;
    }
    m.graph.check().map_err(|e| LowerError::Model(format!("the lowered graph fails its check: {e}")))?;
    if log.contrib && m.opset(MS_DOMAIN).is_none() {
        m.opset_imports.push(OpsetImport { domain: MS_DOMAIN.into(), version: 1 });
    }
    *model = m;
    Ok(log)
}

/// Constants of the graphs enclosing the subgraph at `path`, by name (the nearest definition
/// wins; a name redefined by a non-constant on the way is dropped).
fn outer_constants(root: &Graph, path: &[(NodeId, String)]) -> HashMap<String, Tensor> {
    let mut map = HashMap::new();
    let mut g = root;
    for (id, attr) in path {
        for (_, v) in g.values() {
            match v.initializer().filter(|_| v.is_constant()) {
                Some(t) => map.insert(v.name.clone(), t.clone()),
                None => map.remove(&v.name),
            };
        }
        let Some(sub) = g.node(*id).ok().and_then(|n| n.subgraphs().find(|(a, _)| a == attr).map(|(_, s)| s)) else { break };
        g = sub;
    }
    map
}

/// Lowers the units of one graph, then removes equal-qparams DQ -> Q pairs and dead nodes.
/// `opsets` are the default-domain opset and every import of the model.
fn lower_graph(g: &mut Graph, outer: &HashMap<String, Tensor>, opsets: (i64, &[OpsetImport]), options: LowerOptions, log: &mut LowerLog) -> Result<(), LowerError> {
    let (opset, imports) = opsets;
    let order = g.topo_order().map_err(|e| LowerError::Model(e.to_string()))?;
    for id in order {
        let Ok(node) = g.node(id) else { continue };
        let (name, op) = (node.display_name(id), node.qualified_op());
        if is_op(node, "QuantizeLinear") || is_op(node, "DequantizeLinear") {
            continue;
        }
        let ctx = Ctx { g, outer, opset, imports };
        let mut result = lower_node(&ctx, id);
        if options.lookup_tables && !matches!(result, Ok(Some(_))) {
            if let Some(rw) = lower_lookup(&ctx, id) {
                result = Ok(Some(rw));
            }
        }
        match result {
            Ok(None) => {}
            Ok(Some(rw)) => {
                g.apply(rw.patch).map_err(|e| LowerError::Node { graph: g.name.clone(), node: name.clone(), op: op.clone(), reason: e.to_string() })?;
                log.contrib |= rw.contrib;
                log.lowered.push(Lowered { graph: g.name.clone(), node: name, op, into: rw.into });
            }
            Err(reason) => log.not_lowered.push(NotLowered { graph: g.name.clone(), node: name, op, reason }),
        }
    }
    log.pairs_removed += remove_equal_pairs(g, outer, opset, imports).map_err(|e| LowerError::Model(format!("graph '{}': {e}", g.name)))?;
    g.remove_dead_nodes();
    if options.lookup_tables {
        compose_lookups(g, outer, opsets, log)?;
        tables_into_convs(g, outer, opsets, log)?;
    }
    Ok(())
}

/// Whether `n` is `op` in the default domain, or a Q/DQ in ONNX Runtime's contrib domain.
fn is_op(n: &Node, op: &str) -> bool {
    n.op_type == op && (n.domain.is_empty() || n.domain == "ai.onnx" || (n.domain == MS_DOMAIN && matches!(op, "QuantizeLinear" | "DequantizeLinear")))
}

/// The graph being lowered, the constants of enclosing graphs, the default-domain opset and
/// the model's opset imports.
struct Ctx<'a> {
    g: &'a Graph,
    outer: &'a HashMap<String, Tensor>,
    opset: i64,
    imports: &'a [OpsetImport],
}

impl Ctx<'_> {
    fn node(&self, id: NodeId) -> &Node {
        self.g.node(id).expect("a live node")
    }

    /// The constant data of a value: an initializer, a constant of an enclosing graph, or the
    /// output of a `Constant` node.
    fn constant(&self, v: ValueId) -> Option<Tensor> {
        let val = self.g.value(v).ok()?;
        if val.kind() == qforge_ir::ValueKind::Outer {
            return self.outer.get(&val.name).cloned();
        }
        self.g.constant_data(v)
    }

    /// The element type of a value, from its type or its constant data.
    fn dtype(&self, v: ValueId) -> Option<DType> {
        self.g.value(v).ok().and_then(|x| x.ty.as_ref()).and_then(|t| t.elem()).or_else(|| self.constant(v).map(|t| t.dtype()))
    }

    /// The static shape of a value, when every dimension is known.
    fn shape(&self, v: ValueId) -> Option<Vec<usize>> {
        let ty = self.g.value(v).ok()?.ty.as_ref()?;
        ty.shape()?.iter().map(|d| d.known().and_then(|k| usize::try_from(k).ok())).collect()
    }

    /// The readers of `v` when it is not a graph output and no subgraph reads it.
    fn plain_readers(&self, v: ValueId) -> Option<&[(NodeId, usize)]> {
        let r = self.g.consumers(v);
        (!self.g.is_output(v) && r.iter().all(|u| u.1 != CAPTURE_USE)).then_some(r)
    }
}

/// Float32 values of a tensor.
fn floats(t: &Tensor) -> Option<Vec<f32>> {
    t.as_slice::<f32>().ok().map(|s| s.to_vec())
}

/// Integer values of a tensor of any integer type (4-bit included).
fn ints(t: &Tensor) -> Option<Vec<i64>> {
    t.to_i64_vec().ok().or_else(|| matches!(t.dtype(), DType::U4 | DType::I4).then(|| t.to_f64_vec().ok().map(|v| v.into_iter().map(|x| x as i64).collect())).flatten())
}

/// The value range of an integer type.
fn type_range(d: DType) -> (i64, i64) {
    d.int_range().unwrap_or((0, 0))
}

/// A `DequantizeLinear` feeding a unit.
#[derive(Debug, Clone)]
struct Deq {
    /// The integer tensor it reads.
    x: ValueId,
    dtype: DType,
    scale_v: ValueId,
    zp_v: Option<ValueId>,
    /// Constant scales and zero points (`None` when computed at run time).
    scale: Option<Vec<f32>>,
    zp: Option<Vec<i64>>,
    axis: i64,
    block: bool,
    /// `x`, the scale and the zero point are the outputs of one `DynamicQuantizeLinear`.
    dynamic: bool,
}

impl Deq {
    fn per_tensor(&self) -> bool {
        self.scale.as_ref().is_some_and(|s| s.len() == 1) && !self.block
    }

    /// The scalar qparams of a per-tensor constant DQ.
    fn params(&self) -> Option<(f32, i64)> {
        let s = self.scale.as_ref().filter(|s| s.len() == 1)?[0];
        let z = match &self.zp {
            Some(z) if z.len() == 1 => z[0],
            Some(_) => return None,
            None if self.zp_v.is_none() => 0,
            None => return None,
        };
        Some((s, z))
    }
}

/// The `DequantizeLinear` producing `v`, if any.
fn deq(ctx: &Ctx, v: ValueId) -> Option<Deq> {
    let (p, _) = ctx.g.producer(v)?;
    let n = ctx.node(p);
    if !is_op(n, "DequantizeLinear") {
        return None;
    }
    let (x, scale_v, zp_v) = (n.input(0)?, n.input(1)?, n.input(2));
    let from_dql = |v: ValueId, k: usize| ctx.g.producer(v).is_some_and(|(q, i)| i == k && ctx.node(q).op_type == "DynamicQuantizeLinear" && ctx.g.producer(x).map(|(a, _)| a) == Some(q));
    let dynamic = from_dql(x, 0) && from_dql(scale_v, 1) && zp_v.is_some_and(|z| from_dql(z, 2));
    let scale_t = ctx.constant(scale_v);
    let zp_t = zp_v.and_then(|z| ctx.constant(z));
    let dtype = zp_t.as_ref().map(|t| t.dtype()).or_else(|| zp_v.and_then(|z| ctx.dtype(z))).or_else(|| ctx.dtype(x)).or(dynamic.then_some(DType::U8))?;
    Some(Deq {
        x,
        dtype,
        scale_v,
        zp_v,
        scale: scale_t.as_ref().and_then(floats).filter(|s| !s.is_empty()),
        zp: zp_t.as_ref().and_then(ints).filter(|z| !z.is_empty()),
        axis: n.attr_int("axis").unwrap_or(1),
        block: n.attr_int("block_size").is_some_and(|b| b > 0),
        dynamic,
    })
}

/// A bit-width phrase for messages.
fn width(d: DType) -> String {
    match d {
        DType::U16 | DType::I16 => "int16".into(),
        DType::U4 | DType::I4 => "int4".into(),
        DType::I32 => "int32".into(),
        other => other.to_string(),
    }
}

/// Checks an activation input: 8-bit, per-tensor, constant qparams (run-time ones only when
/// `dynamic_ok`).
fn check_activation(d: &Deq, what: &str, op: &str, dynamic_ok: bool) -> Result<(), String> {
    if !matches!(d.dtype, DType::U8 | DType::I8) {
        return Err(format!("{} activations: {op} takes 8-bit only", width(d.dtype)));
    }
    if d.dynamic {
        return if dynamic_ok { Ok(()) } else { Err(format!("{what} is quantized at run time (DynamicQuantizeLinear): {op} takes constant qparams")) };
    }
    if d.block {
        return Err(format!("{what} quantized per-block: {op} takes one scale"));
    }
    match (&d.scale, d.params()) {
        (None, _) => Err(format!("the scale of {what} is not constant")),
        (Some(s), _) if s.len() != 1 => Err(format!("{what} quantized per-axis: {op} takes one scale")),
        (_, None) => Err(format!("the zero point of {what} is not constant")),
        _ => Ok(()),
    }
}

/// A quantized constant weight: its data and per-output-channel layout.
struct Weight {
    deq: Deq,
    /// Scales, one per output channel (or one).
    scales: Vec<f32>,
    /// The common zero point when all are equal.
    zp: Option<i64>,
}

/// Checks a weight DQ: constant 8-bit data, per tensor or per channel along `axis` (of
/// `channels`).
fn check_weight(ctx: &Ctx, d: &Deq, axis: usize, op: &str) -> Result<Weight, String> {
    let data = ctx.constant(d.x).ok_or("the weight is not a constant")?;
    if !matches!(d.dtype, DType::U8 | DType::I8) {
        return Err(format!("weight is {}: {op} takes 8-bit weights", width(d.dtype)));
    }
    if d.block {
        return Err(format!("weight quantized per-block: {op} takes per-tensor or per-channel scales"));
    }
    let scales = d.scale.clone().ok_or("the weight scale is not constant")?;
    let zps = match (&d.zp, d.zp_v) {
        (Some(z), _) => z.clone(),
        (None, None) => vec![0],
        (None, Some(_)) => return Err("the weight zero point is not constant".into()),
    };
    if scales.len() > 1 {
        let rank = data.rank() as i64;
        let ax = if d.axis < 0 { d.axis + rank } else { d.axis };
        let channels = data.shape().get(axis).copied().unwrap_or(0);
        if ax != axis as i64 || scales.len() != channels {
            return Err(format!("weight quantized along axis {} (shape {:?}): {op} takes scales along axis {axis}", d.axis, data.shape()));
        }
    }
    let zp = zps.iter().all(|&z| z == zps[0]).then_some(zps[0]);
    Ok(Weight { deq: d.clone(), scales, zp })
}

/// A `QuantizeLinear` writing a unit's output.
#[derive(Debug, Clone)]
struct Quant {
    node: NodeId,
    output: ValueId,
    dtype: DType,
    scale_v: ValueId,
    zp_v: Option<ValueId>,
    scale: f32,
    zp: i64,
}

/// Reads a per-tensor `QuantizeLinear` with constant qparams.
fn quant(ctx: &Ctx, id: NodeId) -> Result<Quant, String> {
    let n = ctx.node(id);
    let (output, scale_v) = (n.output(0).ok_or("QuantizeLinear has no output")?, n.input(1).ok_or("QuantizeLinear has no scale")?);
    let zp_v = n.input(2);
    let scale = ctx.constant(scale_v).as_ref().and_then(floats).filter(|s| s.len() == 1).ok_or("the output scale is not a constant float scalar")?[0];
    let (zp, dtype) = match zp_v {
        Some(z) => {
            let t = ctx.constant(z).ok_or("the output zero point is not constant")?;
            (ints(&t).filter(|v| v.len() == 1).ok_or("the output zero point is not a scalar")?[0], t.dtype())
        }
        None => (0, n.attr_int("output_dtype").and_then(|c| i32::try_from(c).ok()).and_then(DType::from_onnx).unwrap_or(DType::U8)),
    };
    if n.attr_int("axis").is_some() && ctx.constant(scale_v).is_some_and(|t| t.len() > 1) {
        return Err("the output is quantized per-axis".into());
    }
    Ok(Quant { node: id, output, dtype, scale_v, zp_v, scale, zp })
}

/// How a unit's output is consumed.
enum Out {
    /// By one `QuantizeLinear`, possibly through an absorbed `Relu`/`Clip`.
    Q { q: Quant, absorbed: Vec<NodeId> },
    /// In float; `why` says why a quantized reader could not be used.
    Float { why: Option<String> },
}

/// The bounds of a `Clip` (constant inputs from opset 11, attributes before).
fn clip_bounds(ctx: &Ctx, n: &Node) -> Result<(f32, f32), String> {
    if ctx.opset < 11 {
        return Ok((n.attr_float("min").unwrap_or(f32::MIN), n.attr_float("max").unwrap_or(f32::MAX)));
    }
    let bound = |i: usize, default: f32| -> Result<f32, String> {
        match n.input(i) {
            None => Ok(default),
            Some(v) => constant_scalar(ctx, v).ok_or_else(|| "the Clip bounds are not constant".to_string()),
        }
    };
    Ok((bound(1, f32::NEG_INFINITY)?, bound(2, f32::INFINITY)?))
}

/// A constant float scalar, or the dequantized value of a constant read through a per-tensor
/// `DequantizeLinear` (convert quantizes constant activation inputs such as Clip bounds):
/// `(q - zp)·scale` in f32, as DequantizeLinear computes it.
fn constant_scalar(ctx: &Ctx, v: ValueId) -> Option<f32> {
    if let Some(x) = ctx.constant(v).as_ref().and_then(floats).filter(|x| x.len() == 1) {
        return Some(x[0]);
    }
    let d = deq(ctx, v)?;
    let q = ctx.constant(d.x).as_ref().and_then(ints).filter(|q| q.len() == 1)?;
    let (s, z) = d.params()?;
    Some((q[0] - z) as i32 as f32 * s)
}

/// Whether a `Relu`/`Clip` right before `q` can be dropped, with ONNX Runtime's rules.
fn absorbable(ctx: &Ctx, clamp: &Node, q: &Quant) -> Result<(), String> {
    let (qmin, qmax) = type_range(q.dtype);
    if !matches!(q.dtype, DType::U8 | DType::I8) {
        return Err(format!("{} output", width(q.dtype)));
    }
    if clamp.op_type == "Relu" {
        return if q.zp == qmin { Ok(()) } else { Err(format!("the Relu before the QuantizeLinear cannot be absorbed: the output zero point {} is not the type minimum {qmin}", q.zp)) };
    }
    let (lo, hi) = clip_bounds(ctx, clamp)?;
    let lower = q.scale * (qmin - q.zp) as f32;
    let upper = q.scale * (qmax - q.zp) as f32;
    if f32::EPSILON < lo - lower || f32::EPSILON < upper - hi {
        return Err(format!("the Clip [{lo}, {hi}] before the QuantizeLinear cannot be absorbed: the output's quantized range [{lower}, {upper}] goes beyond it"));
    }
    Ok(())
}

/// How the output `y` of a unit is read.
fn output(ctx: &Ctx, y: ValueId) -> Result<Out, String> {
    let quantized_reader = ctx.g.consumers(y).iter().any(|(r, i)| *i == 0 && is_op(ctx.node(*r), "QuantizeLinear"));
    let Some(readers) = ctx.plain_readers(y) else {
        return Ok(Out::Float { why: quantized_reader.then(|| "the output is also a graph output or read by a subgraph".into()) });
    };
    if readers.len() != 1 {
        let quantized = readers.iter().filter(|(r, _)| is_op(ctx.node(*r), "QuantizeLinear")).count();
        let why = (quantized > 0).then(|| format!("the output has {} readers besides its QuantizeLinear", readers.len() - 1));
        return Ok(Out::Float { why });
    }
    let (r, i) = readers[0];
    let rn = ctx.node(r);
    if is_op(rn, "QuantizeLinear") && i == 0 {
        return Ok(Out::Q { q: quant(ctx, r)?, absorbed: vec![] });
    }
    if (rn.op_type == "Relu" || rn.op_type == "Clip") && rn.domain.is_empty() && i == 0 {
        let Some(z) = rn.output(0) else { return Ok(Out::Float { why: None }) };
        let Some(zr) = ctx.plain_readers(z).filter(|r| r.len() == 1) else { return Ok(Out::Float { why: None }) };
        let qn = ctx.node(zr[0].0);
        if !is_op(qn, "QuantizeLinear") || zr[0].1 != 0 {
            return Ok(Out::Float { why: None });
        }
        let q = quant(ctx, zr[0].0)?;
        return Ok(match absorbable(ctx, rn, &q) {
            Ok(()) => Out::Q { q, absorbed: vec![r] },
            Err(why) => Out::Float { why: Some(why) },
        });
    }
    Ok(Out::Float { why: None })
}

/// A rewrite of one unit.
struct Rewrite {
    patch: Patch,
    into: String,
    contrib: bool,
}

/// Builds a rewrite: new constants, values and nodes named after the unit's node.
struct Builder<'a, 'c> {
    ctx: &'a Ctx<'c>,
    patch: Patch,
    base: String,
}

impl<'a, 'c> Builder<'a, 'c> {
    fn new(ctx: &'a Ctx<'c>, id: NodeId) -> Self {
        let n = ctx.node(id);
        let base = if n.name.is_empty() { format!("{}_{}", n.op_type, id.0) } else { n.name.clone() };
        Builder { ctx, patch: Patch::new(ctx.g, "lower_qoperator"), base }
    }

    fn init(&mut self, suffix: &str, t: Tensor) -> ValueId {
        let name = self.patch.unique_name(self.ctx.g, &format!("{}_{suffix}", self.base));
        self.patch.new_initializer(name, t)
    }

    fn value(&mut self, suffix: &str, dtype: DType) -> ValueId {
        let name = self.patch.unique_name(self.ctx.g, &format!("{}_{suffix}", self.base));
        self.patch.new_value(name, Some(ValueType::Tensor { elem: Some(dtype), shape: None }))
    }

    /// A scalar integer constant of `dtype`.
    fn int_scalar(&mut self, suffix: &str, dtype: DType, v: i64) -> ValueId {
        let t = match dtype {
            DType::U8 => Tensor::scalar(v as u8),
            DType::I8 => Tensor::scalar(v as i8),
            _ => Tensor::scalar(v as i32),
        };
        self.init(suffix, t)
    }

    /// The zero point input of a DQ, or a new zero of its type when it has none.
    fn zp_of(&mut self, d: &Deq, suffix: &str) -> ValueId {
        match d.zp_v {
            Some(z) => z,
            None => self.int_scalar(suffix, d.dtype, 0),
        }
    }

    fn q_zp(&mut self, q: &Quant) -> ValueId {
        match q.zp_v {
            Some(z) => z,
            None => self.int_scalar("y_zero_point", q.dtype, 0),
        }
    }

    fn add(&mut self, op: &str, domain: &str, suffix: Option<&str>, inputs: Vec<Option<ValueId>>, outputs: Vec<ValueId>, attrs: Vec<qforge_ir::Attribute>) {
        let name = match suffix {
            Some(s) => format!("{}_{s}", self.base),
            None => self.base.clone(),
        };
        let mut n = Node::new(op, name).with_outputs(outputs);
        n.domain = domain.to_string();
        n.inputs = inputs;
        n.attrs = attrs;
        self.patch.add_node(n);
    }

    /// Makes readers of `old` (whose producer this patch removes) read `new`; through an
    /// `Identity` when `old` is a graph output or read by a subgraph.
    fn alias(&mut self, old: ValueId, new: ValueId) {
        if self.ctx.plain_readers(old).is_some() {
            self.patch.replace_uses(old, new);
        } else {
            self.add("Identity", "", Some("alias"), vec![Some(new)], vec![old], vec![]);
        }
    }

    fn done(mut self, remove: &[NodeId], into: impl Into<String>, contrib: bool) -> Rewrite {
        for &r in remove {
            self.patch.remove_node(r);
        }
        Rewrite { patch: self.patch, into: into.into(), contrib }
    }
}

/// The nodes a lowered unit replaces: its node, the absorbed clamp and the QuantizeLinear.
fn unit_nodes(id: NodeId, q: &Quant, absorbed: &[NodeId]) -> Vec<NodeId> {
    [&[id, q.node][..], absorbed].concat()
}

/// What a unit lowered with a float output became, with the reason its quantized reader could
/// not be used, if any.
fn float_path(into: &str, why: Option<String>) -> String {
    match why {
        Some(w) => format!("{into} (float output: {w})"),
        None => into.to_string(),
    }
}

/// Attributes of `n` whose names are in `keep`.
fn attrs_named(n: &Node, keep: &[&str]) -> Vec<qforge_ir::Attribute> {
    n.attrs.iter().filter(|a| keep.contains(&a.name.as_str())).cloned().collect()
}

/// `a·b` within a relative tolerance (bias scales against input scale x weight scale).
fn close(a: f32, b: f32) -> bool {
    ((a as f64) - (b as f64)).abs() <= 1e-4 * (b as f64).abs().max(f64::MIN_POSITIVE)
}

/// Data-movement ops that run on the integers unchanged when their input and output share
/// qparams (exact: they only select, reorder or copy values).
const DIRECT: &[&str] = &["MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Gather", "Identity", "DepthToSpace",
    "SpaceToDepth", "Split", "Expand", "Tile", "Resize", "Pad", "ReduceMax", "ReduceMin"];

/// Lowers the unit anchored at `id`: `Ok(None)` when it is not a QDQ unit, `Err` with the
/// reason when it is one that stays QDQ.
fn lower_node(ctx: &Ctx, id: NodeId) -> Result<Option<Rewrite>, String> {
    let n = ctx.node(id);
    if !n.inputs.iter().flatten().any(|&v| deq(ctx, v).is_some()) {
        return Ok(None);
    }
    if !(n.domain.is_empty() || n.domain == "ai.onnx") {
        return quantized_outputs(ctx, n).then(|| Err(format!("{} has no QLinear form", n.qualified_op()))).transpose();
    }
    match n.op_type.as_str() {
        "Conv" => lower_conv(ctx, id).map(Some),
        "MatMul" => lower_matmul(ctx, id).map(Some),
        "Gemm" => lower_gemm(ctx, id).map(Some),
        "Add" | "Mul" => lower_binary(ctx, id).map(Some),
        "Sigmoid" | "LeakyRelu" | "GlobalAveragePool" | "AveragePool" | "Softmax" => lower_unary(ctx, id).map(Some),
        "Concat" => lower_concat(ctx, id).map(Some),
        "Relu" | "Clip" => lower_clamp(ctx, id),
        op if DIRECT.contains(&op) => lower_direct(ctx, id),
        op => quantized_outputs(ctx, n).then(|| Err(no_form(op))).transpose(),
    }
}

/// Why an op without a lowering here stays QDQ.
fn no_form(op: &str) -> String {
    match op {
        "Where" => format!("op has no QLinear form here: lowering to com.microsoft QLinear{op} is not implemented (qforge has no kernel for it; ONNX Runtime fuses the QDQ unit itself)"),
        "ConvTranspose" => "op has no QLinear form: ONNX and ONNX Runtime's CPU contrib ops have no QLinearConvTranspose".into(),
        _ => format!("op has no QLinear form: {op} has no integer operator in ONNX or ONNX Runtime's com.microsoft domain"),
    }
}

/// Whether some output of `n` is read by a `QuantizeLinear` (the node is a full QDQ unit).
fn quantized_outputs(ctx: &Ctx, n: &Node) -> bool {
    n.outputs.iter().flatten().any(|&o| ctx.g.consumers(o).iter().any(|(r, i)| *i == 0 && is_op(ctx.node(*r), "QuantizeLinear")))
}

/// The DQ of input `i` of `n`, or an error naming the input.
fn input_deq(ctx: &Ctx, n: &Node, i: usize, what: &str) -> Result<Deq, String> {
    let v = n.input(i).ok_or_else(|| format!("{what} is missing"))?;
    deq(ctx, v).ok_or_else(|| format!("{what} is not quantized (no DequantizeLinear)"))
}

/// Refuses the int8-activation / uint8-weight pair ONNX Runtime has no kernel for.
fn check_pair(x: DType, w: DType, op: &str) -> Result<(), String> {
    if x == DType::I8 && w == DType::U8 {
        return Err(format!("int8 input with uint8 weight: ONNX Runtime has no {op} kernel for this pair"));
    }
    Ok(())
}

/// `Conv` -> `QLinearConv`, or `ConvInteger` -> `Cast` -> `Mul` when the output is float.
fn lower_conv(ctx: &Ctx, id: NodeId) -> Result<Rewrite, String> {
    let n = ctx.node(id);
    let y = n.output(0).ok_or("Conv has no output")?;
    let x = input_deq(ctx, n, 0, "the input")?;
    let out = output(ctx, y)?;
    let quantized_out = matches!(out, Out::Q { .. });
    let op = if quantized_out { "QLinearConv" } else { "ConvInteger" };
    check_activation(&x, "the input", op, !quantized_out)?;
    let w = check_weight(ctx, &input_deq(ctx, n, 1, "the weight")?, 0, op)?;
    check_pair(x.dtype, w.deq.dtype, op)?;
    let wshape = ctx.constant(w.deq.x).expect("checked constant").shape().to_vec();
    if wshape.len() < 3 {
        return Err(format!("weight of shape {wshape:?} is not a convolution kernel"));
    }
    if wshape.len() > 4 {
        return Err(format!("a {}-D convolution: qforge's {op} kernel computes 1-D and 2-D ones", wshape.len() - 2));
    }
    let m = wshape[0];
    let bias = conv_bias(ctx, n.input(2), &x, &w.scales, m, op)?;
    let conv_attrs = attrs_named(n, &["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"]);
    let mut b = Builder::new(ctx, id);
    match out {
        Out::Q { q, absorbed } => {
            if q.dtype != x.dtype {
                return Err(format!("the output is {} and the input {}: ONNX Runtime's QLinearConv writes the input's type", q.dtype, x.dtype));
            }
            let Bias::Int(bias) = bias else { return Err("the bias is float: QLinearConv takes an int32 bias with scale input scale x weight scale".into()) };
            if w.zp.is_none() {
                return Err("the weight zero points differ across channels: QLinearConv needs one".into());
            }
            let (xz, wz, yz) = (b.zp_of(&x, "x_zero_point"), b.zp_of(&w.deq, "w_zero_point"), b.q_zp(&q));
            let inputs = vec![Some(x.x), Some(x.scale_v), Some(xz), Some(w.deq.x), Some(w.deq.scale_v), Some(wz), Some(q.scale_v), Some(yz), bias];
            b.add("QLinearConv", "", None, inputs, vec![q.output], conv_attrs);
            Ok(b.done(&unit_nodes(id, &q, &absorbed), "QLinearConv", false))
        }
        Out::Float { why } => {
            let wz = w.zp.ok_or("the weight zero points differ across channels: ConvInteger takes one")?;
            let xz = b.zp_of(&x, "x_zero_point");
            let wzv = b.int_scalar("w_zero_point", w.deq.dtype, wz);
            let acc = b.value("int32", DType::I32);
            b.add("ConvInteger", "", None, vec![Some(x.x), Some(w.deq.x), Some(xz), Some(wzv)], vec![acc], conv_attrs);
            let rank = wshape.len();
            let channel_shape: Vec<usize> = [vec![1, m], vec![1; rank - 2]].concat();
            let acc = match &bias {
                Bias::Int(Some(bv)) => {
                    let data = ctx.constant(*bv).expect("checked constant");
                    let t = data.reshaped(&if data.len() == 1 { vec![1; rank] } else { channel_shape.clone() }).map_err(|e| e.to_string())?;
                    let bi = b.init("bias_int32", t);
                    let sum = b.value("biased", DType::I32);
                    b.add("Add", "", Some("bias"), vec![Some(acc), Some(bi)], vec![sum], vec![]);
                    sum
                }
                _ => acc,
            };
            let cast = b.value("float", DType::F32);
            b.add("Cast", "", Some("cast"), vec![Some(acc)], vec![cast], vec![qforge_ir::Attribute::new("to", Attr::Int(DType::F32 as i64))]);
            let wscale: Vec<f32> = if w.scales.len() == 1 { vec![w.scales[0]; m] } else { w.scales.clone() };
            let scale = scale_product(&mut b, &x, &wscale, &channel_shape)?;
            let float_bias = match bias {
                Bias::Float(bv) => Some(bv),
                _ => None,
            };
            match float_bias {
                None => b.add("Mul", "", Some("scale"), vec![Some(cast), Some(scale)], vec![y], vec![]),
                Some(bv) => {
                    let data = ctx.constant(bv).expect("checked constant");
                    let t = data.reshaped(&if data.len() == 1 { vec![1; rank] } else { channel_shape.clone() }).map_err(|e| e.to_string())?;
                    let bf = b.init("bias_float", t);
                    let scaled = b.value("scaled", DType::F32);
                    b.add("Mul", "", Some("scale"), vec![Some(cast), Some(scale)], vec![scaled], vec![]);
                    b.add("Add", "", Some("bias"), vec![Some(scaled), Some(bf)], vec![y], vec![]);
                }
            }
            Ok(b.done(&[id], float_path("ConvInteger+Cast+Mul", why), false))
        }
    }
}

/// A Conv/Gemm bias: int32 through a DQ (the integer value), float constant, or none.
enum Bias {
    Int(Option<ValueId>),
    Float(ValueId),
}

/// Checks a Conv bias: an int32 DQ with zero point 0 and scale `sx·sw[c]`, or (for the
/// integer path) a float constant.
fn conv_bias(ctx: &Ctx, b: Option<ValueId>, x: &Deq, wscales: &[f32], m: usize, op: &str) -> Result<Bias, String> {
    let Some(bv) = b else { return Ok(Bias::Int(None)) };
    let Some(d) = deq(ctx, bv) else {
        let t = ctx.constant(bv).ok_or("the bias is neither quantized nor constant")?;
        if t.dtype() != DType::F32 || !(t.len() == m || t.len() == 1) {
            return Err(format!("the bias of shape {:?} and type {} does not match the {m} output channels", t.shape(), t.dtype()));
        }
        return Ok(Bias::Float(bv));
    };
    let data = ctx.constant(d.x).ok_or("the bias is not a constant")?;
    if d.dtype != DType::I32 {
        return Err(format!("the bias is quantized to {}: {op} takes int32", width(d.dtype)));
    }
    if !(data.len() == m || data.len() == 1) || data.rank() > 1 {
        return Err(format!("the bias of shape {:?} does not match the {m} output channels", data.shape()));
    }
    if d.zp.as_ref().is_some_and(|z| z.iter().any(|&v| v != 0)) {
        return Err("the bias zero point is not 0".into());
    }
    let bs = d.scale.as_ref().ok_or("the bias scale is not constant")?;
    if x.dynamic {
        return Err("an int32 bias with a run-time input scale cannot be checked".into());
    }
    let (sx, _) = x.params().ok_or("the input qparams are not constant")?;
    for c in 0..m.max(1) {
        let want = sx * wscales[if wscales.len() == 1 { 0 } else { c.min(wscales.len() - 1) }];
        let got = bs[if bs.len() == 1 { 0 } else { c.min(bs.len() - 1) }];
        if !close(got, want) {
            return Err(format!("the bias scale {got:e} (channel {c}) is not input scale x weight scale {want:e}"));
        }
    }
    Ok(Bias::Int(Some(d.x)))
}

/// The scale that turns an integer accumulation into the float result: the constant
/// `sx·sw[c]` laid out as `shape`, or for a run-time input scale a `Mul` of it by `sw`.
fn scale_product(b: &mut Builder, x: &Deq, wscales: &[f32], shape: &[usize]) -> Result<ValueId, String> {
    let channels: usize = shape.iter().product();
    let wshape = if channels == 1 && wscales.len() == 1 { vec![] } else { shape.to_vec() };
    if x.dynamic {
        let sw = b.init("w_scale", Tensor::from_vec(&wshape, wscales.to_vec()).map_err(|e| e.to_string())?);
        let s = b.value("scale", DType::F32);
        b.add("Mul", "", Some("scale_product"), vec![Some(x.scale_v), Some(sw)], vec![s], vec![]);
        return Ok(s);
    }
    let (sx, _) = x.params().ok_or("the input qparams are not constant")?;
    let prod: Vec<f32> = wscales.iter().map(|&s| sx * s).collect();
    Ok(b.init("scale", Tensor::from_vec(&wshape, prod).map_err(|e| e.to_string())?))
}

/// `MatMul` -> `QLinearMatMul`, or `MatMulInteger` -> `Cast` -> `Mul` when the output is float
/// (including A quantized at run time by `DynamicQuantizeLinear`).
fn lower_matmul(ctx: &Ctx, id: NodeId) -> Result<Rewrite, String> {
    let n = ctx.node(id);
    let y = n.output(0).ok_or("MatMul has no output")?;
    let a = input_deq(ctx, n, 0, "input A")?;
    let bd = input_deq(ctx, n, 1, "input B")?;
    let out = output(ctx, y)?;
    let quantized_out = matches!(out, Out::Q { .. });
    let op = if quantized_out { "QLinearMatMul" } else { "MatMulInteger" };
    check_activation(&a, "input A", op, !quantized_out)?;
    // B: a constant weight (per tensor or per column of a 2-D matrix) or an activation.
    let bconst = ctx.constant(bd.x);
    let bscales = match &bconst {
        Some(t) => {
            let axis = if t.rank() == 2 { 1 } else { t.rank().saturating_sub(1) };
            let w = check_weight(ctx, &bd, axis, op)?;
            if w.scales.len() > 1 && t.rank() != 2 {
                return Err(format!("per-column weight of rank {}: {op} takes per-column scales of a 2-D matrix only", t.rank()));
            }
            w.scales
        }
        None => {
            check_activation(&bd, "input B", op, false)?;
            vec![bd.params().expect("checked").0]
        }
    };
    check_pair(a.dtype, bd.dtype, op)?;
    let mut b = Builder::new(ctx, id);
    match out {
        Out::Q { q, absorbed } => {
            if q.dtype != a.dtype {
                return Err(format!("the output is {} and input A {}: ONNX Runtime's QLinearMatMul writes A's type", q.dtype, a.dtype));
            }
            let (az, bz, yz) = (b.zp_of(&a, "a_zero_point"), b.zp_of(&bd, "b_zero_point"), b.q_zp(&q));
            let inputs = vec![Some(a.x), Some(a.scale_v), Some(az), Some(bd.x), Some(bd.scale_v), Some(bz), Some(q.scale_v), Some(yz)];
            b.add("QLinearMatMul", "", None, inputs, vec![q.output], vec![]);
            Ok(b.done(&unit_nodes(id, &q, &absorbed), "QLinearMatMul", false))
        }
        Out::Float { why } => {
            let az = b.zp_of(&a, "a_zero_point");
            let bz = b.zp_of(&bd, "b_zero_point");
            let acc = b.value("int32", DType::I32);
            b.add("MatMulInteger", "", None, vec![Some(a.x), Some(bd.x), Some(az), Some(bz)], vec![acc], vec![]);
            let cast = b.value("float", DType::F32);
            b.add("Cast", "", Some("cast"), vec![Some(acc)], vec![cast], vec![qforge_ir::Attribute::new("to", Attr::Int(DType::F32 as i64))]);
            let shape = if bscales.len() > 1 { vec![bscales.len()] } else { vec![1] };
            let scale = scale_product(&mut b, &a, &bscales, &shape)?;
            b.add("Mul", "", Some("scale"), vec![Some(cast), Some(scale)], vec![y], vec![]);
            let into = if a.dynamic { "DynamicQuantizeLinear+MatMulInteger+Cast+Mul" } else { "MatMulInteger+Cast+Mul" };
            Ok(b.done(&[id], float_path(into, why), false))
        }
    }
}

/// `Gemm` -> `com.microsoft` `QGemm` (quantized or float output).
fn lower_gemm(ctx: &Ctx, id: NodeId) -> Result<Rewrite, String> {
    let n = ctx.node(id);
    let y = n.output(0).ok_or("Gemm has no output")?;
    let a = input_deq(ctx, n, 0, "input A")?;
    check_activation(&a, "input A", "QGemm", false)?;
    let bd = input_deq(ctx, n, 1, "input B")?;
    let bdata = ctx.constant(bd.x).ok_or("input B is not a constant weight: QGemm takes a constant B")?;
    if bdata.rank() != 2 {
        return Err(format!("input B of shape {:?} is not a matrix", bdata.shape()));
    }
    let trans_b = n.attr_int("transB").unwrap_or(0) != 0;
    let w = check_weight(ctx, &bd, if trans_b { 0 } else { 1 }, "QGemm")?;
    check_pair(a.dtype, bd.dtype, "QGemm")?;
    let cols = bdata.shape()[if trans_b { 0 } else { 1 }];
    let (alpha, beta) = (n.attr_float("alpha").unwrap_or(1.0), n.attr_float("beta").unwrap_or(1.0));
    let c = match n.input(2) {
        None => None,
        Some(cv) => {
            if alpha != 1.0 || beta != 1.0 {
                return Err(format!("alpha {alpha} and beta {beta} with a bias: QGemm's int32 bias assumes both are 1"));
            }
            match conv_bias(ctx, Some(cv), &a, &w.scales, cols, "QGemm")? {
                Bias::Int(v) => v,
                Bias::Float(_) => return Err("the bias C is float: QGemm takes an int32 bias with scale A scale x B scale".into()),
            }
        }
    };
    if c.is_some_and(|cv| ctx.constant(cv).is_some_and(|t| t.rank() != 1)) {
        return Err("the bias C is not 1-D".into());
    }
    let attrs = attrs_named(n, &["alpha", "transA", "transB"]);
    let mut b = Builder::new(ctx, id);
    let (az, bz) = (b.zp_of(&a, "a_zero_point"), b.zp_of(&bd, "b_zero_point"));
    let mut inputs = vec![Some(a.x), Some(a.scale_v), Some(az), Some(bd.x), Some(bd.scale_v), Some(bz), c];
    match output(ctx, y)? {
        Out::Q { q, absorbed } => {
            if q.dtype != a.dtype {
                return Err(format!("the output is {} and input A {}: ONNX Runtime's QGemm writes A's type", q.dtype, a.dtype));
            }
            let yz = b.q_zp(&q);
            inputs.extend([Some(q.scale_v), Some(yz)]);
            b.add("QGemm", MS_DOMAIN, None, inputs, vec![q.output], attrs);
            Ok(b.done(&unit_nodes(id, &q, &absorbed), "com.microsoft::QGemm", true))
        }
        Out::Float { why } => {
            while inputs.last() == Some(&None) {
                inputs.pop();
            }
            b.add("QGemm", MS_DOMAIN, None, inputs, vec![y], attrs);
            Ok(b.done(&[id], float_path("com.microsoft::QGemm (float output)", why), true))
        }
    }
}

/// The quantized output of an op that has no float-output integer form.
fn quantized_output(ctx: &Ctx, y: ValueId, op: &str, dtype: DType) -> Result<(Quant, Vec<NodeId>), String> {
    match output(ctx, y)? {
        Out::Q { q, absorbed } if q.dtype == dtype => Ok((q, absorbed)),
        Out::Q { q, .. } => Err(format!("the output is {} and the input {}: {op} keeps the type", width(q.dtype), width(dtype))),
        Out::Float { why } => Err(why.unwrap_or_else(|| format!("the output is not quantized (read in float): {op} needs a quantized output"))),
    }
}

/// `Add`/`Mul` -> `com.microsoft` `QLinearAdd`/`QLinearMul`.
fn lower_binary(ctx: &Ctx, id: NodeId) -> Result<Rewrite, String> {
    let n = ctx.node(id);
    let op = format!("QLinear{}", n.op_type);
    let y = n.output(0).ok_or("no output")?;
    let a = input_deq(ctx, n, 0, "input A")?;
    let bd = input_deq(ctx, n, 1, "input B")?;
    check_activation(&a, "input A", &op, false)?;
    check_activation(&bd, "input B", &op, false)?;
    if a.dtype != bd.dtype {
        return Err(format!("inputs of types {} and {}: {op} takes one type", a.dtype, bd.dtype));
    }
    let (q, absorbed) = quantized_output(ctx, y, &op, a.dtype)?;
    let mut b = Builder::new(ctx, id);
    let (az, bz, yz) = (b.zp_of(&a, "a_zero_point"), b.zp_of(&bd, "b_zero_point"), b.q_zp(&q));
    b.add(&op, MS_DOMAIN, None, vec![Some(a.x), Some(a.scale_v), Some(az), Some(bd.x), Some(bd.scale_v), Some(bz), Some(q.scale_v), Some(yz)], vec![q.output], vec![]);
    Ok(b.done(&unit_nodes(id, &q, &absorbed), format!("com.microsoft::{op}"), true))
}

/// `Sigmoid`, `LeakyRelu`, `GlobalAveragePool`, `AveragePool`, `Softmax` -> their
/// `com.microsoft` QLinear forms.
fn lower_unary(ctx: &Ctx, id: NodeId) -> Result<Rewrite, String> {
    let n = ctx.node(id);
    let op = format!("QLinear{}", n.op_type);
    let y = n.output(0).ok_or("no output")?;
    let x = input_deq(ctx, n, 0, "the input")?;
    check_activation(&x, "the input", &op, false)?;
    let (q, absorbed) = quantized_output(ctx, y, &op, x.dtype)?;
    let mut attrs = match n.op_type.as_str() {
        "LeakyRelu" => attrs_named(n, &["alpha"]),
        "Softmax" => {
            // QLinearSoftmax computes the Softmax of the version its `opset` attribute names.
            let since = if ctx.opset >= 13 { 13 } else if ctx.opset >= 11 { 11 } else { 1 };
            let mut a = attrs_named(n, &["axis"]);
            a.push(qforge_ir::Attribute::new("opset", Attr::Int(since)));
            a
        }
        "AveragePool" => {
            if n.attr_ints("dilations").is_some_and(|d| d.iter().any(|&v| v != 1)) {
                return Err("AveragePool with dilations: QLinearAveragePool has none".into());
            }
            attrs_named(n, &["auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides"])
        }
        _ => vec![],
    };
    if n.op_type.ends_with("AveragePool") {
        attrs.push(qforge_ir::Attribute::new("channels_last", Attr::Int(0)));
    }
    if n.op_type == "GlobalAveragePool" {
        // ONNX Runtime refuses combined scales outside [2^-32, 256) at run time.
        let (sx, _) = x.params().expect("checked");
        let image: Option<usize> = n.input(0).and_then(|v| ctx.shape(v)).filter(|s| s.len() >= 3).map(|s| s[2..].iter().product());
        let ratio = sx / (q.scale * image.unwrap_or(1) as f32);
        if ratio >= 256.0 || (image.is_some() && ratio < 2f32.powi(-32)) || image.is_some_and(|i| i >= 1 << 24) {
            return Err(format!("input scale / (output scale x image size) = {ratio:e} is outside ONNX Runtime's QLinearGlobalAveragePool range [2^-32, 256)"));
        }
    }
    let mut b = Builder::new(ctx, id);
    let (xz, yz) = (b.zp_of(&x, "x_zero_point"), b.q_zp(&q));
    b.add(&op, MS_DOMAIN, None, vec![Some(x.x), Some(x.scale_v), Some(xz), Some(q.scale_v), Some(yz)], vec![q.output], attrs);
    Ok(b.done(&unit_nodes(id, &q, &absorbed), format!("com.microsoft::{op}"), true))
}

/// `Concat` -> `Concat` of the integers when every input shares the output's qparams, else
/// `com.microsoft` `QLinearConcat`.
fn lower_concat(ctx: &Ctx, id: NodeId) -> Result<Rewrite, String> {
    let n = ctx.node(id);
    let y = n.output(0).ok_or("no output")?;
    let mut xs = vec![];
    for i in 0..n.inputs.len() {
        let d = input_deq(ctx, n, i, &format!("input {i}"))?;
        check_activation(&d, &format!("input {i}"), "QLinearConcat", false)?;
        xs.push(d);
    }
    let dtype = xs[0].dtype;
    if xs.iter().any(|d| d.dtype != dtype) {
        return Err("inputs of different integer types".into());
    }
    let (q, absorbed) = quantized_output(ctx, y, "QLinearConcat", dtype)?;
    let same = xs.iter().all(|d| d.params().is_some_and(|(s, z)| s.to_bits() == q.scale.to_bits() && z == q.zp));
    let mut b = Builder::new(ctx, id);
    let attrs = attrs_named(n, &["axis"]);
    if same {
        b.add("Concat", "", None, xs.iter().map(|d| Some(d.x)).collect(), vec![q.output], attrs);
        return Ok(b.done(&unit_nodes(id, &q, &absorbed), "Concat on integers", false));
    }
    let yz = b.q_zp(&q);
    let mut inputs = vec![Some(q.scale_v), Some(yz)];
    for (i, d) in xs.iter().enumerate() {
        let z = b.zp_of(d, &format!("x{i}_zero_point"));
        inputs.extend([Some(d.x), Some(d.scale_v), Some(z)]);
    }
    b.add("QLinearConcat", MS_DOMAIN, None, inputs, vec![q.output], attrs);
    Ok(b.done(&unit_nodes(id, &q, &absorbed), "com.microsoft::QLinearConcat", true))
}

/// `QuantizeLinear` of one value as ONNX Runtime computes it (f32 division, clamp, round to
/// nearest even).
fn quantize_value(v: f32, scale: f32, zp: i64, dtype: DType) -> i64 {
    let (qmin, qmax) = type_range(dtype);
    let r = v / scale;
    let r = if r.is_nan() { qmin as f32 - zp as f32 } else { r.max((qmin - zp) as f32).min((qmax - zp) as f32) };
    (r.round_ties_even() as i64 + zp).clamp(qmin, qmax)
}

/// The `QuantizeLinear`s reading every output of a data-movement or clamp node, when each is
/// the output's only reader and has the input's qparams. `Ok(None)`: no output is quantized
/// (not a unit).
fn equal_param_outputs(ctx: &Ctx, n: &Node, x: &Deq) -> Result<Option<Vec<Quant>>, String> {
    if !quantized_outputs(ctx, n) {
        return Ok(None);
    }
    let (sx, zx) = x.params().ok_or("the input qparams are not constant per-tensor")?;
    let mut qs = vec![];
    for o in n.outputs.iter().flatten() {
        let readers = ctx.plain_readers(*o).ok_or("an output is also a graph output or read by a subgraph")?;
        let [(r, 0)] = readers else { return Err("an output is also read in float".into()) };
        if !is_op(ctx.node(*r), "QuantizeLinear") {
            return Err("an output is read in float".into());
        }
        let q = quant(ctx, *r)?;
        if q.dtype != x.dtype || q.scale.to_bits() != sx.to_bits() || q.zp != zx {
            return Err(format!("output qparams (scale {:e}, zero point {} {}) differ from the input's ({sx:e}, {zx} {}): {} on integers cannot requantize",
                q.scale, q.zp, q.dtype, x.dtype, n.op_type));
        }
        qs.push(q);
    }
    Ok(Some(qs))
}

/// Data movement with equal input and output qparams -> the same op on the integers.
fn lower_direct(ctx: &Ctx, id: NodeId) -> Result<Option<Rewrite>, String> {
    let n = ctx.node(id);
    let Some(x) = n.input(0).and_then(|v| deq(ctx, v)) else { return Ok(None) };
    if n.inputs.iter().skip(1).flatten().any(|&v| deq(ctx, v).is_some()) {
        return Ok(None);
    }
    if !quantized_outputs(ctx, n) {
        return Ok(None);
    }
    check_activation(&x, "the input", &n.op_type, false)?;
    let Some(qs) = equal_param_outputs(ctx, n, &x)? else { return Ok(None) };
    let op = n.op_type.as_str();
    if matches!(op, "MaxPool" | "ReduceMax" | "ReduceMin") && ctx.opset < 12 {
        return Err(format!("{op} on 8-bit integers needs opset 12, the model imports {}", ctx.opset));
    }
    if op == "MaxPool" && n.output(1).is_some() {
        return Err("MaxPool with an Indices output".into());
    }
    if op == "Resize" {
        let mode = n.attr_str("mode").unwrap_or("nearest");
        if mode != "nearest" {
            return Err(format!("Resize in {mode} mode interpolates: it does not commute with quantization"));
        }
    }
    let mut b = Builder::new(ctx, id);
    let mut node = n.clone();
    node.inputs[0] = Some(x.x);
    if op == "Pad" && n.attr_str("mode").unwrap_or("constant") == "constant" {
        if ctx.opset < 11 {
            return Err("Pad before opset 11 takes a float pad value".into());
        }
        let v = match n.input(2) {
            None => 0.0,
            Some(c) => ctx.constant(c).as_ref().and_then(floats).filter(|v| v.len() == 1).ok_or("the pad value is not a constant scalar")?[0],
        };
        let (s, z) = x.params().expect("checked");
        let pv = b.int_scalar("pad_value", x.dtype, quantize_value(v, s, z, x.dtype));
        if node.inputs.len() < 3 {
            node.inputs.resize(3, None);
        }
        node.inputs[2] = Some(pv);
    }
    let mut outs = node.outputs.clone();
    for (o, q) in outs.iter_mut().flatten().zip(&qs) {
        *o = q.output;
    }
    b.add(&node.op_type, "", None, node.inputs.clone(), outs.into_iter().flatten().collect(), node.attrs.clone());
    let remove: Vec<NodeId> = std::iter::once(id).chain(qs.iter().map(|q| q.node)).collect();
    Ok(Some(b.done(&remove, format!("{op} on integers"), false)))
}

/// `Relu`/`Clip` with equal input and output qparams -> nothing when the quantized range
/// already lies within the clamp, else `Clip` of the integers at the quantized bounds.
fn lower_clamp(ctx: &Ctx, id: NodeId) -> Result<Option<Rewrite>, String> {
    let n = ctx.node(id);
    let Some(x) = n.input(0).and_then(|v| deq(ctx, v)) else { return Ok(None) };
    if !quantized_outputs(ctx, n) {
        return Ok(None);
    }
    check_activation(&x, "the input", &n.op_type, false)?;
    let Some(qs) = equal_param_outputs(ctx, n, &x)? else { return Ok(None) };
    let q = &qs[0];
    let (s, z) = x.params().expect("checked");
    let (qmin, qmax) = type_range(x.dtype);
    let (lo, hi) = if n.op_type == "Relu" { (z, qmax) } else {
        let (lo, hi) = clip_bounds(ctx, n)?;
        (quantize_value(lo, s, z, x.dtype), quantize_value(hi, s, z, x.dtype))
    };
    let mut b = Builder::new(ctx, id);
    if lo <= qmin && hi >= qmax {
        b.alias(q.output, x.x);
        return Ok(Some(b.done(&[id, q.node], "removed: the quantized range lies within the clamp", false)));
    }
    if ctx.opset < 12 {
        return Err(format!("{} on 8-bit integers needs Clip from opset 12, the model imports {}", n.op_type, ctx.opset));
    }
    let (lv, hv) = (b.int_scalar("min", x.dtype, lo), b.int_scalar("max", x.dtype, hi));
    b.add("Clip", "", None, vec![Some(x.x), Some(lv), Some(hv)], vec![q.output], vec![]);
    Ok(Some(b.done(&[id, q.node], "Clip on integers", false)))
}

/// A unit `DequantizeLinear -> pointwise op [-> absorbed Relu/Clip] -> QuantizeLinear` with
/// per-tensor 8-bit qparams and constant other inputs -> a [`LOOKUP_TABLE`] of the unit's
/// result for every input byte, computed by running the unit's own nodes' kernels on the 256
/// possible inputs (see [`LowerOptions::lookup_tables`]). `None` when the node is not such a
/// unit.
fn lower_lookup(ctx: &Ctx, id: NodeId) -> Option<Rewrite> {
    let n = ctx.node(id);
    if !(n.domain.is_empty() || n.domain == "ai.onnx") || !is_pointwise(&n.op_type) || n.outputs.len() != 1 {
        return None;
    }
    let x = deq(ctx, n.input(0)?)?;
    check_activation(&x, "the input", LOOKUP_TABLE, false).ok()?;
    let Ok(Out::Q { q, absorbed }) = output(ctx, n.output(0)?) else { return None };
    if !matches!(q.dtype, DType::U8 | DType::I8) {
        return None;
    }
    let (dq, _) = ctx.g.producer(n.input(0)?)?;
    let bytes = match x.dtype {
        DType::U8 => Tensor::from_vec(&[256], (0..=255u8).collect()),
        _ => Tensor::from_vec(&[256], (0..=255u8).map(|b| b as i8).collect()),
    }.ok()?;
    let mut v = run_pointwise(ctx, dq, bytes)?;
    for &node in std::iter::once(&id).chain(&absorbed) {
        v = run_pointwise(ctx, node, v)?;
    }
    let table = run_pointwise(ctx, q.node, v)?;
    let mut b = Builder::new(ctx, id);
    let t = b.init("table", table);
    b.add(LOOKUP_TABLE, RUNTIME_DOMAIN, None, vec![Some(x.x), Some(t)], vec![q.output], vec![]);
    Some(b.done(&unit_nodes(id, &q, &absorbed), LOOKUP_TABLE, false))
}

/// Runs node `id`'s kernel on `x` as its first input and the constants of its other inputs (a
/// dequantized constant scalar counts, see [`constant_scalar`]); `None` when an other input
/// is not constant or the kernel fails.
fn run_pointwise(ctx: &Ctx, id: NodeId, x: Tensor) -> Option<Tensor> {
    let node = ctx.node(id);
    let mut inputs = vec![Some(x)];
    for &v in node.inputs.iter().skip(1) {
        inputs.push(match v {
            None => None,
            Some(v) => Some(ctx.constant(v).or_else(|| constant_scalar(ctx, v).map(Tensor::scalar))?),
        });
    }
    run_node(ctx, id, &inputs, |i| i > 0)
}

/// Builds node `id`'s kernel, telling it that the inputs at the positions `constant` accepts
/// are the constants given, and runs it on `inputs`; its first output, or `None` when the
/// kernel refuses the node or the inputs.
fn run_node(ctx: &Ctx, id: NodeId, inputs: &[Option<Tensor>], constant: impl Fn(usize) -> bool) -> Option<Tensor> {
    let node = ctx.node(id);
    let opset = crate::opset_of(ctx.imports, &node.domain);
    let build = crate::Registry::builtin().lookup(&node.domain, &node.op_type, opset)?;
    let scope_consts = HashMap::new();
    let info = crate::NodeInfo {
        node,
        id,
        graph: ctx.g,
        opset,
        opsets: ctx.imports,
        scope_consts: &scope_consts,
        const_inputs: inputs.iter().enumerate().map(|(i, t)| t.as_ref().filter(|_| constant(i))).collect(),
        input_types: node.inputs.iter().map(|v| v.and_then(|v| ctx.g.value(v).ok()).and_then(|v| v.ty.as_ref())).collect(),
    };
    let kernel = build(&info).ok()?;
    let ins: Vec<Option<&Tensor>> = inputs.iter().map(Option::as_ref).collect();
    let no_scope = |_: &str| None;
    kernel.run(&ins, &crate::RunCtx { scope: &no_scope, hooks: None }).ok()?.into_iter().next()
}

/// The data inputs of an elementwise op, each with the position of an input of its type.
type DataInputs = &'static [(usize, Option<usize>)];

/// Integer ops of the lowered graph computed element by element, with their data inputs,
/// each with the position of the zero point of its type; the other inputs are per-tensor
/// parameters.
const ELEMENTWISE_INTEGER: &[(&str, &str, DataInputs)] = &[
    (MS_DOMAIN, "QLinearAdd", &[(0, Some(2)), (3, Some(5))]),
    (MS_DOMAIN, "QLinearMul", &[(0, Some(2)), (3, Some(5))]),
    (MS_DOMAIN, "QLinearSigmoid", &[(0, Some(2))]),
    (MS_DOMAIN, "QLinearLeakyRelu", &[(0, Some(2))]),
    (RUNTIME_DOMAIN, LOOKUP_TABLE, &[(0, None)]),
    ("", "DequantizeLinear", &[(0, Some(2))]),
    ("", "QuantizeLinear", &[(0, None)]),
];

/// The data inputs of `n` when it computes each output element from the elements at the same
/// position of its data inputs (with scalar constants broadcast), each with the position of
/// an input of its type when there is one: the ops of [`ELEMENTWISE_INTEGER`], the pointwise
/// default-domain ops (`Clip` bounds have the input's type) and `Add`/`Sub`/`Mul`/`Div`.
fn elementwise_inputs(n: &Node) -> Option<DataInputs> {
    let default = n.domain.is_empty() || n.domain == "ai.onnx";
    if let Some(&(_, _, data)) = ELEMENTWISE_INTEGER.iter().find(|(d, op, _)| n.op_type == *op && (n.domain == *d || (d.is_empty() && default))) {
        return Some(data);
    }
    match n.op_type.as_str() {
        _ if !default => None,
        "Add" | "Sub" | "Mul" | "Div" => Some(&[(0, Some(1)), (1, Some(0))]),
        "Clip" => Some(&[(0, Some(1))]),
        op if is_pointwise(op) => Some(&[(0, None)]),
        _ => None,
    }
}

/// Composes chains of elementwise nodes over one 8-bit value into lookup tables: a node of
/// [`elementwise_inputs`] whose non-constant data inputs are all the same 8-bit value `x` or
/// functions of it already tabulated, whose other inputs are constant and whose constants hold
/// one element, has the table of its result for each of the 256 values of `x`, computed by
/// running its kernel on the tables of its inputs. A node with such a table and an 8-bit
/// output that is not already a [`LOOKUP_TABLE`] of `x` becomes one, so the hardswish
/// `x * clip(x + 3, 0, 6) / 6` of four integer nodes is read and written once; nodes left
/// without readers are removed afterwards. Each table is listed in [`LowerLog::composed`].
fn compose_lookups(g: &mut Graph, outer: &HashMap<String, Tensor>, opsets: (i64, &[OpsetImport]), log: &mut LowerLog) -> Result<(), LowerError> {
    let (opset, imports) = opsets;
    let mut tables: HashMap<ValueId, Tabulated> = HashMap::new();
    let order = g.topo_order().map_err(|e| LowerError::Model(e.to_string()))?;
    for id in order {
        let ctx = Ctx { g, outer, opset, imports };
        let Some(t) = tabulate(&ctx, id, &tables) else { continue };
        let n = ctx.node(id);
        let y = n.output(0).expect("tabulated nodes have one output");
        let already = n.op_type == LOOKUP_TABLE && n.domain == RUNTIME_DOMAIN && n.input(0) == Some(t.root);
        let rewrite = (matches!(t.table.dtype(), DType::U8 | DType::I8) && !already).then(|| {
            let mut b = Builder::new(&ctx, id);
            let table = b.init("composed_table", t.table.clone());
            b.add(LOOKUP_TABLE, RUNTIME_DOMAIN, Some("composed"), vec![Some(t.root), Some(table)], vec![y], vec![]);
            b.done(&[id], LOOKUP_TABLE, false)
        });
        if let Some(rw) = rewrite {
            log.composed.push(Composed { graph: g.name.clone(), chain: t.chain.clone() });
            g.apply(rw.patch).map_err(|e| LowerError::Model(format!("graph '{}': {e}", g.name)))?;
        }
        tables.insert(y, t);
    }
    g.remove_dead_nodes();
    Ok(())
}

/// Moves lookup tables into the convolutions they follow: a [`LOOKUP_TABLE`] whose input is
/// the output of a default-domain `QLinearConv` read by nothing else (no other node, graph
/// output or subgraph) becomes, with that convolution, one [`QLINEAR_CONV_LOOKUP`] node: the
/// convolution's inputs and attributes, the table as input 9, the table's output, and the
/// convolution's name. The convolution kernels apply the table to each block of output bytes
/// right after requantizing it, on the thread that computed it, instead of in a second pass
/// over the whole output. Each one is listed in [`LowerLog::tables_in_convs`].
fn tables_into_convs(g: &mut Graph, outer: &HashMap<String, Tensor>, opsets: (i64, &[OpsetImport]), log: &mut LowerLog) -> Result<(), LowerError> {
    let (opset, imports) = opsets;
    let lookups: Vec<NodeId> = g.nodes().filter(|(_, n)| n.op_type == LOOKUP_TABLE && n.domain == RUNTIME_DOMAIN).map(|(id, _)| id).collect();
    for id in lookups {
        let ctx = Ctx { g, outer, opset, imports };
        let n = ctx.node(id);
        let (Some(x), Some(table), Some(y)) = (n.input(0), n.input(1), n.output(0)) else { continue };
        let Some((conv_id, _)) = ctx.g.producer(x) else { continue };
        let conv = ctx.node(conv_id);
        let sole_reader = ctx.plain_readers(x).is_some_and(|r| r.len() == 1);
        if !(is_op(conv, "QLinearConv") && conv.outputs.len() == 1 && sole_reader && ctx.constant(table).is_some()) {
            continue;
        }
        let mut inputs = conv.inputs.clone();
        inputs.resize(9, None);
        inputs.push(Some(table));
        let name = conv.display_name(conv_id);
        let attrs = conv.attrs.clone();
        let mut b = Builder::new(&ctx, conv_id);
        b.add(QLINEAR_CONV_LOOKUP, RUNTIME_DOMAIN, None, inputs, vec![y], attrs);
        let rw = b.done(&[conv_id, id], QLINEAR_CONV_LOOKUP, false);
        g.apply(rw.patch).map_err(|e| LowerError::Model(format!("graph '{}': {e}", g.name)))?;
        log.tables_in_convs.push(name);
    }
    Ok(())
}

/// A value computed from one 8-bit value `root` element by element: its value for each of the
/// 256 values of `root`, and the nodes that compute it from `root`.
struct Tabulated {
    root: ValueId,
    table: Tensor,
    chain: Vec<String>,
}

/// What node `id` computes as a function of one 8-bit value (see [`compose_lookups`]), or
/// `None`.
fn tabulate(ctx: &Ctx, id: NodeId, tables: &HashMap<ValueId, Tabulated>) -> Option<Tabulated> {
    let n = ctx.node(id);
    let data = elementwise_inputs(n)?;
    if n.outputs.len() != 1 || n.subgraphs().next().is_some() {
        return None;
    }
    let mut root = None;
    let mut chain: Vec<String> = vec![];
    let mut inputs = Vec::with_capacity(n.inputs.len());
    let mut constant = vec![false; n.inputs.len()];
    for (i, v) in n.inputs.iter().enumerate() {
        let Some(v) = *v else {
            inputs.push(None);
            continue;
        };
        let data_input = data.iter().find(|d| d.0 == i);
        if let Some(c) = ctx.constant(v) {
            let table_of_lookup = i == 1 && n.op_type == LOOKUP_TABLE && n.domain == RUNTIME_DOMAIN;
            if !table_of_lookup && (c.len() != 1 || (data_input.is_some() && c.shape().len() > 1)) {
                return None;
            }
            inputs.push(Some(c));
            constant[i] = true;
            continue;
        }
        let &(_, type_of) = data_input?;
        let (r, table) = match tables.get(&v) {
            Some(t) => {
                chain.extend(t.chain.iter().filter(|c| !chain.contains(c)).cloned().collect::<Vec<_>>());
                (t.root, t.table.clone())
            }
            None => {
                let dtype = ctx.dtype(v).or_else(|| type_of.and_then(|t| n.input(t)).and_then(|t| ctx.dtype(t)))?;
                (v, byte_values(dtype)?)
            }
        };
        if root.is_some_and(|x| x != r) || ctx.shape(r).is_some_and(|s| s.iter().product::<usize>() == 1) {
            return None;
        }
        root = Some(r);
        inputs.push(Some(table));
    }
    let table = run_node(ctx, id, &inputs, |i| constant[i])?;
    chain.push(n.display_name(id));
    (table.shape() == [256]).then_some(Tabulated { root: root?, table, chain })
}

/// The 256 values of an 8-bit type in the order of their bytes.
fn byte_values(dtype: DType) -> Option<Tensor> {
    match dtype {
        DType::U8 => Tensor::from_vec(&[256], (0..=255u8).collect()).ok(),
        DType::I8 => Tensor::from_vec(&[256], (0..=255u8).map(|b| b as i8).collect()).ok(),
        _ => None,
    }
}

/// Removes `DequantizeLinear -> QuantizeLinear` pairs whose per-tensor qparams are equal: the
/// readers of the `QuantizeLinear` read the integer tensor directly. Returns the count.
fn remove_equal_pairs(g: &mut Graph, outer: &HashMap<String, Tensor>, opset: i64, imports: &[OpsetImport]) -> qforge_ir::IrResult<usize> {
    let mut removed = 0;
    let qnodes: Vec<NodeId> = g.nodes().filter(|(_, n)| is_op(n, "QuantizeLinear")).map(|(id, _)| id).collect();
    for qid in qnodes {
        let ctx = Ctx { g, outer, opset, imports };
        let Some(input) = ctx.g.node(qid).ok().and_then(|n| n.input(0)) else { continue };
        let Some(d) = deq(&ctx, input) else { continue };
        let Ok(q) = quant(&ctx, qid) else { continue };
        let same = !d.dynamic && d.per_tensor() && d.params().is_some_and(|(s, z)| s.to_bits() == q.scale.to_bits() && z == q.zp) && d.dtype == q.dtype;
        if !same {
            continue;
        }
        let mut b = Builder::new(&ctx, qid);
        b.alias(q.output, d.x);
        let patch = b.done(&[qid], "", false).patch;
        g.apply(patch)?;
        removed += 1;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_value_saturates_and_rounds_to_even() {
        assert_eq!(quantize_value(0.25, 0.5, 0, DType::U8), 0);
        assert_eq!(quantize_value(0.75, 0.5, 0, DType::U8), 2);
        assert_eq!(quantize_value(f32::INFINITY, 0.1, 3, DType::I8), 127);
        assert_eq!(quantize_value(f32::NEG_INFINITY, 0.1, 3, DType::U8), 0);
        assert_eq!(quantize_value(f32::NAN, 0.1, 3, DType::U8), 0);
    }

    #[test]
    fn bias_scale_tolerance_is_relative() {
        assert!(close(1.0e-6, 1.00001e-6));
        assert!(!close(1.0e-6, 1.01e-6));
    }
}
