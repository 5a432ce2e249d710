//! Winograd F(4x4, 3x3) (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks",
//! 2016) for dense 2-D convolutions with 3x3 kernels, stride 1 and dilation 1.
//!
//! The output is cut into 4x4 tiles; tile `(i, j)` reads the 6x6 block of the padded input
//! whose top left corner is padded position `(4i, 4j)`. With `d` that block of one input
//! channel and `g` the 3x3 kernel of one (output, input) channel pair, the tile is
//! `Aᵀ [Σ_c (G g Gᵀ) ⊙ (Bᵀ d B)] A`: the input transform `Bᵀ d B` and the weight transform
//! `G g Gᵀ` are 6x6, and the sum over input channels is, for each of the 36 positions of a
//! transformed tile, a matrix product `[tiles x cg] · [cg x mg]`: 36 multiply-adds per tile
//! and channel pair where the direct convolution needs 144. The transforms' coefficients
//! (up to 8 in `A`, 5 in `B`) amplify rounding: on DNSMOS's and PP-OCRv4 det's activations
//! the result differs from an f64 convolution by up to 2.4e-6 of the output's largest
//! magnitude, 2-3 times the direct kernels' error.

use std::mem::MaybeUninit;

use super::{finish_tile, Axis, Finish, OutPtr};
use crate::kernels::fused::Scratch;
use crate::kernels::util::{min_items, par_steps, threads};

/// Outputs along each axis of a tile.
const TILE: usize = 4;
/// Inputs along each axis of a tile, and values along each axis of a transformed tile.
const SIDE: usize = TILE + 2;
/// Positions of a transformed tile, one matrix product each.
const POSITIONS: usize = SIDE * SIDE;
/// Tiles transformed and multiplied together (lanes of the products).
const CHUNK: usize = 32;
/// Lanes one step of the products computes along the tiles.
const STEP: usize = 16;
/// Output channels one step of the products computes.
const CB: usize = 8;

/// The instructions the products and the transforms are compiled for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Isa {
    /// AVX-512F: the product's lanes are one 16-lane register per step.
    Avx512,
    /// AVX2 and FMA: the product's lanes are two 8-lane registers per step.
    Avx2,
}

impl Isa {
    /// The best this CPU supports, if any.
    pub(super) fn detect() -> Option<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") {
                return Some(Isa::Avx512);
            }
            if has!("avx2") && has!("fma") {
                return Some(Isa::Avx2);
            }
        }
        None
    }
}

/// `G`, the weight transform's 6x3 matrix.
const G: [[f64; 3]; SIDE] = [
    [1.0 / 4.0, 0.0, 0.0],
    [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
    [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
    [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
    [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
    [0.0, 0.0, 1.0],
];

/// A constant weight's transform ([`transform_weights`]) for every group, computed on first
/// use and kept: made on every call, it took six times as long as the rest of a 16x16-output,
/// 256-channel convolution (AVX2), so small planes would not pay for Winograd.
#[derive(Default)]
pub(crate) struct Transformed(std::sync::OnceLock<Vec<Vec<f32>>>);

impl Transformed {
    /// The transform of group `g` of the constant weight `w` (`group` groups of `[mg, cg, 3, 3]`).
    pub(super) fn group(&self, w: &[f32], group: usize, mg: usize, cg: usize, g: usize) -> &[f32] {
        &self.0.get_or_init(|| (0..group).map(|g| transform_weights(&w[g * mg * cg * 9..(g + 1) * mg * cg * 9], mg, cg)).collect())[g]
    }
}

/// The weights `[mg, cg, 3, 3]` transformed (`G g Gᵀ`, computed in f64) and laid out for the
/// products: for each block of [`CB`] output channels, each position, each input channel,
/// the block's [`CB`] values (channels past `mg` zero).
pub(super) fn transform_weights(w: &[f32], mg: usize, cg: usize) -> Vec<f32> {
    let mut u = vec![0f32; mg.div_ceil(CB) * POSITIONS * cg * CB];
    for (pair, g) in w[..mg * cg * 9].chunks_exact(9).enumerate() {
        let (m, c) = (pair / cg, pair % cg);
        let gg: [[f64; 3]; SIDE] = std::array::from_fn(|a| std::array::from_fn(|j| (0..3).map(|k| G[a][k] * g[k * 3 + j] as f64).sum()));
        for a in 0..SIDE {
            for b in 0..SIDE {
                let v: f64 = (0..3).map(|j| gg[a][j] * G[b][j]).sum();
                u[((m / CB * POSITIONS + a * SIDE + b) * cg + c) * CB + m % CB] = v as f32;
            }
        }
    }
    u
}

/// Tiles of one chunk that lie in one tile row: lanes `lane..lane + len` hold tiles
/// `(row, col..col + len)`.
#[derive(Debug, Clone, Copy)]
struct Run {
    lane: usize,
    row: usize,
    col: usize,
    len: usize,
}

/// The values of one position (or one row of a transform) for every tile of a chunk.
type Lanes = [f32; CHUNK];

/// Groups of four padded columns one run's row is split into: one more than the run's tiles,
/// rounded up to whole steps.
const GROUPS: usize = CHUNK + STEP;

/// One task's working memory.
struct Buffers {
    /// Transformed inputs: row `position * cg + c`.
    v: Vec<Lanes>,
    /// One block's products: row `position * CB + k`.
    m: Vec<Lanes>,
    /// One padded input row of a run (`4 * GROUPS` values, zero past the run's columns).
    line: Vec<f32>,
    /// `line` split by column modulo 4.
    phases: [[f32; GROUPS]; 4],
    /// The chunk's input blocks of one channel (row `r * SIDE + c`: block row r, column c),
    /// then its output tiles of one channel (row `r * TILE + c`).
    block: [Lanes; POSITIONS],
    /// A transform along one axis: row `a * SIDE + c`.
    half: [Lanes; POSITIONS],
    runs: Vec<Run>,
}

impl Buffers {
    fn new(cg: usize) -> Buffers {
        Buffers { v: vec![[0.0; CHUNK]; POSITIONS * cg], m: vec![[0.0; CHUNK]; POSITIONS * CB], line: vec![0.0; 4 * GROUPS], phases: [[0.0; GROUPS]; 4], block: [[0.0; CHUNK]; POSITIONS], half: [[0.0; CHUNK]; POSITIONS], runs: Vec::with_capacity(CHUNK) }
    }
}

/// The geometry of one call.
#[derive(Clone, Copy)]
struct Geometry {
    h: Axis,
    wa: Axis,
    cg: usize,
    mg: usize,
}

/// Dense 3x3 convolution of stride 1 and dilation 1 of one image and group (`cg` input
/// channels in `src`, weights `[mg, cg, 3, 3]` given transformed as `u`, see
/// [`transform_weights`]) by Winograd F(4x4, 3x3), with `isa`'s
/// instructions (the CPU must support them). Written to `dst` (`mg` channel planes; its
/// first element is output element `base`) and finished in bands of tile rows; bands run in
/// parallel, each transforming and multiplying [`CHUNK`] tiles at a time, so its buffers
/// hold about `4.6 KiB * cg` of transformed inputs whatever the plane's size.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv_winograd(src: &[f32], cg: usize, h: Axis, wa: Axis, u: &[f32], mg: usize, dst: &mut [MaybeUninit<f32>], base: usize, fin: Finish, isa: Isa) {
    assert!(h.kernel == 3 && wa.kernel == 3 && h.stride == 1 && wa.stride == 1 && h.dilation == 1 && wa.dilation == 1, "Winograd F(4x4, 3x3) needs a 3x3 window of stride 1 and dilation 1");
    let (oh, ow) = (h.output, wa.output);
    let plane = oh * ow;
    if plane == 0 {
        return;
    }
    assert!(src.len() >= cg * h.input * wa.input, "input too small");
    let (th, tw) = (oh.div_ceil(TILE), ow.div_ceil(TILE));
    assert!(u.len() >= mg.div_ceil(CB) * POSITIONS * cg * CB, "transformed weights too small");
    let ch0 = (base / plane) % fin.channels;
    let bias: Vec<f32> = (0..mg).map(|m| fin.bias.map_or(0.0, |b| b[ch0 + m])).collect();
    let fin = Finish { bias: None, ..fin };
    // Bands of at least two chunks, and two per thread when the plane has enough tile rows.
    let band = (2 * CHUNK).div_ceil(tw).min(th.div_ceil(2 * threads())).max(1);
    let geo = Geometry { h, wa, cg, mg };
    let out = OutPtr::new(dst);
    assert!(out.len >= mg * plane, "output too small");
    par_steps(th, band, min_items(band * tw * POSITIONS * cg * mg), || (Scratch::new(), Buffers::new(cg)), |(scratch, bufs), i0| {
        let i1 = (i0 + band).min(th);
        let tiles = (i1 - i0) * tw;
        for t0 in (0..tiles).step_by(CHUNK) {
            let n = CHUNK.min(tiles - t0);
            bufs.runs.clear();
            let mut t = t0;
            while t < t0 + n {
                let (row, col) = (i0 + t / tw, t % tw);
                let len = (tw - col).min(t0 + n - t);
                bufs.runs.push(Run { lane: t - t0, row, col, len });
                t += len;
            }
            // SAFETY: the caller's `isa` is supported by this CPU; the chunk's tiles are in
            // tile rows `i0..i1`, whose output rows belong to this band alone.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => chunk_avx512(&geo, src, u, &bias, bufs, n, out, plane),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => chunk_avx2(&geo, src, u, &bias, bufs, n, out, plane),
                    #[cfg(not(target_arch = "x86_64"))]
                    _ => unreachable!("no Winograd kernel on this architecture"),
                }
            }
        }
        let (r0, r1) = (TILE * i0, (TILE * i1).min(oh));
        // SAFETY: the chunks just wrote every output of rows `r0..r1` of every channel, which
        // no other band touches.
        unsafe { finish_tile(fin, out, r0 * ow, mg, plane, (r1 - r0) * ow, base + r0 * ow, scratch) };
    });
}

/// One chunk of `n` tiles (`bufs.runs`) of [`conv_winograd`] with AVX-512F: the input
/// transform, then for each block of [`CB`] output channels the products and the output
/// transform into `out` (`mg` planes of `plane` values).
///
/// # Safety
/// The CPU must support AVX-512F; the chunk's output rows are valid for writes and written
/// by nothing else meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn chunk_avx512(geo: &Geometry, src: &[f32], u: &[f32], bias: &[f32], bufs: &mut Buffers, n: usize, out: OutPtr, plane: usize) {
    // SAFETY: the CPU supports AVX-512F (the caller's guarantee).
    transform_input(geo, src, bufs, |line, phases, groups| unsafe { deinterleave_avx512(line, phases, groups) });
    for blk in 0..geo.mg.div_ceil(CB) {
        let ub = &u[blk * POSITIONS * geo.cg * CB..(blk + 1) * POSITIONS * geo.cg * CB];
        // SAFETY: the CPU supports AVX-512F (the caller's guarantee).
        unsafe {
            if n > STEP {
                product_avx512::<2>(bufs.v.as_flattened(), ub, geo.cg, bufs.m.as_flattened_mut())
            } else {
                product_avx512::<1>(bufs.v.as_flattened(), ub, geo.cg, bufs.m.as_flattened_mut())
            }
        }
        // SAFETY: the caller's guarantee.
        unsafe { transform_output(geo, blk, bias, bufs, out, plane) };
    }
}

/// [`chunk_avx512`] with AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA; otherwise as [`chunk_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn chunk_avx2(geo: &Geometry, src: &[f32], u: &[f32], bias: &[f32], bufs: &mut Buffers, n: usize, out: OutPtr, plane: usize) {
    transform_input(geo, src, bufs, deinterleave);
    for blk in 0..geo.mg.div_ceil(CB) {
        let ub = &u[blk * POSITIONS * geo.cg * CB..(blk + 1) * POSITIONS * geo.cg * CB];
        // SAFETY: the CPU supports AVX2 and FMA (the caller's guarantee).
        unsafe { product_avx2(bufs.v.as_flattened(), ub, geo.cg, bufs.m.as_flattened_mut(), n.div_ceil(STEP)) };
        // SAFETY: the caller's guarantee.
        unsafe { transform_output(geo, blk, bias, bufs, out, plane) };
    }
}

/// `Bᵀ` applied to the six values `d`: the input transform along one axis.
#[inline(always)]
fn input_1d(d: [f32; SIDE]) -> [f32; SIDE] {
    let (a, b) = (d[4] - 4.0 * d[2], 4.0 * d[1] - d[3]);
    let (c, e) = (d[4] - d[2], 2.0 * (d[1] - d[3]));
    [4.0 * d[0] - 5.0 * d[2] + d[4], a - b, a + b, c - e, c + e, 4.0 * d[1] - 5.0 * d[3] + d[5]]
}

/// `Aᵀ` applied to the six values `m`: the output transform along one axis.
#[inline(always)]
fn output_1d(m: [f32; SIDE]) -> [f32; TILE] {
    let (s12, d12, s34, d34) = (m[1] + m[2], m[1] - m[2], m[3] + m[4], m[3] - m[4]);
    [m[0] + s12 + s34, d12 + 2.0 * d34, s12 + 4.0 * s34, d12 + 8.0 * d34 + m[5]]
}

/// `phases[p][g] = line[4 * g + p]` for the first `groups` groups.
#[inline(always)]
fn deinterleave(line: &[f32], phases: &mut [[f32; GROUPS]; 4], groups: usize) {
    for (g, q) in line[..4 * groups].chunks_exact(4).enumerate() {
        for (p, &v) in q.iter().enumerate() {
            phases[p][g] = v;
        }
    }
}

/// [`deinterleave`] with AVX-512F, sixteen groups per step (`line` holds `4 * GROUPS` values;
/// groups past `groups` up to the next step are written too).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn deinterleave_avx512(line: &[f32], phases: &mut [[f32; GROUPS]; 4], groups: usize) {
    use std::arch::x86_64::*;
    assert!(groups <= GROUPS && line.len() >= 4 * GROUPS);
    for g in (0..groups).step_by(STEP) {
        // SAFETY: the 64 values from 4 * g lie in `line` (asserted above, g < GROUPS).
        let at = |i: usize| unsafe { _mm512_loadu_ps(line.as_ptr().add(4 * g + i * STEP)) };
        let x = [at(0), at(1), at(2), at(3)];
        for (p, dst) in phases.iter_mut().enumerate() {
            // Lanes 0..8 gather values p, p + 4, ... of the first (second) pair of registers.
            let idx = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
            let idx = _mm512_add_epi32(idx, _mm512_set1_epi32(p as i32));
            let lo = _mm512_permutex2var_ps(x[0], idx, x[1]);
            let hi = _mm512_permutex2var_ps(x[2], idx, x[3]);
            // SAFETY: g + 16 <= GROUPS.
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(g), _mm512_shuffle_f32x4::<0x44>(lo, hi)) };
        }
    }
}

/// The input transform of every input channel of the chunk's tiles (`bufs.runs`) into
/// `bufs.v`, each run's rows split into groups of four columns by `split` (a
/// [`deinterleave`]). Inlined into [`chunk_avx512`] and [`chunk_avx2`], whose instructions
/// vectorize it along the tiles.
#[inline(always)]
fn transform_input(geo: &Geometry, src: &[f32], bufs: &mut Buffers, split: impl Fn(&[f32], &mut [[f32; GROUPS]; 4], usize)) {
    let (h, wa, cg) = (geo.h, geo.wa, geo.cg);
    let (ih, iw) = (h.input, wa.input);
    let Buffers { v, line, phases, block, half, runs, .. } = bufs;
    for c in 0..cg {
        let img = &src[c * ih * iw..(c + 1) * ih * iw];
        for run in runs.iter() {
            let (n, lanes) = (run.len, run.lane..run.lane + run.len);
            for r in 0..SIDE {
                let y = (TILE * run.row + r).wrapping_sub(h.pad_begin);
                if y >= ih {
                    block[r * SIDE..(r + 1) * SIDE].iter_mut().for_each(|b| b[lanes.clone()].fill(0.0));
                    continue;
                }
                // Padded columns 4 * col .. 4 * (col + n + 1), input columns from x0.
                let width = TILE * (n + 1);
                let x0 = (TILE * run.col) as isize - wa.pad_begin as isize;
                let lo = (-x0).clamp(0, width as isize) as usize;
                let hi = (iw as isize - x0).clamp(lo as isize, width as isize) as usize;
                line[..lo].fill(0.0);
                line[hi..width].fill(0.0);
                if hi > lo {
                    let from = y * iw + (x0 + lo as isize) as usize;
                    line[lo..hi].copy_from_slice(&img[from..from + hi - lo]);
                }
                split(line, phases, n + 1);
                for q in 0..SIDE {
                    let shift = q / TILE;
                    block[r * SIDE + q][lanes.clone()].copy_from_slice(&phases[q % TILE][shift..shift + n]);
                }
            }
        }
        // Along the block rows, then along the columns into the channel's rows of `v`.
        for q in 0..SIDE {
            let e: [&Lanes; SIDE] = [0, 1, 2, 3, 4, 5].map(|r| &block[r * SIDE + q]);
            for l in 0..CHUNK {
                let t = input_1d([e[0][l], e[1][l], e[2][l], e[3][l], e[4][l], e[5][l]]);
                for a in 0..SIDE {
                    half[a * SIDE + q][l] = t[a];
                }
            }
        }
        for a in 0..SIDE {
            let e = &half[a * SIDE..(a + 1) * SIDE];
            let [d0, d1, d2, d3, d4, d5] = v.get_disjoint_mut([0, 1, 2, 3, 4, 5].map(|k| (a * SIDE + k) * cg + c)).expect("distinct rows");
            for l in 0..CHUNK {
                let t = input_1d([e[0][l], e[1][l], e[2][l], e[3][l], e[4][l], e[5][l]]);
                (d0[l], d1[l], d2[l], d3[l], d4[l], d5[l]) = (t[0], t[1], t[2], t[3], t[4], t[5]);
            }
        }
    }
}

/// The output transform of block `blk`'s products (`bufs.m`) for the chunk's tiles
/// (`bufs.runs`), plus each channel's `bias`, written to `out` (`geo.mg` planes of `plane`
/// values; outputs past the plane's edge are dropped).
///
/// # Safety
/// The runs' output rows of the block's channels are valid for writes and written by
/// nothing else meanwhile.
#[inline(always)]
unsafe fn transform_output(geo: &Geometry, blk: usize, bias: &[f32], bufs: &mut Buffers, out: OutPtr, plane: usize) {
    let (oh, ow) = (geo.h.output, geo.wa.output);
    let Buffers { m, block, half, runs, .. } = bufs;
    for k in 0..CB.min(geo.mg - blk * CB) {
        let ch = blk * CB + k;
        let b = bias[ch];
        // Along the rows of each transformed tile, then along its columns.
        for j in 0..SIDE {
            let e: [&Lanes; SIDE] = [0, 1, 2, 3, 4, 5].map(|a| &m[(a * SIDE + j) * CB + k]);
            for l in 0..CHUNK {
                let t = output_1d([e[0][l], e[1][l], e[2][l], e[3][l], e[4][l], e[5][l]]);
                for r in 0..TILE {
                    half[r * SIDE + j][l] = t[r];
                }
            }
        }
        for r in 0..TILE {
            let e = &half[r * SIDE..(r + 1) * SIDE];
            for l in 0..CHUNK {
                let t = output_1d([e[0][l], e[1][l], e[2][l], e[3][l], e[4][l], e[5][l]]);
                for q in 0..TILE {
                    block[r * TILE + q][l] = t[q] + b;
                }
            }
        }
        for run in runs.iter() {
            // The last tile of a row may be cut by the plane's edge.
            let width = (ow - TILE * run.col).min(TILE * run.len);
            let whole = width / TILE;
            for r in 0..TILE.min(oh - TILE * run.row) {
                let y = TILE * run.row + r;
                // SAFETY: `width` outputs from column `4 * col` of row `y` of channel `ch` lie
                // in the plane, and the caller owns them.
                let row = unsafe { std::slice::from_raw_parts_mut(out.at(ch * plane + y * ow + TILE * run.col).cast::<MaybeUninit<f32>>(), width) };
                let tile = |q: usize| &block[r * TILE + q][run.lane..run.lane + run.len];
                let (y0, y1, y2, y3) = (tile(0), tile(1), tile(2), tile(3));
                let (body, cut) = row.split_at_mut(TILE * whole);
                for (l, o) in body.chunks_exact_mut(TILE).enumerate() {
                    o[0].write(y0[l]);
                    o[1].write(y1[l]);
                    o[2].write(y2[l]);
                    o[3].write(y3[l]);
                }
                for (q, o) in cut.iter_mut().enumerate() {
                    o.write(tile(q)[whole]);
                }
            }
        }
    }
}

/// The products of one block of [`CB`] output channels for the first `NV` steps of
/// [`STEP`] lanes: `m[(p * CB + k) * CHUNK + t] = Σ_c v[(p * cg + c) * CHUNK + t] ·
/// u[(p * cg + c) * CB + k]` for every position `p`.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn product_avx512<const NV: usize>(v: &[f32], u: &[f32], cg: usize, m: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(NV * STEP <= CHUNK && v.len() >= POSITIONS * cg * CHUNK && u.len() >= POSITIONS * cg * CB && m.len() >= POSITIONS * CB * CHUNK);
    for p in 0..POSITIONS {
        let mut acc = [[_mm512_setzero_ps(); NV]; CB];
        // SAFETY: position p's inputs and weights lie inside `v` and `u` (asserted above).
        let (vp, up) = unsafe { (v.as_ptr().add(p * cg * CHUNK), u.as_ptr().add(p * cg * CB)) };
        for c in 0..cg {
            // SAFETY: input channel c's lanes and weights of position p (see above).
            let mut x = [_mm512_setzero_ps(); NV];
            for (i, x) in x.iter_mut().enumerate() {
                // SAFETY: see above.
                *x = unsafe { _mm512_loadu_ps(vp.add(c * CHUNK + i * STEP)) };
            }
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: see above.
                let w = _mm512_set1_ps(unsafe { *up.add(c * CB + k) });
                for i in 0..NV {
                    a[i] = _mm512_fmadd_ps(x[i], w, a[i]);
                }
            }
        }
        for (k, a) in acc.iter().enumerate() {
            for (i, &s) in a.iter().enumerate() {
                // SAFETY: inside `m` (asserted above).
                unsafe { _mm512_storeu_ps(m.as_mut_ptr().add((p * CB + k) * CHUNK + i * STEP), s) };
            }
        }
    }
}

/// [`product_avx512`] with AVX2 and FMA for the first `steps` (1 or 2) steps of [`STEP`]
/// lanes, each step as two 8-lane registers for half a block of channels at a time.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn product_avx2(v: &[f32], u: &[f32], cg: usize, m: &mut [f32], steps: usize) {
    use std::arch::x86_64::*;
    const HALF: usize = CB / 2;
    assert!(steps * STEP <= CHUNK && v.len() >= POSITIONS * cg * CHUNK && u.len() >= POSITIONS * cg * CB && m.len() >= POSITIONS * CB * CHUNK);
    for p in 0..POSITIONS {
        // SAFETY: position p's inputs and weights lie inside `v` and `u` (asserted above).
        let (vp, up) = unsafe { (v.as_ptr().add(p * cg * CHUNK), u.as_ptr().add(p * cg * CB)) };
        for step in 0..steps {
            for half in 0..2 {
                let mut acc = [[_mm256_setzero_ps(); 2]; HALF];
                for c in 0..cg {
                    // SAFETY: this step's lanes of input channel c and the weights of
                    // position p (see above).
                    let x = unsafe { [_mm256_loadu_ps(vp.add(c * CHUNK + step * STEP)), _mm256_loadu_ps(vp.add(c * CHUNK + step * STEP + 8))] };
                    for (k, a) in acc.iter_mut().enumerate() {
                        // SAFETY: see above.
                        let w = _mm256_set1_ps(unsafe { *up.add(c * CB + half * HALF + k) });
                        a[0] = _mm256_fmadd_ps(x[0], w, a[0]);
                        a[1] = _mm256_fmadd_ps(x[1], w, a[1]);
                    }
                }
                for (k, a) in acc.iter().enumerate() {
                    for (i, &s) in a.iter().enumerate() {
                        // SAFETY: inside `m` (asserted above).
                        unsafe { _mm256_storeu_ps(m.as_mut_ptr().add((p * CB + half * HALF + k) * CHUNK + step * STEP + i * 8), s) };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::conv::Window;
    use crate::kernels::fused::{Inst, Operand, Program, Unary};
    use crate::kernels::util::{assume_init, uninit};

    /// The instruction sets this CPU can run.
    fn isas() -> Vec<Isa> {
        let mut isas = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") {
                isas.push(Isa::Avx512);
            }
            if has!("avx2") && has!("fma") {
                isas.push(Isa::Avx2);
            }
        }
        isas
    }

    /// A 3x3 convolution of stride 1 in f64 (`pads`: top, left, bottom, right), then the
    /// bias and a Relu, and for each output the sum of the absolute values of its terms (bias
    /// included), which bounds the rounding error of any f32 evaluation up to a factor.
    fn reference(x: &[f32], xs: [usize; 4], w: &[f32], m: usize, b: &[f32], pads: [usize; 4], group: usize) -> (Vec<f64>, Vec<f64>, [usize; 4]) {
        let [n, c, ih, iw] = xs;
        let (cg, mg) = (c / group, m / group);
        let (oh, ow) = (ih + pads[0] + pads[2] - 2, iw + pads[1] + pads[3] - 2);
        let (mut out, mut mag) = (vec![0f64; n * m * oh * ow], vec![0f64; n * m * oh * ow]);
        for (i, (o, a)) in out.iter_mut().zip(&mut mag).enumerate() {
            let (ox, oy, co, bi) = (i % ow, i / ow % oh, i / (oh * ow) % m, i / (m * oh * ow));
            let (mut s, mut t) = (b[co] as f64, (b[co] as f64).abs());
            for ci in 0..cg {
                for (ki, kj) in (0..3).flat_map(|ki| (0..3).map(move |kj| (ki, kj))) {
                    let (iy, ix) = ((oy + ki).wrapping_sub(pads[0]), (ox + kj).wrapping_sub(pads[1]));
                    if iy < ih && ix < iw {
                        let p = x[((bi * c + co / mg * cg + ci) * ih + iy) * iw + ix] as f64 * w[((co * cg + ci) * 3 + ki) * 3 + kj] as f64;
                        s += p;
                        t += p.abs();
                    }
                }
            }
            *o = s.max(0.0);
            *a = t;
        }
        (out, mag, [n, m, oh, ow])
    }

    /// [`conv_winograd`] of every image and group of `x` with `isa`, the bias and a Relu
    /// epilogue, as `conv_2d` runs it.
    fn run(isa: Isa, x: &[f32], xs: [usize; 4], w: &[f32], m: usize, b: &[f32], pads: [usize; 4], group: usize) -> Vec<f32> {
        let [n, c, ih, iw] = xs;
        let (cg, mg) = (c / group, m / group);
        let window = Window { kernel: None, strides: None, dilations: None, pads: Some(pads.to_vec()), auto_pad: "NOTSET".into(), ceil_mode: false };
        let [h, wa] = window.axes(&xs[2..], &[3, 3]).unwrap()[..] else { unreachable!() };
        let plane = h.output * wa.output;
        let relu = Program { inputs: 1, insts: vec![Inst::Unary(Unary::Relu, Operand::Input(0))], params: vec![] };
        let bound = relu.bind(&[n, m, h.output, wa.output], &[]).unwrap();
        let fin = Finish { bias: Some(b), channels: m, plane, epilogue: Some(&bound) };
        let mut out = uninit::<f32>(n * m * plane);
        for (i, dst) in out.chunks_mut(mg * plane).enumerate() {
            let (bi, g) = (i / group, i % group);
            let src = &x[(bi * c + g * cg) * ih * iw..(bi * c + (g + 1) * cg) * ih * iw];
            conv_winograd(src, cg, h, wa, &transform_weights(&w[g * mg * cg * 9..(g + 1) * mg * cg * 9], mg, cg), mg, dst, i * mg * plane, fin, isa);
        }
        // SAFETY: each call writes every element of its image's and group's planes.
        unsafe { assume_init(out) }
    }

    /// The largest error of F(4x4, 3x3) in f32 relative to the sum of the absolute values of
    /// an output's terms that these tests allow. A direct f32 evaluation of the sum is within
    /// a small multiple of `f32::EPSILON` (1.2e-7) times that sum; the transforms' coefficients
    /// multiply the input and product roundings by up to about 100 (`Bᵀ`'s rows sum to at most
    /// 10 in absolute value, `Aᵀ`'s to 18, and each is applied along both axes). These tests
    /// measure up to 2.3e-6 (DNSMOS's activations up to 1.3e-5, where an output's own terms
    /// are much smaller than its tile's neighbours); 2e-5 allows that without admitting the
    /// error of a wrong tap or channel, which is of the order of the sum itself.
    const TOLERANCE: f64 = 2e-5;

    #[test]
    fn winograd_matches_an_f64_convolution_with_bias_and_relu() {
        // (input shape, output channels, pads top/left/bottom/right, group): odd and even
        // heights and widths, planes smaller than one tile, rows of one tile and of more tiles
        // than a chunk, every combination of zero and one pads, asymmetric pads and pads of
        // two, two groups, two images, channel counts off multiples of 8 and 16.
        let mut cases: Vec<([usize; 4], usize, [usize; 4], usize)> = vec![
            ([1, 5, 9, 37], 24, [1, 1, 1, 1], 1),
            ([2, 7, 13, 11], 17, [1, 1, 1, 1], 1),
            ([1, 16, 3, 3], 9, [0, 0, 0, 0], 1),
            ([1, 3, 2, 5], 4, [1, 1, 1, 1], 1),
            ([1, 12, 30, 161], 20, [1, 1, 1, 1], 1),
            ([1, 8, 21, 70], 40, [2, 0, 1, 2], 1),
            ([2, 12, 10, 19], 10, [1, 2, 2, 0], 2),
            ([1, 6, 6, 4], 6, [2, 2, 2, 2], 3),
            ([1, 33, 8, 9], 31, [0, 1, 1, 0], 1),
        ];
        for p in 0..16 {
            let pads = [p & 1, p >> 1 & 1, p >> 2 & 1, p >> 3 & 1];
            cases.push(([1, 4, 7 + p % 3, 10 + p], 9, pads, 1));
        }
        for isa in isas() {
            for (k, &(xs, m, pads, group)) in cases.iter().enumerate() {
                let x: Vec<f32> = (0..xs.iter().product::<usize>()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let w: Vec<f32> = (0..m * xs[1] / group * 9).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
                let b: Vec<f32> = (0..m).map(|i| i as f32 * 0.25 - 1.0).collect();
                let (want, mag, _) = reference(&x, xs, &w, m, &b, pads, group);
                let runs: Vec<Vec<f32>> = [1, 2].iter().map(|&threads| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| run(isa, &x, xs, &w, m, &b, pads, group))
                }).collect();
                assert!(runs[0].iter().zip(&runs[1]).all(|(p, q)| p.to_bits() == q.to_bits()), "case {k}, {isa:?}: 1 and 2 threads differ");
                for (i, ((&g, &e), &s)) in runs[0].iter().zip(&want).zip(&mag).enumerate() {
                    let err = (g as f64 - e).abs() / s.max(f64::MIN_POSITIVE);
                    assert!(err <= TOLERANCE, "case {k}, {isa:?}, element {i}: {g} vs {e} (terms' magnitude {s})");
                }
            }
        }
    }
}
