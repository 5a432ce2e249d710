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

use qforge_ir::Node;

use crate::qparams::quantize;
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

/// Whether two paired integers (zero point 0) exceed `max`: of one sign, with `|a| + |b| > max`
/// (with opposite signs their products partly cancel and the sum stays within one product).
pub fn overflows(a: i64, b: i64, max: i64) -> bool {
    a.signum() == b.signum() && a.abs() + b.abs() > max
}

/// A quantized weight being fitted: float values, the parameter each element uses, the integer
/// range, the pairs ([`reduction_pairs`]) and their limit.
pub struct PairedWeight<'a> {
    pub data: &'a [f32],
    pub param_of: &'a (dyn Fn(usize) -> usize + Sync),
    pub range: (i64, i64),
    pub pairs: &'a [[usize; 2]],
    /// The largest `|q_a| + |q_b|` of a same-sign pair.
    pub max: i64,
}

/// Scale multipliers tried between the min/max scale (factor 1) and the scale at which the
/// parameter's largest pair fits without projection.
const SCALE_STEPS: usize = 16;

impl PairedWeight<'_> {
    /// The integer of element `e` under `p`, before any projection.
    fn nearest(&self, e: usize, p: QParams) -> i64 {
        quantize(self.data[e], p, self.range.0, self.range.1)
    }

    /// The integers `(a, b)` of a pair whose same-sign sum exceeds [`Self::max`] moved onto the
    /// constraint: both magnitudes lowered by the same real amount (the least-squares point of
    /// `|a| + |b| = max`), then rounded so that they sum to `max` exactly. Pairs within the
    /// constraint come back unchanged.
    pub fn fit(&self, [a, b]: [usize; 2], qa: i64, qb: i64, pa: QParams, pb: QParams) -> (i64, i64) {
        let (da, db) = (qa - pa.zero_point, qb - pb.zero_point);
        if !overflows(da, db, self.max) {
            return (qa, qb);
        }
        let sign = da.signum();
        let target = |e: usize, p: QParams| (sign as f64 * self.data[e] as f64 / p.scale as f64).max(0.0);
        let (ta, tb) = (target(a, pa), target(b, pb));
        let excess = (ta + tb - self.max as f64) / 2.0;
        let limit = if sign > 0 { self.range.1 - pa.zero_point } else { pa.zero_point - self.range.0 };
        let ma = ((ta - excess).round().max(0.0) as i64).min(self.max).min(limit);
        let limit_b = if sign > 0 { self.range.1 - pb.zero_point } else { pb.zero_point - self.range.0 };
        let mb = (self.max - ma).min(limit_b);
        (pa.zero_point + sign * ma, pb.zero_point + sign * mb)
    }

    /// For each parameter, the factor (at least 1) to multiply its scale by: among
    /// `SCALE_STEPS + 1` (17) factors from 1 to the one at which the parameter's largest same-sign
    /// pair sums to [`Self::max`], the one with the least squared error of the parameter's
    /// elements after nearest rounding and [`Self::fit`] (the smallest factor on ties).
    /// Parameters with no pair over the constraint keep factor 1.
    pub fn pair_scales(&self, params: &[QParams]) -> Vec<f32> {
        use rayon::prelude::*;
        let mut members: Vec<(Vec<[usize; 2]>, f64, Vec<usize>)> = vec![(vec![], 0.0, vec![]); params.len()];
        let mut paired = vec![false; self.data.len()];
        for &[a, b] in self.pairs {
            (paired[a], paired[b]) = (true, true);
            let p = (self.param_of)(a);
            if (self.param_of)(b) != p {
                continue;
            }
            let (x, y) = (self.data[a] as f64, self.data[b] as f64);
            if x * y > 0.0 {
                let m = &mut members[p];
                m.1 = m.1.max((x.abs() + y.abs()) / params[p].scale as f64);
            }
            members[p].0.push([a, b]);
        }
        for (e, _) in paired.iter().enumerate().filter(|(_, &x)| !x) {
            members[(self.param_of)(e)].2.push(e);
        }
        members.par_iter().zip(params.par_iter()).map(|((pairs, largest, singles), &p)| {
            let over = pairs.iter().any(|&[a, b]| {
                let (qa, qb) = (self.nearest(a, p), self.nearest(b, p));
                self.fit([a, b], qa, qb, p, p) != (qa, qb)
            });
            if !over || p.scale <= 0.0 {
                return 1.0;
            }
            let top = (largest / self.max as f64).max(1.0);
            let error = |f: f64| {
                let q = QParams { scale: (p.scale as f64 * f) as f32, zero_point: p.zero_point };
                let e = |i: usize, v: i64| (self.data[i] as f64 - q.scale as f64 * (v - q.zero_point) as f64).powi(2);
                let in_pairs: f64 = pairs.iter().map(|&[a, b]| {
                    let (qa, qb) = self.fit([a, b], self.nearest(a, q), self.nearest(b, q), q, q);
                    e(a, qa) + e(b, qb)
                }).sum();
                in_pairs + singles.iter().map(|&i| e(i, self.nearest(i, q))).sum::<f64>()
            };
            let factors: Vec<f64> = (0..=SCALE_STEPS).map(|k| 1.0 + (top - 1.0) * k as f64 / SCALE_STEPS as f64).collect();
            let errors: Vec<f64> = factors.iter().map(|&f| error(f)).collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(group: i64) -> Node {
        Node::new("Conv", "c").with_attr("group", qforge_ir::Attr::Int(group))
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
        PairedWeight { data, param_of, range: (-128, 127), pairs, max: 128 }
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
}
