//! Bias correction for weight quantization (Nagel et al. 2019, "Data-Free Quantization
//! Through Weight Equalization and Bias Correction", §4.2, with the input expectation measured
//! on the calibration data as in its empirical variant).
//!
//! Rounding a layer's weights `W` to `Ŵ` shifts the mean of its output by
//! `E[(W − Ŵ)·x]` per output channel: a systematic error that the following layers see as a
//! wrong bias. Because the layer is linear in its input, that shift only needs the mean of every
//! input element a kernel tap reads: for a Conv, `m[c, k]` = the mean over calibration samples
//! and output positions of the (zero-padded) input of channel `c` under tap `k`; for a Gemm, the
//! mean input row. Convert then adds `Σ (W − Ŵ)[o, c, k] · m[c, k]` to the float bias of each
//! output channel `o` before quantizing the bias to int32, so the quantized layer's expected
//! output equals the float layer's on the calibration distribution.
//!
//! The means are collected by [`InputMeans`] during calibration (the same run as the
//! observers: no extra pass over the data). Per-sample sums are added in fixed point, so the
//! result does not depend on how samples were split across calibration workers.
//!
//! Corrected: Conv (1-D and 2-D) and Gemm whose bias input is a constant with one value per
//! output channel. Other weighted nodes (MatMul, ConvTranspose, Conv without bias, 3-D Conv)
//! are listed with the reason.

use std::collections::{BTreeMap, HashMap};

use qforge_ir::{Graph, GraphPath, Node, NodeId, Tensor, ValueId};
use qforge_runtime::ValueEvent;

use crate::prepare::QuantPlan;
use crate::spec::{Derivation, Spec};

/// Fractional bits of the fixed-point sums.
const FRAC_BITS: i32 = 32;

/// How a node reads its activation input, for the per-tap input means.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Window {
    /// A 1-D or 2-D convolution; 1-D is stored as 2-D with a height of 1.
    Conv(ConvWindow),
    /// Gemm input A (`[M, K]`, or `[K, M]` when transposed): the mean over rows.
    Gemm { trans_a: bool },
}

/// The geometry of a 1-D or 2-D convolution, 1-D stored as 2-D with a height of 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ConvWindow {
    pub kernel: [usize; 2],
    pub strides: [usize; 2],
    pub dilations: [usize; 2],
    pub pads: Pads,
    /// 1 or 2.
    pub spatial: usize,
}

/// Conv padding: explicit `[begin_h, begin_w, end_h, end_w]`, or ONNX `auto_pad` SAME/VALID.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Pads {
    Explicit([usize; 4]),
    SameUpper,
    SameLower,
}

impl ConvWindow {
    /// The geometry of Conv node `n` with weight shape `ws` (`[M, C/groups, k...]`), or why it
    /// is not a 1-D or 2-D convolution with valid attributes.
    pub fn of(n: &Node, ws: &[usize]) -> Result<ConvWindow, String> {
        let spatial = ws.len().checked_sub(2).filter(|s| (1..=2).contains(s)).ok_or("only 1-D and 2-D convolutions are handled")?;
        let kernel = ints(n, "kernel_shape", spatial, 0).filter(|k| k[..] == ws[2..]).unwrap_or_else(|| ws[2..].to_vec());
        let strides = ints(n, "strides", spatial, 1).ok_or("bad strides")?;
        let dilations = ints(n, "dilations", spatial, 1).ok_or("bad dilations")?;
        let pads = match n.attr_str("auto_pad").unwrap_or("NOTSET") {
            "SAME_UPPER" => Pads::SameUpper,
            "SAME_LOWER" => Pads::SameLower,
            "VALID" => Pads::Explicit([0; 4]),
            _ => {
                let p = ints(n, "pads", 2 * spatial, 0).ok_or("bad pads")?;
                Pads::Explicit(if spatial == 1 { [0, p[0], 0, p[1]] } else { [p[0], p[1], p[2], p[3]] })
            }
        };
        let two = |v: &[usize], fill| if spatial == 1 { [fill, v[0]] } else { [v[0], v[1]] };
        Ok(ConvWindow { kernel: two(&kernel, 1), strides: two(&strides, 1), dilations: two(&dilations, 1), pads, spatial })
    }

    /// For an input of shape `shape` (`[N, C, (H,) W]`): the spatial size `[H, W]` (H = 1 in
    /// 1-D), the leading pads `[top, left]` and the output size `[OH, OW]`.
    pub fn layout(&self, shape: &[usize]) -> Result<[[usize; 2]; 3], String> {
        if shape.len() != self.spatial + 2 {
            return Err(format!("rank {} does not fit a {}-D convolution", shape.len(), self.spatial));
        }
        let size = if self.spatial == 1 { [1, shape[2]] } else { [shape[2], shape[3]] };
        let (mut begin, mut out) = ([0; 2], [0; 2]);
        for a in 0..2 {
            let (n, k, s, d) = (size[a], self.kernel[a], self.strides[a].max(1), self.dilations[a].max(1));
            let span = (k - 1) * d + 1;
            (begin[a], out[a]) = match self.pads {
                Pads::Explicit(p) => {
                    let total = n + p[a] + p[a + 2];
                    (p[a], if total >= span { (total - span) / s + 1 } else { 0 })
                }
                Pads::SameUpper | Pads::SameLower => {
                    let out = n.div_ceil(s);
                    let total = ((out.saturating_sub(1)) * s + span).saturating_sub(n);
                    (if self.pads == Pads::SameUpper { total / 2 } else { total - total / 2 }, out)
                }
            };
        }
        Ok([size, begin, out])
    }
}

/// The input statistics of one weighted node.
#[derive(Debug, Clone)]
struct NodeMeans {
    window: Window,
    /// Fixed-point sums: `[C, kh, kw]` for a Conv, `[K]` for a Gemm.
    sums: Vec<i128>,
    /// Output positions (Conv: batch × output spatial size; Gemm: rows) summed over.
    count: u64,
    /// Set when an input arrived in a layout the window cannot read.
    unusable: Option<String>,
}

/// Per-tap input means of every node bias correction applies to, keyed by (plan graph index,
/// node), filled during calibration; plus the weighted nodes it cannot correct, with why.
#[derive(Debug, Clone, Default)]
pub struct InputMeans {
    nodes: BTreeMap<(usize, NodeId), NodeMeans>,
    /// (plan graph index, activation value) to the nodes reading it.
    watch: HashMap<(usize, ValueId), Vec<NodeId>>,
    paths: Vec<GraphPath>,
    /// Weighted nodes left uncorrected: (plan graph index, node, reason).
    pub skipped: Vec<(usize, NodeId, String)>,
}

/// Whether input `index` of an annotated node is a bias whose scale derives from its weight.
fn is_bias(spec: Option<&Spec>) -> bool {
    matches!(spec, Some(Spec::Derived { how: Derivation::BiasScale, .. }))
}

fn ints(n: &Node, name: &str, len: usize, default: i64) -> Option<Vec<usize>> {
    let v: Vec<i64> = n.attr_ints(name).map_or_else(|| vec![default; len], <[i64]>::to_vec);
    (v.len() == len && v.iter().all(|&x| x >= 0)).then(|| v.into_iter().map(|x| x as usize).collect())
}

/// The window of a weighted node whose bias can be corrected, or why it cannot.
fn window_of(g: &Graph, n: &Node) -> Result<Window, String> {
    let weight = n.input(1).and_then(|w| g.value(w).ok()).and_then(|v| v.initializer()).ok_or("the weight is not a constant")?;
    let bias = n.input(2).and_then(|b| g.value(b).ok()).ok_or("no bias input")?;
    let bias = bias.initializer().ok_or("the bias is not a constant")?;
    let ws = weight.shape();
    match n.op_type.as_str() {
        "Conv" => {
            let window = ConvWindow::of(n, ws)?;
            if bias.len() != ws[0] {
                return Err("the bias does not have one value per output channel".into());
            }
            Ok(Window::Conv(window))
        }
        "Gemm" => {
            let trans_b = n.attr_int("transB").unwrap_or(0) != 0;
            let out = if trans_b { ws[0] } else { ws[1] };
            if ws.len() != 2 || bias.len() != out || bias.shape().iter().filter(|&&d| d != 1).count() > 1 || out < 2 {
                return Err("the bias does not have one value per output column".into());
            }
            if n.attr_float("beta").unwrap_or(1.0) == 0.0 {
                return Err("beta is 0".into());
            }
            Ok(Window::Gemm { trans_a: n.attr_int("transA").unwrap_or(0) != 0 })
        }
        op => Err(format!("bias correction does not handle {op}")),
    }
}

impl InputMeans {
    /// The values of the main graph whose statistics are collected.
    pub(crate) fn main_graph_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        main_graph_values(&self.paths, self.watch.keys())
    }

    /// Empty statistics for every weighted node of `plan` (whose graphs are those of `main`,
    /// in [`graphs`] order) with a bias: Conv and Gemm get a watch on their activation input,
    /// the others are listed in [`InputMeans::skipped`].
    pub fn new(main: &Graph, plan: &QuantPlan) -> InputMeans {
        let all = main.graphs();
        let mut me = InputMeans { paths: plan.graphs.iter().map(|g| g.path.clone()).collect(), ..Default::default() };
        for (gi, gp) in plan.graphs.iter().enumerate() {
            let Some((_, g)) = all.iter().find(|(p, _)| *p == gp.path) else { continue };
            for (&id, ann) in &gp.annotations.nodes {
                let Ok(n) = g.node(id) else { continue };
                let weighted = ann.inputs.get(1).is_some_and(|s| matches!(s, Some(Spec::Quantize(_)))) && n.input(1).is_some_and(|w| g.value(w).is_ok_and(|v| v.is_constant()));
                if !weighted {
                    continue;
                }
                if !is_bias(ann.inputs.get(2).and_then(Option::as_ref)) {
                    me.skipped.push((gi, id, "no bias input".into()));
                    continue;
                }
                let Some(x) = n.input(0) else { continue };
                match window_of(g, n) {
                    Ok(window) => {
                        let sums = match &window {
                            Window::Conv(ConvWindow { kernel, .. }) => vec![0; g.value(n.input(1).expect("weighted")).ok().and_then(|v| v.initializer()).map_or(0, |w| w.shape()[1]) * kernel[0] * kernel[1]],
                            Window::Gemm { .. } => vec![],
                        };
                        me.nodes.insert((gi, id), NodeMeans { window, sums, count: 0, unusable: None });
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

    /// Adds the statistics of `other` (collected on other samples, from a clone of the same
    /// empty state). Exact, so the order of merges does not matter.
    pub fn merge(&mut self, other: &InputMeans) {
        for (k, theirs) in &other.nodes {
            let Some(mine) = self.nodes.get_mut(k) else { continue };
            if mine.sums.len() < theirs.sums.len() {
                mine.sums.resize(theirs.sums.len(), 0);
            }
            for (a, b) in mine.sums.iter_mut().zip(&theirs.sums) {
                *a += b;
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
            let added = match &m.window {
                Window::Conv(w) => conv_sums(data, value.shape(), w),
                Window::Gemm { trans_a } => gemm_sums(data, value.shape(), *trans_a),
            };
            match added {
                Ok((sums, count)) => {
                    if m.sums.len() != sums.len() && m.count == 0 {
                        m.sums = vec![0; sums.len()];
                    }
                    if m.sums.len() != sums.len() {
                        m.unusable = Some(format!("input '{}' changed its channel count between samples", event.name));
                        continue;
                    }
                    for (a, s) in m.sums.iter_mut().zip(sums) {
                        *a += (s * f64::powi(2.0, FRAC_BITS)).round() as i128;
                    }
                    m.count += count;
                }
                Err(why) => m.unusable = Some(format!("input '{}': {why}", event.name)),
            }
        }
    }

    /// The output-channel shift `E[(W − Ŵ)·x]` of node `id` of plan graph `gi`, from its float
    /// weight `w` and the dequantized weight `w_hat` (same shape), scaled for its bias input
    /// (Gemm: `alpha / beta`). `Err`: why the node is not corrected.
    pub fn shift(&self, gi: usize, id: NodeId, node: &Node, w: &[f32], w_hat: &[f32], w_shape: &[usize]) -> Result<Vec<f64>, String> {
        let m = self.nodes.get(&(gi, id)).ok_or("not watched")?;
        if let Some(why) = &m.unusable {
            return Err(why.clone());
        }
        if m.count == 0 {
            return Err("its input was not seen during calibration".into());
        }
        let means: Vec<f64> = m.sums.iter().map(|&s| s as f64 / f64::powi(2.0, FRAC_BITS) / m.count as f64).collect();
        let delta = |i: usize| (w[i] - w_hat[i]) as f64;
        match &m.window {
            Window::Conv(ConvWindow { kernel, .. }) => {
                let (outs, per_group) = (w_shape[0], w_shape[1]);
                let taps = kernel[0] * kernel[1];
                let groups = (means.len() / taps).checked_div(per_group).filter(|&g| g > 0 && outs % g == 0).ok_or("the input channels do not match the weight")?;
                let outs_per_group = outs / groups;
                Ok((0..outs).map(|o| {
                    let first = (o / outs_per_group) * per_group * taps;
                    (0..per_group * taps).map(|k| delta(o * per_group * taps + k) * means[first + k]).sum()
                }).collect())
            }
            Window::Gemm { .. } => {
                let trans_b = node.attr_int("transB").unwrap_or(0) != 0;
                let (k, n) = if trans_b { (w_shape[1], w_shape[0]) } else { (w_shape[0], w_shape[1]) };
                if means.len() != k {
                    return Err("the input columns do not match the weight".into());
                }
                let scale = node.attr_float("alpha").unwrap_or(1.0) as f64 / node.attr_float("beta").unwrap_or(1.0) as f64;
                Ok((0..n).map(|j| scale * (0..k).map(|i| delta(if trans_b { j * k + i } else { i * n + j }) * means[i]).sum::<f64>()).collect())
            }
        }
    }
}

/// The values of `watched` (keyed by plan graph index, graphs at `paths`) that are in the
/// main graph.
pub(crate) fn main_graph_values<'a>(paths: &[GraphPath], watched: impl Iterator<Item = &'a (usize, ValueId)> + 'a) -> impl Iterator<Item = ValueId> + 'a {
    let main = paths.iter().position(|p| p.is_empty());
    watched.filter(move |(gi, _)| Some(*gi) == main).map(|&(_, v)| v)
}

/// The index in `paths` (a plan's graph paths) of the graph a value event comes from.
pub(crate) fn plan_graph_of(paths: &[GraphPath], event: &ValueEvent) -> Option<usize> {
    paths.iter().position(|p| p.len() == event.path.len() && p.iter().zip(event.path).all(|(a, b)| a.0 == b.0 && a.1 == b.1))
}

/// Sums of a Conv input under each tap: `[C, kh, kw]`, and the number of output positions.
fn conv_sums(x: &[f32], shape: &[usize], window: &ConvWindow) -> Result<(Vec<f64>, u64), String> {
    let [size, begin, outs] = window.layout(shape)?;
    let ConvWindow { kernel, strides, dilations, .. } = *window;
    let (batch, channels) = (shape[0], shape[1]);
    // Per spatial axis, for each tap: the input positions it reads (in range).
    let reads: Vec<Vec<Vec<usize>>> = (0..2).map(|a| {
        let (n, s, d) = (size[a], strides[a].max(1), dilations[a].max(1));
        (0..kernel[a]).map(|t| (0..outs[a]).filter_map(|o| (o * s + t * d).checked_sub(begin[a]).filter(|&r| r < n)).collect()).collect()
    }).collect();
    let (h, w) = (size[0], size[1]);
    let mut sums = vec![0f64; channels * kernel[0] * kernel[1]];
    let full = |v: &[usize], n: usize| v.len() == n && v.first() == Some(&0) && v.last() == Some(&(n - 1));
    if kernel == [1, 1] && full(&reads[0][0], h) && full(&reads[1][0], w) {
        for b in 0..batch {
            for (c, s) in sums.iter_mut().enumerate() {
                *s += lane_sum(&x[(b * channels + c) * h * w..][..h * w]);
            }
        }
        return Ok((sums, (batch * outs[0] * outs[1]) as u64));
    }
    // Per column tap: the contiguous run it reads (`None`: strided, summed element by element).
    let runs: Vec<Option<(usize, usize)>> = reads[1].iter().map(|cols| match (cols.first(), cols.last()) {
        (Some(&lo), Some(&hi)) if hi - lo + 1 == cols.len() => Some((lo, hi + 1)),
        (None, _) => Some((0, 0)),
        _ => None,
    }).collect();
    let mut rows = vec![0f64; h * kernel[1]];
    for b in 0..batch {
        for c in 0..channels {
            let plane = &x[(b * channels + c) * h * w..][..h * w];
            for r in 0..h {
                let line = &plane[r * w..][..w];
                let total = lane_sum(line);
                for (j, cols) in reads[1].iter().enumerate() {
                    rows[j * h + r] = match runs[j] {
                        Some((lo, hi)) if lo + (w - hi) <= hi - lo => total - lane_sum(&line[..lo]) - lane_sum(&line[hi..]),
                        Some((lo, hi)) => lane_sum(&line[lo..hi]),
                        None => cols.iter().map(|&q| line[q] as f64).sum(),
                    };
                }
            }
            for (i, taps) in reads[0].iter().enumerate() {
                for j in 0..kernel[1] {
                    sums[(c * kernel[0] + i) * kernel[1] + j] += taps.iter().map(|&r| rows[j * h + r]).sum::<f64>();
                }
            }
        }
    }
    Ok((sums, (batch * outs[0] * outs[1]) as u64))
}

/// The sum of a slice, in eight f32 lanes added up in f64 (vectorizes).
fn lane_sum(v: &[f32]) -> f64 {
    let mut lanes = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            lanes[k] += c[k];
        }
    }
    lanes.iter().map(|&l| l as f64).sum::<f64>() + chunks.remainder().iter().map(|&x| x as f64).sum::<f64>()
}

/// Column sums of Gemm input A (`[K]`) and the number of rows.
fn gemm_sums(x: &[f32], shape: &[usize], trans_a: bool) -> Result<(Vec<f64>, u64), String> {
    let &[r, c] = shape else { return Err(format!("rank {} is not a matrix", shape.len())) };
    Ok(if trans_a {
        ((0..r).map(|k| lane_sum(&x[k * c..][..c])).collect(), c as u64)
    } else {
        let mut s = vec![0f64; c];
        for row in x.chunks_exact(c.max(1)) {
            for (a, &v) in s.iter_mut().zip(row) {
                *a += v as f64;
            }
        }
        (s, r as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tap sums by the definition: every output position, every tap, zero outside the input.
    fn conv_sums_naive(x: &[f32], [b, c, h, w]: [usize; 4], k: [usize; 2], s: [usize; 2], d: [usize; 2], p: [usize; 4]) -> Vec<f64> {
        let oh = (h + p[0] + p[2] - (k[0] - 1) * d[0] - 1) / s[0] + 1;
        let ow = (w + p[1] + p[3] - (k[1] - 1) * d[1] - 1) / s[1] + 1;
        let mut out = vec![0f64; c * k[0] * k[1]];
        for n in 0..b {
            for ch in 0..c {
                for i in 0..k[0] {
                    for j in 0..k[1] {
                        for y in 0..oh {
                            for z in 0..ow {
                                let r = (y * s[0] + i * d[0]) as i64 - p[0] as i64;
                                let q = (z * s[1] + j * d[1]) as i64 - p[1] as i64;
                                if r >= 0 && q >= 0 && (r as usize) < h && (q as usize) < w {
                                    out[(ch * k[0] + i) * k[1] + j] += x[((n * c + ch) * h + r as usize) * w + q as usize] as f64;
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn tap_sums_match_the_definition_for_strides_dilations_and_pads() {
        let shape = [2, 3, 7, 9];
        let x: Vec<f32> = (0..shape.iter().product::<usize>()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        for (k, s, d, p) in [([3, 3], [1, 1], [1, 1], [1, 1, 1, 1]), ([3, 2], [2, 3], [1, 2], [0, 2, 1, 0]), ([1, 1], [2, 2], [1, 1], [0, 0, 0, 0]), ([1, 1], [1, 1], [1, 1], [0, 0, 0, 0]), ([1, 3], [1, 1], [1, 3], [0, 0, 0, 0]), ([5, 5], [1, 2], [2, 1], [3, 0, 2, 4])] {
            let (got, count) = conv_sums(&x, &shape, &ConvWindow { kernel: k, strides: s, dilations: d, pads: Pads::Explicit(p), spatial: 2 }).unwrap();
            let want = conv_sums_naive(&x, shape, k, s, d, p);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-3, "kernel {k:?} strides {s:?} dilations {d:?} pads {p:?}: {a} vs {b}");
            }
            let oh = (7 + p[0] + p[2] - (k[0] - 1) * d[0] - 1) / s[0] + 1;
            let ow = (9 + p[1] + p[3] - (k[1] - 1) * d[1] - 1) / s[1] + 1;
            assert_eq!(count, (2 * oh * ow) as u64);
        }
    }

    #[test]
    fn same_upper_pads_like_explicit_pads() {
        let shape = [1, 2, 6, 5];
        let x: Vec<f32> = (0..60).map(|i| i as f32 * 0.5 - 7.0).collect();
        // 3x3, stride 2: out 3x3; total pad (3-1)*2+3-6 = 1 (rows: 0 begin, 1 end), (3-1)*2+3-5 = 2 (cols: 1, 1).
        let window = |pads| ConvWindow { kernel: [3, 3], strides: [2, 2], dilations: [1, 1], pads, spatial: 2 };
        let (same, _) = conv_sums(&x, &shape, &window(Pads::SameUpper)).unwrap();
        let (explicit, _) = conv_sums(&x, &shape, &window(Pads::Explicit([0, 1, 1, 1]))).unwrap();
        assert_eq!(same, explicit);
    }
}
