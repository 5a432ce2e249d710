//! Requantized 8-bit depthwise convolution (`group == C == M`) of NCHW images with AVX2,
//! plane by plane, exact in `i32` through `vpmaddwd` on 16-bit values.
//!
//! The input rows a band of output rows reads are converted once into pairs of 16-bit values
//! `(x[i] - xz, x[i + d] - xz)` over the padded row (`d` the horizontal dilation, 0 in the
//! padding), stored by column phase modulo the horizontal stride `s`: pair `i` is entry
//! `i / s` of phase `i % s`. Output position `p` at kernel column `kj` reads pair
//! `s p + kj d`, entry `p + (kj d) / s` of phase `(kj d) % s`, so 8 consecutive positions
//! are one unaligned load of 8 pairs, and one `vpmaddwd` against the broadcast weight pair
//! `(w[kj] - wz, w[kj + 1] - wz)` adds two taps into each position's `i32` sum. A kernel row
//! of `kw` taps takes `ceil(kw / 2)` of them, the tap past `kw` weighing 0. Both factors are
//! at most 255 in magnitude, so a pair sum is at most `2 * 255 * 255 = 130050` and every sum
//! is exact (wrapping `i32`, like every GEMM path). The sums get the bias and ONNX Runtime's
//! requantization (see the `output` module).

use std::arch::x86_64::*;

use super::conv::{ConvInput, ConvRequant};
use super::{Int8, Out8, Scale, SharedOut, ZeroPoints};
use crate::kernels::conv::Axis;

/// Output positions per register.
const LANES: usize = 8;
/// Registers of positions computed together along one output row.
const BLOCK: usize = 4;
/// Output rows per item of work (each item converts the input rows it reads once).
const BAND: usize = 16;

/// Per-thread buffers of an item: one padded input row, its pairs in column order, and the
/// converted rows (pairs by phase).
#[derive(Default)]
struct Buffers {
    line: Vec<i16>,
    pairs: Vec<i32>,
    rows: Vec<i32>,
}

/// Whether [`depthwise_requant`] runs on this CPU (AVX2).
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// Whether the kernel beats the channels-last one for this horizontal geometry (measured on
/// Zen 4 without AVX-512): output rows of at least 14 positions at stride 1, or of at least
/// 56 at larger strides; narrower rows spend more on converting input rows than they save.
pub(crate) fn worth_it(w: &Axis) -> bool {
    w.output >= if w.stride == 1 { 14 } else { 56 }
}

/// Depthwise convolution of one image: input channel `c` of `inp` (`inp.channels` channels)
/// with filter `c` of `w` (`[C, 1, kh, kw]` bytes of type `wt`) into output plane `c` of
/// `out` (`h.output x w.output` values per plane, every one written: `out` may start
/// uninitialized), requantized to `T`. `rq`'s per-channel
/// vectors hold one value per channel. Items of work (a band of up to [`BAND`] output rows of
/// one channel) run on the current rayon pool when `parallel`.
///
/// Panics unless the CPU has AVX2 and `w`, `x`, `out` and the per-channel vectors are long
/// enough for the geometry.
pub(crate) fn depthwise_requant<T: Out8>(inp: &ConvInput, w: &[u8], wt: Int8, rq: &ConvRequant, out: &mut [std::mem::MaybeUninit<T>], parallel: bool) {
    assert!(available(), "the AVX2 depthwise kernel needs AVX2");
    let (h, wa, c) = (inp.h, inp.w, inp.channels);
    let (taps, plane) = (h.kernel * wa.kernel, h.output * wa.output);
    assert!(w.len() >= c * taps, "depthwise weights of {} bytes are too short for {c} x {} x {}", w.len(), h.kernel, wa.kernel);
    assert!(inp.x.len() >= c * h.input * wa.input && out.len() >= c * plane);
    rq.assert_covers(c);
    if c == 0 || plane == 0 {
        return;
    }
    let pairs = wa.kernel.div_ceil(2);
    let value = |b: u8, t: Int8| if t == Int8::I8 { b as i8 as i32 } else { b as i32 };
    let mut wq = vec![0i32; c * h.kernel * pairs];
    for ch in 0..c {
        let z = match rq.w_zp {
            ZeroPoints::Tensor(z) => z,
            ZeroPoints::Each(v) => v[ch],
        };
        for ki in 0..h.kernel {
            for pr in 0..pairs {
                let tap = |kj: usize| if kj < wa.kernel { (value(w[ch * taps + ki * wa.kernel + kj], wt) - z) as i16 as u16 as u32 } else { 0 };
                wq[(ch * h.kernel + ki) * pairs + pr] = (tap(2 * pr) | (tap(2 * pr + 1) << 16)) as i32;
            }
        }
    }
    let (s, d) = (wa.stride, wa.dilation);
    let padded8 = wa.output.div_ceil(LANES) * LANES;
    // Whole vectors of 16 pairs, so the conversions have no scalar tails.
    let phase_len = (padded8 + (2 * (pairs - 1) * d) / s).div_ceil(16) * 16;
    let row_len = s * phase_len;
    let pair_at = (0..h.kernel)
        .flat_map(|ki| (0..pairs).map(move |pr| (ki, 2 * pr * d)))
        .map(|(ki, off)| ki * h.dilation * row_len + (off % s) * phase_len + off / s)
        .collect();
    let job = Job {
        inp: *inp,
        xz: inp.x_zp,
        pairs,
        wq: &wq,
        bias: rq.bias,
        scale: rq.scale,
        lo: (T::MIN - rq.y_zp) as f32,
        hi: (T::MAX - rq.y_zp) as f32,
        zp: rq.y_zp,
        phase_len,
        row_len,
        pair_at,
    };
    let per_ch = h.output.div_ceil(BAND);
    let items = c * per_ch;
    let o = SharedOut::uninit(&mut out[..c * plane]);
    let run = |bufs: &mut Buffers, i: usize| {
        let (ch, band) = (i / per_ch, i % per_ch);
        let (oy0, oy1) = (band * BAND, ((band + 1) * BAND).min(h.output));
        // SAFETY: the CPU has AVX2 (asserted above); item `i` writes (and maps through the
        // table) output rows `oy0..oy1` of plane `ch` only, which no other item writes.
        unsafe {
            let dst = o.ptr(ch * plane + oy0 * wa.output, (oy1 - oy0) * wa.output);
            job.item::<T>(bufs, ch, oy0, oy1, dst);
            rq.map(dst, (oy1 - oy0) * wa.output, 1, 0);
        }
    };
    let threads = if parallel { crate::kernels::util::threads() } else { 1 };
    let work = (c * plane * taps) as u64;
    if threads > 1 && items > 1 && work >= 1 << 16 {
        use rayon::prelude::*;
        (0..items).into_par_iter().for_each_init(Default::default, run);
    } else {
        let mut bufs = Buffers::default();
        (0..items).for_each(|i| run(&mut bufs, i));
    }
}

/// One image's constants for its items.
struct Job<'a> {
    inp: ConvInput<'a>,
    xz: i32,
    /// Weight pairs per kernel row.
    pairs: usize,
    /// Per channel, kernel row and pair: `(w[2 pr] - wz, w[2 pr + 1] - wz)` as two `i16` in
    /// one `i32` (0 past the kernel width).
    wq: &'a [i32],
    bias: Option<&'a [i32]>,
    scale: Scale<'a>,
    /// `T::MIN - zp`, `T::MAX - zp` and `zp` of the output.
    lo: f32,
    hi: f32,
    zp: i32,
    /// Pairs per column phase of a converted row, and pairs per converted row (`s` phases).
    phase_len: usize,
    row_len: usize,
    /// Per kernel row and pair (the order of a channel's weight pairs): where position 0 of
    /// an output row reads its pair, from the output row's first converted row.
    pair_at: Vec<usize>,
}

impl Job<'_> {
    /// Computes output rows `oy0..oy1` of channel `ch` into `dst` (row-major, `w.output`
    /// values per row).
    ///
    /// # Safety
    /// The CPU must support AVX2; `dst` must be valid for writes of `(oy1 - oy0) * w.output`
    /// values.
    #[target_feature(enable = "avx2")]
    unsafe fn item<T: Out8>(&self, bufs: &mut Buffers, ch: usize, oy0: usize, oy1: usize, dst: *mut T) {
        let (h, wa) = (self.inp.h, self.inp.w);
        let (s, d) = (wa.stride, wa.dilation);
        let (r0, r1) = (oy0 * h.stride, (oy1 - 1) * h.stride + (h.kernel - 1) * h.dilation + 1);
        let Buffers { line, pairs, rows: conv } = bufs;
        // The padded row must reach the second value of the last pair read.
        line.clear();
        line.resize(self.row_len + d, 0);
        conv.clear();
        conv.resize((r1 - r0) * self.row_len, 0);
        let plane = &self.inp.x[ch * h.input * wa.input..(ch + 1) * h.input * wa.input];
        let inside = wa.pad_begin.min(line.len())..(wa.pad_begin + wa.input).min(line.len());
        for r in r0..r1 {
            let iy = r as isize - h.pad_begin as isize;
            if iy < 0 || iy >= h.input as isize || inside.is_empty() {
                continue;
            }
            let src = &plane[iy as usize * wa.input..][..inside.len()];
            let xz = self.xz;
            if self.inp.xt == Int8::I8 {
                line[inside.clone()].iter_mut().zip(src).for_each(|(v, &b)| *v = (b as i8 as i32 - xz) as i16);
            } else {
                line[inside.clone()].iter_mut().zip(src).for_each(|(v, &b)| *v = (b as i32 - xz) as i16);
            }
            let row = &mut conv[(r - r0) * self.row_len..(r - r0 + 1) * self.row_len];
            if s == 1 {
                pair_up(line, d, row);
            } else {
                pairs.resize(self.row_len, 0);
                pair_up(line, d, pairs);
                if s == 2 {
                    split_even_odd(pairs, row);
                } else {
                    for (phase, entries) in row.chunks_exact_mut(self.phase_len).enumerate() {
                        entries.iter_mut().zip(pairs[phase..].iter().step_by(s)).for_each(|(e, &v)| *e = v);
                    }
                }
            }
        }
        let wrow = &self.wq[ch * h.kernel * self.pairs..(ch + 1) * h.kernel * self.pairs];
        let bias = self.bias.map_or(0, |b| b[ch]);
        let scale = match self.scale {
            Scale::Tensor(v) => v,
            Scale::Each(v) => v[ch],
        };
        let ow = wa.output;
        let rows: &[i32] = conv;
        for oy in oy0..oy1 {
            let base = (oy * h.stride - r0) * self.row_len;
            let out = dst.add((oy - oy0) * ow);
            let mut p = 0;
            while p + BLOCK * LANES <= ow {
                let acc = self.sums::<BLOCK>(rows, base, wrow, p);
                self.store(acc, bias, scale, out, p, ow);
                p += BLOCK * LANES;
            }
            match (ow - p).div_ceil(LANES) {
                0 => {}
                1 => self.store(self.sums::<1>(rows, base, wrow, p), bias, scale, out, p, ow),
                2 => self.store(self.sums::<2>(rows, base, wrow, p), bias, scale, out, p, ow),
                3 => self.store(self.sums::<3>(rows, base, wrow, p), bias, scale, out, p, ow),
                _ => self.store(self.sums::<4>(rows, base, wrow, p), bias, scale, out, p, ow),
            }
        }
    }

    /// The window sums of `B` registers of positions from `p` of the output row whose first
    /// kernel row's converted row starts at `rows[base]`, with the channel's weight pairs
    /// `wrow` (per kernel row, [`Job::pairs`] pairs).
    ///
    /// # Safety
    /// The CPU must support AVX2; the converted rows hold every pair the positions read
    /// (`p + 8 B` is at most the output width rounded up to 8).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums<const B: usize>(&self, rows: &[i32], base: usize, wrow: &[i32], p: usize) -> [__m256i; B] {
        let mut acc = [_mm256_setzero_si256(); B];
        let first = rows.as_ptr().add(base + p);
        for (&at, &w) in self.pair_at.iter().zip(wrow) {
            debug_assert!(base + p + at + B * LANES <= rows.len());
            let src = first.add(at);
            let wv = _mm256_set1_epi32(w);
            for (b, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(_mm256_loadu_si256(src.add(b * LANES) as *const __m256i), wv));
            }
        }
        acc
    }

    /// Adds `bias` to the sums of the registers from position `p`, requantizes them with
    /// `scale` and stores the positions below `ow` at `out`.
    ///
    /// # Safety
    /// The CPU must support AVX2; `out` must be valid for writes of `ow` values.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn store<T: Out8, const B: usize>(&self, acc: [__m256i; B], bias: i32, scale: f32, out: *mut T, p: usize, ow: usize) {
        let (bv, sc) = (_mm256_set1_epi32(bias), _mm256_set1_ps(scale));
        let (lo, hi, zp) = (_mm256_set1_ps(self.lo), _mm256_set1_ps(self.hi), _mm256_set1_epi32(self.zp));
        for (b, &a) in acc.iter().enumerate() {
            let f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a, bv)), sc);
            let f = _mm256_min_ps(_mm256_max_ps(f, lo), hi);
            let q = _mm256_add_epi32(_mm256_cvtps_epi32(f), zp);
            // The values lie in `T`'s range, so neither pack saturates.
            let w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0b1000);
            let w = _mm256_castsi256_si128(w);
            let bytes = if T::MIN < 0 { _mm_packs_epi16(w, w) } else { _mm_packus_epi16(w, w) };
            let start = p + b * LANES;
            let n = ow.saturating_sub(start).min(LANES);
            if n == LANES {
                _mm_storel_epi64(out.add(start) as *mut __m128i, bytes);
            } else {
                let mut tmp = [0u8; 16];
                _mm_storeu_si128(tmp.as_mut_ptr() as *mut __m128i, bytes);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), out.add(start) as *mut u8, n);
            }
        }
    }
}

/// `pairs[i] = (line[i], line[i + d])` as two `i16` in one `i32`, for every `i` of `pairs`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn pair_up(line: &[i16], d: usize, pairs: &mut [i32]) {
    let n = pairs.len();
    assert!(n + d <= line.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + d + 16 <= n + d <= line.len()` and `i + 16 <= n` (checked above).
        let (a, b) = (_mm256_loadu_si256(line.as_ptr().add(i) as *const __m256i), _mm256_loadu_si256(line.as_ptr().add(i + d) as *const __m256i));
        let (lo, hi) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
        _mm256_storeu_si256(pairs.as_mut_ptr().add(i) as *mut __m256i, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(pairs.as_mut_ptr().add(i + 8) as *mut __m256i, _mm256_permute2x128_si256(lo, hi, 0x31));
        i += 16;
    }
    for (j, e) in pairs.iter_mut().enumerate().skip(i) {
        *e = (line[j] as u16 as u32 | (line[j + d] as u16 as u32) << 16) as i32;
    }
}

/// Splits `src` into its even entries (the first half of `dst`) and its odd entries (the
/// second half).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn split_even_odd(src: &[i32], dst: &mut [i32]) {
    let half = src.len() / 2;
    assert!(src.len() == dst.len() && half.is_multiple_of(8));
    let order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for q in (0..half).step_by(8) {
        // SAFETY: `2 q + 16 <= src.len()` and `half + q + 8 <= dst.len()` (checked above).
        let a = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(s.add(2 * q) as *const __m256i), order);
        let b = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(s.add(2 * q + 8) as *const __m256i), order);
        _mm256_storeu_si256(d.add(q) as *mut __m256i, _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256(d.add(half + q) as *mut __m256i, _mm256_permute2x128_si256(a, b, 0x31));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qgemm::test_reference::{check_depthwise, output_bytes, AxisSpec, DEPTHWISE_CASES};

    #[test]
    fn matches_a_direct_depthwise_convolution() {
        if !available() {
            eprintln!("AVX2 depthwise convolution NOT TESTED: this CPU lacks AVX2");
            return;
        }
        // A row of 29 positions (three whole registers and a partial one), and stride 4 with
        // dilation 3, beyond the VNNI kernel's reach.
        let wide: [(usize, AxisSpec, AxisSpec); 2] = [(3, (6, 3, 1, 1, 1, 1), (29, 3, 1, 1, 1, 1)), (2, (19, 3, 2, 1, 1, 1), (70, 9, 4, 3, 4, 4))];
        let cases = [&DEPTHWISE_CASES[..], &wide].concat();
        check_depthwise(13, &cases, |inp, w, wt, rq| {
            let len = inp.channels * inp.h.output * inp.w.output;
            output_bytes(inp.xt, len, |o| depthwise_requant(inp, w, wt, rq, o, true), |o| depthwise_requant(inp, w, wt, rq, o, true))
        });
    }
}
