//! Requantized 8-bit convolution of NCHW images as `W x im2col(X)` with AVX-512 VNNI.
//!
//! Rows of the product are output channels and columns output positions, so a finished
//! `R x 32` tile is one run of 32 positions in each of `R` output planes: the tile is
//! corrected for the zero points, biased, requantized in registers and stored straight into
//! the NCHW output. The activations are packed per block of positions from the NCHW image
//! directly into the kernel's B layout (the im2col gather, the signedness flip and the
//! 4-byte interleave in one pass), so neither side is transposed and no `i32` block is
//! written to memory.
//!
//! VNNI multiplies `u8` by `i8`: the activations are stored as `u8` (i8 activations flipped
//! by `xor 0x80`, i.e. `+128`) and the weights as `i8` (u8 weights flipped, `-128`). With `'`
//! marking stored values and zero points shifted the same way, over the real depth `K`:
//!
//! `acc[m][p] = sum_k w'x' - wz'_m colsum_p - xz' rowsum_m + K wz'_m xz'`
//!
//! `rowsum` (per output channel) is computed when the weights are packed and `colsum` (per
//! position) when a block of positions is packed, unless every `wz'` is 0 (symmetric i8
//! weights, or u8 weights with zero point 128), when the term vanishes and the column sums
//! are neither computed nor applied; depths padded to whole groups of 4 are stored as 0 on
//! both sides and add nothing. Arithmetic is wrapping `i32`, equal to the
//! exact sum modulo 2^32 like every other GEMM path, and the requantization is ONNX
//! Runtime's (see the `output` module): `f32(acc) * scale`, `maxps`/`minps` clamp, round to
//! nearest even, `+ zp`.

use std::arch::x86_64::*;

use super::pack::AlignedBuf;
use super::{Int8, Isa, Out8, Scale, SharedOut, ZeroPoints};
use crate::kernels::conv::Axis;

/// Output positions per tile (the B panel width).
const NR: usize = 32;
/// Output channels per full tile.
const MR: usize = 12;
/// The most panels per block of positions (one block is packed and computed by one thread).
const PANELS: usize = 8;

/// The weights of one convolution group (`m` output channels by depth `k`, ONNX order `(c,
/// ki, kj)`), stored for the VNNI kernel: row `j` holds `kp` bytes (the depth padded to
/// groups of 4 with zeros), with their sums over the real depth.
pub(crate) struct ConvW {
    wt: Int8,
    m: usize,
    k: usize,
    kp: usize,
    data: AlignedBuf,
    row_sums: Vec<i32>,
}

impl ConvW {
    /// Packs row-major weights `w` (`m x k`, element `(j, kk)` at `w[j * k + kk]`) of type
    /// `wt`. Panics if `w` is shorter than `m * k`.
    pub(crate) fn pack(wt: Int8, w: &[u8], m: usize, k: usize) -> ConvW {
        assert!(w.len() >= m * k, "weights of {} bytes are too short for {m} x {k}", w.len());
        let kp = k.div_ceil(4) * 4;
        let mut data = AlignedBuf::default();
        data.zeroed(m * kp);
        let flip = if wt == Int8::U8 { 0x80 } else { 0 };
        let bytes = data.bytes_mut();
        let row_sums = (0..m)
            .map(|j| {
                let row = &mut bytes[j * kp..j * kp + k];
                let mut sum = 0i32;
                for (d, &v) in row.iter_mut().zip(&w[j * k..(j + 1) * k]) {
                    *d = v ^ flip;
                    sum = sum.wrapping_add(*d as i8 as i32);
                }
                sum
            })
            .collect();
        ConvW { wt, m, k, kp, data, row_sums }
    }
}

/// Whether [`conv_requant`] runs on this CPU (AVX-512 F, BW, VL and VNNI).
pub(crate) fn available() -> bool {
    Isa::Avx512Vnni.available() && std::arch::is_x86_feature_detected!("avx512vl")
}

/// One image's input channels of one group: channel `c` (of `channels`) at `x[c * ih * iw..]`,
/// row-major, with the convolution's two axes.
#[derive(Clone, Copy)]
pub(crate) struct ConvInput<'a> {
    pub x: &'a [u8],
    pub xt: Int8,
    pub x_zp: i32,
    pub channels: usize,
    pub h: Axis,
    pub w: Axis,
}

/// The output stage of a requantized convolution group, indexed by the group's output
/// channels: the multiplier (`x_scale * w_scale / y_scale`, one or one per channel), the
/// optional `i32` bias, the weight zero points (one or one per channel, in the weights'
/// domain), the output zero point, and an optional table that each requantized output byte
/// is then mapped through (applied by the kernels to each block they finish).
#[derive(Clone, Copy)]
pub(crate) struct ConvRequant<'a> {
    pub scale: Scale<'a>,
    pub bias: Option<&'a [i32]>,
    pub w_zp: ZeroPoints<'a>,
    pub y_zp: i32,
    pub table: Option<&'a [u8; 256]>,
}

impl ConvRequant<'_> {
    /// Maps `count` runs of `len` output values, `stride` values apart from `at`, through the
    /// table, if there is one.
    ///
    /// # Safety
    /// The runs must be valid for reads and writes, and no other thread may access them
    /// meanwhile.
    pub(crate) unsafe fn map<T: Out8>(&self, at: *mut T, len: usize, count: usize, stride: usize) {
        if let Some(table) = self.table {
            // SAFETY: the caller's runs; `T` is one byte wide.
            unsafe { crate::kernels::qlinear_ms::lookup_in_place(at.cast::<u8>(), len, count, stride, table) };
        }
    }

    /// Panics unless the per-channel scales, weight zero points and bias cover `channels`
    /// output channels.
    pub(crate) fn assert_covers(&self, channels: usize) {
        if let Scale::Each(s) = self.scale {
            assert!(s.len() >= channels, "{} scales for {channels} channels", s.len());
        }
        if let ZeroPoints::Each(z) = self.w_zp {
            assert!(z.len() >= channels, "{} weight zero points for {channels} channels", z.len());
        }
        assert!(self.bias.is_none_or(|b| b.len() >= channels), "bias shorter than {channels} channels");
    }
}

/// Per-row terms of one tile's epilogue (pointers at the tile's first row and column).
struct Epi {
    /// Column sums of the stored activations (32 values).
    colsum: *const i32,
    /// `K wz' xz' - xz' rowsum + bias` per row.
    row: *const i32,
    /// `-wz'` per row.
    neg_wz: *const i32,
    /// The multiplier per row.
    scale: *const f32,
    /// `T::MIN - zp`, `T::MAX - zp` and `zp` of the output.
    lo: f32,
    hi: f32,
    zp: i32,
}

/// Convolves one group of one image into `out` (`w.m()` planes of `h.output x w.output`
/// values, plane after plane) with requantization to `T`, writing every one of them (`out`
/// may start uninitialized). Blocks of positions run on the current rayon pool when
/// `parallel` and the convolution is large enough.
///
/// Panics unless the CPU has AVX-512 VNNI ([`available`]), `w`'s depth is `channels x kh x
/// kw`, `x` holds the channels, `out` the planes, and per-channel vectors `w.m()` values.
pub(crate) fn conv_requant<T: Out8>(wts: &ConvW, inp: &ConvInput, rq: &ConvRequant, out: &mut [std::mem::MaybeUninit<T>], parallel: bool) {
    assert!(available(), "the NCHW convolution kernel needs AVX-512 VNNI");
    let (h, w) = (inp.h, inp.w);
    let (m, k) = (wts.m, wts.k);
    let plane = h.output * w.output;
    assert_eq!(k, inp.channels * h.kernel * w.kernel, "weight depth and image channels disagree");
    assert!(inp.x.len() >= inp.channels * h.input * w.input && out.len() >= m * plane);
    rq.assert_covers(m);
    if m == 0 || plane == 0 {
        return;
    }
    let ash = if wts.wt == Int8::U8 { -128 } else { 0 };
    let xz = inp.x_zp + if inp.xt == Int8::I8 { 128 } else { 0 };
    let kk = k as i32;
    let wz = |j: usize| match rq.w_zp {
        ZeroPoints::Tensor(z) => z + ash,
        ZeroPoints::Each(v) => v[j] + ash,
    };
    let row: Vec<i32> = (0..m)
        .map(|j| {
            let t = kk.wrapping_mul(wz(j)).wrapping_mul(xz).wrapping_sub(xz.wrapping_mul(wts.row_sums[j]));
            t.wrapping_add(rq.bias.map_or(0, |b| b[j]))
        })
        .collect();
    let neg_wz: Vec<i32> = (0..m).map(|j| wz(j).wrapping_neg()).collect();
    let col_terms = neg_wz.iter().any(|&z| z != 0);
    let scale: Vec<f32> = (0..m)
        .map(|j| match rq.scale {
            Scale::Tensor(s) => s,
            Scale::Each(v) => v[j],
        })
        .collect();
    let plane_in = h.input * w.input;
    let taps = (0..k)
        .map(|kk| {
            let (c, tap) = (kk / (h.kernel * w.kernel), kk % (h.kernel * w.kernel));
            (c * plane_in, (tap / w.kernel * h.dilation) as isize - h.pad_begin as isize, tap % w.kernel)
        })
        .collect();
    let cols = (0..w.kernel)
        .map(|kj| {
            let (ow, s) = (w.output, w.stride);
            let off = (kj * w.dilation) as isize - w.pad_begin as isize;
            let lo = if off >= 0 { 0 } else { ((-off) as usize).div_ceil(s) }.min(ow);
            let hi = if (w.input as isize) <= off { 0 } else { ((w.input as isize - off - 1) as usize / s + 1).min(ow) };
            (off, lo, hi)
        })
        .collect();
    let pointwise = h.kernel == 1 && w.kernel == 1 && h.stride == 1 && w.stride == 1 && h.pad_begin + h.pad_end + w.pad_begin + w.pad_end == 0;
    let threads = crate::kernels::util::threads();
    let panels = plane.div_ceil(NR);
    let split = parallel && threads > 1 && panels > 1 && ((m + PACK_COST) * k * plane) as u64 >= SPLIT_MIN_WORK;
    let blocks = block_count(panels, if split { threads } else { 1 });
    let job = Job { wts, inp: *inp, row, neg_wz, col_terms, scale, lo: (T::MIN - rq.y_zp) as f32, hi: (T::MAX - rq.y_zp) as f32, rq: *rq, plane, panels, blocks, taps, cols, pointwise };
    let o = SharedOut::uninit(&mut out[..m * plane]);
    let block = |b: usize| PANEL_BUF.with_borrow_mut(|buf| job.block(buf, b, &o));
    if split {
        use rayon::prelude::*;
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
}

thread_local! {
    /// Per-thread buffer of a block's packed positions, reused across blocks and runs.
    static PANEL_BUF: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::default());
}

/// The least work for which a convolution group's blocks are split across threads, counted
/// as multiply-adds plus [`PACK_COST`] per packed input byte: about 5 µs. Below it, handing
/// half the blocks to another core costs more than it saves, not least because the next node
/// then reads an output written by two cores.
const SPLIT_MIN_WORK: u64 = 1 << 21;

/// The work of packing one input byte into a panel, in multiply-adds (gathering a depth of
/// a few channels for thousands of positions, as in a first convolution over an image, takes
/// longer than multiplying it by a few output channels).
const PACK_COST: usize = 32;

/// How many blocks `panels` panels are split into for `threads` threads: the fewest of at most
/// [`PANELS`] panels each, rounded up to a multiple of `threads` (while there are panels
/// enough), so that a small image keeps every thread busy. Block `b` takes panels
/// `b * panels / blocks..(b + 1) * panels / blocks` ([`Job::block`]), so block sizes differ by
/// at most one panel.
fn block_count(panels: usize, threads: usize) -> usize {
    (panels.div_ceil(PANELS).div_ceil(threads) * threads).min(panels).max(1)
}

/// One convolution group's constants for its blocks.
struct Job<'a> {
    wts: &'a ConvW,
    inp: ConvInput<'a>,
    row: Vec<i32>,
    neg_wz: Vec<i32>,
    /// Whether some `wz'` is not 0 (the column sums are needed).
    col_terms: bool,
    scale: Vec<f32>,
    lo: f32,
    hi: f32,
    /// The output stage: its zero point and table.
    rq: ConvRequant<'a>,
    plane: usize,
    /// Panels of [`NR`] positions in the plane, and the blocks they are split into
    /// ([`block_count`]).
    panels: usize,
    blocks: usize,
    /// Per depth `(c, ki, kj)`: the channel's offset in `x`, `ki * dilation - pad_begin` on
    /// the rows, and `kj`.
    taps: Vec<(usize, isize, usize)>,
    /// Per kernel column `kj`: the input column offset `kj * dilation - pad_begin` and the
    /// output columns `lo..hi` whose input column is inside the row.
    cols: Vec<(isize, usize, usize)>,
    /// Whether the kernel is `1 x 1` with unit strides and no padding, so that output
    /// position `q` reads input position `q` of each channel.
    pointwise: bool,
}

impl Job<'_> {
    /// Packs block `b` of positions into `buf` and computes every output channel of it.
    fn block<T: Out8>(&self, buf: &mut AlignedBuf, b: usize, out: &SharedOut<T>) {
        let groups = self.wts.kp / 4;
        let (first, end) = (b * self.panels / self.blocks, (b + 1) * self.panels / self.blocks);
        let p0 = first * NR;
        let n = (end * NR).min(self.plane) - p0;
        let panels = n.div_ceil(NR);
        let panel_bytes = groups * NR * 4;
        buf.reserve_len(panels * panel_bytes + panels * NR * 4);
        let bytes = buf.bytes_mut();
        let (packed, sums) = bytes.split_at_mut(panels * panel_bytes);
        for pi in 0..panels {
            let q0 = p0 + pi * NR;
            let cols = (self.plane - q0).min(NR);
            // SAFETY: the CPU has AVX-512 VNNI (asserted by `conv_requant`); the panel and its
            // 32 column sums are inside `packed` and `sums`.
            unsafe {
                self.pack_panel(q0, cols, &mut packed[pi * panel_bytes..(pi + 1) * panel_bytes]);
                if self.col_terms {
                    col_sums(&packed[pi * panel_bytes..], groups, sums[pi * NR * 4..].as_mut_ptr() as *mut i32);
                }
            }
        }
        let sums = sums.as_ptr() as *const i32;
        let m = self.wts.m;
        let a = self.wts.data.bytes();
        for pi in 0..panels {
            let q0 = p0 + pi * NR;
            let cols = (self.plane - q0).min(NR);
            let mask = if cols == NR { u32::MAX } else { (1u32 << cols) - 1 };
            for r0 in (0..m).step_by(MR) {
                let rows = MR.min(m - r0);
                // SAFETY: `sums` holds 32 values per panel (written when `col_terms`, the only
                // case the tile reads them); `row`, `neg_wz` and `scale` hold
                // `m` values; the output rows `r0..r0 + rows` at positions `q0..q0 + cols` are
                // inside the output and written by this block only (blocks own disjoint
                // positions); A holds `rows` rows of `kp` bytes from row `r0`.
                unsafe {
                    let e = Epi {
                        colsum: sums.add(pi * NR),
                        row: self.row.as_ptr().add(r0),
                        neg_wz: self.neg_wz.as_ptr().add(r0),
                        scale: self.scale.as_ptr().add(r0),
                        lo: self.lo,
                        hi: self.hi,
                        zp: self.rq.y_zp,
                    };
                    let dst = out.ptr(r0 * self.plane + q0, (rows - 1) * self.plane + cols) as *mut u8;
                    tile_fn(rows, self.col_terms)(groups, a.as_ptr().add(r0 * self.wts.kp), self.wts.kp, packed.as_ptr().add(pi * panel_bytes), &e, dst, self.plane, mask);
                }
            }
        }
        // SAFETY: this block owns positions `p0..p0 + n` of every output plane, just written.
        unsafe { self.rq.map(out.ptr(p0, (m - 1) * self.plane + n), n, m, self.plane) };
    }

    /// Writes the B panel of positions `q0..q0 + cols` (`cols <= 32`): for each group of 4
    /// depths, 32 positions of 4 stored bytes. Positions past `cols` and depths past `k` are
    /// stored as 0.
    ///
    /// Each depth's 32 bytes are read with one masked load per run of positions on one output
    /// row (strides 1 and 2; the padding lanes keep the zero point), and the 4 depths of a
    /// group are interleaved in registers.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW, VL and VNNI; `dst` must hold `kp / 4 * 128` bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn pack_panel(&self, q0: usize, cols: usize, dst: &mut [u8]) {
        let inp = &self.inp;
        let (h, w) = (inp.h, inp.w);
        let (k, groups) = (self.wts.k, self.wts.kp / 4);
        let (ow, s) = (w.output, w.stride);
        assert!(dst.len() >= groups * NR * 4 && cols <= NR);
        let flip = _mm256_set1_epi8(if inp.xt == Int8::I8 { 0x80u8 as i8 } else { 0 });
        let padv = _mm256_set1_epi8(inp.x_zp as u8 as i8);
        let keep = if cols == NR { u32::MAX } else { (1u32 << cols) - 1 };
        // Runs of positions on one output row: (first lane, lanes, oy, first ox).
        let mut segs = [(0usize, 0usize, 0usize, 0usize); NR];
        let (mut nseg, mut at) = (0, 0);
        while at < cols {
            let p = q0 + at;
            let (oy, ox) = (p / ow, p % ow);
            let run = (ow - ox).min(cols - at);
            segs[nseg] = (at, run, oy, ox);
            nseg += 1;
            at += run;
        }
        let segs = &segs[..nseg];
        let x = inp.x.as_ptr();
        let lanes = |a: usize, b: usize| -> u64 { if b - a == 64 { u64::MAX } else { ((1u64 << (b - a)) - 1) << a } };
        for g in 0..groups {
            let mut v = [_mm256_setzero_si256(); 4];
            for (t, vt) in v.iter_mut().enumerate() {
                let kk = g * 4 + t;
                if kk >= k {
                    continue;
                }
                let (base, dy, kj) = self.taps[kk];
                let r = if self.pointwise {
                    // Output position `q` reads input position `q`.
                    _mm256_maskz_loadu_epi8(keep, x.add(base + q0) as *const i8)
                } else {
                    let (off, lo, hi) = self.cols[kj];
                    let mut r = padv;
                    for &(j0, len, oy, ox0) in segs {
                        let iy = (oy * h.stride) as isize + dy;
                        if iy < 0 || iy >= h.input as isize {
                            continue;
                        }
                        let (a, b) = (lo.clamp(ox0, ox0 + len), hi.clamp(ox0, ox0 + len));
                        if a >= b {
                            continue;
                        }
                        let (ja, jb) = (j0 + a - ox0, j0 + b - ox0);
                        let line = x.wrapping_add(base + iy as usize * w.input);
                        // Lane `j` of the run reads input column `(ox0 + j - j0) * s + off`, inside
                        // the row for the lanes `ja..jb`, the only ones loaded (masked-off lanes
                        // are not accessed, so the base pointer may lie outside the image).
                        let ptr = line.wrapping_offset((ox0 * s) as isize + off - (j0 * s) as isize);
                        match s {
                            1 => r = _mm256_mask_loadu_epi8(r, lanes(ja, jb) as u32, ptr as *const i8),
                            2 => {
                                let l = _mm512_maskz_loadu_epi8(lanes(2 * ja, 2 * jb) & 0x5555_5555_5555_5555, ptr as *const i8);
                                r = _mm256_mask_blend_epi8(lanes(ja, jb) as u32, r, _mm512_cvtepi16_epi8(l));
                            }
                            _ => {
                                let mut tmp = [0u8; NR];
                                _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, r);
                                for (j, d) in tmp.iter_mut().enumerate().take(jb).skip(ja) {
                                    *d = *ptr.wrapping_add(j * s);
                                }
                                r = _mm256_loadu_si256(tmp.as_ptr() as *const __m256i);
                            }
                        }
                    }
                    r
                };
                *vt = _mm256_maskz_mov_epi8(keep, _mm256_xor_si256(r, flip));
            }
            // Interleave the 4 depth rows into 32 positions of 4 bytes.
            let t0 = _mm256_unpacklo_epi8(v[0], v[1]);
            let t1 = _mm256_unpackhi_epi8(v[0], v[1]);
            let t2 = _mm256_unpacklo_epi8(v[2], v[3]);
            let t3 = _mm256_unpackhi_epi8(v[2], v[3]);
            let u0 = _mm256_unpacklo_epi16(t0, t2);
            let u1 = _mm256_unpackhi_epi16(t0, t2);
            let u2 = _mm256_unpacklo_epi16(t1, t3);
            let u3 = _mm256_unpackhi_epi16(t1, t3);
            let o = dst.as_mut_ptr().add(g * NR * 4) as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_permute2x128_si256(u0, u1, 0x20));
            _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256(u2, u3, 0x20));
            _mm256_storeu_si256(o.add(2), _mm256_permute2x128_si256(u0, u1, 0x31));
            _mm256_storeu_si256(o.add(3), _mm256_permute2x128_si256(u2, u3, 0x31));
        }
    }
}

/// Writes the 32 column sums of a packed panel (`groups` groups of 32 positions x 4 unsigned
/// bytes) to `sums`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI; `panel` must hold `groups * 128` bytes and
/// `sums` room for 32 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn col_sums(panel: &[u8], groups: usize, sums: *mut i32) {
    assert!(panel.len() >= groups * 128);
    let ones = _mm512_set1_epi8(1);
    let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for g in 0..groups {
        let p = panel.as_ptr().add(g * 128);
        s0 = _mm512_dpbusd_epi32(s0, _mm512_loadu_si512(p as *const _), ones);
        s1 = _mm512_dpbusd_epi32(s1, _mm512_loadu_si512(p.add(64) as *const _), ones);
    }
    _mm512_storeu_si512(sums as *mut _, s0);
    _mm512_storeu_si512(sums.add(16) as *mut _, s1);
}

/// An `R x 32` tile kernel: `(groups, A, lda, B panel, epilogue, out, ldo, column mask)`.
type ConvTileFn = unsafe fn(usize, *const u8, usize, *const u8, &Epi, *mut u8, usize, u32);

/// The tile kernel for `rows` rows (1..=12), applying the column sums when `col_terms`.
fn tile_fn(rows: usize, col_terms: bool) -> ConvTileFn {
    macro_rules! rows {
        ($($r:literal)*) => {
            match (rows, col_terms) {
                $(($r, false) => tile::<$r, false>, ($r, true) => tile::<$r, true>,)*
                (_, false) => tile::<12, false>,
                (_, true) => tile::<12, true>,
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11)
}

/// Computes `R` output channels at 32 positions: the `vpdpbusd` sums of `R` weight rows (`i8`,
/// at stride `lda`) with a packed panel, plus `row` and, when `COLS`, `colsum * neg_wz`,
/// requantized (`f32`
/// multiply, clamp to `lo..=hi`, round to nearest even, `+ zp`) and stored as bytes to `out`
/// rows at stride `ldo`, the positions selected by `mask` only.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI. `a` must hold `R` rows of `4 groups` bytes,
/// `b` `groups * 128` bytes, `e`'s pointers 32 (`colsum`, read only when `COLS`) and `R` (the
/// rest) values, and
/// `out` must be valid for writes of the masked bytes of `R` rows of 32 at stride `ldo`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const COLS: bool>(groups: usize, a: *const u8, lda: usize, b: *const u8, e: &Epi, out: *mut u8, ldo: usize, mask: u32) {
    let sum = super::avx512vnni::dot_rows::<R, false>(groups, a, lda, b);
    let (c0, c1) = if COLS {
        (_mm512_loadu_si512(e.colsum as *const _), _mm512_loadu_si512(e.colsum.add(16) as *const _))
    } else {
        (_mm512_setzero_si512(), _mm512_setzero_si512())
    };
    let (lo, hi, zp) = (_mm512_set1_ps(e.lo), _mm512_set1_ps(e.hi), _mm512_set1_epi32(e.zp));
    let (m0, m1) = (mask as u16, (mask >> 16) as u16);
    for (r, s) in sum.iter().enumerate() {
        let nz = _mm512_set1_epi32(*e.neg_wz.add(r));
        let rv = _mm512_set1_epi32(*e.row.add(r));
        let sc = _mm512_set1_ps(*e.scale.add(r));
        let dst = out.add(r * ldo);
        for (half, (acc, cs, m)) in [(s[0], c0, m0), (s[1], c1, m1)].into_iter().enumerate() {
            let v = if COLS { _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_mullo_epi32(cs, nz), rv)) } else { _mm512_add_epi32(acc, rv) };
            let f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), sc);
            let f = _mm512_min_ps(_mm512_max_ps(f, lo), hi);
            let q = _mm512_add_epi32(_mm512_cvtps_epi32(f), zp);
            _mm_mask_storeu_epi8(dst.add(16 * half) as *mut i8, m, _mm512_cvtepi32_epi8(q));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qgemm::test_reference::{axis, naive_conv, output_bytes};

    #[test]
    fn matches_a_direct_convolution() {
        if !available() {
            eprintln!("NCHW VNNI convolution NOT TESTED: this CPU lacks AVX-512 VNNI");
            return;
        }
        let mut rng = qforge_testkit::Rng::new(7);
        let mut next = move || (rng.next() >> 32) as u32;
        // (channels, out channels, (ih, kh, sh, dh, pads), (iw, kw, sw, dw, pads)).
        type Ax = (usize, usize, usize, usize, usize, usize);
        let cases: [(usize, usize, Ax, Ax); 10] = [
            (3, 16, (17, 3, 2, 1, 1, 1), (23, 3, 2, 1, 1, 1)),
            (8, 5, (6, 1, 1, 1, 0, 0), (70, 1, 1, 1, 0, 0)),
            (13, 25, (9, 3, 1, 1, 1, 1), (41, 3, 1, 1, 1, 1)),
            (5, 12, (7, 2, 1, 2, 0, 2), (9, 3, 3, 1, 2, 0)),
            (1, 1, (1, 1, 1, 1, 0, 0), (1, 1, 1, 1, 0, 0)),
            (36, 13, (11, 3, 1, 1, 0, 0), (12, 5, 1, 1, 2, 2)),
            (4, 7, (5, 1, 2, 1, 0, 0), (33, 1, 2, 1, 0, 0)),
            (21, 33, (9, 1, 1, 1, 0, 0), (37, 1, 1, 1, 0, 0)),
            (3, 2, (1, 1, 1, 1, 0, 0), (5, 1, 1, 1, 0, 0)),
            (6, 4, (7, 1, 1, 1, 1, 0), (7, 1, 1, 1, 0, 1)),
        ];
        for (ci, &(c, m, hx, wx)) in cases.iter().enumerate() {
            let h = axis(hx.0, hx.1, hx.2, hx.3, hx.4, hx.5);
            let wa = axis(wx.0, wx.1, wx.2, wx.3, wx.4, wx.5);
            for (xt, wt) in [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8), (Int8::I8, Int8::U8)] {
                let x: Vec<u8> = (0..c * h.input * wa.input).map(|_| next() as u8).collect();
                let k = c * h.kernel * wa.kernel;
                let w: Vec<u8> = (0..m * k).map(|_| next() as u8).collect();
                let per_channel = ci % 2 == 0;
                let wz: Vec<i32> = (0..m).map(|j| if per_channel || j == 0 { (next() % 256) as i32 - if wt == Int8::I8 { 128 } else { 0 } } else { 0 }).collect();
                // Every other type pair: the zero point of no column terms (0 for i8, 128 for u8).
                let symmetric = (ci + (wt == Int8::U8) as usize) % 2 == 1;
                let wz: Vec<i32> = if symmetric { vec![if wt == Int8::U8 { 128 } else { 0 }; m] } else { wz };
                let wz: Vec<i32> = if per_channel { wz } else { vec![wz[0]; m] };
                let xz = (next() % 256) as i32 - if xt == Int8::I8 { 128 } else { 0 };
                let yz = (next() % 256) as i32 - if xt == Int8::I8 { 128 } else { 0 };
                let bias: Vec<i32> = (0..m).map(|_| (next() % 20001) as i32 - 10000).collect();
                let scale: Vec<f32> = (0..m).map(|_| [1.0 / 256.0, 1.0 / 1024.0, 0.0037, 0.00051][(next() % 4) as usize]).collect();
                let want = naive_conv(&x, xt, xz, &w, wt, &wz, c, m, 1, h, wa, &bias, &scale, yz);
                let cw = ConvW::pack(wt, &w, m, k);
                let inp = ConvInput { x: &x, xt, x_zp: xz, channels: c, h, w: wa };
                let table: Option<[u8; 256]> = (ci % 3 == 2).then(|| std::array::from_fn(|_| next() as u8));
                let want: Vec<u8> = want.iter().map(|&b| table.map_or(b, |t| t[b as usize])).collect();
                let rq = ConvRequant {
                    scale: Scale::Each(&scale),
                    bias: Some(&bias),
                    w_zp: if per_channel { ZeroPoints::Each(&wz) } else { ZeroPoints::Tensor(wz[0]) },
                    y_zp: yz,
                    table: table.as_ref(),
                };
                for parallel in [false, true] {
                    let len = m * h.output * wa.output;
                    let got = output_bytes(xt, len, |o| conv_requant(&cw, &inp, &rq, o, parallel), |o| conv_requant(&cw, &inp, &rq, o, parallel));
                    assert_eq!(got, want, "case {ci} x {xt:?} w {wt:?} per-channel {per_channel} symmetric {symmetric} table {}", table.is_some());
                }
            }
        }
    }
}
