//! Integer weights whose pair sums fit a target's 16-bit accumulator.
//!
//! ONNX Runtime's x86 u8 x s8 kernels on CPUs without VNNI (AVX2, and AVX-512 without VNNI)
//! multiply with `vpmaddubsw`: the products of two adjacent reduction inputs are added into
//! one *saturating* 16-bit sum before the 32-bit accumulation. Two u8 activations of 255 times
//! two s8 weights of 127 give 64770, which becomes 32767, and the output leaves the ONNX
//! semantics. With VNNI (`vpdpbusd`) the same model is exact. A target declares this with
//! `pair_sum_max` on its weight dtype (`backends/ort.toml`: 128, since `255 · 128 = 32640` and
//! `−255 · 128` fit in 16 bits); qforge then chooses integers for which no such pair can
//! saturate, so the model gives the same results on every CPU.
//!
//! What a pair can add up to depends on the activations it multiplies. During calibration
//! [`InputMaxima`] records, per input channel of each such weight's activation, its largest
//! value; through the activation's u8 qparams, with [`REACH_HEADROOM`] above it, that is the
//! channel's *reach* `r`, at most 255. The constraint on two same-sign integers is then
//! `r_a·|q_a| + r_b·|q_b| <= 255 · pair_sum_max`, which at full reach is `|q_a| + |q_b| <=
//! pair_sum_max`. Channels whose activations stay small (most of them, in networks whose
//! channel ranges differ) leave their weights at full range; the results equal ONNX semantics
//! on every CPU for activations within the reach of their channels.
//!
//! Which weights are paired is the kernel's reduction order ([`reduction_pairs`]), measured
//! against ONNX Runtime 1.31: element `2m` with `2m + 1` along the reduction of one output
//! channel. `crates/quant/tests/pair_sums.rs` (weights whose every pair would saturate) and
//! `crates/cli/tests/int8_vs_ort.rs` (the benchmark models) compare ONNX Runtime with qforge
//! at full weight range. Only two weights of one sign can overflow: with opposite signs the
//! pair sum stays within `255 · 128`.
//!
//! Per output channel ([`PairedWeight::pair_scales`]), the scale is the one, from the min/max
//! scale up to the scale at which the channel's largest pair fits, with the least squared
//! weight error once violating pairs are projected ([`PairedWeight::project_pairs`]): a
//! channel with two near-maximal neighbours gets a coarser scale rather than two halved
//! weights, one whose large weight sits among thousands of small ones gets part of the rise
//! and has that pair pulled in the rest of the way.

use std::collections::{BTreeMap, HashMap};

use qforge_ir::{Graph, GraphPath, Node, NodeId, Tensor, ValueId};
use qforge_runtime::ValueEvent;

use crate::bias_correction::{main_graph_values, plan_graph_of};
use crate::observer::{AxisLayout, MinMax};
use crate::prepare::QuantPlan;
use crate::spec::Spec;
use crate::QParams;

/// The pairs of weight elements (flat indices into a weight of `shape`, read as input 1 of
/// `node`) that ONNX Runtime's u8 x s8 kernels add into one 16-bit sum, or `None` when the op
/// has no such kernel:
/// * Conv `[M, C/g, k..]`: per output channel, the reduction runs over kernel positions, and
///   within one over the group's input channels (MLAS's im2col order); a depthwise Conv (one
///   input and one output channel per group) runs in a kernel that sums in 32 bits;
/// * Gemm and MatMul: the reduction is the input dimension `K` of each output column (of each
///   matrix of a batched MatMul weight `[.., K, N]`).
///
/// ConvTranspose has no integer kernel in ONNX Runtime's CPU provider (it runs in float).
pub fn reduction_pairs(node: &Node, shape: &[usize]) -> Option<Vec<[usize; 2]>> {
    let numel: usize = shape.iter().product();
    let mut pairs = Vec::with_capacity(numel / 2);
    match node.op_type.as_str() {
        "Conv" if shape.len() >= 3 => {
            let (m, cg, taps) = (shape[0], shape[1], shape[2..].iter().product::<usize>());
            let group = node.attr_int("group").unwrap_or(1).max(1) as usize;
            if cg == 1 && m == group {
                return None;
            }
            let k = cg * taps;
            let flat = |o: usize, r: usize| o * k + (r % cg) * taps + r / cg;
            for o in 0..m {
                pairs.extend((0..k / 2).map(|j| [flat(o, 2 * j), flat(o, 2 * j + 1)]));
            }
        }
        "Gemm" if shape.len() == 2 => {
            let (rows, cols) = (shape[0], shape[1]);
            if node.attr_int("transB").unwrap_or(0) != 0 {
                pairs.extend((0..rows).flat_map(|n| (0..cols / 2).map(move |j| [n * cols + 2 * j, n * cols + 2 * j + 1])));
            } else {
                pairs.extend((0..rows / 2).flat_map(|j| (0..cols).map(move |n| [2 * j * cols + n, (2 * j + 1) * cols + n])));
            }
        }
        "MatMul" if shape.len() >= 2 => {
            let (k, n) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            for b in 0..numel / (k * n).max(1) {
                let base = b * k * n;
                pairs.extend((0..k / 2).flat_map(|j| (0..n).map(move |c| [base + 2 * j * n + c, base + (2 * j + 1) * n + c])));
            }
        }
        _ => return None,
    }
    Some(pairs)
}

/// Whether two paired integers `a`, `b` (zero point removed) read against activations reaching
/// `ra`, `rb` can sum to more than `limit` (`FULL_REACH` times the target's `pair_sum_max`): of
/// one sign, with `ra·|a| + rb·|b| > limit`. With opposite signs their products partly cancel
/// and the sum stays within one product.
pub fn pair_over(a: i64, b: i64, [ra, rb]: [i64; 2], limit: i64) -> bool {
    a.signum() == b.signum() && ra * a.abs() + rb * b.abs() > limit
}

/// The largest u8 activation: the reach [`PairedWeight::reach`] assumes when nothing smaller
/// is known, at which `pair_sum_max` is the limit on `|a| + |b|`.
pub const FULL_REACH: i64 = 255;

/// A quantized weight being fitted: float values, the parameter each element uses, the integer
/// range, the pairs ([`reduction_pairs`]), their limit, and how far the activations they
/// multiply reach.
pub struct PairedWeight<'a> {
    pub data: &'a [f32],
    pub param_of: &'a (dyn Fn(usize) -> usize + Sync),
    pub range: (i64, i64),
    pub pairs: &'a [[usize; 2]],
    /// The target's `pair_sum_max`: the largest `|q_a| + |q_b|` of a same-sign pair read
    /// against activations at [`FULL_REACH`]. A pair is within the target's 16-bit sum when
    /// `r_a·|q_a| + r_b·|q_b| <= FULL_REACH · max`.
    pub max: i64,
    /// The largest u8 value of the activation element `e` multiplies (`0..=255`): its input
    /// channel's calibrated maximum with headroom, or [`FULL_REACH`].
    pub reach: &'a (dyn Fn(usize) -> i64 + Sync),
}

/// Scale multipliers tried between the min/max scale (factor 1) and the scale at which the
/// parameter's largest pair fits without projection.
const SCALE_STEPS: usize = 16;

impl PairedWeight<'_> {
    /// The limit on a pair's sum of products, `FULL_REACH · max`.
    fn limit(&self) -> i64 {
        FULL_REACH * self.max
    }

    /// Whether integers `da`, `db` (zero point removed) read against activations reaching `ra`,
    /// `rb` can exceed the limit: of one sign, with `ra·|da| + rb·|db| > limit`.
    fn over(&self, da: i64, db: i64, reach: [i64; 2]) -> bool {
        pair_over(da, db, reach, self.limit())
    }

    /// The integers `(a, b)` of a pair whose same-sign sum of products exceeds the limit moved
    /// onto it: around the least-squares point of `r_a·|a| + r_b·|b| = limit` (both magnitudes
    /// lowered in proportion to their reach), `|a|` rounded either way, `|b|` as large as the
    /// limit then allows, neither above its magnitude before; the candidate with the least
    /// squared error. Pairs within the constraint come back unchanged.
    pub fn fit(&self, [a, b]: [usize; 2], qa: i64, qb: i64, pa: QParams, pb: QParams) -> (i64, i64) {
        self.fit_values([self.data[a], self.data[b]], [(self.reach)(a), (self.reach)(b)], qa, qb, pa, pb)
    }

    /// [`Self::fit`] of a pair given by its float values `[x, y]` and reaches.
    fn fit_values(&self, [x, y]: [f32; 2], reach: [i64; 2], qa: i64, qb: i64, pa: QParams, pb: QParams) -> (i64, i64) {
        let (da, db) = (qa - pa.zero_point, qb - pb.zero_point);
        if !self.over(da, db, reach) {
            return (qa, qb);
        }
        // Over the limit, at least one reach is positive.
        let ([ra, rb], limit) = (reach, self.limit());
        let (na, nb) = (da.abs(), db.abs());
        let sign = da.signum();
        let target = |x: f32, p: QParams| (sign as f64 * x as f64 / p.scale as f64).max(0.0);
        let (ta, tb) = (target(x, pa), target(y, pb));
        let lambda = (ra as f64 * ta + rb as f64 * tb - limit as f64) / (ra * ra + rb * rb) as f64;
        let most = |r: i64, spent: i64, cap: i64| if r == 0 { cap } else { ((limit - spent) / r).clamp(0, cap) };
        let top_a = most(ra, 0, na);
        let a_star = (ta - lambda * ra as f64).clamp(0.0, top_a as f64);
        let near = a_star.round() as i64;
        let other = if (near as f64) < a_star { near + 1 } else { near - 1 }.clamp(0, top_a);
        let error = |ma: i64, mb: i64| (ta - ma as f64).powi(2) + (tb - mb as f64).powi(2);
        let (ma, mb) = [near, other].into_iter().map(|ma| (ma, most(rb, ra * ma, nb)))
            .fold(None, |best: Option<(i64, i64)>, c| match best {
                Some(b) if error(b.0, b.1) <= error(c.0, c.1) => Some(b),
                _ => Some(c),
            })
            .expect("two candidates");
        (pa.zero_point + sign * ma, pb.zero_point + sign * mb)
    }

    /// For each parameter, the factor (at least 1) to multiply its scale by: among
    /// `SCALE_STEPS + 1` (17) factors from 1 to the one at which the parameter's largest same-sign
    /// pair's sum of products reaches the limit, the one with the least squared error of the
    /// parameter's elements after nearest rounding and [`Self::fit`] (the smallest factor on
    /// ties). Parameters with no pair over the constraint keep factor 1.
    pub fn pair_scales(&self, params: &[QParams]) -> Vec<f32> {
        use rayon::prelude::*;
        let mut members: Vec<Members> = (0..params.len()).map(|_| Members::default()).collect();
        let mut paired = vec![false; self.data.len()];
        for &[a, b] in self.pairs {
            (paired[a], paired[b]) = (true, true);
            let p = (self.param_of)(a);
            if (self.param_of)(b) != p {
                continue;
            }
            let (x, y) = (self.data[a], self.data[b]);
            let reach = [(self.reach)(a), (self.reach)(b)];
            let m = &mut members[p];
            if x as f64 * y as f64 > 0.0 {
                m.largest = m.largest.max((reach[0] as f64 * x.abs() as f64 + reach[1] as f64 * y.abs() as f64) / params[p].scale as f64);
            }
            m.pairs += 1;
            m.values.extend([x, y]);
            m.reaches.push(reach);
        }
        for (e, _) in paired.iter().enumerate().filter(|(_, &x)| !x) {
            members[(self.param_of)(e)].values.push(self.data[e]);
        }
        members.par_iter().zip(params.par_iter()).map(|(m, &p)| {
            let mut rounded = vec![0f32; m.values.len()];
            let mut error = |f: f64| -> (f64, bool) {
                let q = QParams { scale: (p.scale as f64 * f) as f32, zero_point: p.zero_point };
                let mut total = rounding_error(&m.values, q.scale, (self.range.0 - q.zero_point) as f32, (self.range.1 - q.zero_point) as f32, &mut rounded);
                let mut over = false;
                for (j, r) in rounded[..2 * m.pairs].chunks_exact(2).enumerate() {
                    let (da, db) = (r[0] as i64, r[1] as i64);
                    if !self.over(da, db, m.reaches[j]) {
                        continue;
                    }
                    over = true;
                    let (x, y) = (m.values[2 * j], m.values[2 * j + 1]);
                    let (qa, qb) = self.fit_values([x, y], m.reaches[j], da + q.zero_point, db + q.zero_point, q, q);
                    let e = |x: f32, v: i64| (x as f64 - q.scale as f64 * (v - q.zero_point) as f64).powi(2);
                    total += e(x, qa) + e(y, qb) - e(x, da + q.zero_point) - e(y, db + q.zero_point);
                }
                (total, over)
            };
            let (first, over) = error(1.0);
            if !over || p.scale <= 0.0 {
                return 1.0;
            }
            let top = (m.largest / self.limit() as f64).max(1.0);
            let factors: Vec<f64> = (0..=SCALE_STEPS).map(|k| 1.0 + (top - 1.0) * k as f64 / SCALE_STEPS as f64).collect();
            let errors: Vec<f64> = std::iter::once(first).chain(factors[1..].iter().map(|&f| error(f).0)).collect();
            let best = (0..factors.len()).fold(0, |b, k| if errors[k] < errors[b] { k } else { b });
            factors[best] as f32
        }).collect()
    }

    /// Applies [`Self::fit`] to every pair of `values` (the weight's integers under `params`);
    /// returns how many pairs changed.
    pub fn project_pairs(&self, values: &mut [i64], params: &[QParams]) -> usize {
        let mut changed = 0;
        for &[a, b] in self.pairs {
            let (pa, pb) = (params[(self.param_of)(a)], params[(self.param_of)(b)]);
            let fitted = self.fit([a, b], values[a], values[b], pa, pb);
            if fitted != (values[a], values[b]) {
                (values[a], values[b]) = fitted;
                changed += 1;
            }
        }
        changed
    }
}

/// How far above its calibrated maximum an input channel may go before a fitted pair can
/// saturate: its reach is `zero_point + max(REACH_HEADROOM · m, m + REACH_MIN_STEPS)` for a
/// maximum `m` steps above the zero point, at most 255. The additive part keeps a channel that
/// stayed at or below zero during calibration (a dead ReLU channel) from reaching nothing.
pub const REACH_HEADROOM: f64 = 1.25;

/// See [`REACH_HEADROOM`]: the least headroom, in steps of the activation's u8 grid.
pub const REACH_MIN_STEPS: f64 = 16.0;

/// The fewest values per input channel calibration must see for its maximum to set a reach.
/// A pooled feature (a squeeze-excitation bottleneck after GlobalAveragePool, a classifier's
/// input) gives one per sample, so over a few dozen samples its maximum is the largest of a
/// few dozen draws, which new inputs pass by more than the headroom (up to 1.8 times, on
/// fresh ocr_det pages); the weights reading it assume [`FULL_REACH`]. A decoder step's
/// vector inside a Loop gives one per step, and hundreds of steps per sample measure it.
pub const REACH_MIN_VALUES: u64 = 1024;

/// The axis of an activation that a weighted node reduces over (its input channels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReductionAxis {
    Index(usize),
    Last,
}

impl ReductionAxis {
    /// The axis of `n`'s activation input that its weight reduces over: 1 for Conv, the first
    /// for Gemm with `transA`, the last for MatMul and Gemm; `None` for other ops. With
    /// `integer`, the integer forms count too (QLinearConv, ConvInteger, QGemm, QLinearMatMul,
    /// MatMulInteger).
    pub fn of(n: &Node, integer: bool) -> Option<ReductionAxis> {
        let op = n.op_type.as_str();
        let float = matches!(op, "Conv" | "Gemm" | "MatMul");
        if !float && !(integer && matches!(op, "QLinearConv" | "ConvInteger" | "QGemm" | "QLinearMatMul" | "MatMulInteger")) {
            return None;
        }
        Some(match op {
            "Conv" | "QLinearConv" | "ConvInteger" => ReductionAxis::Index(1),
            "Gemm" | "QGemm" if n.attr_int("transA").unwrap_or(0) != 0 => ReductionAxis::Index(0),
            _ => ReductionAxis::Last,
        })
    }

    /// The axis in a tensor of rank `rank`.
    fn index(self, rank: usize) -> usize {
        match self {
            ReductionAxis::Index(a) => a,
            ReductionAxis::Last => rank.saturating_sub(1),
        }
    }
}

/// Per channel, the largest u8 of named activations over runs of a quantized model: the
/// integers ONNX Runtime's u8 x s8 kernels multiply by the weights reading them. A
/// [`Hooks`](qforge_runtime::Hooks) that only reads; a value seen with two channel counts, or
/// not as u8, is dropped.
#[derive(Debug, Clone, Default)]
pub struct U8ChannelMaxima {
    watch: HashMap<String, Vec<ReductionAxis>>,
    maxima: HashMap<(String, ReductionAxis), Option<Vec<u8>>>,
}

impl U8ChannelMaxima {
    /// Watches each named value with the channels along its axis.
    pub fn new(values: impl IntoIterator<Item = (String, ReductionAxis)>) -> U8ChannelMaxima {
        let mut me = U8ChannelMaxima::default();
        for (name, axis) in values {
            let axes = me.watch.entry(name).or_default();
            if !axes.contains(&axis) {
                axes.push(axis);
            }
        }
        me
    }

    /// The largest u8 of each channel of `name` along `axis`, when it was seen.
    pub fn get(&self, name: &str, axis: ReductionAxis) -> Option<&[u8]> {
        self.maxima.get(&(name.to_string(), axis))?.as_deref()
    }

    /// The same watch with nothing seen yet.
    pub fn cleared(&self) -> U8ChannelMaxima {
        U8ChannelMaxima { watch: self.watch.clone(), maxima: HashMap::new() }
    }

    /// Adds what `other` (a clone of the same watch) saw: channel by channel the larger value;
    /// a value dropped by either, or seen with two channel counts, is dropped.
    pub fn merge(&mut self, other: &U8ChannelMaxima) {
        for (k, theirs) in &other.maxima {
            let mine = self.maxima.entry(k.clone()).or_insert_with(|| theirs.clone());
            *mine = match (mine.take(), theirs) {
                (Some(a), Some(b)) if a.len() == b.len() => Some(a.iter().zip(b).map(|(x, y)| *x.max(y)).collect()),
                _ => None,
            };
        }
    }
}

impl qforge_runtime::Hooks for U8ChannelMaxima {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let axes = self.watch.get(event.name)?;
        let shape = value.shape();
        for &axis in axes {
            let slot = self.maxima.entry((event.name.to_string(), axis)).or_insert_with(|| Some(vec![]));
            let Some(m) = slot else { continue };
            let (Ok(data), Some(layout)) = (value.as_slice::<u8>(), AxisLayout::new(shape, Some(axis.index(shape.len())))) else {
                *slot = None;
                continue;
            };
            if data.is_empty() {
                continue;
            }
            if m.is_empty() {
                m.resize(layout.channels, 0);
            }
            if m.len() != layout.channels {
                *slot = None;
                continue;
            }
            layout.for_each_run(data, |c, run| m[c] = run.iter().fold(m[c], |acc, &v| acc.max(v)));
        }
        None
    }
}

/// Whether a reader's channel maxima set a reach: each channel seen at least
/// [`REACH_MIN_VALUES`] times.
fn measured(m: &MinMax) -> bool {
    !m.max.is_empty() && m.count >= REACH_MIN_VALUES * m.max.len() as u64
}

/// A pair-fitted reader in the main graph of a converted model: the u8 activation it reads
/// through DequantizeLinear, with that activation's qparams.
#[derive(Debug, Clone)]
pub struct QuantizedInput {
    pub node: NodeId,
    pub value: String,
    pub axis: ReductionAxis,
    pub qparams: QParams,
}

/// The per-input-channel extremes, over the calibration samples, of the activation every weight
/// with a `pair_sum_max` reads (Conv channels, the `K` columns of Gemm and MatMul), keyed by
/// (plan graph index, node): a per-channel [`MinMax`] observer each, so merging is exact in
/// any order. `None` marks a reader dropped (its input was not float or changed its channel
/// count); its weights then assume [`FULL_REACH`], as do those of a reader seen fewer than
/// [`REACH_MIN_VALUES`] times per channel.
#[derive(Debug, Clone, Default)]
pub struct InputMaxima {
    observed: BTreeMap<(usize, NodeId), Option<MinMax>>,
    /// (plan graph index, activation value) to the nodes reading it and their axes.
    watch: HashMap<(usize, ValueId), Vec<(NodeId, ReductionAxis)>>,
    paths: Vec<GraphPath>,
}

impl InputMaxima {
    /// Watches for every node of `plan` (graphs of `main`) whose constant weight (input 1) is
    /// quantized with a `pair_sum_max`.
    pub fn new(main: &Graph, plan: &QuantPlan) -> InputMaxima {
        let all = main.graphs();
        let mut me = InputMaxima { paths: plan.graphs.iter().map(|g| g.path.clone()).collect(), ..Default::default() };
        for (gi, gp) in plan.graphs.iter().enumerate() {
            let Some((_, g)) = all.iter().find(|(p, _)| *p == gp.path) else { continue };
            for (&id, ann) in &gp.annotations.nodes {
                let Ok(n) = g.node(id) else { continue };
                // Weights whose two largest magnitudes fit the limit (`--reduce-range`) need no reach.
                let paired = matches!(ann.inputs.get(1), Some(Some(Spec::Quantize(s)))
                    if s.pair_sum_max.is_some_and(|max| { let (lo, hi) = s.scheme.qrange(); 2 * lo.abs().max(hi.abs()) > max }));
                let (Some(x), Some(w)) = (n.input(0), n.input(1)) else { continue };
                if !paired || !g.value(w).is_ok_and(|v| v.is_constant()) {
                    continue;
                }
                let Some(axis) = ReductionAxis::of(n, false) else { continue };
                me.watch.entry((gi, x)).or_default().push((id, axis));
            }
        }
        me
    }

    /// Whether any node is watched.
    pub fn is_empty(&self) -> bool {
        self.watch.is_empty()
    }

    /// The values of the main graph whose maxima are collected.
    pub(crate) fn main_graph_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        main_graph_values(&self.paths, self.watch.keys())
    }

    /// Streams one produced value into the observers of the nodes reading it.
    pub(crate) fn observe(&mut self, event: &ValueEvent, value: &Tensor) {
        let Some(gi) = plan_graph_of(&self.paths, event) else { return };
        let Some(readers) = self.watch.get(&(gi, event.value)) else { return };
        let shape = value.shape();
        for &(id, axis) in readers {
            let axis = axis.index(shape.len());
            let slot = self.observed.entry((gi, id)).or_insert_with(|| Some(MinMax::new(Some(axis))));
            let kept = match (slot.as_mut(), value.as_slice::<f32>()) {
                (Some(m), Ok(data)) => m.observe(data, shape).is_ok(),
                _ => false,
            };
            if !kept {
                *slot = None;
            }
        }
    }

    /// Adds the observers of `other` (collected on other samples from a clone of the same
    /// empty state); a reader dropped by either, or seen with two channel counts, is dropped.
    pub fn merge(&mut self, other: &InputMaxima) {
        for (k, theirs) in &other.observed {
            let Some(mine) = self.observed.get_mut(k) else {
                self.observed.insert(*k, theirs.clone());
                continue;
            };
            let kept = match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => m.merge(t).is_ok(),
                _ => false,
            };
            if !kept {
                *mine = None;
            }
        }
    }

    /// The plan graph index of the main graph.
    fn main(&self) -> Option<usize> {
        self.paths.iter().position(|p| p.is_empty())
    }

    /// The observed readers of the main graph whose maxima set a reach ([`measured`]), in `q`
    /// (the main graph converted from the plan's, node ids kept): each with the u8 activation
    /// it reads through a per-tensor DequantizeLinear of constant qparams (a u8 zero point).
    /// Readers whose input is not so quantized are left out.
    pub fn quantized_inputs(&self, q: &Graph) -> Vec<QuantizedInput> {
        let Some(main) = self.main() else { return vec![] };
        let constant = |v: Option<ValueId>| v.and_then(|v| q.value(v).ok()?.initializer()?.to_f64_vec().ok()).filter(|x| x.len() == 1).map(|x| x[0]);
        self.observed.iter().filter(|((gi, _), m)| *gi == main && m.as_ref().is_some_and(measured)).filter_map(|(&(_, id), _)| {
            let n = q.node(id).ok()?;
            let (p, _) = q.producer(n.input(0)?)?;
            let dq = q.node(p).ok().filter(|d| d.op_type == "DequantizeLinear" && d.domain.is_empty())?;
            let x = dq.input(0)?;
            let zp = q.value(dq.input(2)?).ok()?.initializer()?;
            (zp.dtype() == qforge_ir::DType::U8).then_some(())?;
            let qparams = QParams { scale: constant(dq.input(1))? as f32, zero_point: constant(dq.input(2))? as i64 };
            Some(QuantizedInput { node: id, value: q.value_name(x).to_string(), axis: ReductionAxis::of(n, false)?, qparams })
        }).collect()
    }

    /// The channels of main-graph reader `input.node` whose u8 maxima in the quantized model,
    /// `u8max` (one per channel), went beyond their [`InputMaxima::reach`].
    pub fn beyond_reach(&self, input: &QuantizedInput, u8max: &[u8]) -> Vec<usize> {
        let Some(main) = self.main() else { return vec![] };
        match self.reach(main, input.node, input.qparams) {
            Some(reach) if reach.len() == u8max.len() => (0..reach.len()).filter(|&c| u8max[c] as i64 > reach[c]).collect(),
            _ => vec![],
        }
    }

    /// Raises the maxima of `channels` of main-graph reader `input.node` to what the quantized
    /// model's u8 maxima `u8max` stand for through the reader's qparams, so that the reach
    /// gives them its headroom too.
    pub fn raise(&mut self, input: &QuantizedInput, u8max: &[u8], channels: &[usize]) {
        let Some(main) = self.main() else { return };
        let Some(Some(m)) = self.observed.get_mut(&(main, input.node)) else { return };
        let len = m.max.len().min(u8max.len());
        for &c in channels.iter().filter(|&&c| c < len) {
            let value = ((u8max[c] as i64 - input.qparams.zero_point) as f64 * input.qparams.scale as f64) as f32;
            m.max[c] = m.max[c].max(value);
        }
    }

    /// The reach of each input channel of node `id` (plan graph `gi`) read through the u8
    /// qparams `x` ([`REACH_HEADROOM`], rounded up), at most [`FULL_REACH`]; `None` when the
    /// node was not observed, or seen fewer than [`REACH_MIN_VALUES`] times per channel.
    pub fn reach(&self, gi: usize, id: NodeId, x: QParams) -> Option<Vec<i64>> {
        let m = self.observed.get(&(gi, id))?.as_ref().filter(|m| measured(m))?;
        if !(x.scale > 0.0) {
            return None;
        }
        Some(m.max.iter().map(|&v| {
            let m = v.max(0.0) as f64 / x.scale as f64;
            let steps = (REACH_HEADROOM * m).max(m + REACH_MIN_STEPS).ceil();
            (x.zero_point as f64 + steps).clamp(0.0, FULL_REACH as f64) as i64
        }).collect())
    }
}

/// The input channel that weight element `e` of node `node` (weight shape `shape`) multiplies:
/// Conv `[M, C/g, k..]` its group's channel, Gemm and MatMul the row `k` of `B` (`[K, N]`, or
/// `[N, K]` with `transB`). `None` for other ops.
pub fn reduction_channel(node: &Node, shape: &[usize]) -> Option<Box<dyn Fn(usize) -> usize + Sync>> {
    match node.op_type.as_str() {
        "Conv" if shape.len() >= 3 => {
            let (m, cg, taps) = (shape[0], shape[1], shape[2..].iter().product::<usize>());
            let group = node.attr_int("group").unwrap_or(1).max(1) as usize;
            let per_group = (m / group).max(1);
            Some(Box::new(move |e| (e / (cg * taps) / per_group) * cg + (e / taps) % cg))
        }
        "Gemm" if shape.len() == 2 => {
            let (rows, cols) = (shape[0], shape[1]);
            let trans_b = node.attr_int("transB").unwrap_or(0) != 0;
            Some(if trans_b { Box::new(move |e| e % cols) } else { Box::new(move |e| (e / cols) % rows) })
        }
        "MatMul" if shape.len() >= 2 => {
            let (k, n) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            Some(Box::new(move |e| (e / n.max(1)) % k.max(1)))
        }
        _ => None,
    }
}

/// One parameter's elements as [`PairedWeight::pair_scales`] searches them: its `pairs` pairs'
/// values first (`[x, y]` after each other), then the values paired with no other element of it.
#[derive(Default)]
struct Members {
    values: Vec<f32>,
    pairs: usize,
    /// The reaches of each pair's two elements.
    reaches: Vec<[i64; 2]>,
    /// The largest `(r_x·|x| + r_y·|y|) / scale` of a same-sign pair.
    largest: f64,
}

/// The summed squared error of rounding each of `xs` to the grid of spacing `scale`, integers
/// (relative to the zero point) clamped to `[lo, hi]`; the integers go to `rounded`. The same
/// integers as [`crate::qparams::quantize`]: `x / scale` rounded half to even, then clamped.
/// Summed lane-wise in a fixed order, so the result is the same with or without AVX2.
fn rounding_error(xs: &[f32], scale: f32, lo: f32, hi: f32, rounded: &mut [f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn rounding_error_avx2(xs: &[f32], scale: f32, lo: f32, hi: f32, rounded: &mut [f32]) -> f64 {
            rounding_error_lanes(xs, scale, lo, hi, rounded)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { rounding_error_avx2(xs, scale, lo, hi, rounded) };
        }
    }
    rounding_error_lanes(xs, scale, lo, hi, rounded)
}

/// [`rounding_error`]'s body, written lane-wise so it vectorizes for whatever SIMD width the
/// caller is compiled for.
#[inline(always)]
fn rounding_error_lanes(xs: &[f32], scale: f32, lo: f32, hi: f32, rounded: &mut [f32]) -> f64 {
    const LANES: usize = 8;
    // Adding and subtracting 1.5 * 2^23 rounds half to even below 2^22 in magnitude, which the
    // clamp to one step outside [lo, hi] ensures without changing the clamped result. The
    // comparisons are written out so that they compile to min/max instructions.
    const SHIFT: f32 = 12_582_912.0;
    let (below, above) = (lo - 1.0, hi + 1.0);
    let round = |x: f32| {
        let t = x / scale;
        let t = if t > below { t } else { below };
        let t = if t < above { t } else { above };
        let r = (t + SHIFT) - SHIFT;
        let r = if r > lo { r } else { lo };
        if r < hi { r } else { hi }
    };
    let wide = scale as f64;
    let mut sums = [0f64; LANES];
    let whole = xs.len() / LANES * LANES;
    for (x, r) in xs[..whole].chunks_exact(LANES).zip(rounded[..whole].chunks_exact_mut(LANES)) {
        for k in 0..LANES {
            r[k] = round(x[k]);
            let d = x[k] as f64 - wide * r[k] as f64;
            sums[k] += d * d;
        }
    }
    for (k, (&x, r)) in xs[whole..].iter().zip(&mut rounded[whole..]).enumerate() {
        *r = round(x);
        let d = x as f64 - wide * *r as f64;
        sums[k] += d * d;
    }
    sums.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qparams::quantize;

    fn conv(group: i64) -> Node {
        Node::new("Conv", "c").with_attr("group", qforge_ir::Attr::Int(group))
    }

    #[test]
    fn channels_beyond_their_reach_in_the_quantized_model_are_raised_through_the_zero_point() {
        // Zero point 128, scale 1/8; calibrated channel maxima 1.25 and 6.25 are 10 and 50 steps,
        // so the reaches are 128 + max(1.25·10, 10 + 16) = 154 and 128 + max(62.5, 66) = 194.
        let mut m = MinMax::new(Some(1));
        m.min = vec![0.0, 0.0];
        m.max = vec![1.25, 6.25];
        m.count = 2 * REACH_MIN_VALUES - 1;
        let node = NodeId(3);
        let mut maxima = InputMaxima { observed: BTreeMap::from([((0, node), Some(m))]), watch: HashMap::new(), paths: vec![vec![]] };
        let input = QuantizedInput { node, value: "x_q".into(), axis: ReductionAxis::Index(1), qparams: QParams { scale: 0.125, zero_point: 128 } };
        assert_eq!(maxima.reach(0, node, input.qparams), None, "a channel seen fewer than REACH_MIN_VALUES times sets no reach");
        if let Some(Some(m)) = maxima.observed.get_mut(&(0, node)) {
            m.count += 1;
        }
        assert_eq!(maxima.reach(0, node, input.qparams), Some(vec![154, 194]));
        // The quantized model reached 150 and 200: only the second channel is beyond its reach.
        let u8max = [150u8, 200];
        let beyond = maxima.beyond_reach(&input, &u8max);
        assert_eq!(beyond, vec![1]);
        maxima.raise(&input, &u8max, &beyond);
        // (200 - 128) / 8 = 9 is 72 steps: 128 + max(90, 88) = 218.
        assert_eq!(maxima.reach(0, node, input.qparams), Some(vec![154, 218]));
        assert!(maxima.beyond_reach(&input, &u8max).is_empty());
    }

    #[test]
    fn u8_channel_maxima_follow_the_axis_and_merge_by_maximum() {
        use qforge_runtime::Hooks;
        let event = |name: &'static str| ValueEvent { node: None, output: 0, value: ValueId(0), name, path: &[] };
        let watch = || U8ChannelMaxima::new([("x".to_string(), ReductionAxis::Index(1)), ("x".to_string(), ReductionAxis::Last), ("f".to_string(), ReductionAxis::Last)]);
        // [1, 2, 3]: channel 0 holds 1, 9, 3 and channel 1 holds 4, 5, 6.
        let x = Tensor::from_vec(&[1, 2, 3], vec![1u8, 9, 3, 4, 5, 6]).unwrap();
        let mut a = watch();
        a.on_value(&event("x"), &x);
        a.on_value(&event("f"), &Tensor::from_vec(&[2], vec![1f32, 2.0]).unwrap());
        assert_eq!(a.get("x", ReductionAxis::Index(1)), Some(&[9u8, 6][..]));
        assert_eq!(a.get("x", ReductionAxis::Last), Some(&[4u8, 9, 6][..]));
        assert_eq!(a.get("f", ReductionAxis::Last), None, "a float value is not an activation of u8 kernels");
        let mut b = a.cleared();
        b.on_value(&event("x"), &Tensor::from_vec(&[1, 2, 3], vec![10u8, 0, 0, 0, 0, 0]).unwrap());
        a.merge(&b);
        assert_eq!(a.get("x", ReductionAxis::Index(1)), Some(&[10u8, 6][..]));
        let mut c = watch();
        c.on_value(&event("x"), &Tensor::from_vec(&[1, 3, 1], vec![1u8, 2, 3]).unwrap());
        a.merge(&c);
        assert_eq!(a.get("x", ReductionAxis::Index(1)), None, "seen with 2 and 3 channels");
    }

    #[test]
    fn conv_pairs_follow_the_order_measured_in_onnx_runtime() {
        // Measured with ONNX Runtime 1.31 on an AVX2 CPU (QLinearConv, 3 input channels, 3x3
        // kernel, inputs at 255): the pairs of OIHW taps at 127 whose output saturates.
        let measured = [[0, 9], [1, 18], [2, 11], [3, 20], [4, 13], [5, 22], [6, 15], [7, 24], [8, 17], [10, 19], [12, 21], [14, 23], [16, 25]];
        let mut got = reduction_pairs(&conv(1), &[8, 3, 3, 3]).unwrap()[..13].to_vec();
        got.iter_mut().for_each(|p| p.sort());
        got.sort();
        assert_eq!(got, measured);
        // Grouped (8 channels, 2 groups): pairs stay within a group's 4 input channels.
        let grouped = reduction_pairs(&conv(2), &[8, 4, 3, 3]).unwrap();
        assert!(grouped[..18].iter().all(|&[a, b]| b == a + 9), "{:?}", &grouped[..18]);
        // Depthwise with one output per group sums in 32 bits; with two it pairs taps.
        assert!(reduction_pairs(&conv(4), &[4, 1, 3, 3]).is_none());
        assert_eq!(reduction_pairs(&conv(4), &[8, 1, 3, 3]).unwrap()[..2], [[0, 1], [2, 3]]);
    }

    #[test]
    fn gemm_and_matmul_pair_neighbours_along_the_input_dimension() {
        let gemm = Node::new("Gemm", "g");
        assert_eq!(reduction_pairs(&gemm, &[4, 3]).unwrap(), vec![[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]);
        let transposed = gemm.with_attr("transB", qforge_ir::Attr::Int(1));
        assert_eq!(reduction_pairs(&transposed, &[2, 5]).unwrap(), vec![[0, 1], [2, 3], [5, 6], [7, 8]]);
        let matmul = Node::new("MatMul", "m");
        assert_eq!(reduction_pairs(&matmul, &[2, 2, 2]).unwrap(), vec![[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert!(reduction_pairs(&Node::new("ConvTranspose", "t"), &[4, 8, 2, 2]).is_none());
    }

    fn weight<'a>(data: &'a [f32], pairs: &'a [[usize; 2]], param_of: &'a (dyn Fn(usize) -> usize + Sync)) -> PairedWeight<'a> {
        PairedWeight { data, param_of, range: (-128, 127), pairs, max: 128, reach: &|_| FULL_REACH }
    }

    #[test]
    fn pairs_over_the_constraint_are_projected_onto_it_by_least_squares() {
        let data = [1.27f32, 1.27, 1.27, 0.10, -1.0, -0.9, 1.27, -1.27];
        let pairs = [[0, 1], [2, 3], [4, 5], [6, 7]];
        let p = [QParams { scale: 0.01, zero_point: 0 }];
        let mut q: Vec<i64> = vec![127, 127, 127, 10, -100, -90, 127, -127];
        assert_eq!(weight(&data, &pairs, &|_| 0).project_pairs(&mut q, &p), 3);
        // Each over-the-limit pair lands on |a| + |b| = 128, both moved by the same amount
        // (to within rounding); opposite signs cannot saturate and stay.
        assert_eq!(q, vec![64, 64, 123, 5, -69, -59, 127, -127]);
    }

    #[test]
    fn pairs_are_bounded_by_the_reach_of_the_activations_they_multiply() {
        // Three pairs at (127, 127). Against activations reaching 100, 100·254 = 25400 fits
        // 255·128 = 32640 as it is; against 200 the pair lands on 200·(|a| + |b|) <= 32640
        // (at most 163 together, tight); against 255 and 50 the element read against the far
        // reaching activation gives up more (least squares on the weighted constraint).
        let data = [1.27f32; 6];
        let pairs = [[0, 1], [2, 3], [4, 5]];
        let reach = |e: usize| [100, 100, 200, 200, 255, 50][e];
        let p = [QParams { scale: 0.01, zero_point: 0 }];
        let w = PairedWeight { data: &data, param_of: &|_| 0, range: (-128, 127), pairs: &pairs, max: 128, reach: &reach };
        let mut q = vec![127i64; 6];
        assert_eq!(w.project_pairs(&mut q, &p), 2);
        assert_eq!(q[..2], [127, 127]);
        assert!(200 * (q[2] + q[3]) <= 32640 && 200 * (q[2] + q[3] + 1) > 32640, "{q:?}");
        assert!(255 * q[4] + 50 * q[5] <= 32640 && q[5] > q[4], "{q:?}");
        // A far-reaching element next to a barely reaching one: shaving the first by two steps
        // costs less than cutting the second by a fifth. A reach of zero (with a limit below
        // the largest weight, as a backend file may declare) constrains only the other element.
        let skew = |e: usize| [255, 5][e % 2];
        let mut q = vec![127i64; 2];
        PairedWeight { pairs: &pairs[..1], reach: &skew, ..w }.project_pairs(&mut q, &p);
        assert_eq!(q, [125, 127]);
        let zero = |e: usize| [255, 0][e % 2];
        let mut q = vec![127i64; 2];
        PairedWeight { pairs: &pairs[..1], reach: &zero, max: 100, ..w }.project_pairs(&mut q, &p);
        assert_eq!(q, [100, 127]);
        // The scale search sees the same constraint: at reach 100 nothing needs a rise.
        let low = |_| 100;
        let w = PairedWeight { reach: &low, ..w };
        assert_eq!(w.pair_scales(&p), [1.0]);
    }

    #[test]
    fn channels_take_the_scale_rise_or_the_projection_with_the_least_error() {
        // Channel 0: eight equal weights, every pair at 254 under min/max: the scale doubles
        // (less error than halving every weight). Channel 1: one large weight next to small
        // ones: the scale rises just enough for that pair (less error than shaving the large
        // weight by a few levels). Channel 2: the same pair among 4000 small weights, whose
        // rounding error a coarser scale raises more: part rise, part projection.
        let small = |n: usize| (0..n).map(|i| ((i * 7919) % 1000) as f32 / 2000.0 - 0.25);
        let data: Vec<f32> = [vec![1.0f32; 8], vec![1.0, 0.04, 0.02, -0.03, 0.04, 0.01, -0.02, 0.03], [1.0, 0.04].into_iter().chain(small(3998)).collect()].concat();
        let pairs: Vec<[usize; 2]> = (0..data.len() / 2).map(|j| [2 * j, 2 * j + 1]).collect();
        let params = [QParams { scale: 1.0 / 127.0, zero_point: 0 }; 3];
        let param_of = |e: usize| (e / 8).min(2);
        let w = weight(&data, &pairs, &param_of);
        let f = w.pair_scales(&params);
        assert!((f[0] - 254.0 / 128.0).abs() < 1e-4, "{f:?}");
        assert!((f[1] - 1.04 * 127.0 / 128.0).abs() < 1e-4, "{f:?}");
        assert!(f[2] > 1.0 && f[2] < f[1] - 0.01, "{f:?}");
        let mut q: Vec<i64> = data.iter().map(|&x| quantize(x, params[0], -128, 127)).collect();
        assert_eq!(q[16..18], [127, 5]);
        assert_eq!(w.project_pairs(&mut q, &params), 6, "four pairs of channel 0, one of channels 1 and 2");
        assert_eq!(q[16..18], [125, 3]);
    }

    /// [`PairedWeight::pair_scales`] as its contract states it, element by element.
    fn pair_scales_by_definition(w: &PairedWeight, params: &[QParams]) -> Vec<f32> {
        (0..params.len()).map(|p| {
            let pairs: Vec<[usize; 2]> = w.pairs.iter().copied().filter(|&[a, b]| (w.param_of)(a) == p && (w.param_of)(b) == p).collect();
            let paired: std::collections::HashSet<usize> = w.pairs.iter().flatten().copied().collect();
            let singles: Vec<usize> = (0..w.data.len()).filter(|&e| (w.param_of)(e) == p && !paired.contains(&e)).collect();
            let error = |scale: f32| {
                let q = QParams { scale, zero_point: params[p].zero_point };
                let near = |e: usize| quantize(w.data[e], q, w.range.0, w.range.1);
                let err = |e: usize, v: i64| (w.data[e] as f64 - scale as f64 * (v - q.zero_point) as f64).powi(2);
                let mut over = false;
                let mut total = singles.iter().map(|&e| err(e, near(e))).sum::<f64>();
                for &[a, b] in &pairs {
                    let fitted = w.fit([a, b], near(a), near(b), q, q);
                    over |= fitted != (near(a), near(b));
                    total += err(a, fitted.0) + err(b, fitted.1);
                }
                (total, over)
            };
            if !error(params[p].scale).1 {
                return 1.0;
            }
            let largest = pairs.iter().map(|&[a, b]| (w.data[a] as f64, w.data[b] as f64)).filter(|(x, y)| x * y > 0.0).map(|(x, y)| (x.abs() + y.abs()) / params[p].scale as f64).fold(0.0, f64::max);
            let top = (largest / w.max as f64).max(1.0);
            let factors: Vec<f64> = (0..=SCALE_STEPS).map(|k| 1.0 + (top - 1.0) * k as f64 / SCALE_STEPS as f64).collect();
            let errors: Vec<f64> = factors.iter().map(|&f| error((params[p].scale as f64 * f) as f32).0).collect();
            factors[(0..factors.len()).fold(0, |b, k| if errors[k] < errors[b] { k } else { b })] as f32
        }).collect()
    }

    #[test]
    fn the_search_finds_the_factors_its_definition_gives() {
        // Per-channel Conv weights [16, 6, 3, 3] with heavy-tailed values (many pairs over the
        // limit), a channel of zeros, and one odd-sized reduction so that singles exist.
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut uniform = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let (m, k) = (16, 6 * 9 + 1);
        let mut data: Vec<f32> = (0..m * k).map(|_| { let u = uniform() * 2.0 - 1.0; (u * u * u) as f32 }).collect();
        data[3 * k..4 * k].fill(0.0);
        let pairs: Vec<[usize; 2]> = (0..m).flat_map(|o| (0..k / 2).map(move |j| [o * k + 2 * j, o * k + 2 * j + 1])).collect();
        let param_of = move |e: usize| e / k;
        let params: Vec<QParams> = (0..m).map(|o| {
            let absmax = data[o * k..(o + 1) * k].iter().fold(0f32, |a, x| a.max(x.abs()));
            QParams { scale: if absmax > 0.0 { absmax / 127.0 } else { 1.0 }, zero_point: 0 }
        }).collect();
        let w = weight(&data, &pairs, &param_of);
        let fast = w.pair_scales(&params);
        assert_eq!(fast, pair_scales_by_definition(&w, &params));
        assert!(fast.iter().filter(|&&f| f > 1.0).count() >= m / 2, "most channels need a rise: {fast:?}");
        assert_eq!(fast[3], 1.0);
    }
}
