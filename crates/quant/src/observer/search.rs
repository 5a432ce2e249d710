//! Range selection on a histogram: choosing the clipping range `[lo, hi]` that a quantizer
//! should use instead of the raw extremes.

use super::histogram::coarse_index;
use super::Histogram;

/// A histogram with uniform bins over `[min, max]`, the form the search algorithms take.
#[derive(Debug, Clone, PartialEq)]
pub struct UniformBins<'a> {
    pub counts: &'a [f64],
    pub min: f64,
    pub max: f64,
}

impl Histogram {
    /// Counts as `f64` with the grid range they cover, for the search functions.
    pub fn uniform(&self) -> (Vec<f64>, f64, f64) {
        (self.counts.iter().map(|&c| c as f64).collect(), self.bin_start(0), self.bin_start(self.counts.len()))
    }
}

/// PyTorch's `HistogramObserver._non_linear_param_search` (from caffe2's
/// `NormMinimization::NonlinearQuantizationParamsSearch`): shrink the range from whichever
/// side holds less mass, in quantile steps of 1e-5, while the L2 quantization error of
/// quantizing the histogram to `dst_nbins` levels over the candidate range keeps decreasing.
pub fn l2_search(h: &UniformBins, dst_nbins: usize) -> (f64, f64) {
    let bins = h.counts.len();
    if bins == 0 {
        return (h.min, h.max);
    }
    let bin_width = (h.max - h.min) / bins as f64;
    let total: f64 = h.counts.iter().sum();
    let csum: Vec<f64> = h.counts.iter().scan(0.0, |s, &c| { *s += c; Some(*s) }).collect();
    let stepsize = 1e-5;
    let (mut alpha, mut beta) = (0.0f64, 1.0f64);
    let (mut start_bin, mut end_bin) = (0usize, bins - 1);
    let mut norm_min = f64::INFINITY;
    while alpha < beta {
        let next_alpha = alpha + stepsize;
        let next_beta = beta - stepsize;
        let (mut l, mut r) = (start_bin, end_bin);
        while l < end_bin && csum[l] < next_alpha * total {
            l += 1;
        }
        while r > start_bin && csum[r] > next_beta * total {
            r -= 1;
        }
        let (mut next_start, mut next_end) = (start_bin, end_bin);
        if (l - start_bin) > (end_bin - r) {
            next_start = l;
            alpha = next_alpha;
        } else {
            next_end = r;
            beta = next_beta;
        }
        if next_start == start_bin && next_end == end_bin {
            continue;
        }
        let norm = l2_error(h, bin_width, next_start, next_end, dst_nbins);
        if norm > norm_min {
            break;
        }
        norm_min = norm;
        start_bin = next_start;
        end_bin = next_end;
    }
    (h.min + bin_width * start_bin as f64, h.min + bin_width * (end_bin + 1) as f64)
}

/// PyTorch's `_compute_quantization_error`: the L2 error of quantizing the piecewise-constant
/// density of the histogram to `dst_nbins` levels spanning bins `start..=end`.
fn l2_error(h: &UniformBins, bin_width: f64, start: usize, end: usize, dst_nbins: usize) -> f64 {
    let dst_bin_width = bin_width * (end - start + 1) as f64 / dst_nbins as f64;
    if dst_bin_width == 0.0 {
        return 0.0;
    }
    let last = (dst_nbins - 1) as f64;
    let norm = |begin: f64, end: f64, density: f64| density * (end * end * end - begin * begin * begin) / 3.0;
    let mut total = 0.0;
    for (i, &count) in h.counts.iter().enumerate() {
        let density = count / bin_width;
        let src_begin = (i as f64 - start as f64) * bin_width;
        let src_end = src_begin + bin_width;
        let dst_of_begin = (src_begin / dst_bin_width).floor().clamp(0.0, last);
        let dst_of_end = (src_end / dst_bin_width).floor().clamp(0.0, last);
        let dst_begin_center = (dst_of_begin + 0.5) * dst_bin_width;
        let dst_end_center = dst_of_end * dst_bin_width + dst_bin_width / 2.0;
        total += norm(src_begin - dst_begin_center, dst_bin_width / 2.0, density);
        total += (dst_of_end - dst_of_begin - 1.0) * norm(-dst_bin_width / 2.0, dst_bin_width / 2.0, density);
        total += norm(-dst_bin_width / 2.0, src_end - dst_end_center, density);
    }
    total
}

/// The range holding the central `percentile` percent of the mass: the lower and upper
/// `(100 - percentile) / 2` percent tails are cut, interpolating linearly inside a bin.
pub fn percentile_range(h: &UniformBins, percentile: f64) -> (f64, f64) {
    let total: f64 = h.counts.iter().sum();
    if total == 0.0 || h.counts.is_empty() {
        return (h.min, h.max);
    }
    let tail = total * (100.0 - percentile.clamp(0.0, 100.0)) / 200.0;
    let width = (h.max - h.min) / h.counts.len() as f64;
    let locate = |target: f64| -> f64 {
        let mut acc = 0.0;
        for (i, &c) in h.counts.iter().enumerate() {
            if c > 0.0 && acc + c >= target {
                return h.min + width * (i as f64 + ((target - acc) / c).clamp(0.0, 1.0));
            }
            acc += c;
        }
        h.max
    };
    (locate(tail), locate(total - tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l2_search_clips_a_lone_outlier() {
        let mut counts = vec![0.0; 2048];
        for c in counts.iter_mut().take(200) {
            *c = 1000.0;
        }
        counts[2047] = 1.0;
        let (lo, hi) = l2_search(&UniformBins { counts: &counts, min: 0.0, max: 2048.0 }, 256);
        assert_eq!(lo, 0.0);
        assert!(hi < 300.0, "outlier at 2047 was kept: hi = {hi}");
        assert!(hi >= 150.0, "bulk of the mass was clipped: hi = {hi}");
    }

    #[test]
    fn percentile_of_uniform_mass() {
        let counts = vec![10.0; 100];
        let (lo, hi) = percentile_range(&UniformBins { counts: &counts, min: 0.0, max: 100.0 }, 98.0);
        assert!((lo - 1.0).abs() < 1e-9 && (hi - 99.0).abs() < 1e-9, "{lo} {hi}");
    }

    /// The entropy search's histogram, read back: every value must fall in a bin with a count,
    /// and the counts must add up to the values observed.
    fn assert_holds(counts: &[f64], t: f64, data: &[f32]) {
        let k = counts.len() / 2;
        let width = t / k as f64;
        assert_eq!(counts.iter().sum::<f64>(), data.len() as f64);
        for &x in data {
            let bin = (x as f64 / width).floor() as i64 + k as i64;
            assert!((0..counts.len() as i64).contains(&bin) && counts[bin as usize] > 0.0, "{x} falls in empty or missing bin {bin} of {}", counts.len());
        }
    }

    #[test]
    fn symmetric_bins_merge_a_range_far_from_zero_to_max_bins_a_side() {
        // 0.5 wide at 1000: the 2048-bin grid has width 2^-12, and padding it to zero would
        // take over four million bins.
        let far: Vec<f32> = (0..10_000).map(|i| 1000.0 + 0.5 * i as f32 / 9999.0).collect();
        let mut h = Histogram::new(2048);
        h.observe(&far);
        let (counts, t) = symmetric_bins(&h);
        assert!(counts.len() <= 2 * 2048 && counts.len() % 2 == 0, "{} bins", counts.len());
        assert!(t >= 1000.5 && t <= 2.0 * 1000.5, "t = {t}");
        assert_holds(&counts, t, &far);
        let (lo, hi) = entropy_search(&counts, t, h.min as f64, h.max as f64, 512);
        assert!(h.min as f64 <= lo && lo <= hi && hi <= h.max as f64, "[{lo}, {hi}]");

        // A range holding zero is only padded: bin j of the grid lands at j + max(|first|, |end|).
        let near: Vec<f32> = (0..10_000).map(|i| -1.0 + 4.0 * i as f32 / 9999.0).collect();
        let mut h = Histogram::new(2048);
        h.observe(&near);
        let (counts, t) = symmetric_bins(&h);
        let end = h.first + h.counts.len() as i64;
        let k = h.first.abs().max(end.abs());
        assert_eq!(counts.len() as i64, 2 * k);
        assert_eq!(t, k as f64 * h.bin_width());
        for (i, &c) in h.counts.iter().enumerate() {
            assert_eq!(counts[(h.first + i as i64 + k) as usize], c as f64);
        }
        assert_holds(&counts, t, &near);
    }
}

/// A histogram over `[-t, t]` with an even number of bins, at most twice the source's
/// `max_bins`, the form the entropy search takes. Made from a zero-aligned [`Histogram`] by
/// padding it with empty bins to symmetric extent. A range far from zero and narrow beside its
/// distance (values in `[0.99, 1]`) would pad to millions of bins, and the search is quadratic
/// in them; such a histogram is first merged by a power of two, which keeps zero on a bin
/// edge, until each side has at most `max_bins` bins. A range that holds zero spans at most
/// `max_bins` bins already and is never merged.
pub fn symmetric_bins(h: &Histogram) -> (Vec<f64>, f64) {
    if h.counts.is_empty() {
        return (vec![0.0, 0.0], 0.0);
    }
    let end = h.first + h.counts.len() as i64;
    // The symmetric extent of bins [first, end) merged by 2^merge.
    let extent = |merge: i32| {
        let merged = coarse_index(merge);
        merged(h.first).abs().max((merged(end - 1) + 1).abs()).max(1)
    };
    let mut merge = 0;
    while extent(merge) > h.max_bins.max(1) as i64 {
        merge += 1;
    }
    let (k, merged) = (extent(merge), coarse_index(merge));
    let mut counts = vec![0.0; 2 * k as usize];
    for (i, &c) in h.counts.iter().enumerate() {
        counts[(merged(h.first + i as i64) + k) as usize] += c as f64;
    }
    (counts, k as f64 * h.bin_width() * (1u64 << merge) as f64)
}

/// Gives the bin `[0, width)` of a zero-centred histogram (from [`symmetric_bins`]) the count
/// of the bin after it, as NVIDIA's pytorch-quantization entropy calibrator does with its first
/// `|x|` bin. A ReLU output is mostly exact zeros; left as it is, that spike dominates both
/// distributions of the KL search, and the narrowest windows (where each quantized level covers
/// one bin, so the spike is reproduced exactly) win however much of the tail they clip.
pub fn flatten_zero_bin(counts: &mut [f64]) {
    let zero = counts.len() / 2;
    if zero + 1 < counts.len() {
        counts[zero] = counts[zero + 1];
    }
}

/// KL-divergence (entropy) calibration as TensorRT describes it and ONNX Runtime implements it
/// (`HistogramCollector.get_entropy_threshold`): for each candidate symmetric window of the
/// histogram `counts` over `[-t, t]`, fold the outliers into the edge bins (reference `p`),
/// quantize the window to `num_quantized_bins` levels and expand back (candidate `q`, spread
/// over the non-empty bins), smooth both, and keep the window with the smallest KL(p || q).
/// The result is clipped to the observed `[min, max]`.
pub fn entropy_search(counts: &[f64], t: f64, min: f64, max: f64, num_quantized_bins: usize) -> (f64, f64) {
    let num_bins = counts.len();
    let zero = num_bins / 2;
    let half_q = num_quantized_bins / 2;
    if num_bins == 0 || half_q == 0 || zero < half_q {
        return (min, max);
    }
    let edge = |i: usize| -t + 2.0 * t * i as f64 / num_bins as f64;
    let mut best = (f64::INFINITY, (min, max));
    for i in half_q..=zero {
        let start = zero - i;
        let end = (zero + i + 1).min(num_bins);
        let slice = &counts[start..end];
        let mut p = slice.to_vec();
        p[0] += counts[..start].iter().sum::<f64>();
        *p.last_mut().unwrap() += counts[end..].iter().sum::<f64>();
        let merged = slice.len() / num_quantized_bins;
        let mut quantized = vec![0.0f64; num_quantized_bins];
        for (k, qb) in quantized.iter_mut().enumerate() {
            *qb = slice[k * merged..(k + 1) * merged].iter().sum();
        }
        *quantized.last_mut().unwrap() += slice[num_quantized_bins * merged..].iter().sum::<f64>();
        let mut q = vec![0.0f64; p.len()];
        for (k, &qb) in quantized.iter().enumerate() {
            let range = k * merged..(k + 1) * merged;
            let nonzero = p[range.clone()].iter().filter(|&&x| x != 0.0).count();
            if nonzero != 0 {
                // ORT stores q as int64: the share is truncated.
                let share = (qb / nonzero as f64).trunc();
                q[range].iter_mut().for_each(|x| *x = share);
            }
        }
        let div = match (smooth(&p), smooth(&q)) {
            (Some(p), Some(q)) => kl_divergence(&p, &q),
            _ => f64::INFINITY,
        };
        if div < best.0 {
            best = (div, (edge(start), edge(end)));
        }
    }
    let (lo, hi) = best.1;
    (lo.max(min), hi.min(max))
}

/// Replaces zeros with `eps` and takes the same total off the non-zero entries
/// (ONNX Runtime's `smooth_distribution`, eps = 1e-4). `None` when every entry is zero.
fn smooth(p: &[f64]) -> Option<Vec<f64>> {
    let eps = 1e-4;
    let zeros = p.iter().filter(|&&x| x == 0.0).count();
    let nonzeros = p.len() - zeros;
    if nonzeros == 0 {
        return None;
    }
    let eps1 = eps * zeros as f64 / nonzeros as f64;
    Some(p.iter().map(|&x| if x == 0.0 { eps } else { x - eps1 }).collect())
}

/// KL(p || q) of two unnormalized distributions, in nats.
fn kl_divergence(p: &[f64], q: &[f64]) -> f64 {
    let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
    p.iter().zip(q).map(|(&a, &b)| {
        let (a, b) = (a / sp, b / sq);
        if a > 0.0 && b > 0.0 { a * (a / b).ln() } else if a == 0.0 { 0.0 } else { f64::INFINITY }
    }).sum()
}

/// The range minimizing the expected squared error of quantizing the histogram's values (taken
/// at bin centers) to `levels` uniform levels, clipping included. Candidates shrink the
/// observed range `[min, max]` towards zero in `steps` equal steps, the two ends independently
/// scaled by the same factor (so the zero point stays where the full range puts it).
pub fn mse_search(h: &UniformBins, levels: usize, steps: usize) -> (f64, f64) {
    mse_search_with_gain(h, levels, steps).0
}

/// [`mse_search`]'s range with its gain: the error over the whole range divided by the error
/// over the chosen one (1 when it keeps the whole range; infinite when the chosen range has no
/// error).
pub fn mse_search_with_gain(h: &UniformBins, levels: usize, steps: usize) -> ((f64, f64), f64) {
    let lo0 = h.min.min(0.0);
    let hi0 = h.max.max(0.0);
    if h.counts.is_empty() || hi0 <= lo0 || levels < 2 {
        return ((h.min, h.max), 1.0);
    }
    let width = (h.max - h.min) / h.counts.len() as f64;
    let error = |lo: f64, hi: f64| -> f64 {
        let step = (hi - lo) / (levels - 1) as f64;
        h.counts.iter().enumerate().filter(|(_, &c)| c > 0.0).map(|(i, &c)| {
            let x = h.min + width * (i as f64 + 0.5);
            let q = ((x.clamp(lo, hi) - lo) / step).round_ties_even() * step + lo;
            c * (x - q) * (x - q)
        }).sum()
    };
    let full = error(lo0, hi0);
    let mut best = (full, (lo0, hi0));
    for k in 1..steps {
        let f = 1.0 - k as f64 / steps as f64;
        let e = error(lo0 * f, hi0 * f);
        if e < best.0 {
            best = (e, (lo0 * f, hi0 * f));
        }
    }
    let gain = if best.0 > 0.0 { full / best.0 } else if full > 0.0 { f64::INFINITY } else { 1.0 };
    (best.1, gain)
}

#[cfg(test)]
mod mse_tests {
    use super::*;

    #[test]
    fn mse_prefers_clipping_sparse_outliers() {
        // 10^7 values in [0, 10), one at 1000. Over [0, 1001] the step is ~3.9, costing
        // ~1.3 per bulk value (~1.3e7 in all); clipping at ~10 costs the outlier ~990^2 ~ 1e6.
        let mut counts = vec![0.0; 1001];
        for c in counts.iter_mut().take(10) {
            *c = 1e6;
        }
        counts[1000] = 1.0;
        let (lo, hi) = mse_search(&UniformBins { counts: &counts, min: 0.0, max: 1001.0 }, 256, 200);
        assert_eq!(lo, 0.0);
        assert!(hi < 200.0, "hi = {hi}");
    }

    #[test]
    fn mse_keeps_a_uniform_range() {
        let counts = vec![5.0; 100];
        let (lo, hi) = mse_search(&UniformBins { counts: &counts, min: -1.0, max: 1.0 }, 256, 100);
        assert!(lo <= -0.98 && hi >= 0.98, "{lo} {hi}");
    }
}
