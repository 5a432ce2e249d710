//! Range selection on a histogram: choosing the clipping range `[lo, hi]` that a quantizer
//! should use instead of the raw extremes.

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
}
