//! GPTQ weight rounding (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for
//! Generative Pre-trained Transformers", Algorithm 1, after the Optimal Brain Quantizer of
//! Frantar & Alistarh 2022, "Optimal Brain Compression", which evaluates it on CNNs).
//!
//! Rounding every weight to its nearest grid point minimizes the weight error, not the
//! layer's output error. For one output channel with float weights `w` (the `K` weights one
//! output reads: a Conv's `C/groups × kh × kw` taps, a Gemm's input columns), integer weights
//! `q` with dequantized values `ŵ`, and inputs `x` (a Conv's patches), the output error over
//! the calibration data is `E[((w − ŵ)·x)²] = (w − ŵ)ᵀ H (w − ŵ)` with `H = E[x xᵀ]`.
//! GPTQ quantizes the `K` weights one at a time, in decreasing order of `H`'s diagonal (the
//! paper's act-order), and after each one moves the weights not yet quantized by the
//! least-squares compensation of its rounding error (`δ = −e · H⁻¹[:, j] / H⁻¹[j, j]` on the
//! remaining set, computed through the Cholesky factor of `H⁻¹`). The scales and zero points
//! are those the weight range chose (min/max or `--weight-range mse`); only the integers change,
//! clamped to the type's range.
//!
//! `H` is estimated during calibration, in the same runs as the observers, by [`InputGrams`]:
//! per sample and node, output positions spread evenly over the sample (enough for
//! [`VECTORS_PER_INPUT`] vectors per input over the calibration set, at most
//! [`POSITIONS_PER_SAMPLE`]; a Conv's patches are zero-padded as the Conv pads), their
//! products summed in fixed point so the result does not depend on how samples were split
//! across workers. From `N` vectors of `K` inputs, `H`'s off-diagonal entries are shrunk by
//! `N / (N + K)` (few vectors per input fall back towards nearest rounding rather than fit the
//! calibration set), and `H` is damped by 1 % of its mean diagonal before the factorization,
//! as in the paper.
//!
//! Rounded: Conv and ConvTranspose (1-D and 2-D, any group count; ConvTranspose with explicit
//! pads), Gemm, and MatMul with a constant 2-D weight, when the weight is quantized per tensor,
//! per output channel or per block along the input. The rest keep nearest rounding and are
//! listed with the reason. The constant inputs of elementwise ops (Add, Mul, ...) are not
//! weights here: each of their values reaches its outputs alone, so nearest rounding is already
//! the least-error choice.

use std::collections::{BTreeMap, HashMap};

use qforge_ir::{Graph, GraphPath, Node, NodeId, Tensor, ValueId};
use qforge_runtime::kernels::gemm::{sgemm, MatRef};
use qforge_runtime::ValueEvent;
use rayon::prelude::*;

use crate::bias_correction::{plan_graph_of, ConvWindow, Pads};
use crate::prepare::QuantPlan;
use crate::spec::Spec;
use crate::QType;

/// How weights are rounded to their quantization grid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightRounding {
    /// GPTQ for weights of at most 4 bits, where nearest rounding loses accuracy; nearest
    /// rounding for wider ones, where GPTQ's gain is within noise for its cost.
    #[default]
    Auto,
    /// Each weight to its nearest grid point.
    Nearest,
    /// GPTQ: one input at a time, compensating each rounding error on the inputs not yet
    /// rounded, for the least output error on the calibration data.
    Gptq,
}

impl WeightRounding {
    /// Whether a weight of type `qtype` is rounded by GPTQ.
    pub fn gptq_for(self, qtype: QType) -> bool {
        match self {
            WeightRounding::Auto => matches!(qtype, QType::S4 | QType::U4),
            WeightRounding::Nearest => false,
            WeightRounding::Gptq => true,
        }
    }
}

/// Most bytes of fixed-point sums [`InputGrams`] holds (per calibration worker); the nodes
/// past it, in node order, keep nearest rounding.
pub const MAX_SUM_BYTES: usize = 768 << 20;

/// Most output positions (Conv) or rows (Gemm, MatMul) sampled per calibration sample and
/// node.
pub const POSITIONS_PER_SAMPLE: usize = 512;

/// Input vectors sampled per input of a node over the whole calibration set (at least one
/// position per sample, at most [`POSITIONS_PER_SAMPLE`]): `H` has `K²` entries, and 64·K
/// vectors estimate it well after shrinkage and damping.
pub const VECTORS_PER_INPUT: usize = 64;

/// Widest input (`K`) a node may read to be rounded: `H` holds `K²` sums.
pub const MAX_WIDTH: usize = 4608;

/// Fractional bits of the fixed-point sums.
const FRAC_BITS: i32 = 32;

/// How a rounded node reads its activation input.
#[derive(Debug, Clone, PartialEq)]
enum Reader {
    /// A convolution: patches of `channels / groups` channels, one `H` per group.
    Conv { window: ConvWindow, groups: usize },
    /// A transposed convolution with explicit pads: per output position, the `channels /
    /// groups × kh × kw` products that reach it (zero for the taps that do not), one `H` per
    /// group.
    Transposed { window: ConvWindow, groups: usize, output_padding: [usize; 2] },
    /// Gemm input A (`[M, K]`, `[K, M]` when transposed) or MatMul input A (`[..., K]`): rows.
    Rows { transposed: bool },
}

/// The input statistics of one rounded node.
#[derive(Debug, Clone)]
struct NodeGram {
    reader: Reader,
    /// Inputs per output (`K`).
    width: usize,
    /// Positions sampled per calibration sample.
    positions: usize,
    /// Per group, the upper triangle of `Σ x xᵀ` in fixed point, row by row.
    sums: Vec<i128>,
    /// Input vectors summed over.
    count: u64,
    /// Set when an input arrived in a layout the reader cannot use.
    unusable: Option<String>,
}

/// Index of `(i, j)`, `i ≤ j`, in the row-by-row upper triangle of a `k × k` matrix.
fn upper(k: usize, i: usize, j: usize) -> usize {
    i * (2 * k - i + 1) / 2 + (j - i)
}

/// The second moments `Σ x xᵀ` of the inputs of every node GPTQ rounds, keyed by (plan graph
/// index, node), filled during calibration; plus the weighted nodes it cannot round, with why.
#[derive(Debug, Clone, Default)]
pub struct InputGrams {
    nodes: BTreeMap<(usize, NodeId), NodeGram>,
    /// (plan graph index, activation value) to the nodes reading it.
    watch: HashMap<(usize, ValueId), Vec<NodeId>>,
    paths: Vec<GraphPath>,
    /// Weighted nodes left at nearest rounding: (plan graph index, node, reason).
    pub skipped: Vec<(usize, NodeId, String)>,
}

/// How node `n` reads its input and its `K`, or why GPTQ does not round it.
fn reader_of(g: &Graph, n: &Node) -> Result<(Reader, usize), String> {
    let weight = n.input(1).and_then(|w| g.value(w).ok()).and_then(|v| v.initializer()).ok_or("the weight is not a constant")?;
    let ws = weight.shape();
    let (reader, width) = match n.op_type.as_str() {
        "Conv" => {
            let window = ConvWindow::of(n, ws)?;
            let groups = n.attr_int("group").unwrap_or(1);
            if groups < 1 || ws[0] % groups as usize != 0 {
                return Err("the group count does not divide the output channels".into());
            }
            (Reader::Conv { window, groups: groups as usize }, ws[1..].iter().product())
        }
        "ConvTranspose" => {
            let window = ConvWindow::of(n, ws)?;
            let groups = n.attr_int("group").unwrap_or(1);
            if groups < 1 || ws[0] % groups as usize != 0 {
                return Err("the group count does not divide the input channels".into());
            }
            if n.attr_ints("output_shape").is_some() || !matches!(window.pads, Pads::Explicit(_)) {
                return Err("GPTQ rounds ConvTranspose with explicit pads only (no output_shape or auto_pad)".into());
            }
            let pad = n.attr_ints("output_padding").map_or(Some(vec![0; window.spatial]), |p| (p.len() == window.spatial && p.iter().all(|&v| v >= 0)).then(|| p.iter().map(|&v| v as usize).collect()));
            let pad = pad.ok_or("bad output_padding")?;
            let output_padding = if window.spatial == 1 { [0, pad[0]] } else { [pad[0], pad[1]] };
            (Reader::Transposed { window, groups: groups as usize, output_padding }, ws[0] / groups as usize * ws[2..].iter().product::<usize>())
        }
        "Gemm" if ws.len() == 2 => {
            let trans_b = n.attr_int("transB").unwrap_or(0) != 0;
            (Reader::Rows { transposed: n.attr_int("transA").unwrap_or(0) != 0 }, if trans_b { ws[1] } else { ws[0] })
        }
        "MatMul" if ws.len() == 2 => (Reader::Rows { transposed: false }, ws[0]),
        "Gemm" | "MatMul" => return Err(format!("the weight has rank {}, not 2", ws.len())),
        op => return Err(format!("GPTQ does not round {op} weights")),
    };
    if width == 0 || width > MAX_WIDTH {
        return Err(format!("each output reads {width} inputs (GPTQ rounds 1 to {MAX_WIDTH})"));
    }
    Ok((reader, width))
}

impl InputGrams {
    /// The values of the main graph whose statistics are collected.
    pub(crate) fn main_graph_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        crate::bias_correction::main_graph_values(&self.paths, self.watch.keys())
    }

    /// Empty statistics for every Conv, ConvTranspose, Gemm and MatMul of `plan` (whose graphs
    /// are those of `main`, in [`Graph::graphs`] order) with a quantized constant weight at
    /// input 1, for calibration on
    /// `samples` samples: Conv, Gemm and MatMul get a watch on their activation input, the
    /// others are listed in [`InputGrams::skipped`].
    pub fn new(main: &Graph, plan: &QuantPlan, samples: usize, rounding: WeightRounding) -> InputGrams {
        let all = main.graphs();
        let mut me = InputGrams { paths: plan.graphs.iter().map(|g| g.path.clone()).collect(), ..Default::default() };
        let mut bytes = 0;
        for (gi, gp) in plan.graphs.iter().enumerate() {
            let Some((_, g)) = all.iter().find(|(p, _)| *p == gp.path) else { continue };
            for (&id, ann) in &gp.annotations.nodes {
                let Ok(n) = g.node(id) else { continue };
                let product = matches!(n.op_type.as_str(), "Conv" | "ConvTranspose" | "Gemm" | "MatMul") && n.domain.is_empty();
                let Some(Some(Spec::Quantize(spec))) = ann.inputs.get(1).filter(|_| product) else { continue };
                let weighted = rounding.gptq_for(spec.scheme.qtype) && n.input(1).is_some_and(|w| g.value(w).is_ok_and(|v| v.is_constant()));
                let Some(x) = n.input(0).filter(|_| weighted) else { continue };
                match reader_of(g, n) {
                    Ok((reader, width)) => {
                        let groups = match reader {
                            Reader::Conv { groups, .. } | Reader::Transposed { groups, .. } => groups,
                            Reader::Rows { .. } => 1,
                        };
                        let need = groups * width * (width + 1) / 2 * std::mem::size_of::<i128>();
                        if bytes + need > MAX_SUM_BYTES {
                            me.skipped.push((gi, id, format!("its input second moments ({} MiB) would pass the {} MiB budget of GPTQ's statistics", need >> 20, MAX_SUM_BYTES >> 20)));
                            continue;
                        }
                        bytes += need;
                        let positions = (VECTORS_PER_INPUT * width).div_ceil(samples.max(1)).clamp(1, POSITIONS_PER_SAMPLE);
                        me.nodes.insert((gi, id), NodeGram { reader, width, positions, sums: vec![], count: 0, unusable: None });
                        me.watch.entry((gi, x)).or_default().push(id);
                    }
                    Err(why) => me.skipped.push((gi, id, why)),
                }
            }
        }
        me
    }

    /// Whether any node is watched.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Whether node `id` of plan graph `gi` is watched (GPTQ rounds it, or says why not).
    pub fn watches(&self, gi: usize, id: NodeId) -> bool {
        self.nodes.contains_key(&(gi, id))
    }

    /// Adds the statistics of `other` (collected on other samples, from a clone of the same
    /// empty state). Exact, so the order of merges does not matter.
    pub fn merge(&mut self, other: &InputGrams) {
        for (k, theirs) in &other.nodes {
            let Some(mine) = self.nodes.get_mut(k) else { continue };
            if mine.sums.is_empty() {
                mine.sums = vec![0; theirs.sums.len()];
            }
            if mine.sums.len() == theirs.sums.len() {
                for (a, b) in mine.sums.iter_mut().zip(&theirs.sums) {
                    *a += b;
                }
            } else if !theirs.sums.is_empty() && mine.unusable.is_none() {
                mine.unusable = Some("the input changed its channel count between samples".into());
            }
            mine.count += theirs.count;
            if mine.unusable.is_none() {
                mine.unusable.clone_from(&theirs.unusable);
            }
        }
    }

    /// Streams one produced value into the nodes reading it.
    pub(crate) fn observe(&mut self, event: &ValueEvent, value: &Tensor) {
        let Some(gi) = plan_graph_of(&self.paths, event) else { return };
        let Some(readers) = self.watch.get(&(gi, event.value)) else { return };
        for id in readers.clone() {
            let m = self.nodes.get_mut(&(gi, id)).expect("watched nodes have statistics");
            if m.unusable.is_some() {
                continue;
            }
            let Ok(data) = value.as_slice::<f32>() else {
                m.unusable = Some(format!("input '{}' holds {} data", event.name, value.dtype()));
                continue;
            };
            let columns = match &m.reader {
                Reader::Conv { window, groups } => conv_patches(data, value.shape(), window, *groups, m.width, m.positions),
                Reader::Transposed { window, groups, output_padding } => transposed_patches(data, value.shape(), window, *groups, *output_padding, m.width, m.positions),
                Reader::Rows { transposed } => rows(data, value.shape(), *transposed, m.width, m.positions),
            };
            match columns {
                Ok((groups, positions)) => {
                    let k = m.width;
                    let tri = k * (k + 1) / 2;
                    if m.sums.is_empty() {
                        m.sums = vec![0; groups.len() * tri];
                    }
                    if m.sums.len() != groups.len() * tri {
                        m.unusable = Some(format!("input '{}' changed its channel count between samples", event.name));
                        continue;
                    }
                    let mut gram = vec![0f32; k * k];
                    for (x, sums) in groups.iter().zip(m.sums.chunks_exact_mut(tri)) {
                        gram_of(x, k, positions, &mut gram);
                        add_upper(&gram, k, sums);
                    }
                    m.count += positions as u64;
                }
                Err(why) => m.unusable = Some(format!("input '{}': {why}", event.name)),
            }
        }
    }

    /// `H = E[x xᵀ]` of node `id` of plan graph `gi`, one `K × K` matrix (row-major) per group,
    /// or why there is none. Estimated from `N` input vectors, its off-diagonal entries are
    /// shrunk by `N / (N + K)` towards the diagonal: with few vectors per input (an SE block's
    /// 1x1 convs see one per sample) the sample moments are rank-deficient and would let GPTQ
    /// fit the calibration set; with a diagonal `H`, GPTQ is nearest rounding.
    fn hessians(&self, gi: usize, id: NodeId) -> Result<Vec<Vec<f64>>, String> {
        let m = self.nodes.get(&(gi, id)).ok_or("not watched")?;
        if let Some(why) = &m.unusable {
            return Err(why.clone());
        }
        if m.count == 0 || m.sums.is_empty() {
            return Err("its input was not seen during calibration".into());
        }
        let k = m.width;
        let scale = f64::powi(2.0, -FRAC_BITS) / m.count as f64;
        let kept = m.count as f64 / (m.count as f64 + k as f64);
        Ok(m.sums.chunks_exact(k * (k + 1) / 2).map(|s| {
            let mut h = vec![0f64; k * k];
            for i in 0..k {
                for j in i..k {
                    let v = s[upper(k, i, j)] as f64 * scale * if i == j { 1.0 } else { kept };
                    h[i * k + j] = v;
                    h[j * k + i] = v;
                }
            }
            h
        }).collect())
    }

    /// Rounds the weight of node `id` (plan graph `gi`): `w` is the float weight of shape
    /// `w_shape` in its ONNX layout, on `grid`. Returns the integers in `w`'s layout, and the
    /// output error proxy `Σ (w − ŵ)ᵀ H (w − ŵ)` (summed over outputs) of nearest rounding and
    /// of GPTQ's; `Err`: why the node keeps nearest rounding.
    pub fn round(&self, gi: usize, id: NodeId, node: &Node, w: &[f32], w_shape: &[usize], grid: &Grid) -> Result<Rounded, String> {
        let (param, (qmin, qmax)) = (&grid.param, grid.range);
        let hs = self.hessians(gi, id)?;
        let m = &self.nodes[&(gi, id)];
        let k = m.width;
        // Element index of (output, input) for each output row.
        let (outputs, index): (usize, Box<dyn Fn(usize, usize) -> usize + Sync>) = match &m.reader {
            Reader::Conv { .. } => (w_shape[0], Box::new(move |o, i| o * k + i)),
            Reader::Transposed { window, groups, .. } => {
                // Weight [C, M/groups, kh, kw]; output o of group g reads input channel
                // g·C/groups + c through taps t at ((g·C/groups + c)·M/groups + o mod M/groups)·taps + t.
                let (taps, per_out, per_in) = (window.kernel[0] * window.kernel[1], w_shape[1], w_shape[0] / groups);
                (per_out * groups, Box::new(move |o, i| (((o / per_out) * per_in + i / taps) * per_out + o % per_out) * taps + i % taps))
            }
            Reader::Rows { .. } => {
                let trans_b = node.op_type == "Gemm" && node.attr_int("transB").unwrap_or(0) != 0;
                if trans_b {
                    (w_shape[0], Box::new(move |o, i| o * k + i))
                } else {
                    let n = w_shape[1];
                    (n, Box::new(move |o, i| i * n + o))
                }
            }
        };
        if outputs * k != w.len() || outputs % hs.len() != 0 {
            return Err(format!("the weight shape {w_shape:?} does not match the {} input(s) per output seen in calibration", k));
        }
        let per_group = outputs / hs.len();
        let mut values = vec![0i64; w.len()];
        let (mut nearest_error, mut rounded_error) = (0f64, 0f64);
        for (gidx, h) in hs.iter().enumerate() {
            let rows: Vec<usize> = (gidx * per_group..(gidx + 1) * per_group).collect();
            let weights: Vec<Vec<f64>> = rows.iter().map(|&o| (0..k).map(|i| w[index(o, i)] as f64).collect()).collect();
            let grid = |r: usize, i: usize, x: f64| -> (i64, f64) {
                let (s, z) = param(index(rows[r], i));
                let q = if s > 0.0 { ((x / s as f64).round_ties_even() as i64 + z).clamp(qmin, qmax) } else { z };
                (q, (q - z) as f64 * s as f64)
            };
            let q = gptq(&weights, h, k, &grid)?;
            let errors: Vec<(f64, f64)> = rows.par_iter().enumerate().map(|(r, &o)| {
                let near: Vec<f64> = (0..k).map(|i| weights[r][i] - grid(r, i, weights[r][i]).1).collect();
                let gptq_err: Vec<f64> = (0..k).map(|i| {
                    let (s, z) = param(index(o, i));
                    weights[r][i] - (q[r][i] - z) as f64 * s as f64
                }).collect();
                (quadratic(h, k, &near), quadratic(h, k, &gptq_err))
            }).collect();
            for (r, &o) in rows.iter().enumerate() {
                nearest_error += errors[r].0;
                rounded_error += errors[r].1;
                for i in 0..k {
                    values[index(o, i)] = q[r][i];
                }
            }
        }
        Ok(Rounded { values, nearest_error, rounded_error })
    }
}

/// The quantization grid of a weight: each element's `(scale, zero point)` by its index in the
/// weight, and the integer range.
pub struct Grid<'a> {
    pub param: Box<dyn Fn(usize) -> (f32, i64) + Sync + 'a>,
    pub range: (i64, i64),
}

/// A weight rounded by GPTQ, with the output error proxy `Σ (w − ŵ)ᵀ H (w − ŵ)` of nearest
/// rounding and of GPTQ's.
#[derive(Debug, Clone)]
pub struct Rounded {
    pub values: Vec<i64>,
    pub nearest_error: f64,
    pub rounded_error: f64,
}

/// `eᵀ H e`.
fn quadratic(h: &[f64], k: usize, e: &[f64]) -> f64 {
    (0..k).map(|i| e[i] * dot(&h[i * k..][..k], e)).sum()
}

/// Lower Cholesky factor `L` of a symmetric positive definite `k × k` matrix (`A = L Lᵀ`), or
/// `None` when a pivot is not positive.
fn cholesky(a: &[f64], k: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; k * k];
    for i in 0..k {
        for j in 0..=i {
            let s = a[i * k + j] - dot(&l[i * k..][..j], &l[j * k..][..j]);
            if i == j {
                if s <= 0.0 || !s.is_finite() {
                    return None;
                }
                l[i * k + i] = s.sqrt();
            } else {
                l[i * k + j] = s / l[j * k + j];
            }
        }
    }
    Some(l)
}

/// The inverse of `A = L Lᵀ` from its lower Cholesky factor.
fn inverse_from_cholesky(l: &[f64], k: usize) -> Vec<f64> {
    // Row i of L⁻¹ is (e_i − Σ_{p<i} L[i][p] · row p of L⁻¹) / L[i][i]; then A⁻¹ = L⁻ᵀ L⁻¹,
    // summed row by row of L⁻¹.
    let mut li = vec![0f64; k * k];
    for i in 0..k {
        let (done, rest) = li.split_at_mut(i * k);
        let row = &mut rest[..k];
        row[i] = 1.0;
        for p in 0..i {
            let f = l[i * k + p];
            for (r, &v) in row[..=p].iter_mut().zip(&done[p * k..][..=p]) {
                *r -= f * v;
            }
        }
        let d = l[i * k + i];
        for r in &mut row[..=i] {
            *r /= d;
        }
    }
    let mut inv = vec![0f64; k * k];
    for p in 0..k {
        let row = &li[p * k..][..=p];
        for i in 0..=p {
            let f = row[i];
            for (x, &v) in inv[i * k..][..=i].iter_mut().zip(&row[..=i]) {
                *x += f * v;
            }
        }
    }
    for i in 0..k {
        for j in 0..i {
            inv[j * k + i] = inv[i * k + j];
        }
    }
    inv
}

/// Damping added to `H`'s diagonal, as a fraction of its mean diagonal.
const DAMPING: f64 = 0.01;

/// GPTQ on the rows of one group: `weights[r]` (length `k`) share `H` (`k × k`, row-major);
/// `grid(r, i, x)` rounds value `x` of row `r`, input `i` to `(integer, dequantized value)`.
/// Inputs are visited in decreasing order of `H`'s diagonal (ties by index); an input whose
/// diagonal is 0 is never read, so it is rounded to nearest and nothing compensates for it.
pub(crate) fn gptq(weights: &[Vec<f64>], h: &[f64], k: usize, grid: &(dyn Fn(usize, usize, f64) -> (i64, f64) + Sync)) -> Result<Vec<Vec<i64>>, String> {
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| h[b * k + b].total_cmp(&h[a * k + a]).then(a.cmp(&b)));
    let mean_diag = (0..k).map(|i| h[i * k + i]).sum::<f64>() / k as f64;
    if mean_diag.is_nan() || mean_diag <= 0.0 || mean_diag.is_infinite() {
        return Err("its input was zero (or not finite) at every sampled position".into());
    }
    // H in visiting order, damped; inputs never read get a unit diagonal and no coupling.
    let mut hp = vec![0f64; k * k];
    for (a, &i) in order.iter().enumerate() {
        for (b, &j) in order.iter().enumerate() {
            hp[a * k + b] = h[i * k + j];
        }
        if hp[a * k + a] == 0.0 {
            hp[a * k + a] = 1.0;
        }
        hp[a * k + a] += DAMPING * mean_diag;
    }
    let l = cholesky(&hp, k).ok_or("its input second moments are not positive definite after damping")?;
    let inv = inverse_from_cholesky(&l, k);
    // Upper Cholesky factor U of H⁻¹ (H⁻¹ = Uᵀ U): row a of U is the compensation direction of
    // input a over the inputs after it, scaled by 1 / U[a][a].
    let lu = cholesky(&inv, k).ok_or("the inverse of its input second moments is not positive definite")?;
    let mut u = vec![0f64; k * k];
    for a in 0..k {
        for b in a..k {
            u[a * k + b] = lu[b * k + a];
        }
    }
    Ok(weights.par_iter().enumerate().map(|(r, row)| {
        let mut w: Vec<f64> = order.iter().map(|&i| row[i]).collect();
        let mut q = vec![0i64; k];
        for a in 0..k {
            let (qa, deq) = grid(r, order[a], w[a]);
            q[order[a]] = qa;
            let ua = &u[a * k..][..k];
            let e = (w[a] - deq) / ua[a];
            for (wb, &ub) in w[a + 1..].iter_mut().zip(&ua[a + 1..]) {
                *wb -= e * ub;
            }
        }
        q
    }).collect())
}

/// The sampled output positions of a sample with `total` of them: at most `max`, evenly
/// spread.
fn sampled(total: usize, max: usize) -> Vec<usize> {
    if total <= max {
        return (0..total).collect();
    }
    let step = total as f64 / max as f64;
    (0..max).map(|i| ((i as f64 + 0.5) * step) as usize).collect()
}

/// The zero-padded patches of a Conv input at (at most `max`) sampled output positions: per
/// group, a `P × K` matrix (position-major: `x[p * K + i]`, `i` over channel-in-group × kh ×
/// kw), and `P`.
fn conv_patches(x: &[f32], shape: &[usize], window: &ConvWindow, groups: usize, width: usize, max: usize) -> Result<(Vec<Vec<f32>>, usize), String> {
    let [size, begin, outs] = window.layout(shape)?;
    let source = |a: usize, o: usize, t: usize| (o * window.strides[a] + t * window.dilations[a]).checked_sub(begin[a]).filter(|&v| v < size[a]);
    gather(x, shape, size, outs, window.kernel, groups, width, max, source)
}

/// The inputs of a transposed convolution that reach (at most `max`) sampled output positions:
/// per group, a `P × K` position-major matrix (`i` over channel-in-group × kh × kw; 0 where a
/// tap does not reach the position), and `P`. `window.pads` must be explicit.
fn transposed_patches(x: &[f32], shape: &[usize], window: &ConvWindow, groups: usize, output_padding: [usize; 2], width: usize, max: usize) -> Result<(Vec<Vec<f32>>, usize), String> {
    if shape.len() != window.spatial + 2 {
        return Err(format!("rank {} does not fit a {}-D convolution", shape.len(), window.spatial));
    }
    let Pads::Explicit(pads) = window.pads else { return Err("the pads are not explicit".into()) };
    let size = if window.spatial == 1 { [1, shape[2]] } else { [shape[2], shape[3]] };
    let mut outs = [0; 2];
    for a in 0..2 {
        let full = (size[a] - 1) * window.strides[a] + (window.kernel[a] - 1) * window.dilations[a] + 1 + output_padding[a];
        outs[a] = full.checked_sub(pads[a] + pads[a + 2]).ok_or("the pads are larger than the output")?;
    }
    let source = |a: usize, o: usize, t: usize| -> Option<usize> {
        let v = (o + pads[a]).checked_sub(t * window.dilations[a])?;
        (v % window.strides[a] == 0 && v / window.strides[a] < size[a]).then_some(v / window.strides[a])
    };
    gather(x, shape, size, outs, window.kernel, groups, width, max, source)
}

/// Per group, the `P × K` position-major matrix of what each kernel tap brings to (at most
/// `max`) sampled output positions of an `outs`-sized output, from an NC(H)W input `x` of
/// spatial `size`; `source(axis, output index, tap)` is the input index a tap reads along an
/// axis, if any (0 where there is none). Returns the matrices and `P`.
#[allow(clippy::too_many_arguments)]
fn gather(x: &[f32], shape: &[usize], size: [usize; 2], outs: [usize; 2], [kh, kw]: [usize; 2], groups: usize, width: usize, max: usize, source: impl Fn(usize, usize, usize) -> Option<usize>) -> Result<(Vec<Vec<f32>>, usize), String> {
    let (batch, channels) = (shape[0], shape[1]);
    if channels % groups != 0 || (channels / groups) * kh * kw != width {
        return Err(format!("{channels} channels do not fit the weight ({width} inputs per output, {groups} group(s))"));
    }
    let per_group = channels / groups;
    let plane = size[0] * size[1];
    let positions = sampled(batch * outs[0] * outs[1], max);
    let p = positions.len();
    let mut out = vec![vec![0f32; width * p]; groups];
    // Group by group, so a depthwise convolution reads one plane at a time.
    for (gidx, m) in out.iter_mut().enumerate() {
        for (pi, &pos) in positions.iter().enumerate() {
            let (b, oy, ox) = (pos / (outs[0] * outs[1]), (pos / outs[1]) % outs[0], pos % outs[1]);
            let patch = &mut m[pi * width..][..width];
            for c in 0..per_group {
                let src = &x[(b * channels + gidx * per_group + c) * plane..][..plane];
                for ty in 0..kh {
                    let Some(y) = source(0, oy, ty) else { continue };
                    for tx in 0..kw {
                        let Some(xx) = source(1, ox, tx) else { continue };
                        patch[(c * kh + ty) * kw + tx] = src[y * size[1] + xx];
                    }
                }
            }
        }
    }
    Ok((out, p))
}

/// (At most `max`) sampled rows of a Gemm or MatMul input (`[..., K]`, or `[K, M]` when `transposed`) as
/// one `P × K` position-major matrix, and `P`.
fn rows(x: &[f32], shape: &[usize], transposed: bool, width: usize, max: usize) -> Result<(Vec<Vec<f32>>, usize), String> {
    let k = if transposed { shape.first() } else { shape.last() }.copied().unwrap_or(0);
    if shape.len() < 2 || (transposed && shape.len() != 2) || k != width {
        return Err(format!("shape {shape:?} does not have {width} input columns"));
    }
    let total = x.len() / k;
    let positions = sampled(total, max);
    let p = positions.len();
    let mut out = vec![0f32; k * p];
    for (pi, &r) in positions.iter().enumerate() {
        for i in 0..k {
            out[pi * k + i] = if transposed { x[i * total + r] } else { x[r * k + i] };
        }
    }
    Ok((vec![out], p))
}

/// Adds the upper triangle of the `k × k` matrix `gram` to the fixed-point sums.
fn add_upper(gram: &[f32], k: usize, sums: &mut [i128]) {
    let unit = f64::powi(2.0, FRAC_BITS);
    let mut at = 0;
    for i in 0..k {
        for &g in &gram[i * k + i..(i + 1) * k] {
            let v = g as f64 * unit;
            // Rounds half away from zero; through i64 when it fits (one instruction).
            let r = v + 0.5f64.copysign(v);
            sums[at] += if r.abs() < 9.0e18 { r as i64 as i128 } else { r as i128 };
            at += 1;
        }
    }
}

/// Inputs below which [`gram_of`] multiplies directly rather than through the GEMM.
const DIRECT_GRAM_WIDTH: usize = 32;

/// `gram = xᵀ x` for `x` of `p` rows of `k` values (row-major `k × k`).
fn gram_of(x: &[f32], k: usize, p: usize, gram: &mut [f32]) {
    if k >= DIRECT_GRAM_WIDTH {
        sgemm(k, k, p, MatRef::transposed(x, k), MatRef::rows(x, k), gram, false);
        return;
    }
    gram.fill(0.0);
    for row in x.chunks_exact(k).take(p) {
        for (i, &a) in row.iter().enumerate() {
            for (g, &b) in gram[i * k..(i + 1) * k].iter_mut().zip(row) {
                *g += a * b;
            }
        }
    }
}

/// `a · b` in four f64 lanes (vectorizes).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut lanes = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in `[lo, hi)`.
    fn noise(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * (s >> 11) as f64 / (1u64 << 53) as f64
        }).collect()
    }

    /// `x` (`n × k`, rows are input vectors) with correlated columns: each column mixes a few
    /// shared factors.
    fn correlated(seed: u64, n: usize, k: usize) -> Vec<f64> {
        let factors = noise(seed, n * 4, -1.0, 1.0);
        let mix = noise(seed + 1, 4 * k, -1.0, 1.0);
        let own = noise(seed + 2, n * k, -0.3, 0.3);
        (0..n * k).map(|e| {
            let (r, c) = (e / k, e % k);
            (0..4).map(|f| factors[r * 4 + f] * mix[f * k + c]).sum::<f64>() + own[e]
        }).collect()
    }

    fn moments(x: &[f64], n: usize, k: usize) -> Vec<f64> {
        let mut h = vec![0f64; k * k];
        for r in 0..n {
            for i in 0..k {
                for j in 0..k {
                    h[i * k + j] += x[r * k + i] * x[r * k + j] / n as f64;
                }
            }
        }
        h
    }

    /// Solves `a y = b` (`a`: `n × n`) by Gaussian elimination with partial pivoting.
    fn solve(mut a: Vec<f64>, mut b: Vec<f64>, n: usize) -> Vec<f64> {
        for c in 0..n {
            let p = (c..n).max_by(|&i, &j| a[i * n + c].abs().total_cmp(&a[j * n + c].abs())).unwrap();
            for j in 0..n {
                a.swap(c * n + j, p * n + j);
            }
            b.swap(c, p);
            for r in c + 1..n {
                let f = a[r * n + c] / a[c * n + c];
                for j in c..n {
                    a[r * n + j] -= f * a[c * n + j];
                }
                b[r] -= f * b[c];
            }
        }
        let mut y = vec![0f64; n];
        for c in (0..n).rev() {
            y[c] = (b[c] - (c + 1..n).map(|j| a[c * n + j] * y[j]).sum::<f64>()) / a[c * n + c];
        }
        y
    }

    /// The Optimal Brain Quantizer by its definition: visit the inputs in the given order;
    /// round the current one to nearest, then set every input not yet rounded to the
    /// least-squares optimum given those rounded so far: `w_F = w*_F − H_FF⁻¹ H_FQ (ŵ_Q − w*_Q)`.
    fn obq(w0: &[f64], h: &[f64], k: usize, order: &[usize], grid: &dyn Fn(usize, f64) -> (i64, f64)) -> Vec<i64> {
        let mut q = vec![0i64; k];
        let mut fixed: Vec<(usize, f64)> = vec![];
        let mut w = w0.to_vec();
        for (step, &j) in order.iter().enumerate() {
            let (qj, deq) = grid(j, w[j]);
            q[j] = qj;
            fixed.push((j, deq));
            let free: Vec<usize> = order[step + 1..].to_vec();
            if free.is_empty() {
                break;
            }
            let f = free.len();
            let a: Vec<f64> = free.iter().flat_map(|&i| free.iter().map(move |&l| h[i * k + l])).collect();
            let b: Vec<f64> = free.iter().map(|&i| -fixed.iter().map(|&(c, v)| h[i * k + c] * (v - w0[c])).sum::<f64>()).collect();
            let d = solve(a, b, f);
            for (t, &i) in free.iter().enumerate() {
                w[i] = w0[i] + d[t];
            }
        }
        q
    }

    #[test]
    fn gptq_equals_the_optimal_brain_quantizer_by_its_definition() {
        for (k, rows, bits) in [(7, 3, 4), (12, 5, 8), (20, 4, 3)] {
            let n = 4 * k;
            let x = correlated(k as u64, n, k);
            let h = moments(&x, n, k);
            let weights: Vec<Vec<f64>> = (0..rows).map(|r| noise(50 + r as u64, k, -1.0, 1.0)).collect();
            let qmax = (1i64 << (bits - 1)) - 1;
            let scales: Vec<f64> = weights.iter().map(|w| w.iter().fold(0f64, |m, v| m.max(v.abs())) / qmax as f64).collect();
            let grid = |r: usize, _: usize, v: f64| {
                let q = ((v / scales[r]).round_ties_even() as i64).clamp(-qmax - 1, qmax);
                (q, q as f64 * scales[r])
            };
            let got = gptq(&weights, &h, k, &grid).unwrap();
            // The same damped moments and visiting order, solved directly.
            let mean = (0..k).map(|i| h[i * k + i]).sum::<f64>() / k as f64;
            let mut damped = h.clone();
            for i in 0..k {
                damped[i * k + i] += DAMPING * mean;
            }
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by(|&a, &b| h[b * k + b].total_cmp(&h[a * k + a]).then(a.cmp(&b)));
            let mut changed = 0;
            for (r, w) in weights.iter().enumerate() {
                let want = obq(w, &damped, k, &order, &|i, v| grid(r, i, v));
                assert_eq!(got[r], want, "k {k} row {r} ({bits} bits)");
                changed += (0..k).filter(|&i| want[i] != grid(r, i, w[i]).0).count();
            }
            assert!(changed > 0, "k {k}: GPTQ changed nothing, so this case checks nothing");
        }
    }

    #[test]
    fn gptq_lowers_the_output_error_of_nearest_rounding_and_gives_nearest_for_uncorrelated_inputs() {
        let (k, n, rows) = (48, 400, 16);
        let x = correlated(3, n, k);
        let h = moments(&x, n, k);
        let weights: Vec<Vec<f64>> = (0..rows).map(|r| noise(90 + r as u64, k, -1.0, 1.0)).collect();
        for bits in [4u32, 8] {
            let qmax = (1i64 << (bits - 1)) - 1;
            let grid = |r: usize, _: usize, v: f64| {
                let s = weights[r].iter().fold(0f64, |m, v| m.max(v.abs())) / qmax as f64;
                let q = ((v / s).round_ties_even() as i64).clamp(-qmax - 1, qmax);
                (q, q as f64 * s)
            };
            let q = gptq(&weights, &h, k, &grid).unwrap();
            // Output error on the data itself: Σ_rows Σ_vectors ((w − ŵ)·x)².
            let error = |deq: &dyn Fn(usize, usize) -> f64| -> f64 {
                (0..rows).map(|r| (0..n).map(|v| (0..k).map(|i| (weights[r][i] - deq(r, i)) * x[v * k + i]).sum::<f64>().powi(2)).sum::<f64>()).sum()
            };
            let nearest = error(&|r, i| grid(r, i, weights[r][i]).1);
            let rounded = error(&|r, i| {
                let s = weights[r].iter().fold(0f64, |m, v| m.max(v.abs())) / qmax as f64;
                q[r][i] as f64 * s
            });
            assert!(rounded < 0.6 * nearest, "{bits} bits: GPTQ output error {rounded} against nearest {nearest}");
            // With a diagonal H there is nothing to compensate through: nearest rounding.
            let diagonal: Vec<f64> = (0..k * k).map(|e| if e / k == e % k { h[e] } else { 0.0 }).collect();
            let q = gptq(&weights, &diagonal, k, &grid).unwrap();
            for r in 0..rows {
                for i in 0..k {
                    assert_eq!(q[r][i], grid(r, i, weights[r][i]).0, "{bits} bits, diagonal H, row {r} input {i}");
                }
            }
        }
    }

    /// `y[n, o, oy, ox]` of a convolution without bias, by its definition, in f64.
    #[allow(clippy::too_many_arguments)]
    fn conv(x: &[f32], [b, c, h, w]: [usize; 4], wt: &[f64], [m, cg, kh, kw]: [usize; 4], groups: usize, s: [usize; 2], d: [usize; 2], p: [usize; 4], (n, o, oy, ox): (usize, usize, usize, usize)) -> f64 {
        let _ = b;
        let g = o / (m / groups);
        let mut acc = 0.0;
        for ci in 0..cg {
            for i in 0..kh {
                for j in 0..kw {
                    let (r, q) = ((oy * s[0] + i * d[0]) as i64 - p[0] as i64, (ox * s[1] + j * d[1]) as i64 - p[1] as i64);
                    if r >= 0 && q >= 0 && (r as usize) < h && (q as usize) < w {
                        acc += wt[((o * cg + ci) * kh + i) * kw + j] * x[((n * c + g * cg + ci) * h + r as usize) * w + q as usize] as f64;
                    }
                }
            }
        }
        acc
    }

    #[test]
    fn patches_read_what_the_convolution_multiplies_by_each_weight() {
        let xs = [2, 4, 7, 9];
        let x: Vec<f32> = noise(7, xs.iter().product(), -2.0, 2.0).into_iter().map(|v| v as f32).collect();
        for (groups, k, s, d, p) in [(1, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]), (2, [3, 2], [2, 3], [1, 2], [0, 2, 1, 0]), (4, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]), (1, [1, 1], [1, 1], [1, 1], [0, 0, 0, 0])] {
            let cg = 4 / groups;
            let ws = [4, cg, k[0], k[1]];
            let width = cg * k[0] * k[1];
            let wt = noise(11, 4 * width, -1.0, 1.0);
            let window = ConvWindow { kernel: k, strides: s, dilations: d, pads: Pads::Explicit(p), spatial: 2 };
            let [_, _, outs] = window.layout(&xs).unwrap();
            let (patches, positions) = conv_patches(&x, &xs, &window, groups, width, POSITIONS_PER_SAMPLE).unwrap();
            assert_eq!(positions, 2 * outs[0] * outs[1], "every position is sampled below {POSITIONS_PER_SAMPLE}");
            for pos in 0..positions {
                let (n, oy, ox) = (pos / (outs[0] * outs[1]), (pos / outs[1]) % outs[0], pos % outs[1]);
                for o in 0..4 {
                    let g = o / (4 / groups);
                    let got: f64 = (0..width).map(|i| wt[o * width + i] * patches[g][pos * width + i] as f64).sum();
                    let want = conv(&x, xs, &wt, ws, groups, s, d, p, (n, o, oy, ox));
                    assert!((got - want).abs() < 1e-9, "groups {groups} kernel {k:?} position {pos} output {o}: {got} vs {want}");
                }
            }
        }
    }

    /// `y[n, o, Y, X]` of a transposed convolution without bias by its definition (every input
    /// position scatters `x · w` through every tap), in f64: weight `[C, M/groups, kh, kw]`.
    #[allow(clippy::too_many_arguments)]
    fn conv_transpose(x: &[f32], [b, c, h, w]: [usize; 4], wt: &[f64], [_, mg, kh, kw]: [usize; 4], groups: usize, s: [usize; 2], d: [usize; 2], p: [usize; 4], op: [usize; 2]) -> (Vec<f64>, [usize; 2]) {
        let oh = (h - 1) * s[0] + (kh - 1) * d[0] + 1 + op[0] - p[0] - p[2];
        let ow = (w - 1) * s[1] + (kw - 1) * d[1] + 1 + op[1] - p[1] - p[3];
        let cg = c / groups;
        let mut y = vec![0f64; b * mg * groups * oh * ow];
        for n in 0..b {
            for ci in 0..c {
                let g = ci / cg;
                for iy in 0..h {
                    for ix in 0..w {
                        for o in 0..mg {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let (yy, xx) = ((iy * s[0] + ky * d[0]) as i64 - p[0] as i64, (ix * s[1] + kx * d[1]) as i64 - p[1] as i64);
                                    if yy >= 0 && xx >= 0 && (yy as usize) < oh && (xx as usize) < ow {
                                        y[((n * mg * groups + g * mg + o) * oh + yy as usize) * ow + xx as usize] += x[((n * c + ci) * h + iy) * w + ix] as f64 * wt[((ci * mg + o) * kh + ky) * kw + kx];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        (y, [oh, ow])
    }

    #[test]
    fn transposed_patches_hold_what_reaches_each_output_through_each_weight() {
        let xs = [2, 4, 5, 6];
        let x: Vec<f32> = noise(17, xs.iter().product(), -2.0, 2.0).into_iter().map(|v| v as f32).collect();
        for (groups, k, s, d, p, op) in [(1, [2, 2], [2, 2], [1, 1], [0, 0, 0, 0], [0, 0]), (2, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1], [1, 1]), (1, [3, 2], [1, 3], [2, 1], [2, 0, 1, 1], [0, 2]), (4, [3, 3], [2, 1], [1, 1], [0, 1, 2, 0], [1, 0])] {
            let (cg, mg) = (4 / groups, 3);
            let ws = [4, mg, k[0], k[1]];
            let width = cg * k[0] * k[1];
            let wt = noise(19, 4 * mg * k[0] * k[1], -1.0, 1.0);
            let window = ConvWindow { kernel: k, strides: s, dilations: d, pads: Pads::Explicit(p), spatial: 2 };
            let (want, [oh, ow]) = conv_transpose(&x, xs, &wt, ws, groups, s, d, p, op);
            let (patches, positions) = transposed_patches(&x, &xs, &window, groups, op, width, usize::MAX).unwrap();
            assert_eq!(positions, 2 * oh * ow);
            for pos in 0..positions {
                let (n, oy, ox) = (pos / (oh * ow), (pos / ow) % oh, pos % ow);
                for o in 0..mg * groups {
                    let g = o / mg;
                    // Output o's weight over (channel in group, tap): w[g·C/groups + c, o mod M/groups, tap].
                    let got: f64 = (0..width).map(|i| wt[((g * cg + i / (k[0] * k[1])) * mg + o % mg) * k[0] * k[1] + i % (k[0] * k[1])] * patches[g][pos * width + i] as f64).sum();
                    let y = want[((n * mg * groups + o) * oh + oy) * ow + ox];
                    assert!((got - y).abs() < 1e-9, "groups {groups} kernel {k:?} strides {s:?} position {pos} output {o}: {got} vs {y}");
                }
            }
        }
    }

    #[test]
    fn positions_are_spread_over_the_whole_sample() {
        assert_eq!(sampled(5, 8), [0, 1, 2, 3, 4]);
        let s = sampled(10 * 100 + 3, 100);
        assert_eq!(s.len(), 100);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert!(s[0] < 10 && *s.last().unwrap() >= 10 * 100 - 10);
    }

    #[test]
    fn the_inverse_from_the_cholesky_factor_inverts() {
        let k = 9;
        let x = correlated(5, 40, k);
        let h = moments(&x, 40, k);
        let inv = inverse_from_cholesky(&cholesky(&h, k).unwrap(), k);
        for i in 0..k {
            for j in 0..k {
                let v: f64 = (0..k).map(|p| h[i * k + p] * inv[p * k + j]).sum();
                assert!((v - if i == j { 1.0 } else { 0.0 }).abs() < 1e-8, "({i}, {j}): {v}");
            }
        }
    }
}
