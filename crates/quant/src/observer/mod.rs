//! Observers: streaming statistics of the values a tensor takes during calibration.
//!
//! Every observer state merges associatively and commutatively, so the result does not depend
//! on how calibration data was batched, ordered or sharded across processes; states serialize
//! to JSON for that purpose. Non-finite values are counted and left out of the statistics.

mod histogram;
mod minmax;
mod monotone;
pub mod search;

pub use histogram::Histogram;
pub use minmax::MinMax;
pub use monotone::{Monotone, Step};

/// A run of `len` elements at stride `stride`, repeated: the channel layout of a tensor seen
/// along one axis. `outer` blocks of `channels * inner` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AxisLayout {
    pub outer: usize,
    pub channels: usize,
    pub inner: usize,
}

impl AxisLayout {
    /// The layout of `shape` along `axis` (`None`: the whole tensor is one channel).
    pub fn new(shape: &[usize], axis: Option<usize>) -> Option<AxisLayout> {
        match axis {
            None => Some(AxisLayout { outer: 1, channels: 1, inner: shape.iter().product() }),
            Some(a) if a < shape.len() => Some(AxisLayout {
                outer: shape[..a].iter().product(),
                channels: shape[a],
                inner: shape[a + 1..].iter().product(),
            }),
            Some(_) => None,
        }
    }

    /// Calls `f(channel, values)` for every contiguous run of one channel's values.
    pub fn for_each_run<T>(&self, data: &[T], mut f: impl FnMut(usize, &[T])) {
        for o in 0..self.outer {
            for c in 0..self.channels {
                let start = (o * self.channels + c) * self.inner;
                f(c, &data[start..start + self.inner]);
            }
        }
    }
}

/// The smallest and largest finite values of `run` (`+inf`/`-inf` when there are none) and
/// the number of non-finite ones. The common all-finite case runs lane-wise with compare-select
/// and integer bit tests, which vectorize (AVX2 when the CPU has it); a run holding NaN or
/// infinity is rescanned exactly.
pub(crate) fn finite_extremes(run: &[f32]) -> (f32, f32, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn finite_extremes_avx2(run: &[f32]) -> (f32, f32, u64) {
            finite_extremes_lanes(run)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { finite_extremes_avx2(run) };
        }
    }
    finite_extremes_lanes(run)
}

/// [`finite_extremes`]' body, written lane-wise so it vectorizes for whatever SIMD width the
/// caller is compiled for.
#[inline(always)]
fn finite_extremes_lanes(run: &[f32]) -> (f32, f32, u64) {
    const LANES: usize = 16;
    const EXPONENT: u32 = 0x7f80_0000;
    let mut lo = [f32::INFINITY; LANES];
    let mut hi = [f32::NEG_INFINITY; LANES];
    let mut bad = [0u32; LANES];
    let mut chunks = run.chunks_exact(LANES);
    for chunk in &mut chunks {
        for k in 0..LANES {
            let x = chunk[k];
            lo[k] = if x < lo[k] { x } else { lo[k] };
            hi[k] = if x > hi[k] { x } else { hi[k] };
            bad[k] += u32::from(x.to_bits() & EXPONENT == EXPONENT);
        }
    }
    let mut lo = lo.iter().copied().fold(f32::INFINITY, f32::min);
    let mut hi = hi.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut bad: u64 = bad.iter().map(|&b| b as u64).sum();
    for &x in chunks.remainder() {
        lo = if x < lo { x } else { lo };
        hi = if x > hi { x } else { hi };
        bad += u64::from(!x.is_finite());
    }
    if bad > 0 {
        let finite = run.iter().copied().filter(|x| x.is_finite());
        (lo, hi) = finite.fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), x| (l.min(x), h.max(x)));
    }
    (lo, hi, bad)
}

use crate::spec::{ObserverKind, RangeMethod};

/// Tensors of at least this many values are sampled by histogram observers.
pub const SAMPLED_FROM: usize = 1 << 16;

/// The sampling stride of large tensors in histogram observers. Odd and prime, so the sample
/// walks across the columns and channels of a feature map: a power of two divides common row
/// widths, samples the same columns of every row, and biases the bulk.
pub const SAMPLE_STRIDE: usize = 7;

/// The calibration statistic of one quantized activation, chosen by its spec's
/// [`ObserverKind`]: it streams tensors in, merges with states of the same kind, and yields
/// the range `[lo, hi]` the qparams are computed from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Observer {
    MinMax(MinMax),
    /// PyTorch's `MovingAverageMinMaxObserver`: `range = range + c * (sample_range - range)`
    /// per observed tensor, in calibration order. Order-dependent, so it does not merge.
    MovingAverage { averaging_constant: f32, min: f32, max: f32, seen: bool },
    Histogram { histogram: Histogram, range: RangeMethod },
    /// The state of a monotone map's output, from the observed state of its input (see
    /// [`Observer::mapped`]). Made after calibration; it neither observes nor merges.
    Mapped { source: Box<Observer>, map: Monotone },
}

impl Observer {
    /// A fresh per-tensor observer of a kind.
    pub fn new(kind: &ObserverKind) -> Observer {
        match *kind {
            ObserverKind::MinMax => Observer::MinMax(MinMax::new(None)),
            ObserverKind::MovingAverageMinMax { averaging_constant } => Observer::MovingAverage { averaging_constant, min: 0.0, max: 0.0, seen: false },
            ObserverKind::Histogram { bins, range } => Observer::Histogram { histogram: Histogram::new(bins), range },
        }
    }

    /// Adds one tensor's values. Large tensors are observed in parallel chunks of fixed
    /// positions, whose states merge exactly, so the state does not depend on how the chunks
    /// are scheduled. A histogram counts each chunk of a tensor of at least [`SAMPLED_FROM`]
    /// values on a grid of its own, right after finding its extremes, while the chunk is in
    /// cache: the bulk at every [`SAMPLE_STRIDE`]-th position and the sparse tails value by
    /// value (see [`Histogram::observe_every`]), then merges the counts. The range searches see
    /// the same distribution at a fraction of the cost, and the state does not depend on the
    /// order of the tensors or on how calibration split them over workers.
    pub fn observe(&mut self, data: &[f32]) {
        use rayon::prelude::*;
        /// Values per parallel chunk: 512 KB, about one core's L2 cache, so a histogram counts
        /// a chunk while its extremes pass has left it there. A chunk's histogram costs an
        /// allocation, a flush and a merge; 2^16-value chunks calibrated PP-OCRv6's detector
        /// about 9 % slower.
        const CHUNK: usize = 1 << 17;
        match self {
            Observer::Histogram { histogram, .. } if data.len() >= SAMPLED_FROM => {
                let max_bins = histogram.max_bins;
                let tensor = data.par_chunks(CHUNK).map(|chunk| {
                    let mut h = Histogram::new(max_bins);
                    h.observe_every(chunk, SAMPLE_STRIDE);
                    h
                }).reduce(|| Histogram::new(max_bins), |mut a, b| {
                    a.merge(&b).expect("the same max_bins");
                    a
                });
                histogram.merge(&tensor).expect("the same max_bins");
            }
            Observer::Histogram { histogram, .. } => histogram.observe(data),
            Observer::Mapped { .. } => debug_assert!(false, "a mapped state is derived, not observed"),
            Observer::MinMax(m) if data.len() > 2 * CHUNK => {
                let part = data.par_chunks(CHUNK).map(|c| {
                    let mut o = MinMax::new(None);
                    o.observe(c, &[c.len()]).expect("a per-tensor observer takes any shape");
                    o
                }).reduce(|| MinMax::new(None), |mut a, b| {
                    a.merge(&b).expect("per tensor");
                    a
                });
                m.merge(&part).expect("per tensor");
            }
            Observer::MinMax(m) => m.observe(data, &[data.len()]).expect("a per-tensor observer takes any shape"),
            Observer::MovingAverage { averaging_constant: c, min, max, seen } => {
                let mut m = MinMax::new(None);
                m.observe(data, &[data.len()]).expect("per tensor");
                if let Some((lo, hi)) = m.range() {
                    if *seen {
                        *min += *c * (lo - *min);
                        *max += *c * (hi - *max);
                    } else {
                        (*min, *max, *seen) = (lo, hi, true);
                    }
                }
            }
        }
    }

    /// Combines another state of the same kind into this one.
    pub fn merge(&mut self, other: &Observer) -> Result<(), String> {
        match (self, other) {
            (Observer::MinMax(a), Observer::MinMax(b)) => a.merge(b),
            (Observer::Histogram { histogram: a, .. }, Observer::Histogram { histogram: b, .. }) => a.merge(b),
            (Observer::MovingAverage { .. }, _) => Err("moving-average observers depend on sample order and cannot be merged".into()),
            (Observer::Mapped { .. }, _) | (_, Observer::Mapped { .. }) => Err("a mapped state is derived after calibration and does not merge".into()),
            _ => Err("cannot merge observers of different kinds".into()),
        }
    }

    /// The observed extremes, if any finite value was seen.
    pub fn extremes(&self) -> Option<(f32, f32)> {
        match self {
            Observer::MinMax(m) => m.range(),
            Observer::MovingAverage { min, max, seen, .. } => seen.then_some((*min, *max)),
            Observer::Histogram { histogram: h, .. } => (h.min <= h.max).then_some((h.min, h.max)),
            Observer::Mapped { source, map } => source.extremes().map(|(lo, hi)| map.image(lo, hi)),
        }
    }

    /// The range to quantize, for a target of `levels` integer levels: the extremes, or the
    /// histogram's range search. A histogram of fewer values than it has bins (a classifier's
    /// logits, a regression head's one value per sample) gives its extremes: a search over
    /// mostly empty bins clips on noise.
    pub fn range(&self, levels: usize) -> Option<(f32, f32)> {
        let (min, max) = self.extremes()?;
        let (h, range, map) = match self {
            Observer::Histogram { histogram, range } => (histogram, range, None),
            Observer::Mapped { source, map } => match &**source {
                Observer::Histogram { histogram, range } => (histogram, range, Some(map)),
                _ => return Some((min, max)),
            },
            _ => return Some((min, max)),
        };
        if h.total() < h.max_bins as u64 || min == max {
            return Some((min, max));
        }
        let (counts, lo, hi) = map.map_or_else(|| h.uniform(), |f| f.bins(h));
        let bins = search::UniformBins { counts: &counts, min: lo, max: hi };
        let (a, b) = match *range {
            RangeMethod::MinMax => return Some((min, max)),
            RangeMethod::Percentile { percentile } => search::percentile_range(&bins, percentile),
            RangeMethod::L2 => search::l2_search(&bins, levels),
            RangeMethod::Mse => search::mse_search(&bins, levels, 100),
            RangeMethod::Auto { gain } => match search::mse_search_with_gain(&bins, levels, 100) {
                (range, g) if g >= gain => range,
                _ => return Some((min, max)),
            },
            // A mapped state is never an entropy one (see `Observer::mapped`).
            RangeMethod::Entropy => {
                let (mut sym, t) = search::symmetric_bins(h);
                search::flatten_zero_bin(&mut sym);
                // The window is symmetric; a one-sided tensor uses only half of it, so the
                // target's levels span half the window's bins.
                let one_sided = min >= 0.0 || max <= 0.0;
                let window_levels = if one_sided { 2 * levels } else { levels };
                search::entropy_search(&sym, t, min as f64, max as f64, window_levels)
            }
        };
        Some(((a as f32).max(min), (b as f32).min(max)))
    }

    /// Non-finite values seen (left out of the statistics).
    pub fn nonfinite(&self) -> u64 {
        match self {
            Observer::MinMax(m) => m.nonfinite,
            Observer::Histogram { histogram, .. } => histogram.nonfinite,
            Observer::MovingAverage { .. } => 0,
            Observer::Mapped { source, .. } => source.nonfinite(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Half-normal magnitudes from a fixed xorshift stream (Box-Muller).
    fn half_normal(n: usize) -> Vec<f32> {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos()).abs() as f32).collect()
    }

    #[test]
    fn entropy_range_of_a_relu_output_keeps_its_tail() {
        // A ReLU output: 90 % exact zeros, the rest half-normal.
        let tail = half_normal(20_000);
        let mut data = vec![0.0f32; 180_000];
        data.extend_from_slice(&tail);
        let mut observer = Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Entropy });
        for chunk in data.chunks(10_000) {
            observer.observe(chunk);
        }
        let (lo, hi) = observer.range(256).unwrap();
        let mut sorted = tail.clone();
        sorted.sort_by(f32::total_cmp);
        let p99 = sorted[sorted.len() * 99 / 100];
        let max = *sorted.last().unwrap();
        assert_eq!(lo, 0.0);
        assert!(hi >= p99 && hi <= max, "clip {hi} should keep 99 % of the non-zero values (p99 {p99}, max {max})");
    }

    #[test]
    fn auto_clips_only_where_the_clip_cuts_the_error_enough() {
        let auto = ObserverKind::Histogram { bins: 2048, range: RangeMethod::Auto { gain: 3.0 } };
        // Half-normal bulk: the MSE clip gains little, so the extremes stay.
        let bulk = half_normal(3_000_000);
        let mut o = Observer::new(&auto);
        o.observe(&bulk);
        assert_eq!(o.range(256), o.extremes());
        let mut mse = Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Mse });
        mse.observe(&bulk);
        assert_ne!(mse.range(256), mse.extremes(), "mse itself clips the bulk a little");
        // The same bulk and one value 150 times further out. Over [0, 800] every bulk value
        // rounds with a step of ~3 (about 3e6 * 3.1^2 / 12 ~ 2.5e6 of squared error); a range
        // near [0, 250] cuts that about 10x for ~3e5 on the one value, so auto takes mse's range.
        let mut wide = bulk.clone();
        wide.push(800.0);
        let (mut o, mut m) = (Observer::new(&auto), Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Mse }));
        o.observe(&wide);
        m.observe(&wide);
        let (_, hi) = o.range(256).unwrap();
        assert!(hi < 400.0, "auto kept the far value: hi = {hi}");
        assert_eq!(o.range(256), m.range(256));
    }

    /// The squared error of `data` quantized affinely to u8 over `[lo, hi]` (zero exact, as
    /// PyTorch's `_calculate_qparams` widens a range to hold it).
    fn u8_error(data: &[f32], lo: f32, hi: f32) -> f64 {
        let (lo, hi) = (lo.min(0.0) as f64, hi.max(0.0) as f64);
        let scale = (hi - lo) / 255.0;
        let zero = (-lo / scale).round();
        data.iter().map(|&x| {
            let q = ((x as f64 / scale).round() + zero).clamp(0.0, 255.0);
            ((q - zero) * scale - x as f64).powi(2)
        }).sum()
    }

    #[test]
    fn large_tensors_are_sampled_with_exact_extremes_and_full_weight() {
        let n = SAMPLED_FROM + 12_345;
        let mut data = half_normal(n);
        // The extremes sit where the stride does not sample.
        data[SAMPLE_STRIDE + 1] = 40.0;
        data[3 * SAMPLE_STRIDE + 5] = -2.0;
        for range in [RangeMethod::Mse, RangeMethod::Percentile { percentile: 99.9 }, RangeMethod::Auto { gain: 3.0 }] {
            let kind = ObserverKind::Histogram { bins: 2048, range };
            let mut sampled = Observer::new(&kind);
            sampled.observe(&data);
            let mut counted = Histogram::new(2048);
            counted.observe(&data);
            let full = Observer::Histogram { histogram: counted, range };
            let (Observer::Histogram { histogram: h, .. }, Observer::Histogram { histogram: f, .. }) = (&sampled, &full) else { unreachable!() };
            assert!(h.total().abs_diff(n as u64) < n as u64 / 200, "total {} of {n} values", h.total());
            // The far value's bins are a sparse tail: counted one by one.
            assert_eq!((h.exp, h.first), (f.exp, f.first));
            let tail = h.counts.iter().enumerate().position(|(i, _)| h.bin_start(i) > 20.0).unwrap();
            assert_eq!(h.counts[tail..], f.counts[tail..]);
            assert_eq!(sampled.extremes(), Some((-2.0, 40.0)));
            let ((lo, hi), (full_lo, full_hi)) = (sampled.range(256).unwrap(), full.range(256).unwrap());
            if let RangeMethod::Percentile { .. } = range {
                assert!((hi - full_hi).abs() <= 0.02 * full_hi && (lo - full_lo).abs() <= 0.02 * (full_hi - full_lo), "{range:?}: sampled [{lo}, {hi}], counted in full [{full_lo}, {full_hi}]");
            } else {
                // A range search may settle on another range of nearly the same error: the
                // data's error over the sampled range must be within 2 % of the full count's.
                let (error, full_error) = (u8_error(&data, lo, hi), u8_error(&data, full_lo, full_hi));
                assert!(error <= 1.02 * full_error, "{range:?}: sampled [{lo}, {hi}] error {error}, counted in full [{full_lo}, {full_hi}] error {full_error}");
            }
        }
        // A tensor below the threshold is counted in full.
        let mut small = Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Mse });
        small.observe(&data[..SAMPLED_FROM - 1]);
        let mut full = Histogram::new(2048);
        full.observe(&data[..SAMPLED_FROM - 1]);
        assert_eq!(small, Observer::Histogram { histogram: full, range: RangeMethod::Mse });
    }

    #[test]
    fn sampled_histograms_do_not_depend_on_the_order_or_the_worker_that_saw_a_tensor() {
        // Calibration workers take samples as they come, so the same tensors reach an observer
        // in any order and split over any number of copies that are merged later. A narrow
        // tensor and a wide one, both sampled: whichever comes first, and however they are
        // split, the state must be the same.
        let narrow: Vec<f32> = half_normal(SAMPLED_FROM + 999);
        let wide: Vec<f32> = half_normal(3 * SAMPLED_FROM + 7).iter().map(|v| 60.0 * v - 5.0).collect();
        for range in [RangeMethod::Percentile { percentile: 99.99 }, RangeMethod::Mse] {
            let kind = ObserverKind::Histogram { bins: 2048, range };
            let seen = |tensors: &[&[f32]]| {
                let mut o = Observer::new(&kind);
                tensors.iter().for_each(|t| o.observe(t));
                o
            };
            let forward = seen(&[&narrow, &wide]);
            assert_eq!(forward, seen(&[&wide, &narrow]), "{range:?}: order");
            let mut split = seen(&[&wide]);
            split.merge(&seen(&[&narrow])).unwrap();
            assert_eq!(forward, split, "{range:?}: two workers");
        }
    }

    #[test]
    fn sampling_does_not_lock_onto_power_of_two_periods() {
        // A feature map whose every 8th column is brighter: 1/8 of the values near 2, the rest
        // near 1, over 64 chunks. A sample of every 8th value would see only the bright ones.
        let noise = half_normal(1 << 22);
        let data: Vec<f32> = noise.iter().enumerate().map(|(i, v)| if i % 8 == 0 { 2.0 } else { 1.0 } + 0.01 * v).collect();
        let mut o = Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Mse });
        o.observe(&data);
        let Observer::Histogram { histogram: h, .. } = &o else { unreachable!() };
        let bright: u64 = h.counts.iter().enumerate().filter(|&(i, _)| h.bin_start(i) >= 1.5).map(|(_, &c)| c).sum();
        let share = bright as f64 / h.total() as f64;
        assert!((share - 0.125).abs() < 0.005, "bright share {share}");
    }

    #[test]
    fn searches_over_fewer_values_than_bins_keep_the_extremes() {
        // One regression output per sample, 32 samples: every search method keeps the whole
        // observed range; with 64 times the values the same data is clipped.
        let few: Vec<f32> = half_normal(32).iter().map(|v| -0.2 - v).collect();
        for range in [RangeMethod::Entropy, RangeMethod::Mse, RangeMethod::L2, RangeMethod::Percentile { percentile: 99.0 }] {
            let mut observer = Observer::new(&ObserverKind::Histogram { bins: 2048, range });
            observer.observe(&few);
            assert_eq!(observer.range(256), observer.extremes(), "{range:?}");
        }
        let many: Vec<f32> = half_normal(32 * 2048).iter().map(|v| -0.2 - v).collect();
        let mut observer = Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Percentile { percentile: 99.0 } });
        observer.observe(&many);
        let ((lo, _), (min, _)) = (observer.range(256).unwrap(), observer.extremes().unwrap());
        assert!(lo > min, "{lo} {min}");
    }
}
