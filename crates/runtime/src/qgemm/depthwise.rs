//! Requantized 8-bit depthwise convolution (`group == C == M`) of NCHW images with AVX-512
//! VNNI and VBMI, plane by plane.
//!
//! One output channel reads one input plane. For an output row, 16 consecutive positions are
//! one register of `i32` sums; a run of 4 kernel columns of one kernel row is one
//! `vpdpbusd`: the 4 input bytes each position needs at those taps are gathered from one
//! 64-byte load of the input row by `vpermb` (position `j`, tap `t` reads byte `j * stride +
//! t * dilation`), and the 4 weights are one broadcast `i32`. Kernel rows of `kw` taps take
//! `ceil(kw / 4)` runs, the taps past `kw` having weight 0.
//!
//! The rows an item of work reads are first copied into a padded buffer whose padding holds
//! the input zero point, so every tap is read and the padding contributes `(xz - xz) w = 0`.
//! VNNI multiplies `u8` by `i8`: activations are stored as `u8` (i8 activations flipped by
//! `xor 0x80`, i.e. `+128`) and weights as `i8` (u8 weights flipped, `-128`). With `'`
//! marking stored values and zero points shifted the same way, over the `T = kh x kw` taps:
//!
//! `acc = sum_T x'w' - xz' sum_T w' - wz' sum_T x' + |T| xz' wz'`
//!
//! where the window sums `sum_T x'` are accumulated (a second `vpdpbusd` against ones) only
//! for channels with `wz' != 0`. Arithmetic is wrapping `i32`; the requantization is ONNX
//! Runtime's (see the `output` module), as in the `conv` module.

use std::arch::x86_64::*;

use super::conv::{ConvInput, ConvRequant};
use super::{Int8, Out8, Scale, SharedOut, ZeroPoints};
use crate::kernels::conv::Axis;

/// Output positions per register.
const LANES: usize = 16;
/// Most registers of positions computed together along one output row.
const MAX_BLOCKS: usize = 8;

/// Whether [`depthwise_requant`] runs on this CPU (AVX-512 F, BW, VL, VNNI and VBMI).
pub(crate) fn available() -> bool {
    super::conv::available() && std::arch::is_x86_feature_detected!("avx512vbmi")
}

/// Whether the horizontal geometry fits the kernel: the bytes 16 positions read at 4
/// consecutive kernel columns must lie within one 64-byte load (`15 stride + 3 dilation <
/// 64`).
pub(crate) fn supports(w: &Axis) -> bool {
    15 * w.stride + 3 * w.dilation < 64
}

/// Depthwise weights stored for the kernel: per channel and kernel row, runs of 4 kernel
/// columns as one `i32` of stored (`i8`) bytes, 0 past the kernel width, with each channel's
/// sum of stored weights.
pub(crate) struct DepthwiseW {
    wt: Int8,
    channels: usize,
    kh: usize,
    kw: usize,
    runs: usize,
    wq: Vec<i32>,
    sums: Vec<i32>,
}

impl DepthwiseW {
    /// Packs `channels` filters of `kh x kw` taps (ONNX order, filter `c` at `w[c * kh *
    /// kw..]`) of type `wt`. Panics if `w` is shorter than `channels * kh * kw`.
    pub(crate) fn pack(wt: Int8, w: &[u8], channels: usize, kh: usize, kw: usize) -> DepthwiseW {
        let taps = kh * kw;
        assert!(w.len() >= channels * taps, "depthwise weights of {} bytes are too short for {channels} x {kh} x {kw}", w.len());
        let runs = kw.div_ceil(4);
        let wflip = if wt == Int8::U8 { 0x80 } else { 0 };
        let mut wq = vec![0i32; channels * kh * runs];
        let mut sums = vec![0i32; channels];
        for (ch, sum) in sums.iter_mut().enumerate() {
            for ki in 0..kh {
                for r in 0..runs {
                    let mut b = [0u8; 4];
                    for (t, v) in b.iter_mut().enumerate() {
                        let kj = 4 * r + t;
                        if kj < kw {
                            *v = w[ch * taps + ki * kw + kj] ^ wflip;
                            *sum = sum.wrapping_add(*v as i8 as i32);
                        }
                    }
                    wq[(ch * kh + ki) * runs + r] = i32::from_le_bytes(b);
                }
            }
        }
        DepthwiseW { wt, channels, kh, kw, runs, wq, sums }
    }
}

/// Depthwise convolution of one image: input channel `c` of `inp` (`inp.channels` channels)
/// with filter `c` of `w` into output plane `c` of `out` (`h.output x w.output` values per
/// plane, every one written: `out` may start uninitialized), requantized to `T`. `rq`'s
/// per-channel vectors hold one value per channel. Items
/// of work (a channel, or a band of one channel's output rows) run on the current rayon pool
/// when `parallel`.
///
/// Panics unless the CPU has the needed extensions ([`available`]), the geometry fits
/// ([`supports`]), `w` holds `inp.channels` filters of the kernel's size, and `x`, `out` and
/// the per-channel vectors are long enough.
pub(crate) fn depthwise_requant<T: Out8>(inp: &ConvInput, w: &DepthwiseW, rq: &ConvRequant, out: &mut [std::mem::MaybeUninit<T>], parallel: bool) {
    assert!(available(), "the depthwise kernel needs AVX-512 VNNI and VBMI");
    let (h, wa, c) = (inp.h, inp.w, inp.channels);
    assert!(supports(&wa), "horizontal stride {} and dilation {} do not fit the depthwise kernel", wa.stride, wa.dilation);
    assert!(w.channels == c && w.kh == h.kernel && w.kw == wa.kernel, "depthwise weights of {} x {} x {} for {c} channels and a {} x {} kernel", w.channels, w.kh, w.kw, h.kernel, wa.kernel);
    let (taps, plane) = (h.kernel * wa.kernel, h.output * wa.output);
    assert!(inp.x.len() >= c * h.input * wa.input && out.len() >= c * plane);
    rq.assert_covers(c);
    if c == 0 || plane == 0 {
        return;
    }
    let xz = inp.x_zp + if inp.xt == Int8::I8 { 128 } else { 0 };
    let wshift = if w.wt == Int8::U8 { 128 } else { 0 };
    let (mut konst, mut neg_wz) = (Vec::with_capacity(c), Vec::with_capacity(c));
    for ch in 0..c {
        let z = match rq.w_zp {
            ZeroPoints::Tensor(z) => z,
            ZeroPoints::Each(v) => v[ch],
        } - wshift;
        neg_wz.push(z.wrapping_neg());
        konst.push((taps as i32).wrapping_mul(xz).wrapping_mul(z).wrapping_sub(xz.wrapping_mul(w.sums[ch])).wrapping_add(rq.bias.map_or(0, |b| b[ch])));
    }
    let scale: Vec<f32> = (0..c).map(|ch| match rq.scale {
        Scale::Tensor(s) => s,
        Scale::Each(v) => v[ch],
    }).collect();
    let threads = if parallel { crate::kernels::util::threads() } else { 1 };
    // Whole channels per item unless there are too few channels to go round the threads.
    let bands = if threads > 1 && c < 4 * threads { (4 * threads).div_ceil(c).min(h.output) } else { 1 };
    let rows = h.output.div_ceil(bands);
    let width = (wa.output - 1) * wa.stride + (wa.kernel - 1) * wa.dilation + 1;
    let plan = cached_plan(h.stride * width, &wa, rows * wa.output);
    let (blocks, patterns) = (&plan.0, &plan.1);
    let job = Job { inp: *inp, xz: xz as u8, runs: w.runs, wq: &w.wq, konst, neg_wz, scale, lo: (T::MIN - rq.y_zp) as f32, hi: (T::MAX - rq.y_zp) as f32, zp: rq.y_zp, width, blocks, patterns };
    let per_ch = h.output.div_ceil(rows);
    let items = c * per_ch;
    let o = SharedOut::uninit(&mut out[..c * plane]);
    let run = |buf: &mut Vec<u8>, i: usize| {
        let (ch, band) = (i / per_ch, i % per_ch);
        let (oy0, oy1) = (band * rows, ((band + 1) * rows).min(h.output));
        // SAFETY: the CPU has the extensions (asserted above); item `i` writes (and maps
        // through the table) output rows `oy0..oy1` of plane `ch` only, which no other item
        // writes.
        unsafe {
            let dst = o.ptr(ch * plane + oy0 * wa.output, (oy1 - oy0) * wa.output);
            job.item::<T>(buf, ch, oy0, oy1, dst);
            rq.map(dst, (oy1 - oy0) * wa.output, 1, 0);
        }
    };
    let work = (c * plane * taps) as u64;
    let run = |i: usize| ROWS_BUF.with_borrow_mut(|buf| run(buf, i));
    if threads > 1 && items > 1 && work >= 1 << 16 {
        use rayon::prelude::*;
        (0..items).into_par_iter().for_each(run);
    } else {
        (0..items).for_each(run);
    }
}

thread_local! {
    /// Per-thread buffer of an item's padded input rows, reused across items and runs.
    static ROWS_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A register of output positions: `lanes` consecutive positions of a band (row-major over
/// the band's output rows) from position `start`, whose first tap is padded byte `at` of the
/// band's buffer, gathered by pattern `pattern`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Block {
    at: u32,
    start: u32,
    lanes: u8,
    pattern: u16,
}

/// A band's registers and patterns ([`plan_blocks`]).
type BlockPlan = (Vec<Block>, Vec<[u8; 64]>);

/// [`plan_blocks`], remembered per thread for the last [`PLANS`] geometries: a session runs
/// the same convolutions on the same shapes run after run.
fn cached_plan(row_step: usize, w: &Axis, positions: usize) -> std::rc::Rc<BlockPlan> {
    let key = [row_step, w.output, w.stride, w.dilation, positions];
    PLAN_CACHE.with_borrow_mut(|cache| {
        if let Some(i) = cache.iter().position(|(k, _)| *k == key) {
            let hit = cache.remove(i);
            cache.insert(0, hit);
        } else {
            cache.truncate(PLANS - 1);
            cache.insert(0, (key, std::rc::Rc::new(plan_blocks(row_step, w, positions))));
        }
        cache[0].1.clone()
    })
}

/// How many geometries [`cached_plan`] remembers per thread.
const PLANS: usize = 32;

thread_local! {
    static PLAN_CACHE: std::cell::RefCell<Vec<([usize; 5], std::rc::Rc<BlockPlan>)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Splits `positions` output positions (row-major, `w.output` per row, the first at column
/// 0 of a padded row; consecutive output rows `row_step` bytes apart) into registers of
/// [`LANES`] positions, each one 64-byte load per run of 4 kernel columns.
///
/// A register takes the next 16 positions when every byte they read at 4 consecutive kernel
/// columns lies within 64 bytes of the first position's, wrapping onto the following output
/// rows; otherwise it ends at its row's end. Returns the registers in order and their
/// distinct `vpermb` patterns: byte `4j + t` is the offset of lane `j`'s tap `t` from the
/// register's first tap (lanes past `lanes` repeat lane 0's offsets).
fn plan_blocks(row_step: usize, w: &Axis, positions: usize) -> (Vec<Block>, Vec<[u8; 64]>) {
    let (ow, s, d) = (w.output, w.stride, w.dilation);
    let mut blocks = Vec::with_capacity(positions.div_ceil(LANES));
    let mut patterns: Vec<[u8; 64]> = Vec::new();
    // Per first column: the register's pattern and lanes.
    let mut by_column: Vec<Option<(u16, usize)>> = vec![None; ow];
    let offset = |ox: usize, j: usize| (ox + j) / ow * row_step + (ox + j) % ow * s - ox * s;
    let mut p = 0;
    while p < positions {
        let ox = p % ow;
        let (pattern, lanes) = *by_column[ox].get_or_insert_with(|| {
            let wraps = (0..LANES).all(|j| offset(ox, j) + 3 * d < 64);
            let lanes = if wraps { LANES } else { ow - ox };
            patterns.push(std::array::from_fn(|i| {
                let (j, t) = (i / 4, i % 4);
                ((if j < lanes { offset(ox, j) } else { 0 }) + t * d) as u8
            }));
            ((patterns.len() - 1) as u16, lanes)
        });
        blocks.push(Block { at: (p / ow * row_step + ox * s) as u32, start: p as u32, lanes: lanes as u8, pattern });
        p += lanes;
    }
    (blocks, patterns)
}

/// One image's constants for its items.
struct Job<'a> {
    inp: ConvInput<'a>,
    /// The stored input zero point (the padding byte).
    xz: u8,
    /// Runs of 4 kernel columns per kernel row.
    runs: usize,
    /// Stored weights: per channel, kernel row and run, 4 bytes as one `i32`.
    wq: &'a [i32],
    /// Per channel: `|T| xz' wz' - xz' sum_T w' + bias`.
    konst: Vec<i32>,
    /// Per channel: `-wz'`.
    neg_wz: Vec<i32>,
    /// Per channel: the requantization multiplier.
    scale: Vec<f32>,
    /// `T::MIN - zp`, `T::MAX - zp` and `zp` of the output.
    lo: f32,
    hi: f32,
    zp: i32,
    /// Bytes of a padded input row that the output rows read.
    width: usize,
    /// The registers of a whole band ([`plan_blocks`]); a shorter band uses a prefix.
    blocks: &'a [Block],
    /// Their `vpermb` patterns.
    patterns: &'a [[u8; 64]],
}

impl Job<'_> {
    /// Computes output rows `oy0..oy1` of channel `ch` into `dst` (row-major, `w.output`
    /// values per row), with `buf` as the padded input rows.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW, VL, VNNI and VBMI; `dst` must be valid for writes
    /// of `(oy1 - oy0) * w.output` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    unsafe fn item<T: Out8>(&self, buf: &mut Vec<u8>, ch: usize, oy0: usize, oy1: usize, dst: *mut T) {
        let (h, wa) = (self.inp.h, self.inp.w);
        let (r0, r1) = (oy0 * h.stride, (oy1 - 1) * h.stride + (h.kernel - 1) * h.dilation + 1);
        let width = self.width;
        let positions = (oy1 - oy0) * wa.output;
        let used = self.blocks.partition_point(|b| (b.start as usize) < positions);
        let blocks = &self.blocks[..used];
        // Every load of the last register (whose lanes may run past the band into rows
        // holding the zero point) stays inside the buffer.
        let last = blocks[used - 1].at as usize;
        let len = last + (h.kernel - 1) * h.dilation * width + 4 * (self.runs - 1) * wa.dilation + 64;
        buf.clear();
        buf.resize(len.max((r1 - r0) * width), self.xz);
        let flip = if self.inp.xt == Int8::I8 { 0x80u8 } else { 0 };
        let plane = &self.inp.x[ch * h.input * wa.input..(ch + 1) * h.input * wa.input];
        // Input columns `ix` land at padded column `ix + pad_begin`, kept while inside `width`.
        let (c0, c1) = (wa.pad_begin.min(width), (wa.pad_begin + wa.input).min(width));
        let flipv = _mm512_set1_epi8(flip as i8);
        for r in r0..r1 {
            let iy = r as isize - h.pad_begin as isize;
            if iy < 0 || iy >= h.input as isize || c0 >= c1 {
                continue;
            }
            let src = &plane[iy as usize * wa.input..][..c1 - c0];
            let row = &mut buf[(r - r0) * width + c0..(r - r0) * width + c1];
            for (d, s) in row.chunks_mut(64).zip(src.chunks(64)) {
                let mask = u64::MAX >> (64 - d.len());
                let v = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, s.as_ptr() as *const i8), flipv);
                _mm512_mask_storeu_epi8(d.as_mut_ptr() as *mut i8, mask, v);
            }
        }
        for group in blocks.chunks(MAX_BLOCKS) {
            let f = match group.len() {
                1 => Self::blocks::<T, 1>,
                2 => Self::blocks::<T, 2>,
                3 => Self::blocks::<T, 3>,
                4 => Self::blocks::<T, 4>,
                5 => Self::blocks::<T, 5>,
                6 => Self::blocks::<T, 6>,
                7 => Self::blocks::<T, 7>,
                _ => Self::blocks::<T, 8>,
            };
            f(self, ch, buf.as_ptr(), group, positions, dst);
        }
    }

    /// Computes the `B` registers `group` of channel `ch`'s band: `buf` points at the band's
    /// padded input rows, `dst` at its first output. Lanes at or past `positions` are
    /// computed but not stored.
    ///
    /// # Safety
    /// As [`Job::item`]; every 64-byte load of the registers' taps must lie inside `buf`, and
    /// `dst` must be valid for writes of `positions` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    unsafe fn blocks<T: Out8, const B: usize>(&self, ch: usize, buf: *const u8, group: &[Block], positions: usize, dst: *mut T) {
        let (h, wa) = (self.inp.h, self.inp.w);
        let d = wa.dilation;
        let idx: [__m512i; B] = std::array::from_fn(|b| _mm512_loadu_si512(self.patterns[group[b].pattern as usize].as_ptr() as *const _));
        let first: [*const u8; B] = std::array::from_fn(|b| buf.add(group[b].at as usize));
        let with_sums = self.neg_wz[ch] != 0;
        let mut acc = [_mm512_setzero_si512(); B];
        let mut sums = [_mm512_setzero_si512(); B];
        let wrow = self.wq.as_ptr().add(ch * h.kernel * self.runs);
        for ki in 0..h.kernel {
            let line = ki * h.dilation * self.width;
            for r in 0..self.runs {
                let wv = _mm512_set1_epi32(*wrow.add(ki * self.runs + r));
                let at = line + 4 * r * d;
                if with_sums {
                    let real = (wa.kernel - 4 * r).min(4);
                    let ones = _mm512_set1_epi32(((u32::MAX >> (32 - 8 * real)) & 0x0101_0101) as i32);
                    for b in 0..B {
                        let v = _mm512_permutexvar_epi8(idx[b], _mm512_loadu_si512(first[b].add(at) as *const _));
                        acc[b] = _mm512_dpbusd_epi32(acc[b], v, wv);
                        sums[b] = _mm512_dpbusd_epi32(sums[b], v, ones);
                    }
                } else {
                    for b in 0..B {
                        let v = _mm512_permutexvar_epi8(idx[b], _mm512_loadu_si512(first[b].add(at) as *const _));
                        acc[b] = _mm512_dpbusd_epi32(acc[b], v, wv);
                    }
                }
            }
        }
        let (k, nz, sc) = (_mm512_set1_epi32(self.konst[ch]), _mm512_set1_epi32(self.neg_wz[ch]), _mm512_set1_ps(self.scale[ch]));
        let (lo, hi, zp) = (_mm512_set1_ps(self.lo), _mm512_set1_ps(self.hi), _mm512_set1_epi32(self.zp));
        for b in 0..B {
            let start = group[b].start as usize;
            let n = (group[b].lanes as usize).min(positions - start);
            let mut v = _mm512_add_epi32(acc[b], k);
            if with_sums {
                v = _mm512_add_epi32(v, _mm512_mullo_epi32(sums[b], nz));
            }
            let f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), sc);
            let f = _mm512_min_ps(_mm512_max_ps(f, lo), hi);
            let q = _mm512_add_epi32(_mm512_cvtps_epi32(f), zp);
            let mask = if n == LANES { u16::MAX } else { (1u16 << n) - 1 };
            _mm_mask_storeu_epi8(dst.add(start) as *mut i8, mask, _mm512_cvtepi32_epi8(q));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qgemm::test_reference::{check_depthwise, output_bytes, DEPTHWISE_CASES};

    #[test]
    fn matches_a_direct_depthwise_convolution() {
        if !available() {
            eprintln!("NCHW VNNI depthwise convolution NOT TESTED: this CPU lacks AVX-512 VNNI or VBMI");
            return;
        }
        check_depthwise(11, &DEPTHWISE_CASES, |inp, w, wt, rq| {
            assert!(supports(&inp.w));
            let dw = DepthwiseW::pack(wt, w, inp.channels, inp.h.kernel, inp.w.kernel);
            let len = inp.channels * inp.h.output * inp.w.output;
            output_bytes(inp.xt, len, |o| depthwise_requant(inp, &dw, rq, o, true), |o| depthwise_requant(inp, &dw, rq, o, true))
        });
    }
}
