use serde::{Deserialize, Serialize};

/// The smallest bin-width exponent: below every positive float32.
const MIN_EXP: i32 = -160;

/// A histogram on a canonical grid, so merges are exact and order-independent.
///
/// Bins have width `2^exp` and are aligned to zero: bin `k` holds values in
/// `[k * 2^exp, (k + 1) * 2^exp)`. `exp` is the smallest exponent for which the observed range
/// `[min, max]` spans at most `max_bins` bins, a function of the global range alone. Coarsening
/// merges bins pairwise exactly (each coarse bin is the union of two finer ones), so a histogram
/// built from any batching or sharding of the same data is identical to one built in one pass.
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

/// Adds one count per value of `data` to `counts[floor(x * 2^-exp) - first]`, the same bins
/// as [`bin_at`]. Every value must be finite and fall in the grid `counts` covers, whose
/// indices are at most [`EXACT_GRID_INDEX`] in magnitude. Bin indices are computed a block at a
/// time (vectorized; AVX2 when the CPU has it), in f32 when that is exact (twice the lanes of
/// f64), and counted into four interleaved sub-histograms, so runs of equal values (a ReLU
/// output's zeros) do not serialize on one counter.
fn count_bins(counts: &mut [u64], data: &[f32], exp: i32, first: i64) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn count_bins_avx2(counts: &mut [u64], data: &[f32], exp: i32, first: i64) {
            count_bins_lanes(counts, data, exp, first)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { count_bins_avx2(counts, data, exp, first) };
        }
    }
    count_bins_lanes(counts, data, exp, first)
}

/// [`count_bins`]' body, written so that the index computation vectorizes for whatever SIMD
/// width the caller is compiled for. The sub-histograms hold u16 counts (half the cache of
/// u32), flushed into `counts` every [`FLUSH`] values, before any of them can overflow.
#[inline(always)]
fn count_bins_lanes(counts: &mut [u64], data: &[f32], exp: i32, first: i64) {
    const BLOCK: usize = 256;
    const WAYS: usize = 4;
    /// Values per flush: each way counts at most a quarter of them, and u16 holds that.
    const FLUSH: usize = 1 << 17;
    let last = first + counts.len() as i64 - 1;
    let in_f32 = (-126..=0).contains(&exp) && first.abs().max(last.abs()) < EXACT_F32_GRID_INDEX;
    let mut sub = vec![0u16; counts.len() * WAYS];
    let (inv_width, first_f64) = (2f64.powi(-exp), first as f64);
    let (inv_width_f32, first_f32) = (inv_width as f32, first as f32);
    let mut idx = [0u32; BLOCK];
    for part in data.chunks(FLUSH) {
        for block in part.chunks(BLOCK) {
            // SAFETY (both loops): `x` is finite and inside the covered grid, so the difference
            // is an integer in `[0, counts.len())`, which i32 holds.
            if in_f32 {
                for (i, &x) in idx.iter_mut().zip(block) {
                    *i = unsafe { ((x * inv_width_f32).floor() - first_f32).to_int_unchecked::<i32>() } as u32;
                }
            } else {
                for (i, &x) in idx.iter_mut().zip(block) {
                    *i = unsafe { ((x as f64 * inv_width).floor() - first_f64).to_int_unchecked::<i32>() } as u32;
                }
            }
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
        for (c, s) in counts.iter_mut().zip(sub.chunks_exact_mut(WAYS)) {
            *c += s.iter().map(|&v| u64::from(v)).sum::<u64>();
            s.fill(0);
        }
    }
}

/// Bins spanned by `[min, max]` at width `2^exp`.
fn span(min: f32, max: f32, exp: i32) -> i64 {
    bin_of(max, exp) - bin_of(min, exp) + 1
}

/// The smallest exponent at which `[min, max]` spans at most `max_bins` bins.
fn grid_exp(min: f32, max: f32, max_bins: usize) -> i32 {
    let width = max as f64 - min as f64;
    let mut e = if width > 0.0 { ((width / max_bins as f64).log2().floor() as i32).max(MIN_EXP) } else { MIN_EXP };
    while span(min, max, e) > max_bins as i64 {
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
        let shift = (exp - self.exp) as u32;
        let coarse = |k: i64| if shift >= 63 { if k < 0 { -1 } else { 0 } } else { k >> shift };
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
        let (lo, hi, nonfinite) = super::finite_extremes(data);
        self.nonfinite += nonfinite;
        if lo > hi {
            return;
        }
        self.min = self.min.min(lo);
        self.max = self.max.max(hi);
        self.coarsen(grid_exp(self.min, self.max, self.max_bins));
        self.cover(bin_of(lo, self.exp), bin_of(hi, self.exp));
        let inv_width = 2f64.powi(-self.exp);
        let first = self.first;
        let last = first + self.counts.len() as i64 - 1;
        let counts = &mut self.counts;
        if nonfinite == 0 && first.abs().max(last.abs()) <= EXACT_GRID_INDEX {
            count_bins(counts, data, self.exp, first);
        } else {
            for &x in data.iter().filter(|x| x.is_finite()) {
                counts[(bin_at(x, inv_width) - first) as usize] += 1;
            }
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
        let mut o = other.clone();
        o.coarsen(exp);
        self.cover(o.first, o.first + o.counts.len() as i64 - 1);
        for (i, c) in o.counts.iter().enumerate() {
            self.counts[(o.first - self.first) as usize + i] += c;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        d.extend(std::iter::repeat(0.0).take(1037));
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
            count_bins(&mut got, d, exp, first);
            assert_eq!(got, want, "exp {exp}");
        }
    }

    #[test]
    fn one_bin_counts_past_the_sub_histograms_u16_range() {
        // 600k equal values, more than four ways of u16 can hold between flushes.
        let mut d = vec![0.0f32; 600_000];
        d.extend([1.0, -1.0, 0.5]);
        // Bins of width 1/2 from -1: [-1, -0.5), [-0.5, 0), [0, 0.5), [0.5, 1), [1, 1.5).
        let mut got = vec![0u64; 5];
        count_bins(&mut got, &d, -1, -2);
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
