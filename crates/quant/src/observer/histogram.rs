use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The smallest bin-width exponent: below every positive float32.
const MIN_EXP: i32 = -160;

/// A histogram on a canonical grid, so merges are exact and order-independent.
///
/// Bins have width `2^exp` and are aligned to zero: bin `k` holds values in
/// `[k * 2^exp, (k + 1) * 2^exp)`. `exp` is the smallest exponent for which the observed range
/// `[min, max]` spans at most `max_bins` bins, a function of the global range alone. Coarsening
/// merges bins pairwise exactly (each coarse bin is the union of two finer ones), so a histogram
/// counted in full from any batching or sharding of the same data is identical to one built in
/// one pass. A sampled count ([`Histogram::observe_every`]) decides its tails on the grid in
/// force; counted on a fresh histogram and merged, it depends on the values counted alone.
/// The zero-aligned grid also makes folding negative onto positive bins exact (histograms of
/// `|x|`, as TensorRT's entropy calibration uses).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub max_bins: usize,
    /// Bin width is `2^exp`.
    pub exp: i32,
    /// Grid index of `counts[0]`.
    pub first: i64,
    pub counts: Vec<u64>,
    /// Exact observed extremes (`+inf` / `-inf` before any finite value).
    pub min: f32,
    pub max: f32,
    pub nonfinite: u64,
}

fn bin_of(x: f32, exp: i32) -> i64 {
    bin_at(x, 2f64.powi(-exp))
}

/// `floor(x * inv_width)` for a power-of-two `inv_width`: the product is exact in f64 for every
/// float32 and exponent used here; truncation corrected downward for negative fractions (no
/// libm call, so the binning loop stays tight).
#[inline(always)]
fn bin_at(x: f32, inv_width: f64) -> i64 {
    let t = x as f64 * inv_width;
    let k = t as i64;
    k - i64::from(t < k as f64)
}

/// The largest grid index [`count_bins`] handles: `floor(x * 2^-exp)` and its difference to
/// `first` are then exact in f64.
const EXACT_GRID_INDEX: i64 = 1 << 50;

/// Grid indices below this magnitude are exact in f32, and so is `floor(x * 2^-exp)` for
/// `exp <= 0` (scaling up by a power of two neither rounds nor underflows).
const EXACT_F32_GRID_INDEX: i64 = 1 << 24;

/// The smallest f32 at or above `v`.
fn f32_at_least(v: f64) -> f32 {
    let f = v as f32;
    if (f as f64) < v { f.next_up() } else { f }
}

/// The largest f32 at or below `v`.
fn f32_at_most(v: f64) -> f32 {
    let f = v as f32;
    if (f as f64) > v { f.next_down() } else { f }
}

/// Sampled values that the bins of each tail hold at most, per [`count_bins`] flush: past
/// them, a bin is counted from the stride's sample.
const TAIL_SAMPLES: u32 = 32;

/// Adds the values of `data` to `counts[floor(x * 2^-exp) - first]`, the same bins as
/// [`bin_at`]. With a `stride` above one the bulk is sampled: values at positions `0, stride,
/// 2 * stride, ...` are counted first, and the bins at each end whose sample holds fewer than
/// [`TAIL_SAMPLES`] values in all (the sparse tails, where a range search decides what to
/// clip) are then counted one value at a time; every other bin takes `stride` counts per
/// sampled value. Every value must be finite and fall in the grid `counts` covers, whose
/// indices are at most [`EXACT_GRID_INDEX`] in magnitude; `stride` is at most 32.
///
/// Bin indices are computed a block at a time (vectorized; AVX2 when the CPU has it, for the
/// tails' candidate masks too), in f32 when that is exact (twice the lanes of f64), and counted
/// into four interleaved sub-histograms, so runs of equal values (a ReLU output's zeros) do not
/// serialize on one counter.
fn count_bins(counts: &mut [u64], data: &[f32], stride: usize, exp: i32, first: i64) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn count_bins_avx2(counts: &mut [u64], data: &[f32], stride: usize, exp: i32, first: i64) {
            count_bins_lanes(counts, data, stride, exp, first, |group, below, above| outside_bits_avx2(group, below, above))
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { count_bins_avx2(counts, data, stride, exp, first) };
        }
    }
    count_bins_lanes(counts, data, stride, exp, first, outside_bits)
}

/// Bit `k` is set when `group[k]` is below `below` or at least `above` (at most 32 values).
#[inline(always)]
fn outside_bits(group: &[f32], below: f32, above: f32) -> u32 {
    group.iter().enumerate().fold(0u32, |m, (k, &x)| m | (u32::from(x < below) | u32::from(x >= above)) << k)
}

/// [`outside_bits`] with AVX2 compares and sign-bit masks, eight values at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn outside_bits_avx2(group: &[f32], below: f32, above: f32) -> u32 {
    use std::arch::x86_64::*;
    if group.len() != 32 {
        return outside_bits(group, below, above);
    }
    let (below, above) = (_mm256_set1_ps(below), _mm256_set1_ps(above));
    (0..4).fold(0u32, |m, j| {
        // SAFETY: `group` holds 32 values, so the 8 from `8 * j` are in bounds.
        let x = unsafe { _mm256_loadu_ps(group.as_ptr().add(8 * j)) };
        let out = _mm256_or_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, below), _mm256_cmp_ps::<_CMP_GE_OQ>(x, above));
        m | (_mm256_movemask_ps(out) as u32) << (8 * j)
    })
}

/// [`count_bins`]' body, written so that the index computation vectorizes for whatever SIMD
/// width the caller is compiled for (sampled values are first copied into a contiguous
/// block). Counts go into four interleaved u16 sub-histograms (half the cache of u32),
/// flushed into `counts` every [`FLUSH`] values, before any of them can overflow. A sampled
/// value adds one to its bin's sub-count, and so does a tail value at a position the stride
/// skips; at the flush a sampled bin's sub-count weighs `stride`, a tail bin's one.
#[inline(always)]
fn count_bins_lanes(counts: &mut [u64], data: &[f32], stride: usize, exp: i32, first: i64, outside_bits: impl Fn(&[f32], f32, f32) -> u32) {
    const BLOCK: usize = 256;
    const WAYS: usize = 4;
    /// Values per flush: a way counts at most a quarter of them once, plus a quarter of the
    /// sampled ones, and u16 holds that.
    const FLUSH: usize = 1 << 17;
    debug_assert!((1..=32).contains(&stride));
    let last = first + counts.len() as i64 - 1;
    let in_f32 = (-126..=0).contains(&exp) && first.abs().max(last.abs()) < EXACT_F32_GRID_INDEX;
    let (inv_width, first_f64) = (2f64.powi(-exp), first as f64);
    let (inv_width_f32, first_f32) = (inv_width as f32, first as f32);
    // SAFETY (both loops): `x` is finite and inside the covered grid, so the difference is an
    // integer in `[0, counts.len())`, which i32 holds.
    let index = |block: &[f32], idx: &mut [u32; BLOCK]| {
        if in_f32 {
            for (i, &x) in idx.iter_mut().zip(block) {
                *i = unsafe { ((x * inv_width_f32).floor() - first_f32).to_int_unchecked::<i32>() } as u32;
            }
        } else {
            for (i, &x) in idx.iter_mut().zip(block) {
                *i = unsafe { ((x as f64 * inv_width).floor() - first_f64).to_int_unchecked::<i32>() } as u32;
            }
        }
    };
    let mut sub = vec![0u16; counts.len() * WAYS];
    let mut idx = [0u32; BLOCK];
    let mut picked = [0f32; BLOCK];
    /// Values whose tail candidates are found at once, as the bits of a u32.
    const GROUP: usize = 32;
    // `skipped[r]`: the bits of a group starting at a position `r` past a multiple of the
    // stride whose positions the stride skips.
    let skipped: Vec<u32> = (0..stride).map(|r| !((stride - r) % stride..GROUP).step_by(stride).fold(0u32, |m, k| m | 1 << k)).collect();
    for part in data.chunks(FLUSH) {
        for strided in part.chunks(BLOCK * stride) {
            let block = if stride == 1 {
                strided
            } else {
                for (p, &x) in picked.iter_mut().zip(strided.iter().step_by(stride)) {
                    *p = x;
                }
                &picked[..strided.len().div_ceil(stride)]
            };
            index(block, &mut idx);
            let mut ways = idx[..block.len()].chunks_exact(WAYS);
            for w in &mut ways {
                for (k, &i) in w.iter().enumerate() {
                    sub[i as usize * WAYS + k] += 1;
                }
            }
            for (k, &i) in ways.remainder().iter().enumerate() {
                sub[i as usize * WAYS + k] += 1;
            }
        }
        let sampled = if stride == 1 { 0..counts.len() } else { sampled_bins(&sub, WAYS) };
        if sampled.len() < counts.len() {
            // `i` is a tail bin when `i - sampled.start` wraps past the sampled width.
            let (from, width) = (sampled.start as u32, sampled.len() as u32);
            let in_tail = |i: u32| i.wrapping_sub(from) >= width;
            // Values inside `(below, above)` are in sampled bins: the bulk's edges, rounded
            // inward to f32, so a group within them needs no bin index.
            let edge = |bin: usize| (first + bin as i64) as f64 * 2f64.powi(exp);
            let below = if sampled.start == 0 { f32::NEG_INFINITY } else { f32_at_least(edge(sampled.start)) };
            let above = if sampled.end == counts.len() { f32::INFINITY } else { f32_at_most(edge(sampled.end)) };
            // The group's start position past a multiple of the stride.
            let mut start = 0;
            for group in part.chunks(GROUP) {
                // Bit k is set when value k may be in a tail and the stride skipped it; built
                // vectorized, walked bit by bit.
                let mut mask = skipped[start] & outside_bits(group, below, above);
                while mask != 0 {
                    let k = mask.trailing_zeros() as usize;
                    let i = bin_at(group[k], inv_width) - first;
                    if in_tail(i as u32) {
                        sub[i as usize * WAYS + k % WAYS] += 1;
                    }
                    mask &= mask - 1;
                }
                start += GROUP % stride;
                if start >= stride {
                    start -= stride;
                }
            }
        }
        for (b, (c, s)) in counts.iter_mut().zip(sub.chunks_exact_mut(WAYS)).enumerate() {
            let weight = if sampled.contains(&b) { stride as u64 } else { 1 };
            *c += s.iter().map(|&v| u64::from(v)).sum::<u64>() * weight;
            s.fill(0);
        }
    }
}

/// The bins between the two tails of a sampled sub-histogram (`ways` interleaved counts per
/// bin): each tail is the longest run of end bins holding fewer than [`TAIL_SAMPLES`] values.
fn sampled_bins(sub: &[u16], ways: usize) -> Range<usize> {
    let bin = |b: usize| sub[b * ways..(b + 1) * ways].iter().map(|&v| u32::from(v)).sum::<u32>();
    let bins = sub.len() / ways;
    let (mut end, mut held) = (bins, 0);
    while end > 0 && held + bin(end - 1) < TAIL_SAMPLES {
        held += bin(end - 1);
        end -= 1;
    }
    let (mut start, mut held) = (0, 0);
    while start < end && held + bin(start) < TAIL_SAMPLES {
        held += bin(start);
        start += 1;
    }
    start..end
}

/// The grid index a bin takes when the bin width grows by `2^shift` (`shift >= 0`): the
/// floor of the index over `2^shift`.
pub(super) fn coarse_index(shift: i32) -> impl Fn(i64) -> i64 {
    let shift = shift as u32;
    move |k| if shift >= 63 { if k < 0 { -1 } else { 0 } } else { k >> shift }
}

/// Bins spanned by `[min, max]` at width `2^exp`.
fn span(min: f32, max: f32, exp: i32) -> i64 {
    bin_of(max, exp) - bin_of(min, exp) + 1
}

/// The smallest exponent at which `[min, max]` spans at most `max_bins` bins whose grid
/// indices are at most [`EXACT_GRID_INDEX`] in magnitude. Without that bound a constant tensor
/// would take the finest grid there is, its index would saturate, and a later coarsening would
/// move its count to the wrong bin.
fn grid_exp(min: f32, max: f32, max_bins: usize) -> i32 {
    let width = max as f64 - min as f64;
    let magnitude = (min as f64).abs().max((max as f64).abs());
    let exact = if magnitude > 0.0 { magnitude.log2().floor() as i32 - EXACT_GRID_INDEX.ilog2() as i32 } else { MIN_EXP };
    let fits = if width > 0.0 { (width / max_bins as f64).log2().floor() as i32 } else { MIN_EXP };
    let mut e = fits.max(MIN_EXP).max(exact);
    while span(min, max, e) > max_bins as i64 || bin_of(min, e).abs().max(bin_of(max, e).abs()) > EXACT_GRID_INDEX {
        e += 1;
    }
    e
}

impl Histogram {
    /// An empty histogram of at most `max_bins` bins (at least 2).
    pub fn new(max_bins: usize) -> Histogram {
        Histogram { max_bins: max_bins.max(2), exp: MIN_EXP, first: 0, counts: vec![], min: f32::INFINITY, max: f32::NEG_INFINITY, nonfinite: 0 }
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn bin_width(&self) -> f64 {
        2f64.powi(self.exp)
    }

    /// Lower edge of bin `i` of `counts`.
    pub fn bin_start(&self, i: usize) -> f64 {
        (self.first + i as i64) as f64 * self.bin_width()
    }

    /// Re-bins to a coarser exponent.
    fn coarsen(&mut self, exp: i32) {
        if exp <= self.exp || self.counts.is_empty() {
            self.exp = self.exp.max(exp);
            return;
        }
        let coarse = coarse_index(exp - self.exp);
        let first = coarse(self.first);
        let last = coarse(self.first + self.counts.len() as i64 - 1);
        let mut counts = vec![0u64; (last - first + 1) as usize];
        for (i, &c) in self.counts.iter().enumerate() {
            counts[(coarse(self.first + i as i64) - first) as usize] += c;
        }
        self.exp = exp;
        self.first = first;
        self.counts = counts;
    }

    /// Makes room for grid indices `[lo, hi]` at the current exponent.
    fn cover(&mut self, lo: i64, hi: i64) {
        if self.counts.is_empty() {
            self.first = lo;
            self.counts = vec![0; (hi - lo + 1) as usize];
            return;
        }
        let last = self.first + self.counts.len() as i64 - 1;
        let (new_first, new_last) = (self.first.min(lo), last.max(hi));
        if new_first < self.first {
            let mut counts = vec![0u64; (self.first - new_first) as usize];
            counts.append(&mut self.counts);
            self.counts = counts;
            self.first = new_first;
        }
        self.counts.resize((new_last - self.first + 1) as usize, 0);
    }

    /// Adds values. Non-finite values are counted separately.
    pub fn observe(&mut self, data: &[f32]) {
        self.observe_every(data, 1)
    }

    /// Adds values, sampling the bulk at `stride` (at most 32) as [`count_bins`] describes, so
    /// the histogram weighs the same as one counted in full. The sparse tails, the extremes
    /// and the non-finite count cover every value.
    pub fn observe_every(&mut self, data: &[f32], stride: usize) {
        let extremes = super::finite_extremes(data);
        if self.cover_values(extremes) {
            let (exp, first) = (self.exp, self.first);
            count_bins(&mut self.counts, data, stride, exp, first);
        } else if extremes.0 <= extremes.1 {
            self.count_finite(data);
        }
    }

    /// Records a tensor's `(lo, hi, nonfinite)` from [`super::finite_extremes`] and makes
    /// the grid cover `[lo, hi]`. True when [`count_bins`] can count the tensor: it has a
    /// finite value, no non-finite one, and grid indices it can handle.
    fn cover_values(&mut self, (lo, hi, nonfinite): (f32, f32, u64)) -> bool {
        self.nonfinite += nonfinite;
        if lo > hi {
            return false;
        }
        self.min = self.min.min(lo);
        self.max = self.max.max(hi);
        self.coarsen(grid_exp(self.min, self.max, self.max_bins));
        self.cover(bin_of(lo, self.exp), bin_of(hi, self.exp));
        let last = self.first + self.counts.len() as i64 - 1;
        nonfinite == 0 && self.first.abs().max(last.abs()) <= EXACT_GRID_INDEX
    }

    /// Counts every finite value one by one, on a grid that already covers them.
    fn count_finite(&mut self, data: &[f32]) {
        let inv_width = 2f64.powi(-self.exp);
        for &x in data.iter().filter(|x| x.is_finite()) {
            self.counts[(bin_at(x, inv_width) - self.first) as usize] += 1;
        }
    }

    /// Combines another histogram with the same `max_bins` into this one.
    pub fn merge(&mut self, other: &Histogram) -> Result<(), String> {
        if other.max_bins != self.max_bins {
            return Err(format!("cannot merge a {}-bin histogram into a {}-bin one", other.max_bins, self.max_bins));
        }
        self.nonfinite += other.nonfinite;
        if other.counts.is_empty() {
            return Ok(());
        }
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        let exp = grid_exp(self.min, self.max, self.max_bins);
        self.coarsen(exp);
        // `other`'s bins mapped onto the coarser (or equal) grid: each lands whole in one bin.
        let coarse = coarse_index(exp - other.exp);
        self.cover(coarse(other.first), coarse(other.first + other.counts.len() as i64 - 1));
        for (i, &c) in other.counts.iter().enumerate() {
            self.counts[(coarse(other.first + i as i64) - self.first) as usize] += c;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count of the bin holding `x`.
    fn count_at(h: &Histogram, x: f32) -> u64 {
        h.counts[(bin_of(x, h.exp) - h.first) as usize]
    }

    #[test]
    fn a_constant_tensor_keeps_its_bin_when_later_values_widen_the_grid() {
        for c in [1.0f32, -3.5, 1e-30, 7e20] {
            let mut h = Histogram::new(2048);
            h.observe(&[c; 100]);
            h.observe(&[0.0, 2.0 * c]);
            assert_eq!(h.total(), 102);
            assert_eq!(count_at(&h, c), 100, "constant {c}: exp {}, first {}", h.exp, h.first);

            // The same values in one tensor give the same histogram.
            let mut once = Histogram::new(2048);
            once.observe(&[vec![c; 100], vec![0.0, 2.0 * c]].concat());
            assert_eq!(h, once, "constant {c}");
        }
    }

    #[test]
    fn bin_index_is_the_floor_at_edges_and_for_negatives() {
        for exp in [-160, -20, -3, 0, 4] {
            let w = 2f64.powi(exp);
            for k in [-1_000_001i64, -3, -1, 0, 1, 7, 1_000_001] {
                for x in [k as f64 * w, (k as f64 + 0.5) * w, (k as f64 + 1.0) * w - w / 1024.0] {
                    let x = x as f32;
                    if x.is_finite() {
                        assert_eq!(bin_of(x, exp), (x as f64 / w).floor() as i64, "x {x} exp {exp}");
                    }
                }
            }
        }
    }

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.3) * 10.0
        }).collect()
    }

    #[test]
    fn block_counting_puts_every_value_in_its_floor_bin() {
        // Mixed signs, a run of exact zeros (a ReLU output) and a length that is not a multiple
        // of the block or of the interleave; indices in f32 (exp <= 0, small grid) and in f64
        // (exp > 0, or a grid far from zero whose indices pass 2^24).
        let mut d = data(3001, 11);
        d.extend(std::iter::repeat_n(0.0, 1037));
        d.extend(data(5, 3).iter().map(|v| -v));
        let far: Vec<f32> = d.iter().map(|v| v + 3.0e4).collect();
        for (d, exp) in [(&d, -12), (&d, -5), (&d, 0), (&d, 2), (&far, -12), (&far, -9)] {
            let lo = d.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = d.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (first, last) = (bin_of(lo, exp), bin_of(hi, exp));
            let mut want = vec![0u64; (last - first + 1) as usize];
            for &x in d {
                want[((x as f64 / 2f64.powi(exp)).floor() as i64 - first) as usize] += 1;
            }
            let mut got = vec![0u64; want.len()];
            count_bins(&mut got, d, 1, exp, first);
            assert_eq!(got, want, "exp {exp}");
            // Without AVX2.
            let mut got = vec![0u64; want.len()];
            count_bins_lanes(&mut got, d, 1, exp, first, outside_bits);
            assert_eq!(got, want, "portable, exp {exp}");
        }
    }

    #[test]
    fn tail_candidates_are_the_same_with_and_without_avx2() {
        // Values on and around the bounds, and the bounds open (infinite) on either side.
        let values: Vec<f32> = (0..64).map(|i| [-2.0, -1.0, -1.0f32.next_up(), 0.0, 3.0f32.next_down(), 3.0, 7.5, -0.5][i % 8] * if i % 3 == 0 { 1.0 } else { -1.0 }).collect();
        for (below, above) in [(-1.0, 3.0), (f32::NEG_INFINITY, 3.0), (-1.0, f32::INFINITY), (f32::NEG_INFINITY, f32::INFINITY)] {
            for group in values.chunks(32).chain(values[5..].chunks(32)) {
                let expected = group.iter().enumerate().filter(|(_, &x)| x < below || x >= above).fold(0u32, |m, (k, _)| m | 1 << k);
                assert_eq!(outside_bits(group, below, above), expected, "[{below}, {above}) on {group:?}");
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    assert_eq!(unsafe { outside_bits_avx2(group, below, above) }, expected, "AVX2, [{below}, {above}) on {group:?}");
                }
            }
        }
    }

    #[test]
    fn sampled_counting_counts_tails_one_by_one_and_the_bulk_at_the_stride() {
        // A bulk in [-3, 7), and sparse far values on both sides at positions the stride skips.
        let mut d = data(200_001, 5);
        for (k, v) in [(9, 40.0), (1_001, 39.0), (77_777, 25.5), (150_003, -30.0)] {
            d[k] = v;
        }
        let exp = -4;
        let (first, last) = (bin_of(-30.0, exp), bin_of(40.0, exp));
        let mut exact = vec![0u64; (last - first + 1) as usize];
        for &x in &d {
            exact[(bin_of(x, exp) - first) as usize] += 1;
        }
        let mut got = vec![0u64; exact.len()];
        count_bins(&mut got, &d, 8, exp, first);
        // Everything outside the bulk is counted one by one.
        let bulk = (bin_of(-3.0, exp) - first) as usize..(bin_of(7.0, exp) - first) as usize;
        for (b, (&g, &e)) in got.iter().zip(&exact).enumerate().filter(|(b, _)| !bulk.contains(b)) {
            assert_eq!(g, e, "bin {b}");
        }
        // Inside it, a bin holds 8 counts per sampled value, or its exact count at its edges.
        let sampled: Vec<u64> = (0..exact.len()).map(|b| d.iter().step_by(8).filter(|&&x| (bin_of(x, exp) - first) as usize == b).count() as u64 * 8).collect();
        assert!(got.iter().zip(&exact).zip(&sampled).all(|((g, e), s)| g == e || g == s));
        let total: u64 = got.iter().sum();
        assert!(total.abs_diff(d.len() as u64) < d.len() as u64 / 100, "{total}");
    }

    #[test]
    fn one_bin_counts_past_the_sub_histograms_u16_range() {
        // 600k equal values, more than four ways of u16 can hold between flushes.
        let mut d = vec![0.0f32; 600_000];
        d.extend([1.0, -1.0, 0.5]);
        // Bins of width 1/2 from -1: [-1, -0.5), [-0.5, 0), [0, 0.5), [0.5, 1), [1, 1.5).
        let mut got = vec![0u64; 5];
        count_bins(&mut got, &d, 1, -1, -2);
        assert_eq!(got, vec![1, 0, 600_000, 1, 1]);
    }

    #[test]
    fn batching_does_not_change_the_result() {
        let d = data(5000, 7);
        let mut whole = Histogram::new(256);
        whole.observe(&d);
        assert_eq!(whole.total(), 5000);
        assert!(whole.counts.len() <= 256);
        let mut parts: Vec<Histogram> = d.chunks(333).map(|c| {
            let mut h = Histogram::new(256);
            h.observe(c);
            h
        }).collect();
        let mut merged = parts.pop().unwrap();
        while let Some(p) = parts.pop() {
            merged.merge(&p).unwrap();
        }
        assert_eq!(merged, whole);
        let mut streamed = Histogram::new(256);
        for c in d.chunks(17) {
            streamed.observe(c);
        }
        assert_eq!(streamed, whole);
    }

    #[test]
    fn bins_hold_their_values() {
        let d = data(1000, 3);
        let mut h = Histogram::new(64);
        h.observe(&d);
        for &x in &d {
            let i = ((x as f64 / h.bin_width()).floor() as i64 - h.first) as usize;
            assert!(h.bin_start(i) <= x as f64 && (x as f64) < h.bin_start(i + 1));
        }
        assert!(h.bin_start(0) <= h.min as f64 && h.max as f64 <= h.bin_start(h.counts.len()));
    }

    #[test]
    fn constant_and_nonfinite_input() {
        let mut h = Histogram::new(16);
        h.observe(&[0.0, 0.0, f32::NAN]);
        assert_eq!(h.total(), 2);
        assert_eq!(h.nonfinite, 1);
        h.observe(&[1.0]);
        assert_eq!(h.total(), 3);
        assert!(h.counts.len() <= 16);
    }
}
