//! Convert: the calibrated plan becomes a reference QDQ model.
//!
//! * Each point (a value and integer type) gets `QuantizeLinear -> DequantizeLinear` with its
//!   group's qparams. Readers whose input edge asks for that type, and every reader when the
//!   producer's output is quantized, read the dequantized value; a graph output produced by a
//!   quantized output is replaced by it (its name is kept). Other readers keep the float value.
//! * Constant inputs (weights, constant activation inputs) are stored quantized and read
//!   through `DequantizeLinear` (per tensor, per axis, or per block).
//! * Bias of a weighted op is int32 with zero point 0 and `scale = input scale x weight scale`
//!   (per channel when the weight is). When a bias value would not fit in int32 the weight's
//!   scale for that channel is enlarged until it does, and the change is reported.

use std::collections::BTreeMap;

use qforge_ir::{Attr, DType, Elem, Graph, Node, NodeId, Patch, Tensor, ValueId, CAPTURE_USE};

use crate::pipeline::InputStats;
use crate::pair_sums::{reduction_channel, reduction_pairs, PairedWeight, FULL_REACH};
use crate::weight_rounding::Grid;
use crate::observer::AxisLayout;
use crate::prepare::{concat_inputs, edge_value, qtype_of, resolve, Group, QuantPlan};
use crate::qparams::quantize;
use crate::spec::{Derivation, Edge, Granularity, QuantizationSpec, Spec};
use crate::{QParams, QType};

/// The qparams of a calibrated group, or why it has none.
pub fn group_qparams(g: &Group) -> Result<QParams, String> {
    if let Some(why) = &g.unusable {
        return Err(why.clone());
    }
    if let Some(f) = &g.fixed {
        return Ok(QParams { scale: f.scale, zero_point: f.zero_point });
    }
    let (qmin, qmax) = g.spec.scheme.qrange();
    let (lo, hi) = g.observer.range((qmax - qmin + 1) as usize).ok_or("no finite value reached it during calibration")?;
    let lo = g.floor_for(lo, hi).unwrap_or(lo);
    let q = g.spec.scheme.qparams(lo, hi);
    match g.spec.scale_min {
        Some(min) if q.scale < min => {
            let f = min / q.scale;
            Ok(g.spec.scheme.qparams(lo.min(0.0) * f, hi.max(0.0) * f))
        }
        _ => Ok(q),
    }
}

/// A quantized constant: integer values with their qparams laid out for DequantizeLinear.
#[derive(Debug, Clone)]
struct QuantizedConst {
    /// The integers, as a tensor of `qtype` (4-bit types packed two to a byte).
    values: Tensor,
    shape: Vec<usize>,
    params: Vec<QParams>,
    /// Shape of the scale tensor (`[]` per tensor, `[C]` per axis, blocked shape per block).
    param_shape: Vec<usize>,
    qtype: QType,
    axis: Option<usize>,
    block_size: Option<usize>,
    /// The factor the weight range search applied to each min/max scale (empty: no search).
    searched: Vec<f32>,
}

/// Which qparams each element of a constant uses under a granularity. With the constant laid
/// out as `[outer, channels, inner]` around the axis, the element at `(o, c, k)` uses
/// parameter `0` per tensor, `c` per axis, and `(o · blocks + c / block_size) · inner + k` per
/// block.
#[derive(Debug, Clone, Copy)]
struct ParamLayout {
    /// `None` per tensor and per axis; `Some((block_size, blocks))` per block.
    block: Option<(usize, usize)>,
    per_axis: bool,
    channels: usize,
    inner: usize,
}

impl ParamLayout {
    /// The layout of a constant of `shape` under `g`, with the shape of its parameter tensor.
    fn new(shape: &[usize], g: Granularity) -> Result<(ParamLayout, Vec<usize>), String> {
        let along = |axis: usize| AxisLayout::new(shape, Some(axis)).ok_or(format!("axis {axis} is out of range for shape {shape:?}"));
        match g {
            Granularity::PerTensor => Ok((ParamLayout { block: None, per_axis: false, channels: 1, inner: shape.iter().product::<usize>().max(1) }, vec![])),
            Granularity::PerAxis { axis } => {
                let l = along(axis)?;
                Ok((ParamLayout { block: None, per_axis: true, channels: l.channels, inner: l.inner }, vec![l.channels]))
            }
            Granularity::PerBlock { axis, block_size } => {
                let l = along(axis)?;
                let size = block_size.max(1);
                let blocks = l.channels.div_ceil(size);
                let mut ps = shape.to_vec();
                ps[axis] = blocks;
                Ok((ParamLayout { block: Some((size, blocks)), per_axis: false, channels: l.channels, inner: l.inner }, ps))
            }
        }
    }

    /// The parameter of element `i`.
    fn param(&self, i: usize) -> usize {
        let (inner, channels) = (self.inner.max(1), self.channels.max(1));
        let (o, c, k) = (i / (channels * inner), (i / inner) % channels, i % inner);
        self.at(o, c, k)
    }

    fn at(&self, o: usize, c: usize, k: usize) -> usize {
        match self.block {
            Some((size, blocks)) => (o * blocks + c / size) * self.inner + k,
            None if self.per_axis => c,
            None => 0,
        }
    }

    /// The smallest and largest finite element of each of the `count` parameters (`+inf` and
    /// `-inf` for a parameter with none). Chunks run in parallel when each can keep its own
    /// extremes of every parameter cheaply; min and max do not depend on the order.
    fn extremes(self, data: &[f32], count: usize) -> (Vec<f32>, Vec<f32>) {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 16;
        let scan = |start: usize, xs: &[f32]| {
            let (mut lo, mut hi) = (vec![f32::INFINITY; count], vec![f32::NEG_INFINITY; count]);
            for (&x, p) in xs.iter().zip(self.params_from(start)) {
                if x.is_finite() {
                    lo[p] = lo[p].min(x);
                    hi[p] = hi[p].max(x);
                }
            }
            (lo, hi)
        };
        if count > CHUNK / 16 || data.len() <= CHUNK {
            return scan(0, data);
        }
        data.par_chunks(CHUNK).enumerate().map(|(i, xs)| scan(i * CHUNK, xs)).reduce_with(|(mut lo, mut hi), (l, h)| {
            for p in 0..count {
                lo[p] = lo[p].min(l[p]);
                hi[p] = hi[p].max(h[p]);
            }
            (lo, hi)
        }).unwrap_or_else(|| scan(0, data))
    }

    /// The parameters of the elements from element `start` on, in element order (endless:
    /// zip it with the elements).
    fn params_from(self, start: usize) -> impl Iterator<Item = usize> {
        let (inner, channels) = (self.inner.max(1), self.channels.max(1));
        let (mut o, mut c, mut k) = (start / (channels * inner), (start / inner) % channels, start % inner);
        std::iter::from_fn(move || {
            let p = self.at(o, c, k);
            k += 1;
            if k == inner {
                k = 0;
                c += 1;
                if c == channels {
                    c = 0;
                    o += 1;
                }
            }
            Some(p)
        })
    }
}

/// Scale multipliers tried by the weight range search: 1.00, 0.99, ..., 0.80.
const WEIGHT_SEARCH_STEPS: usize = 21;

/// For each parameter slice of a symmetric scheme, the scale among `scale · (1 − 0.01·k)`
/// (`k < WEIGHT_SEARCH_STEPS`) with the least squared rounding-and-clipping error of its
/// values (the largest such scale on ties); returns the factor chosen for each slice. Slices
/// are searched in parallel; each slice's sum runs in element order, so the result does not
/// depend on the thread count.
fn search_weight_scales(data: &[f32], layout: ParamLayout, params: &mut [QParams], qmin: i64, qmax: i64) -> Vec<f32> {
    use rayon::prelude::*;
    let mut slices: Vec<Vec<f32>> = vec![vec![]; params.len()];
    for (&x, p) in data.iter().zip(layout.params_from(0)) {
        if x.is_finite() {
            slices[p].push(x);
        }
    }
    let factors: Vec<f32> = slices.par_iter().zip(params.par_iter()).map(|(xs, p)| {
        let err = |k: usize| {
            let q = QParams { scale: p.scale * (1.0 - 0.01 * k as f32), zero_point: p.zero_point };
            xs.iter().map(|&x| (x as f64 - (quantize(x, q, qmin, qmax) - q.zero_point) as f64 * q.scale as f64).powi(2)).sum::<f64>()
        };
        if p.scale <= 0.0 {
            return 1.0;
        }
        let errs: Vec<f64> = (0..WEIGHT_SEARCH_STEPS).map(err).collect();
        let best = (0..WEIGHT_SEARCH_STEPS).fold(0, |b, k| if errs[k] < errs[b] { k } else { b });
        1.0 - 0.01 * best as f32
    }).collect();
    for (p, f) in params.iter_mut().zip(&factors) {
        p.scale *= f;
    }
    factors
}

/// Quantizes constant data under a spec, with parameters from each slice's min/max, or the
/// given scales (same layout) when `scales` is set. With `search` (and no `scales`), a
/// symmetric scheme's scales come from [`search_weight_scales`].
fn quantize_const(data: &[f32], shape: &[usize], spec: &QuantizationSpec, scales: Option<&[f32]>, search: bool) -> Result<QuantizedConst, String> {
    let (layout, param_shape) = ParamLayout::new(shape, spec.granularity)?;
    let count: usize = param_shape.iter().product::<usize>().max(1);
    let (lo, hi) = layout.extremes(data, count);
    let mut params: Vec<QParams> = (0..count).map(|p| if lo[p] <= hi[p] { spec.scheme.qparams(lo[p], hi[p]) } else { spec.scheme.qparams(0.0, 0.0) }).collect();
    if let Some(s) = scales {
        for (p, &s) in params.iter_mut().zip(s) {
            p.scale = s;
        }
    }
    let (qmin, qmax) = spec.scheme.qrange();
    let searched = if search && scales.is_none() && spec.scheme.symmetric { search_weight_scales(data, layout, &mut params, qmin, qmax) } else { vec![] };
    let w = Quantized { data, layout, params: &params, range: (qmin, qmax) };
    let values = match spec.scheme.qtype {
        QType::U8 => Tensor::from_vec(shape, w.into_vec::<u8>()),
        QType::S8 => Tensor::from_vec(shape, w.into_vec::<i8>()),
        QType::U16 => Tensor::from_vec(shape, w.into_vec::<u16>()),
        QType::S16 => Tensor::from_vec(shape, w.into_vec::<i16>()),
        QType::S32 => Tensor::from_vec(shape, w.into_vec::<i32>()),
        QType::U4 => Tensor::from_u4(shape, &w.into_vec::<u8>()),
        QType::S4 => Tensor::from_i4(shape, &w.into_vec::<i8>()),
    }.map_err(|e| e.to_string())?;
    let (axis, block_size) = match spec.granularity {
        Granularity::PerTensor => (None, None),
        Granularity::PerAxis { axis } => (Some(axis), None),
        Granularity::PerBlock { axis, block_size } => (Some(axis), Some(block_size)),
    };
    Ok(QuantizedConst { values, shape: shape.to_vec(), params, param_shape, qtype: spec.scheme.qtype, axis, block_size, searched })
}

/// Float constant data quantized element by element under its parameter layout.
struct Quantized<'a> {
    data: &'a [f32],
    layout: ParamLayout,
    params: &'a [QParams],
    range: (i64, i64),
}

impl Quantized<'_> {
    /// The integers, in an element type that holds `range`. Chunks run in parallel; each
    /// starts its parameter walk at its first element.
    fn into_vec<T: Elem + TryFrom<i64>>(self) -> Vec<T> {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 16;
        let Quantized { data, layout, params, range: (qmin, qmax) } = self;
        let narrow = |q: i64| T::try_from(q).ok().expect("quantized values lie within the type's range");
        let mut out = vec![T::zeroed(); data.len()];
        out.par_chunks_mut(CHUNK).zip(data.par_chunks(CHUNK)).enumerate().for_each(|(i, (out, xs))| {
            for ((q, &x), p) in out.iter_mut().zip(xs).zip(layout.params_from(i * CHUNK)) {
                *q = narrow(quantize(x, params[p], qmin, qmax));
            }
        });
        out
    }
}

/// The real values a quantized constant stands for, `scale · (q − zero_point)`, in its layout.
fn dequantize(c: &QuantizedConst) -> Result<Vec<f32>, String> {
    let (layout, _) = ParamLayout::new(&c.shape, granularity_of(c))?;
    let values = c.values.to_i64_vec().map_err(|e| e.to_string())?;
    Ok(values.iter().zip(layout.params_from(0)).map(|(&q, p)| c.params[p].scale * (q - c.params[p].zero_point) as f32).collect())
}

/// Integers as a tensor of a quantized type.
pub fn int_tensor(qtype: QType, shape: &[usize], v: &[i64]) -> Tensor {
    let r = match qtype {
        QType::U8 => Tensor::from_vec(shape, v.iter().map(|&x| x as u8).collect::<Vec<u8>>()),
        QType::S8 => Tensor::from_vec(shape, v.iter().map(|&x| x as i8).collect::<Vec<i8>>()),
        QType::U16 => Tensor::from_vec(shape, v.iter().map(|&x| x as u16).collect::<Vec<u16>>()),
        QType::S16 => Tensor::from_vec(shape, v.iter().map(|&x| x as i16).collect::<Vec<i16>>()),
        QType::S32 => Tensor::from_vec(shape, v.iter().map(|&x| x as i32).collect::<Vec<i32>>()),
        QType::U4 => Tensor::from_u4(shape, &v.iter().map(|&x| x as u8).collect::<Vec<u8>>()),
        QType::S4 => Tensor::from_i4(shape, &v.iter().map(|&x| x as i8).collect::<Vec<i8>>()),
    };
    r.expect("the shape matches the values")
}

/// What convert did in one graph, for the report.
#[derive(Debug, Clone, Default)]
pub struct ConvertLog {
    /// Points given Q/DQ: (value name, group, qparams).
    pub activations: Vec<(String, usize, QParams)>,
    /// Points left float: (value name, reason).
    pub skipped: Vec<(String, String)>,
    /// Constants stored quantized: (value name, type, granularity, first scale).
    pub constants: Vec<(String, QType, Granularity, usize)>,
    /// Weights whose scale was enlarged so the bias fits int32: (weight, channels changed).
    pub bias_adjusted: Vec<(String, usize)>,
    /// Weight range search: (constant, factor applied to each slice's min/max scale).
    pub weight_searched: Vec<(String, Vec<f32>)>,
    /// Bias correction applied: (node, op, float shift added to the bias of each output channel).
    pub bias_corrected: Vec<(String, String, Vec<f32>)>,
    /// Weighted nodes bias correction left alone: (node, op, reason).
    pub bias_uncorrected: Vec<(String, String, String)>,
    /// Weights GPTQ rounded: (node, op, output error proxy of nearest rounding, of GPTQ's).
    pub gptq_rounded: Vec<(String, String, f64, f64)>,
    /// Weighted nodes GPTQ left at nearest rounding: (node, op, reason).
    pub gptq_skipped: Vec<(String, String, String)>,
    /// Inputs of multi-input nodes whose output shares their qparams (Concat) that span fewer
    /// than [`FEW_LEVELS`] levels of the output's qparams: (node, op, input value, levels, the
    /// input's observed range, the output's representable range).
    pub narrow_inputs: Vec<(String, String, String, u64, (f32, f32), (f32, f32))>,
    /// Weights with one scale for the whole tensor whose output channels span fewer than
    /// [`FEW_WEIGHT_LEVELS`] levels of it: (node, op, weight, such channels, channels, the
    /// fewest levels a channel spans).
    pub narrow_weight_channels: Vec<(String, String, String, usize, usize, u64)>,
    /// Weights fitted to the target's `pair_sum_max` ([`crate::pair_sums`]): (node, op, weight,
    /// parameters whose scale rose, parameters, pairs projected onto the constraint, whether
    /// every input channel was taken at full reach).
    pub pair_sums_fitted: Vec<PairSumsRecord>,
    /// The smallest default-domain opset the inserted nodes need.
    pub min_opset: i64,
    /// Whether `com.microsoft` Q/DQ nodes were inserted (the model must import that domain).
    pub contrib: bool,
    /// Every inserted `DequantizeLinear` output (value ids of the converted graph) with what
    /// it stands for; a constant's output read by several edges is listed once per edge.
    pub dequantized: Vec<(ValueId, Dequantized)>,
}

/// What an inserted `DequantizeLinear` output stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dequantized {
    /// The fake-quantized value of a point of `group`; `float` is the `QuantizeLinear`'s input.
    Activation { group: usize, float: ValueId },
    /// The quantized constant read by input `input` of `node`; `float` is its float original.
    Constant { node: NodeId, input: usize, float: ValueId },
}

/// The opset a Q/DQ node of this type and granularity needs.
fn opset_for(qtype: QType, axis: Option<usize>, block: Option<usize>) -> i64 {
    match (qtype, axis, block) {
        (QType::U16 | QType::S16 | QType::U4 | QType::S4, _, _) | (_, _, Some(_)) => 21,
        (QType::S32, ..) | (_, Some(_), None) => 13,
        _ => 10,
    }
}

struct Emitter<'a> {
    g: &'a Graph,
    patch: Patch,
    log: ConvertLog,
    /// Write Q/DQ that would need opset 21 (16- and 4-bit types) in ONNX Runtime's
    /// `com.microsoft` domain instead.
    contrib: bool,
    /// Prefix of every name this graph's patch creates: empty in the main graph, a tag of the
    /// subgraph otherwise, so a Q/DQ inside an If/Loop body never shadows the same value's
    /// Q/DQ in an enclosing graph (ONNX forbids it).
    prefix: String,
}

impl Emitter<'_> {
    fn scalar_params(&mut self, base: &str, qtype: QType, p: QParams) -> (ValueId, ValueId) {
        let s = self.patch.unique_name(self.g, &format!("{base}_scale"));
        let z = self.patch.unique_name(self.g, &format!("{base}_zero_point"));
        (self.patch.new_initializer(s, Tensor::scalar(p.scale)), self.patch.new_initializer(z, int_tensor(qtype, &[], &[p.zero_point])))
    }

    /// `source -> QuantizeLinear -> DequantizeLinear`, named and typed after `v` (`source` is
    /// `v`, or `v` already dequantized at another type); returns the dequantized value.
    fn qdq(&mut self, v: ValueId, source: ValueId, qtype: QType, p: QParams) -> ValueId {
        let base = format!("{}{}", self.prefix, self.g.value_name(v));
        let (s, z) = self.scalar_params(&base, qtype, p);
        let qn = self.patch.unique_name(self.g, &format!("{base}_QuantizeLinear_Output"));
        let q = self.patch.new_value(qn, None);
        let dn = self.patch.unique_name(self.g, &format!("{base}_DequantizeLinear_Output"));
        let float_type = self.g.value(v).ok().and_then(|x| x.ty.clone());
        let d = self.patch.new_value(dn, float_type);
        let qname = self.patch.unique_name(self.g, &format!("{base}_QuantizeLinear"));
        let dname = self.patch.unique_name(self.g, &format!("{base}_DequantizeLinear"));
        let mut qnode = Node::new("QuantizeLinear", qname).with_inputs([source, s, z]).with_outputs([q]);
        let mut dnode = Node::new("DequantizeLinear", dname).with_inputs([q, s, z]).with_outputs([d]);
        let opset = self.domain_of(opset_for(qtype, None, None), [&mut qnode, &mut dnode]);
        self.patch.add_node(qnode);
        self.patch.add_node(dnode);
        self.log.min_opset = self.log.min_opset.max(opset);
        d
    }

    /// Puts `nodes` in the `com.microsoft` domain when they would need opset 21 and contrib
    /// Q/DQ are asked for; returns the default-domain opset they need then.
    fn domain_of<const N: usize>(&mut self, opset: i64, nodes: [&mut Node; N]) -> i64 {
        if !self.contrib || opset < 21 {
            return opset;
        }
        let axis = nodes.iter().any(|n| n.attr_int("axis").is_some());
        for n in nodes {
            n.domain = qforge_ir::MS_DOMAIN.into();
        }
        self.log.contrib = true;
        if axis { 13 } else { 10 }
    }

    /// A quantized initializer read through DequantizeLinear; returns the dequantized value.
    fn constant(&mut self, v: ValueId, c: &QuantizedConst) -> ValueId {
        let base = format!("{}{}", self.prefix, self.g.value_name(v));
        let qn = self.patch.unique_name(self.g, &format!("{base}_quantized"));
        let q = self.patch.new_initializer(qn, c.values.clone());
        let sn = self.patch.unique_name(self.g, &format!("{base}_scale"));
        let zn = self.patch.unique_name(self.g, &format!("{base}_zero_point"));
        let scales: Vec<f32> = c.params.iter().map(|p| p.scale).collect();
        let zps: Vec<i64> = c.params.iter().map(|p| p.zero_point).collect();
        let s = self.patch.new_initializer(sn, Tensor::from_vec(&c.param_shape, scales).expect("shape"));
        let z = self.patch.new_initializer(zn, int_tensor(c.qtype, &c.param_shape, &zps));
        let dn = self.patch.unique_name(self.g, &format!("{base}_DequantizeLinear_Output"));
        let d = self.patch.new_value(dn, None);
        let name = self.patch.unique_name(self.g, &format!("{base}_DequantizeLinear"));
        let mut node = Node::new("DequantizeLinear", name).with_inputs([q, s, z]).with_outputs([d]);
        if let Some(axis) = c.axis {
            node = node.with_attr("axis", Attr::Int(axis as i64));
        }
        if let Some(b) = c.block_size {
            node = node.with_attr("block_size", Attr::Int(b as i64));
        }
        let opset = match c.block_size {
            Some(_) => opset_for(c.qtype, c.axis, c.block_size),
            None => self.domain_of(opset_for(c.qtype, c.axis, c.block_size), [&mut node]),
        };
        self.patch.add_node(node);
        self.log.min_opset = self.log.min_opset.max(opset);
        d
    }
}

/// The ops ONNX Runtime (1.31) runs as `MatMulNBits` when they read a float activation and a
/// weight dequantized from an 8- or 4-bit initializer, and no QuantizeLinear reads their
/// output: it then quantizes that activation to int8 at run time, in blocks of 32 along K
/// (accuracy level 4), so the result leaves the ONNX semantics. A Conv runs its float
/// activation with the dequantized weight.
pub const MATMUL_NBITS_OPS: [&str; 2] = ["MatMul", "Gemm"];

/// An input of a node whose output shares its qparams spanning fewer levels than this of the
/// output's qparams is reported: it keeps under four bits of resolution there.
pub const FEW_LEVELS: u64 = 16;

/// An input of a multi-input node whose output shares its qparams (Concat), narrow against
/// the output's qparams.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NarrowInput {
    pub node: NodeId,
    pub value: ValueId,
    /// Levels of the output's qparams the input's observed range spans.
    pub levels: u64,
    /// The input's observed range.
    pub observed: (f32, f32),
    /// The range the output's qparams represent.
    pub output_range: (f32, f32),
}

/// The inputs of multi-input nodes of graph `gi` whose output shares their qparams (Concat)
/// whose own observed range spans fewer than [`FEW_LEVELS`] levels of the output's qparams
/// (a Concat of class scores in [0, 1] and box coordinates in pixels). `qparams` gives the
/// qparams of a value at an integer type.
pub(crate) fn narrow_inputs(g: &Graph, plan: &QuantPlan, gi: usize, qparams: &dyn Fn(ValueId, QType) -> Option<QParams>) -> Vec<NarrowInput> {
    let a = &plan.graphs[gi].annotations;
    let mut out = vec![];
    for &n in a.nodes.keys() {
        let (Ok(node), Some(inputs)) = (g.node(n), concat_inputs(g, a, n)) else { continue };
        let Some(ov) = node.output(0) else { continue };
        let Some(qt) = resolve(a, Edge::Output { node: n, index: 0 }, 0).and_then(qtype_of) else { continue };
        let Some(p) = qparams(ov, qt) else { continue };
        let (qmin, qmax) = qt.range();
        let output_range = (p.scale * (qmin - p.zero_point) as f32, p.scale * (qmax - p.zero_point) as f32);
        for value in inputs {
            let Some(observed) = plan.value_extremes(gi, value).filter(|(lo, hi)| hi > lo) else { continue };
            let levels = (((observed.1 - observed.0) / p.scale).floor().max(0.0) as u64).saturating_add(1);
            if levels < FEW_LEVELS {
                out.push(NarrowInput { node: n, value, levels, observed, output_range });
            }
        }
    }
    out
}

/// The nodes of graph `gi` that carry a narrow Concat's output on with the Concat's qparams:
/// the Concat itself, then every reader whose quantized output shares its input's qparams
/// (data movement, further Concats), transitively. Widening their activations together keeps
/// the narrow input's resolution until a node that computes (or a graph output).
pub(crate) fn shared_downstream(g: &Graph, plan: &QuantPlan, gi: usize, concat: NodeId) -> Vec<NodeId> {
    let a = &plan.graphs[gi].annotations;
    let mut chain = vec![concat];
    let mut i = 0;
    while i < chain.len() {
        let n = chain[i];
        i += 1;
        let Ok(node) = g.node(n) else { continue };
        for v in node.outputs.iter().flatten() {
            for &(r, _) in g.consumers(*v) {
                let shares = a.get(r).is_some_and(|ra| ra.outputs.iter().any(|s| matches!(s, Some(Spec::Shared(_)))));
                if shares && !chain.contains(&r) {
                    chain.push(r);
                }
            }
        }
    }
    chain
}

/// A weight output channel spanning fewer levels than this of a per-tensor scale keeps under
/// three bits of resolution.
pub const FEW_WEIGHT_LEVELS: u64 = 8;

/// For a weight quantized with one scale for the whole tensor, how many of its output channels
/// (the axis per-channel quantization would use) span fewer than [`FEW_WEIGHT_LEVELS`] levels,
/// out of how many, and the fewest levels any channel spans; `None` when none does or the
/// weight is not per tensor.
fn narrow_channels(g: &Graph, n: NodeId, data: &[f32], shape: &[usize], spec: &QuantizationSpec, c: &QuantizedConst) -> Option<(usize, usize, u64)> {
    if spec.granularity != Granularity::PerTensor || c.params.len() != 1 {
        return None;
    }
    let (Some(axis), _) = crate::quantizer::weight_axes(g.node(n).ok()?, shape.len()) else { return None };
    let layout = AxisLayout::new(shape, Some(axis))?;
    let mut extremes = vec![(f32::INFINITY, f32::NEG_INFINITY); layout.channels];
    layout.for_each_run(data, |ch, run| {
        let (lo, hi, _) = crate::observer::finite_extremes(run);
        extremes[ch] = (extremes[ch].0.min(lo), extremes[ch].1.max(hi));
    });
    let scale = c.params[0].scale;
    // All-zero channels are exact at any scale.
    let levels: Vec<u64> = extremes.iter().filter(|&&(lo, hi)| hi > 0.0 || lo < 0.0).map(|&(lo, hi)| ((hi.max(0.0) - lo.min(0.0)) / scale).floor() as u64 + 1).collect();
    let narrow = levels.iter().filter(|&&l| l < FEW_WEIGHT_LEVELS).count();
    (narrow > 0).then(|| (narrow, extremes.len(), levels.iter().copied().min().unwrap_or(1)))
}

/// A float32 constant value: its tensor, sharing the initializer's data.
fn const_data(g: &Graph, v: ValueId) -> Option<Tensor> {
    let t = g.value(v).ok()?.initializer()?;
    (t.dtype() == DType::F32).then(|| t.clone())
}

/// The elements of a tensor from [`const_data`].
fn floats(t: &Tensor) -> &[f32] {
    t.as_slice().expect("const_data returns float32 tensors")
}

/// How convert writes a graph.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConvertOptions {
    /// Q/DQ that would need opset 21 (16- and 4-bit types, not blocks) are written in ONNX
    /// Runtime's `com.microsoft` domain.
    pub contrib: bool,
    /// Search weight scales ([`convert_graph`]).
    pub weight_search: bool,
    /// A value its producer quantizes reaches readers that take another integer type
    /// requantized from the producer's quantized value (`Q -> DQ -> Q -> DQ`, a target's
    /// conversion op), not quantized from the float value
    /// ([`crate::quantizer::Quantizer::typed_outputs`]).
    pub typed_outputs: bool,
}

/// Inserts the Q/DQ of graph `gi` of `plan` into `g` (the graph at that plan's path), with
/// the qparams of every group (`Err`: the group stays float, with the reason), as `options`
/// says.
///
/// With `options.weight_search`, symmetric constants take the scale of least squared error among
/// 100 %, 99 %, ..., 80 % of their min/max scale, per slice. With input second moments in
/// `stats` ([`crate::weight_rounding`]), the weights of the nodes they watched are rounded by
/// GPTQ on those scales. With input means (bias correction, [`crate::bias_correction`]), the
/// float bias of every Conv and Gemm they watched is then shifted by `E[(W − Ŵ)·x]` before it
/// is quantized. Fitted weights are taken from, and added to, `fits` ([`WeightFits`]).
pub fn convert_graph(g: &mut Graph, plan: &QuantPlan, gi: usize, params: &[Result<QParams, String>], stats: &InputStats, options: ConvertOptions, fits: &WeightFits) -> Result<ConvertLog, String> {
    let ConvertOptions { contrib, weight_search, typed_outputs } = options;
    let means = stats.means.as_ref();
    let gp = &plan.graphs[gi];
    let a = &gp.annotations;
    let prefix = if gi == 0 { String::new() } else { format!("{}@{gi}/", g.name) };
    let mut patch = Patch::new(g, "convert");
    patch.reserve(g.nodes().map(|(_, n)| n.name.clone()));
    let mut em = Emitter { g, patch, log: ConvertLog { min_opset: 1, ..Default::default() }, contrib, prefix };
    let resolved_qtype = |e: Edge| resolve(a, e, 0).and_then(qtype_of);
    // Activations: first each value at the type its producer quantizes it to, then at the
    // other types readers ask for (requantized from the producer's with `typed_outputs`).
    let producer_type = |v: ValueId| g.producer(v).and_then(|(n, k)| resolved_qtype(Edge::Output { node: n, index: k }));
    let mut points: Vec<(ValueId, QType, usize)> = gp.points.iter().map(|(&(v, qt), &gid)| (v, qt, gid)).collect();
    points.sort_by_key(|&(v, qt, _)| (v, producer_type(v) != Some(qt), qt));
    let mut produced: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    let mut act_params: BTreeMap<(ValueId, QType), QParams> = BTreeMap::new();
    for (v, qt, gid) in points {
        let name = g.value_name(v);
        let p = match &params[gid] {
            Ok(p) => *p,
            Err(why) => {
                em.log.skipped.push((name, why.clone()));
                continue;
            }
        };
        act_params.insert((v, qt), p);
        let producer_quantized = producer_type(v) == Some(qt);
        let readers: Vec<(NodeId, usize)> = g.consumers(v).iter().copied().filter(|u| u.1 != CAPTURE_USE).filter(|&(n, i)| {
            match resolved_qtype(Edge::Input { node: n, index: i }) {
                Some(t) => t == qt,
                None => producer_quantized && a.spec(Edge::Input { node: n, index: i }).is_none(),
            }
        }).collect();
        let requantized = typed_outputs && producer_quantized && gp.points.range((v, QType::U4)..=(v, QType::S32)).any(|(&(_, t), _)| t != qt);
        if readers.is_empty() && !(producer_quantized && (g.is_output(v) || requantized)) {
            continue;
        }
        let source = produced.get(&v).copied().unwrap_or(v);
        let d = em.qdq(v, source, qt, p);
        if typed_outputs && producer_quantized {
            produced.insert(v, d);
        }
        em.log.dequantized.push((d, Dequantized::Activation { group: gid, float: v }));
        let all_readers = readers.len() == g.consumers(v).len();
        if producer_quantized && g.is_output(v) && all_readers {
            em.patch.replace_uses(v, d);
        } else {
            for (n, i) in readers {
                em.patch.redirect_input(n, i, d);
            }
        }
        em.log.activations.push((name, gid, p));
    }
    em.log.narrow_inputs = narrow_inputs(em.g, plan, gi, &|v, qt| act_params.get(&(v, qt)).copied()).into_iter().map(|x| {
        let node = em.g.node(x.node).expect("annotated nodes are live");
        (node.name.clone(), node.op_type.clone(), em.g.value_name(x.value).to_string(), x.levels, x.observed, x.output_range)
    }).collect();
    // The u8 value each input channel of a pair-fitted weight's readers reaches: the largest
    // over the readers, so one fit serves a weight that several nodes read; `None` (every
    // channel at full reach) when a reader has no measured reach (not observed, or seen fewer
    // than `REACH_MIN_VALUES` times per channel) or its input has no u8 qparams.
    // The reach comes from the input's calibrated qparams even where the reader's input edge
    // is left float (a unit returned to float by sensitivity or the accuracy budget), so
    // returning a unit to float never changes the integers of a weight.
    let weight_reach = |v: ValueId| -> Option<Vec<i64>> {
        let maxima = stats.maxima.as_ref()?;
        let mut reach: Option<Vec<i64>> = None;
        for &(n, _) in g.consumers(v).iter().filter(|&&(n, i)| i == 1 && a.nodes.contains_key(&n)) {
            let x = g.node(n).ok()?.input(0)?;
            let qx = act_params.get(&(x, QType::U8))?;
            let r = maxima.reach(gi, n, *qx)?;
            match &mut reach {
                Some(acc) if acc.len() == r.len() => acc.iter_mut().zip(&r).for_each(|(a, &b)| *a = (*a).max(b)),
                Some(_) => return None,
                None => reach = Some(r),
            }
        }
        reach
    };
    // Constants: weights first (bias scales depend on them), then biases.
    // A weight that several nodes read alike (an unrolled recurrence's, once per step) is
    // quantized once: same value, spec and reduction order, and no GPTQ rounding of its own.
    // The distinct weights are quantized in parallel, each with a log of its own, merged in
    // node order so that the report does not depend on the thread count.
    let mut jobs: Vec<WeightJob> = vec![];
    let mut biases: Vec<(NodeId, usize, Vec<Edge>)> = vec![];
    for (&n, ann) in &a.nodes {
        for (i, s) in ann.inputs.iter().enumerate() {
            let Some(s) = s else { continue };
            let e = Edge::Input { node: n, index: i };
            let Some(v) = edge_value(g, e) else { continue };
            if !g.value(v).is_ok_and(|x| x.is_constant()) {
                continue;
            }
            match s {
                Spec::Quantize(spec) => {
                    if const_data(g, v).is_none() {
                        continue;
                    }
                    let node = g.node(n).map_err(|e| e.to_string())?;
                    let key = (i == 1 && stats.grams.as_ref().is_none_or(|gr| !gr.watches(gi, n)))
                        .then(|| SharedWeight { value: v, spec: spec.clone(), op: node.op_type.clone(), group: node.attr_int("group"), trans_b: node.attr_int("transB") });
                    let same_as = key.as_ref().and_then(|k| jobs.iter().position(|j| j.same_as.is_none() && j.key.as_ref() == Some(k)));
                    jobs.push(WeightJob { node: n, input: i, value: v, spec, key, same_as });
                }
                Spec::Derived { from, how: Derivation::BiasScale } => biases.push((n, i, from.clone())),
                _ => {}
            }
        }
    }
    let fitted: Vec<Result<Option<(QuantizedConst, ConvertLog)>, String>> = {
        use rayon::prelude::*;
        jobs.par_iter().map(|j| {
            if j.same_as.is_some() {
                return Ok(None);
            }
            let reach = if j.input == 1 { weight_reach(j.value) } else { None };
            if let Some(done) = fits.get((gi, j.node, j.input), &reach) {
                return Ok(Some(done));
            }
            let mut log = ConvertLog::default();
            let t = const_data(g, j.value).expect("constant data checked above");
            let (data, shape) = (floats(&t), t.shape());
            let mut c = quantize_const(data, shape, j.spec, None, weight_search).map_err(|e| format!("constant '{}': {e}", g.value_name(j.value)))?;
            if j.input == 1 {
                finish_weight(g, gi, j.node, stats, reach.as_deref(), data, &mut c, j.spec, true, &mut log)?;
            }
            fits.insert((gi, j.node, j.input), reach, (c.clone(), log.clone()));
            Ok(Some((c, log)))
        }).collect()
    };
    let fitted = fitted.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut weights: BTreeMap<(NodeId, usize), QuantizedConst> = BTreeMap::new();
    for (k, j) in jobs.iter().enumerate() {
        let node = g.node(j.node).map_err(|e| e.to_string())?;
        let (c, log) = fitted[j.same_as.unwrap_or(k)].as_ref().expect("the first job of each key is fitted");
        if j.same_as.is_none() {
            em.log.gptq_rounded.extend(log.gptq_rounded.iter().cloned());
            em.log.gptq_skipped.extend(log.gptq_skipped.iter().cloned());
        }
        let record = log.pair_sums_fitted.first().map(|r| (node.display_name(j.node), r.1.clone(), r.2.clone(), r.3, r.4, r.5, r.6));
        em.log.pair_sums_fitted.extend(record);
        if j.input == 1 {
            let t = const_data(g, j.value).expect("constant data checked above");
            if let Some(narrow) = narrow_channels(g, j.node, floats(&t), t.shape(), j.spec, c) {
                em.log.narrow_weight_channels.push((node.display_name(j.node), node.op_type.clone(), g.value_name(j.value).to_string(), narrow.0, narrow.1, narrow.2));
            }
        }
        weights.insert((j.node, j.input), c.clone());
    }
    let mut bias_consts: Vec<((NodeId, usize), QuantizedConst)> = vec![];
    for (n, i, from) in biases {
        let (Some(x), Some(&Edge::Input { node: wn, index: wi })) = (from.first().and_then(|e| edge_value(g, *e)), from.get(1)) else { continue };
        let x_qt = resolved_qtype(from[0]);
        let Some(sx) = x_qt.and_then(|t| act_params.get(&(x, t))).map(|p| p.scale) else { continue };
        let Some(w) = weights.get_mut(&(wn, wi)) else { continue };
        if w.block_size.is_some() {
            continue;
        }
        let Some(bv) = g.node(n).ok().and_then(|nd| nd.input(i)) else { continue };
        let Some(bias_tensor) = const_data(g, bv) else { continue };
        let (float_bias, bshape) = (floats(&bias_tensor), bias_tensor.shape().to_vec());
        let per_channel = w.params.len() > 1;
        if per_channel && w.params.len() != float_bias.len() {
            continue;
        }
        let wv = g.node(wn).ok().and_then(|nd| nd.input(wi)).expect("weight edge");
        let node = g.node(n).map_err(|e| e.to_string())?;
        let shift = |w: &QuantizedConst| -> Option<Result<Vec<f64>, String>> {
            let means = means?;
            let t = const_data(g, wv)?;
            Some(dequantize(w).and_then(|w_hat| means.shift(gi, n, node, floats(&t), &w_hat, t.shape())))
        };
        let shifted = |s: &Option<Result<Vec<f64>, String>>| -> Vec<f32> {
            match s {
                Some(Ok(s)) => float_bias.iter().zip(s).map(|(&b, &d)| (b as f64 + d) as f32).collect(),
                _ => float_bias.to_vec(),
            }
        };
        let mut correction = shift(w);
        let mut bias = shifted(&correction);
        let limit = i32::MAX as f64;
        let mut changed = 0;
        let mut scales: Vec<f32> = w.params.iter().map(|p| p.scale).collect();
        for (c, &b) in bias.iter().enumerate() {
            let k = if per_channel { c } else { 0 };
            if (b as f64 / (sx as f64 * scales[k] as f64)).abs() > limit {
                scales[k] = ((b.abs() as f64 / (sx as f64 * limit)) * (1.0 + 1e-6)) as f32;
                changed += 1;
            }
        }
        if changed > 0 {
            let t = const_data(g, wv).expect("weights are float constants");
            let (data, shape) = (floats(&t), t.shape());
            let spec = match a.spec(Edge::Input { node: wn, index: wi }) {
                Some(Spec::Quantize(s)) => s.clone(),
                _ => continue,
            };
            *w = quantize_const(data, shape, &spec, Some(&scales), false)?;
            if wi == 1 {
                let name = g.node(wn).map(|x| x.display_name(wn)).unwrap_or_default();
                em.log.gptq_rounded.retain(|r| r.0 != name);
                em.log.gptq_skipped.retain(|r| r.0 != name);
                finish_weight(g, gi, wn, stats, weight_reach(wv).as_deref(), data, w, &spec, false, &mut em.log)?;
            }
            em.log.bias_adjusted.push((g.value_name(wv), changed));
            if correction.is_some() {
                correction = shift(w);
                bias = shifted(&correction);
            }
        }
        match correction {
            Some(Ok(s)) => em.log.bias_corrected.push((node.display_name(n), node.op_type.clone(), s.iter().map(|&d| d as f32).collect())),
            Some(Err(why)) => em.log.bias_uncorrected.push((node.display_name(n), node.op_type.clone(), why)),
            None => {}
        }
        let params: Vec<QParams> = w.params.iter().map(|p| QParams { scale: sx * p.scale, zero_point: 0 }).collect();
        let values: Vec<i64> = bias.iter().enumerate().map(|(c, &b)| {
            let p = params[if per_channel { c } else { 0 }];
            quantize(b, p, i32::MIN as i64, i32::MAX as i64)
        }).collect();
        let param_shape = if per_channel { vec![params.len()] } else { vec![] };
        bias_consts.push(((n, i), QuantizedConst { values: int_tensor(QType::S32, &bshape, &values), shape: bshape, params, param_shape, qtype: QType::S32, axis: per_channel.then_some(0), block_size: None, searched: vec![] }));
    }
    let mut emitted: BTreeMap<(ValueId, String), ValueId> = BTreeMap::new();
    for ((n, i), c) in weights.into_iter().chain(bias_consts) {
        let v = g.node(n).ok().and_then(|nd| nd.input(i)).expect("annotated input");
        let values = if c.qtype == QType::S32 { format!("{:?}", c.values.raw_bytes()) } else { String::new() };
        let key = (v, format!("{:?}{:?}{:?}{values}", c.qtype, c.param_shape, c.params.iter().map(|p| (p.scale.to_bits(), p.zero_point)).collect::<Vec<_>>()));
        let d = match emitted.get(&key) {
            Some(&d) => d,
            None => {
                if !c.searched.is_empty() {
                    em.log.weight_searched.push((g.value_name(v), c.searched.clone()));
                }
                let d = em.constant(v, &c);
                em.log.constants.push((g.value_name(v), c.qtype, granularity_of(&c), c.params.len()));
                emitted.insert(key, d);
                d
            }
        };
        em.patch.redirect_input(n, i, d);
        em.log.dequantized.push((d, Dequantized::Constant { node: n, input: i, float: v }));
    }
    if let Some(means) = means {
        for (_, id, why) in means.skipped.iter().filter(|s| s.0 == gi) {
            let node = g.node(*id).map_err(|e| e.to_string())?;
            em.log.bias_uncorrected.push((node.display_name(*id), node.op_type.clone(), why.clone()));
        }
    }
    if let Some(grams) = &stats.grams {
        for (_, id, why) in grams.skipped.iter().filter(|s| s.0 == gi) {
            let node = g.node(*id).map_err(|e| e.to_string())?;
            em.log.gptq_skipped.push((node.display_name(*id), node.op_type.clone(), why.clone()));
        }
    }
    let Emitter { patch, log, .. } = em;
    g.apply(patch).map_err(|e| e.to_string())?;
    Ok(log)
}

/// The quantized constants [`convert_graph`] computed, by graph index, node and input, each
/// with the reach it was fitted to ([`crate::pair_sums`]; `None` for full reach and for other
/// inputs): converting a plan again after only some channels' reach rose refits only the
/// weights those channels feed. One instance serves one plan with one set of qparams and
/// options, and stats that differ at most in their maxima.
#[derive(Default)]
pub struct WeightFits {
    fits: std::sync::Mutex<std::collections::HashMap<(usize, NodeId, usize), WeightFit>>,
    computed: std::sync::atomic::AtomicUsize,
}

/// A fitted constant, the reach it was fitted to, and what fitting it logged.
type WeightFit = (Option<Vec<i64>>, QuantizedConst, ConvertLog);

impl WeightFits {
    /// How many constants were fitted (not taken from an earlier fit).
    pub fn computed(&self) -> usize {
        self.computed.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn get(&self, key: (usize, NodeId, usize), reach: &Option<Vec<i64>>) -> Option<(QuantizedConst, ConvertLog)> {
        let fits = self.fits.lock().unwrap_or_else(|e| e.into_inner());
        fits.get(&key).filter(|f| &f.0 == reach).map(|f| (f.1.clone(), f.2.clone()))
    }

    fn insert(&self, key: (usize, NodeId, usize), reach: Option<Vec<i64>>, fit: (QuantizedConst, ConvertLog)) {
        self.computed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.fits.lock().unwrap_or_else(|e| e.into_inner()).insert(key, (reach, fit.0, fit.1));
    }
}

/// A quantized constant input of an annotated node: `same_as` names the earlier job whose
/// integers it takes (same [`SharedWeight`] key).
struct WeightJob<'a> {
    node: NodeId,
    input: usize,
    value: ValueId,
    spec: &'a QuantizationSpec,
    key: Option<SharedWeight>,
    same_as: Option<usize>,
}

/// What makes two reads of one weight quantize alike: the value, its spec, and what decides
/// [`reduction_pairs`] (the op and its layout attributes).
#[derive(PartialEq)]
struct SharedWeight {
    value: ValueId,
    spec: QuantizationSpec,
    op: String,
    group: Option<i64>,
    trans_b: Option<i64>,
}

/// An entry of [`ConvertLog::pair_sums_fitted`].
type PairSumsRecord = (String, String, String, usize, usize, usize, bool);

/// The integers of `c`, the quantized weight `data` of node `n` (input 1), as the target takes
/// them: with the spec's `pair_sum_max` ([`crate::pair_sums`]), scales first moved (with
/// `rescale`) to where paired weights fit best, then the rounding ([`round_weight`]), then pairs
/// still over the constraint projected onto it, and what changed logged. `reach` is the u8
/// value each input channel of the activation reaches (full range when absent).
#[allow(clippy::too_many_arguments)]
fn finish_weight(g: &Graph, gi: usize, n: NodeId, stats: &InputStats, reach: Option<&[i64]>, data: &[f32], c: &mut QuantizedConst, spec: &QuantizationSpec, rescale: bool, log: &mut ConvertLog) -> Result<(), String> {
    let node = g.node(n).map_err(|e| e.to_string())?;
    let pairs = spec.pair_sum_max.and_then(|max| Some((max, reduction_pairs(node, &c.shape)?)));
    let Some((max, pairs)) = pairs else { return round_weight(g, gi, n, stats, data, c, spec, log) };
    let (layout, _) = ParamLayout::new(&c.shape, granularity_of(c))?;
    let param_of = move |e: usize| layout.param(e);
    let channel = reduction_channel(node, &c.shape);
    let element_reach = |e: usize| match (reach, &channel) {
        (Some(r), Some(ch)) => r.get(ch(e)).copied().unwrap_or(FULL_REACH),
        _ => FULL_REACH,
    };
    let paired = PairedWeight { data, param_of: &param_of, range: spec.scheme.qrange(), pairs: &pairs, max, reach: &element_reach };
    let mut rescaled = 0;
    if rescale {
        let factors = paired.pair_scales(&c.params);
        rescaled = factors.iter().filter(|&&f| f > 1.0).count();
        if rescaled > 0 {
            let scales: Vec<f32> = c.params.iter().zip(&factors).map(|(p, f)| p.scale * f).collect();
            let searched = std::mem::take(&mut c.searched);
            *c = quantize_const(data, &c.shape, spec, Some(&scales), false)?;
            c.searched = searched;
        }
    }
    round_weight(g, gi, n, stats, data, c, spec, log)?;
    let mut values = c.values.to_i64_vec().map_err(|e| e.to_string())?;
    let projected = paired.project_pairs(&mut values, &c.params);
    if projected > 0 {
        c.values = int_tensor(c.qtype, &c.shape, &values);
    }
    let name = node.display_name(n);
    let earlier = log.pair_sums_fitted.iter().position(|r| r.0 == name);
    let rescaled = rescaled.max(earlier.map_or(0, |k| log.pair_sums_fitted[k].3));
    if let Some(k) = earlier {
        log.pair_sums_fitted.remove(k);
    }
    if rescaled > 0 || projected > 0 {
        let weight = node.input(1).map(|v| g.value_name(v).to_string()).unwrap_or_default();
        log.pair_sums_fitted.push((name, node.op_type.clone(), weight, rescaled, c.params.len(), projected, reach.is_none()));
    }
    Ok(())
}

/// With input second moments in `stats` that watch node `n`, replaces the integers of `c` (the
/// quantized weight `data` of `n`, input 1) by GPTQ's rounding on the same qparams and logs
/// the output error proxies, or logs why the node keeps nearest rounding.
#[allow(clippy::too_many_arguments)]
fn round_weight(g: &Graph, gi: usize, n: NodeId, stats: &InputStats, data: &[f32], c: &mut QuantizedConst, spec: &QuantizationSpec, log: &mut ConvertLog) -> Result<(), String> {
    let Some(grams) = &stats.grams else { return Ok(()) };
    let node = g.node(n).map_err(|e| e.to_string())?;
    if !grams.watches(gi, n) {
        return Ok(());
    }
    let (layout, _) = ParamLayout::new(&c.shape, granularity_of(c))?;
    let params = &c.params;
    let grid = Grid { param: Box::new(move |e: usize| (params[layout.param(e)].scale, params[layout.param(e)].zero_point)), range: spec.scheme.qrange() };
    match grams.round(gi, n, node, data, &c.shape, &grid) {
        Ok(r) => {
            c.values = int_tensor(c.qtype, &c.shape, &r.values);
            log.gptq_rounded.push((node.display_name(n), node.op_type.clone(), r.nearest_error, r.rounded_error));
        }
        Err(why) => log.gptq_skipped.push((node.display_name(n), node.op_type.clone(), why)),
    }
    Ok(())
}

fn granularity_of(c: &QuantizedConst) -> Granularity {
    match (c.axis, c.block_size) {
        (Some(axis), Some(block_size)) => Granularity::PerBlock { axis, block_size },
        (Some(axis), None) => Granularity::PerAxis { axis },
        _ => Granularity::PerTensor,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Convention, QScheme};

    fn sse(data: &[f32], c: &QuantizedConst) -> Vec<f64> {
        let w = dequantize(c).unwrap();
        let (layout, _) = ParamLayout::new(&c.shape, granularity_of(c)).unwrap();
        let mut e = vec![0f64; c.params.len()];
        for ((&x, &y), p) in data.iter().zip(&w).zip(layout.params_from(0)) {
            e[p] += ((x - y) as f64).powi(2);
        }
        e
    }

    #[test]
    fn parameter_walks_from_any_element_follow_the_layout() {
        let shape = [2, 5, 3];
        // Each element's parameter from its coordinates, by the DequantizeLinear definitions.
        let reference = |g: Granularity| -> Vec<usize> {
            let mut v = vec![];
            for o in 0..2 {
                for c in 0..5 {
                    for k in 0..3 {
                        v.push(match g {
                            Granularity::PerTensor => 0,
                            Granularity::PerAxis { axis: 0 } => o,
                            Granularity::PerAxis { axis: 1 } => c,
                            Granularity::PerAxis { .. } => k,
                            // Blocks of 2 along axis 1: [2, 3, 3] parameters.
                            Granularity::PerBlock { .. } => (o * 3 + c / 2) * 3 + k,
                        });
                    }
                }
            }
            v
        };
        for g in [Granularity::PerTensor, Granularity::PerAxis { axis: 0 }, Granularity::PerAxis { axis: 1 }, Granularity::PerAxis { axis: 2 }, Granularity::PerBlock { axis: 1, block_size: 2 }] {
            let want = reference(g);
            let (layout, _) = ParamLayout::new(&shape, g).unwrap();
            for start in 0..want.len() {
                let walked: Vec<usize> = layout.params_from(start).take(want.len() - start).collect();
                assert_eq!(walked, want[start..], "{g:?} from {start}");
                assert_eq!(layout.param(start), want[start], "{g:?} at {start}");
            }
        }
        assert_eq!(ParamLayout::new(&shape, Granularity::PerBlock { axis: 1, block_size: 2 }).unwrap().1, vec![2, 3, 3]);
        assert!(ParamLayout::new(&shape, Granularity::PerAxis { axis: 3 }).is_err());
    }

    #[test]
    fn weight_search_never_increases_the_squared_error_and_clips_lone_outliers() {
        let scheme = QScheme::new(QType::S8, true, Convention::Ort);
        let spec = QuantizationSpec { scheme, granularity: Granularity::PerAxis { axis: 0 }, observer: crate::spec::ObserverKind::MinMax, scale_min: None, pair_sum_max: None };
        // Row 0: a uniform spread over [-1, 1] plus one outlier at 1.2; row 1: values on the
        // min/max grid (exact).
        let n = 1 << 16;
        let mut data: Vec<f32> = (0..n).map(|i| (i * 40503 % n) as f32 / (n - 1) as f32 * 2.0 - 1.0).collect();
        data[17] = 1.2;
        data.extend((0..n).map(|i| (i % 255) as f32 - 127.0));
        let plain = quantize_const(&data, &[2, n], &spec, None, false).unwrap();
        let searched = quantize_const(&data, &[2, n], &spec, None, true).unwrap();
        let (e0, e1) = (sse(&data, &plain), sse(&data, &searched));
        for c in 0..2 {
            assert!(e1[c] <= e0[c], "channel {c}: {} > {}", e1[c], e0[c]);
        }
        assert!(searched.params[0].scale < plain.params[0].scale && e1[0] < e0[0], "the outlier row trades clipping for resolution");
        assert_eq!(searched.params[1].scale, plain.params[1].scale, "values on the grid keep the min/max scale");
    }

    #[test]
    fn per_axis_and_per_block_parameters() {
        let data: Vec<f32> = (0..12).map(|i| i as f32 - 6.0).collect();
        let scheme = QScheme::new(QType::S8, true, Convention::Ort);
        let spec = |granularity| QuantizationSpec { scheme, granularity, observer: crate::spec::ObserverKind::MinMax, scale_min: None, pair_sum_max: None };
        let c = quantize_const(&data, &[3, 4], &spec(Granularity::PerAxis { axis: 0 }), None, false).unwrap();
        assert_eq!(c.param_shape, vec![3]);
        assert_eq!(c.params[0].scale, 6.0 / 127.0);
        assert_eq!(c.values.to_i64_vec().unwrap()[0], -127);
        let b = quantize_const(&data, &[3, 4], &spec(Granularity::PerBlock { axis: 1, block_size: 3 }), None, false).unwrap();
        assert_eq!(b.param_shape, vec![3, 2], "4 columns in blocks of 3 give 2 blocks");
        // Row 0, block 1 holds only column 3 (value -3).
        assert_eq!(b.params[1].scale, 3.0 / 127.0);
    }
}
