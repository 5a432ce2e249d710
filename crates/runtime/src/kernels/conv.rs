//! Convolutions and transposed convolutions over any number of spatial axes (grouped and
//! depthwise), channels first, with fast paths for 1-D and 2-D.

use std::mem::MaybeUninit;

use super::elementwise::{from_f32, to_f32};
use super::fused::{Bound, Program, Scratch};
use super::gemm::{sgemm_into, MatRef};
use super::util::{assume_init, assume_init_mut, check_output_size, input, kernel, map_in_place, min_items, opt_input, par_chunks_mut, par_steps, threads, uninit, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RunCtx, RuntimeResult, LATEST};
use qforge_ir::{DType, Tensor};

mod winograd;

/// Registers Conv, ConvTranspose, Col2Im and DeformConv.
pub fn register(r: &mut Registry) {
    r.add("", "Conv", 1, LATEST, conv);
    r.add("", "ConvTranspose", 1, LATEST, conv_transpose);
    r.add("", "Col2Im", 18, LATEST, col2im);
    r.add("", "DeformConv", 19, LATEST, deform_conv);
}

/// Spatial geometry of a convolution or pooling window along one axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Axis {
    pub input: usize,
    pub kernel: usize,
    pub stride: usize,
    pub dilation: usize,
    pub pad_begin: usize,
    pub pad_end: usize,
    pub output: usize,
}

/// Window attributes shared by Conv and the pools.
#[derive(Debug, Clone)]
pub struct Window {
    pub kernel: Option<Vec<usize>>,
    pub strides: Option<Vec<usize>>,
    pub dilations: Option<Vec<usize>>,
    pub pads: Option<Vec<usize>>,
    pub auto_pad: String,
    pub ceil_mode: bool,
}

impl Window {
    pub fn from_node(info: &NodeInfo) -> RuntimeResult<Window> {
        let u = |name: &str| -> RuntimeResult<Option<Vec<usize>>> {
            info.attr_ints(name).map(|v| v.iter().map(|&x| usize::try_from(x).map_err(|_| info.error(format!("'{name}' has a negative value")))).collect()).transpose()
        };
        Ok(Window {
            kernel: u("kernel_shape")?,
            strides: u("strides")?,
            dilations: u("dilations")?,
            pads: u("pads")?,
            auto_pad: info.attr_str("auto_pad", "NOTSET"),
            ceil_mode: info.attr_int("ceil_mode", 0) != 0,
        })
    }

    /// The same window for a 1-D input treated as height 1: per-axis attributes get a leading
    /// height entry (stride/dilation 1, no padding).
    pub fn lifted_1d(&self) -> Window {
        let lift = |v: &Option<Vec<usize>>, fill: usize| v.as_ref().map(|v| if v.len() == 2 { vec![0, v[0], 0, v[1]] } else { [vec![fill], v.clone()].concat() });
        Window { kernel: None, strides: lift(&self.strides, 1), dilations: lift(&self.dilations, 1), pads: lift(&self.pads, 0), auto_pad: self.auto_pad.clone(), ceil_mode: self.ceil_mode }
    }

    /// Geometry of each spatial axis for input sizes `spatial` and kernel sizes `kernel` (one
    /// per axis). Errors when a per-axis attribute does not have one value per axis (`pads`:
    /// two), a stride, dilation or kernel size is zero, the window does not fit in the padded
    /// input, or a size overflows.
    pub fn axes(&self, spatial: &[usize], kernel: &[usize]) -> RuntimeResult<Vec<Axis>> {
        let r = spatial.len();
        if kernel.len() != r {
            return Err(kernel_error(format!("kernel {kernel:?} does not have one size per spatial axis of {spatial:?}")));
        }
        for (name, values, want) in [("kernel_shape", &self.kernel, r), ("strides", &self.strides, r), ("dilations", &self.dilations, r), ("pads", &self.pads, 2 * r)] {
            if let Some(v) = values.as_ref().filter(|v| v.len() != want) {
                return Err(kernel_error(format!("'{name}' has {} values {v:?}; {r} spatial axes need {want}", v.len())));
            }
        }
        let get = |v: &Option<Vec<usize>>, i: usize, d: usize| v.as_ref().map_or(d, |v| v[i]);
        let overflow = |i: usize| kernel_error(format!("the window geometry on spatial axis {i} overflows"));
        (0..r).map(|i| {
            let (n, k, s, d) = (spatial[i], kernel[i], get(&self.strides, i, 1), get(&self.dilations, i, 1));
            if k == 0 || s == 0 || d == 0 {
                return Err(kernel_error(format!("spatial axis {i} has kernel size {k}, stride {s} and dilation {d}; each must be at least 1")));
            }
            let span = (k - 1).checked_mul(d).and_then(|v| v.checked_add(1)).ok_or_else(|| overflow(i))?;
            let (pb, pe) = match self.auto_pad.as_str() {
                "SAME_UPPER" | "SAME_LOWER" => {
                    let out = n.div_ceil(s);
                    let total = if out == 0 { 0 } else { ((out - 1) * s).checked_add(span).ok_or_else(|| overflow(i))?.saturating_sub(n) };
                    if self.auto_pad == "SAME_UPPER" { (total / 2, total - total / 2) } else { (total - total / 2, total / 2) }
                }
                "VALID" => (0, 0),
                "NOTSET" => (get(&self.pads, i, 0), get(&self.pads, i + r, 0)),
                other => return Err(kernel_error(format!("auto_pad '{other}' is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID"))),
            };
            let padded = n.checked_add(pb).and_then(|v| v.checked_add(pe)).ok_or_else(|| overflow(i))?;
            if padded < span {
                return Err(kernel_error(format!("window {span} is larger than the padded input {padded} on spatial axis {i}")));
            }
            let mut out = if self.ceil_mode { (padded - span).div_ceil(s) + 1 } else { (padded - span) / s + 1 };
            if self.ceil_mode && (out - 1) * s >= n + pb {
                out -= 1;
            }
            Ok(Axis { input: n, kernel: k, stride: s, dilation: d, pad_begin: pb, pad_end: pe, output: out })
        }).collect()
    }
}


impl Axis {
    /// An axis of size 1 with a 1-tap window: the height a 1-D input gets on the 2-D paths.
    pub(crate) const UNIT: Axis = Axis { input: 1, kernel: 1, stride: 1, dilation: 1, pad_begin: 0, pad_end: 0, output: 1 };

    /// The output positions `[lo, hi)` whose input index `o * stride + offset` lies inside the
    /// input (`offset` is a kernel tap's dilated position minus the leading padding).
    fn valid_outputs(&self, offset: isize) -> (usize, usize) {
        let lo = if offset >= 0 { 0 } else { ((-offset) as usize).div_ceil(self.stride) };
        let hi = if (self.input as isize) <= offset { 0 } else { ((self.input as isize - offset - 1) as usize / self.stride + 1).min(self.output) };
        (lo.min(self.output), hi.max(lo.min(self.output)))
    }
}

/// Unfolds output rows `rows` of one image into columns:
/// `col[(c*kh + i)*kw + j][(oy - rows.start)*ow + ox]`.
fn im2col_rows(x: &[f32], channels: usize, h: Axis, w: Axis, rows: std::ops::Range<usize>, col: &mut [f32]) {
    let ow = w.output;
    let width = rows.len() * ow;
    for c in 0..channels {
        let img = &x[c * h.input * w.input..(c + 1) * h.input * w.input];
        for ki in 0..h.kernel {
            for kj in 0..w.kernel {
                let r = (c * h.kernel + ki) * w.kernel + kj;
                let row = &mut col[r * width..(r + 1) * width];
                let off = (kj * w.dilation) as isize - w.pad_begin as isize;
                for (t, oy) in rows.clone().enumerate() {
                    let iy = (oy * h.stride + ki * h.dilation) as isize - h.pad_begin as isize;
                    let dst = &mut row[t * ow..(t + 1) * ow];
                    if iy < 0 || iy >= h.input as isize {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &img[iy as usize * w.input..(iy as usize + 1) * w.input];
                    let (lo, hi) = w.valid_outputs(off);
                    dst[..lo].fill(0.0);
                    dst[hi..].fill(0.0);
                    if lo == hi {
                        continue;
                    }
                    let start = (lo as isize * w.stride as isize + off) as usize;
                    if w.stride == 1 {
                        dst[lo..hi].copy_from_slice(&src[start..start + (hi - lo)]);
                    } else {
                        for (d, s) in dst[lo..hi].iter_mut().zip(src[start..].iter().step_by(w.stride)) {
                            *d = *s;
                        }
                    }
                }
            }
        }
    }
}

/// A convolution's output (`len` values, uninitialized until written) that parallel tiles
/// write to disjointly through raw pointers.
#[derive(Clone, Copy)]
struct OutPtr {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: tiles write disjoint sets of output elements and read only what they wrote.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn new(dst: &mut [MaybeUninit<f32>]) -> OutPtr {
        OutPtr { ptr: dst.as_mut_ptr().cast::<f32>(), len: dst.len() }
    }

    /// Element `offset` (at most `len`).
    fn at(self, offset: usize) -> *mut f32 {
        assert!(offset <= self.len, "offset past the output");
        // SAFETY: `offset` is within the allocation (or one past its end).
        unsafe { self.ptr.add(offset) }
    }

    /// The `count` elements from `offset`, as values.
    ///
    /// # Safety
    /// They have been written, and no other live reference or concurrent write covers them.
    unsafe fn region<'a>(self, offset: usize, count: usize) -> &'a mut [f32] {
        assert!(offset + count <= self.len, "region past the output");
        // SAFETY: in bounds (asserted), written and exclusive (the caller's guarantee).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), count) }
    }
}

/// What a convolution does to each finished block of its output while the block is in
/// cache: add the bias, then run the fused epilogue program, if any.
#[derive(Clone, Copy)]
struct Finish<'a> {
    bias: Option<&'a [f32]>,
    /// Output channels and elements per channel plane, to find a block's channels.
    channels: usize,
    plane: usize,
    epilogue: Option<&'a Bound<'a>>,
}

impl Finish<'_> {
    /// Finishes `block`, the output elements `[offset, offset + block.len())`.
    fn apply(&self, block: &mut [f32], offset: usize, scratch: &mut Scratch) {
        if let Some(bias) = self.bias {
            let mut done = 0;
            while done < block.len() {
                let at = offset + done;
                let run = (self.plane - at % self.plane).min(block.len() - done);
                let b = bias[(at / self.plane) % self.channels];
                map_in_place(&mut block[done..done + run], |v| v + b);
                done += run;
            }
        }
        if let Some(e) = self.epilogue {
            e.apply(block, offset, scratch);
        }
    }
}

/// Convolution of one image and group by tiles of output rows, written to `dst` (`mg`
/// channel planes of `plane` elements; channel `ch` is output channel `ch0 + ch` of the
/// image, whose first element is output element `base`): each tile unfolds its own columns
/// (small enough to stay in cache), multiplies them with the weights and finishes its
/// blocks; tiles run in parallel. An output row is a run along the last of `axes` (two or
/// more spatial axes); rows are numbered row-major over the other axes.
#[allow(clippy::too_many_arguments)]
fn conv_tiled(src: &[f32], cg: usize, axes: &[Axis], weights: &[f32], mg: usize, dst: &mut [MaybeUninit<f32>], base: usize, fin: Finish) {
    let (last, lead) = axes.split_last().expect("at least one spatial axis");
    let ow = last.output;
    let oh: usize = lead.iter().map(|a| a.output).product();
    let plane = oh * ow;
    if plane == 0 {
        return;
    }
    let kdim = cg * axes.iter().map(|a| a.kernel).product::<usize>();
    // About 256 KiB of columns per tile, at least one output row.
    let rows_per_tile = ((64 * 1024) / (kdim * ow).max(1)).clamp(1, oh);
    let out = OutPtr::new(dst);
    assert!(out.len >= mg * plane, "output too small");
    par_steps(oh, rows_per_tile, min_items(mg * kdim * rows_per_tile * ow), || (Vec::new(), Scratch::new()), |(col, scratch): &mut (Vec<f32>, Scratch), r0| {
        let rows = r0..(r0 + rows_per_tile).min(oh);
        let width = rows.len() * ow;
        col.resize(kdim * width, 0.0);
        match *axes {
            [h, w] => im2col_rows(src, cg, h, w, rows.clone(), col),
            _ => im2col_nd(src, cg, axes, rows.clone(), col),
        }
        // SAFETY: the `mg` rows of `width` columns `plane` apart from this tile's first
        // column lie inside the output (asserted above) and belong to this tile alone (rows
        // are disjoint across tiles); `col` and `weights` are other memory.
        unsafe { sgemm_into(mg, width, kdim, MatRef::rows(weights, kdim), MatRef::rows(col, width), out.at(rows.start * ow), plane, false, false) };
        // SAFETY: the product just wrote this tile's columns, which no other tile touches.
        unsafe { finish_tile(fin, out, rows.start * ow, mg, plane, width, base + rows.start * ow, scratch) };
    });
}

/// [`im2col_rows`] for any number of spatial `axes` (at least two): unfolds output rows
/// `rows` (runs along the last axis, numbered row-major over the other axes' output
/// positions) of one image of `channels` channels into `col[(c * taps + t) * width + i]`,
/// where `t` is the kernel tap (row-major over the kernel, as in the weight), `width` is
/// `rows.len()` times the last axis's output size, and `i` counts the rows' outputs in
/// order. Taps that fall in the padding read zero.
fn im2col_nd(x: &[f32], channels: usize, axes: &[Axis], rows: std::ops::Range<usize>, col: &mut [f32]) {
    let (last, lead) = axes.split_last().expect("at least one spatial axis");
    let ow = last.output;
    let width = rows.len() * ow;
    let lead_taps: usize = lead.iter().map(|a| a.kernel).product();
    let image: usize = axes.iter().map(|a| a.input).product();
    let off = |kj: usize| (kj * last.dilation) as isize - last.pad_begin as isize;
    for c in 0..channels {
        let img = &x[c * image..(c + 1) * image];
        for tap in 0..lead_taps {
            for (t, row) in rows.clone().enumerate() {
                let line = input_line(lead, row, tap).map(|l| &img[l * last.input..(l + 1) * last.input]);
                for kj in 0..last.kernel {
                    let r = (c * lead_taps + tap) * last.kernel + kj;
                    let dst = &mut col[r * width + t * ow..r * width + (t + 1) * ow];
                    let Some(src) = line else {
                        dst.fill(0.0);
                        continue;
                    };
                    let (lo, hi) = last.valid_outputs(off(kj));
                    dst[..lo].fill(0.0);
                    dst[hi..].fill(0.0);
                    if lo == hi {
                        continue;
                    }
                    let start = (lo as isize * last.stride as isize + off(kj)) as usize;
                    if last.stride == 1 {
                        dst[lo..hi].copy_from_slice(&src[start..start + (hi - lo)]);
                    } else {
                        for (d, s) in dst[lo..hi].iter_mut().zip(src[start..].iter().step_by(last.stride)) {
                            *d = *s;
                        }
                    }
                }
            }
        }
    }
}

/// The input line (index of a run along the last spatial axis, row-major over the `lead`
/// axes' input positions) that output row `row` (row-major over the `lead` axes' output
/// positions) reads through kernel tap `tap` (row-major over the `lead` axes' kernel), or
/// `None` when that tap falls in the padding.
fn input_line(lead: &[Axis], mut row: usize, mut tap: usize) -> Option<usize> {
    let (mut line, mut stride) = (0, 1);
    for a in lead.iter().rev() {
        let (o, k) = (row % a.output, tap % a.kernel);
        (row, tap) = (row / a.output, tap / a.kernel);
        let i = (o * a.stride + k * a.dilation).checked_sub(a.pad_begin).filter(|&i| i < a.input)?;
        line += i * stride;
        stride *= a.input;
    }
    Some(line)
}

/// The convolution of [`conv_with`] over three or more spatial `axes`, per image and group:
/// pointwise windows multiply the input directly, others unfold tiles of output rows
/// ([`conv_tiled`]); each block is finished by `fin`.
fn conv_nd(x: &[f32], xshape: &[usize], w: &[f32], wshape: &[usize], axes: &[Axis], group: usize, fin: Finish) -> Vec<f32> {
    let (n, c, m, cg) = (xshape[0], xshape[1], wshape[0], wshape[1]);
    let image: usize = axes.iter().map(|a| a.input).product();
    let plane: usize = axes.iter().map(|a| a.output).product();
    let mg = m / group;
    let kdim = cg * axes.iter().map(|a| a.kernel).product::<usize>();
    let pointwise = axes.iter().all(|a| a.kernel == 1 && a.stride == 1 && a.pad_begin == 0 && a.pad_end == 0);
    let mut out = uninit::<f32>(n * m * plane);
    for b in 0..n {
        for g in 0..group {
            let src = &x[(b * c + g * cg) * image..(b * c + (g + 1) * cg) * image];
            let wg = &w[g * mg * kdim..(g + 1) * mg * kdim];
            let base = (b * m + g * mg) * plane;
            let dst = &mut out[base..base + mg * plane];
            if kdim == 0 {
                dst.iter_mut().for_each(|v| { v.write(0.0); });
                // SAFETY: written just above.
                fin.apply(unsafe { assume_init_mut(dst) }, base, &mut Scratch::new());
            } else if pointwise {
                conv_pointwise(src, kdim, plane, wg, mg, dst, base, fin);
            } else {
                conv_tiled(src, cg, axes, wg, mg, dst, base, fin);
            }
        }
    }
    // SAFETY: every path above writes every element of each group's output planes, and
    // the groups of every image cover the whole output.
    unsafe { assume_init(out) }
}

/// Finishes a tile of `mg` channels by `width` columns from element `start` of `out`
/// (channel planes `plane` apart; the tile's first element is output element `offset` of
/// the whole convolution): one block when the tile spans whole planes, else one per
/// channel.
///
/// # Safety
/// The tile's elements have been written, and no other live reference or concurrent
/// write covers them.
#[allow(clippy::too_many_arguments)]
unsafe fn finish_tile(fin: Finish, out: OutPtr, start: usize, mg: usize, plane: usize, width: usize, offset: usize, scratch: &mut Scratch) {
    if width == plane {
        // SAFETY: the tile is these whole planes (the caller's guarantee).
        fin.apply(unsafe { out.region(start, mg * plane) }, offset, scratch);
    } else {
        for ch in 0..mg {
            // SAFETY: this channel's part of the tile (the caller's guarantee).
            fin.apply(unsafe { out.region(start + ch * plane, width) }, offset + ch * plane, scratch);
        }
    }
}

/// Pointwise convolution (a `mg x cg` by `cg x plane` product) of one image and group by
/// tiles of output columns, written to `dst` and finished tile by tile (see
/// [`conv_tiled`]); tiles run in parallel.
#[allow(clippy::too_many_arguments)]
fn conv_pointwise(src: &[f32], cg: usize, plane: usize, weights: &[f32], mg: usize, dst: &mut [MaybeUninit<f32>], base: usize, fin: Finish) {
    // About 128 KiB of input per tile and at least 256 columns, in a multiple of the
    // thread count of tiles.
    let threads = threads().max(1);
    let out = OutPtr::new(dst);
    assert!(out.len >= mg * plane, "output too small");
    if threads > 1 && plane < 128 * threads && mg >= 16 * threads {
        // Too few columns to split evenly: one block of output channels per thread.
        let step = mg.div_ceil(threads).next_multiple_of(8);
        par_steps(mg, step, min_items(step * cg * plane), Scratch::new, |scratch, ch0| {
            let count = step.min(mg - ch0);
            // SAFETY: output channels `ch0..ch0 + count` lie inside the output (asserted
            // above) and belong to this block alone; `src` and `weights` are other memory.
            unsafe { sgemm_into(count, plane, cg, MatRef::rows(&weights[ch0 * cg..], cg), MatRef::rows(src, plane), out.at(ch0 * plane), plane, false, false) };
            // SAFETY: the product just wrote these whole planes, which no other block touches.
            unsafe { finish_tile(fin, out, ch0 * plane, count, plane, plane, base + ch0 * plane, scratch) };
        });
        return;
    }
    let target = (32 * 1024 / cg.max(1)).max(256);
    let tiles = plane.div_ceil(target).div_ceil(threads) * threads;
    let cols = plane.div_ceil(tiles).next_multiple_of(16).min(plane);
    let run = |start: usize, scratch: &mut Scratch| {
        let width = cols.min(plane - start);
        // SAFETY: the `mg` rows of `width` columns `plane` apart from column `start` lie
        // inside the output (asserted above) and belong to this tile alone (column ranges
        // are disjoint across tiles); `src` and `weights` are other memory.
        unsafe { sgemm_into(mg, width, cg, MatRef::rows(weights, cg), MatRef { data: &src[start..], rs: plane, cs: 1 }, out.at(start), plane, false, false) };
        // SAFETY: the product just wrote this tile's columns, which no other tile touches.
        unsafe { finish_tile(fin, out, start, mg, plane, width, base + start, scratch) };
    };
    if plane <= cols {
        run(0, &mut Scratch::new());
    } else {
        par_steps(plane, cols, min_items(mg * cg * cols), Scratch::new, |scratch, start| run(start, scratch));
    }
}

/// An epilogue program and its inputs after the first, as data and shape.
type Epilogue<'a> = Option<(&'a Program, &'a [(&'a [f32], &'a [usize])])>;

/// The kernel a dense (not depthwise, not pointwise) 2-D convolution of one image and
/// group runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Dense {
    /// [`conv_tiled`]: tiles of unfolded columns times the weights.
    Tiled,
    /// [`conv_direct`] with [`direct_rows_avx512`] (or [`direct_rows_avx2`]): blocks of
    /// [`DIRECT_MB`] output channels by 16 or 32 columns, the weights broadcast.
    Columns,
    /// [`conv_direct`] with [`broadcast_rows_avx512`]: blocks of [`BCAST_MB`] output channels
    /// by 16 positions, the inputs broadcast.
    Channels,
    /// [`winograd::conv_winograd`]: Winograd F(4x4, 3x3) with these instructions.
    Winograd(winograd::Isa),
}

/// The kernel for a dense 2-D convolution of `mg` output channels per group, `taps` weights
/// per output channel (input channels times kernel taps) and `oh` output rows `ow` wide, on
/// this CPU.
///
/// With AVX-512F and AVX-512VL, for rows narrower than one 16-column chunk:
/// [`Dense::Channels`] when the output has at least 64 positions (up to twice as fast as
/// [`Dense::Tiled`] there), else [`Dense::Tiled`] (packing the weights for the direct
/// kernels, on every call, then costs more than it saves). For wider rows, whichever of
/// [`Dense::Channels`] and [`Dense::Columns`] has the lower estimated cost, lanes computed
/// times the work per lane (constants measured on Zen 4, where the estimate is within a
/// few percent):
/// - [`Dense::Columns`] computes `mg` rounded up to 8 channels by `ow` rounded up to 32
///   columns (16 when it fits one chunk), each costing `taps + 1` (the 1: stores);
/// - [`Dense::Channels`] computes `ow` rounded up to 16 columns, except that a last chunk of
///   at most 12 columns is rounded up to 4, by `mg` rounded up to 16 channels, except that a
///   last block of at most 8 channels runs in 8-lane registers and costs 1.3 times its 8
///   lanes (it is bound by the broadcasts it loads); each lane costs `0.96 * taps + 4` (no
///   weight broadcasts, but a 16x16 transpose per block of outputs, about 4 taps' worth).
///
/// In effect [`Dense::Columns`] keeps the convolutions with few taps (3-channel stems,
/// 1-channel inputs), where the transposes cost more than its weight broadcasts, and those
/// with a half block of channels whose rows it covers in whole 32-column chunks (24
/// channels of 160 columns). Without AVX-512F and AVX-512VL: [`Dense::Columns`] when rows
/// hold at least one 16-column chunk and the CPU has AVX-512F or AVX2 and FMA; else
/// [`Dense::Tiled`].
fn dense_kernel(mg: usize, oh: usize, ow: usize, taps: usize) -> Dense {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx512 = has!("avx512f");
        if avx512 && has!("avx512vl") {
            if ow < LANES {
                return if oh * ow >= 64 { Dense::Channels } else { Dense::Tiled };
            }
            let columns = (mg.next_multiple_of(DIRECT_MB) * if ow == LANES { LANES } else { ow.next_multiple_of(2 * LANES) }) as f64 * (taps as f64 + 1.0);
            let last = ow % LANES;
            let width = ow - last + if last > 12 { LANES } else { last.next_multiple_of(4) };
            let tail = mg % BCAST_MB;
            let lanes = (mg - tail) as f64 + if tail > BCAST_MB / 2 { BCAST_MB as f64 } else if tail > 0 { 1.3 * (BCAST_MB / 2) as f64 } else { 0.0 };
            let channels = lanes * width as f64 * (0.96 * taps as f64 + 4.0);
            return if channels < columns { Dense::Channels } else { Dense::Columns };
        }
        if ow >= LANES && (avx512 || (has!("avx2") && has!("fma"))) {
            return Dense::Columns;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (mg, oh, ow, taps);
    Dense::Tiled
}

/// Input channels per group below which [`winograd_isa`] leaves a convolution to
/// [`dense_kernel`].
const WINOGRAD_MIN_CHANNELS: usize = 16;

/// 4x4 output tiles below which [`winograd_isa`] leaves a convolution to [`dense_kernel`]
/// with AVX-512F.
const WINOGRAD_MIN_TILES_AVX512: usize = 256;

/// 4x4 output tiles below which [`winograd_isa`] leaves a convolution to [`dense_kernel`]
/// with AVX2: the first for fewer than [`WINOGRAD_WIDE_CHANNELS`] input channels per group,
/// the second from there.
const WINOGRAD_MIN_TILES_AVX2: [usize; 2] = [25, 16];

/// Input channels per group from which the second of [`WINOGRAD_MIN_TILES_AVX2`] applies.
const WINOGRAD_WIDE_CHANNELS: usize = 64;

/// The instructions Winograd F(4x4, 3x3) ([`winograd::conv_winograd`]) runs with on this
/// CPU, if it computes a dense 2-D convolution of `cg` input channels per group over the
/// window `h` x `wa` faster than the kernel [`dense_kernel`] picks; else `None`.
///
/// It needs a 3x3 window of stride 1 and dilation 1, at least [`WINOGRAD_MIN_CHANNELS`] input
/// channels per group, and enough output tiles:
/// - AVX-512F: [`WINOGRAD_MIN_TILES_AVX512`] (an output of about 64x64). Measured on Zen 4
///   (AMD EPYC, 2 vCPUs), one thread, against the direct kernels, with the weights
///   transformed on every call: 1.4-1.9x faster on DNSMOS's 900x161 layers of 32-128 input
///   channels and 1.7-2.3x on PP-OCRv4 det's 96 -> 24 channel 232x184 ones; level at 140-180
///   tiles (outputs of 58x46 and 112x20); 1.4x slower at 48 tiles (29x23), and 1.8x slower
///   with one input channel (DNSMOS's 900x161 stem), where the transforms cost more than the
///   multiplies they save. Constant weights keep their transform after the first run, which
///   those figures include on every call, so this threshold may be higher than it needs to be.
/// - AVX2 and FMA: [`WINOGRAD_MIN_TILES_AVX2`]. Measured on an AMD EPYC with AVX2 and no
///   AVX-512 (2 vCPUs), one thread, square inputs of 16-256 channels and 8-56 columns, with the
///   constant weights' transform kept: Winograd takes 0.2-0.5 of the direct kernel's time from
///   25 tiles (0.7-0.9 at 16 channels) and from 16 tiles with 64 channels or more; 0.9-1.35x
///   at 9 tiles and 1.5-2.3x at 4.
fn winograd_isa(cg: usize, h: Axis, wa: Axis) -> Option<winograd::Isa> {
    let window = [h, wa].iter().all(|a| a.kernel == 3 && a.stride == 1 && a.dilation == 1);
    let tiles = h.output.div_ceil(4) * wa.output.div_ceil(4);
    if !window || cg < WINOGRAD_MIN_CHANNELS {
        return None;
    }
    let isa = winograd::Isa::detect()?;
    let min_tiles = match isa {
        winograd::Isa::Avx512 => WINOGRAD_MIN_TILES_AVX512,
        winograd::Isa::Avx2 => WINOGRAD_MIN_TILES_AVX2[usize::from(cg >= WINOGRAD_WIDE_CHANNELS)],
    };
    (tiles >= min_tiles).then_some(isa)
}

/// Output channels one step of [`direct_rows_avx512`] and [`direct_rows_avx2`] computes.
const DIRECT_MB: usize = 8;

/// Output channels one step of [`broadcast_rows_avx512`] computes (one register).
const BCAST_MB: usize = 16;

/// Dense convolution of one image and group computed directly, without unfolding: the
/// `cg` input channels are copied once into the zero-padded, phase-split layout of
/// [`Padded`], the weights are packed by blocks of output channels ([`pack_direct`]), and
/// `kernel` ([`Dense::Columns`] or [`Dense::Channels`], as [`dense_kernel`] allows on this
/// CPU) computes each output row for a block of channels a few columns at a time, with the
/// sums in registers over every tap of every input channel. Written to `dst` (`mg` channel
/// planes; its first element is output element `base`) and finished in groups of rows and
/// blocks of channels; groups run in parallel (also split by channels when there are too
/// few rows for every thread).
#[allow(clippy::too_many_arguments)]
fn conv_direct(src: &[f32], cg: usize, h: Axis, wa: Axis, weights: &[f32], mg: usize, dst: &mut [MaybeUninit<f32>], base: usize, fin: Finish, kernel: Dense) {
    let (oh, ow) = (h.output, wa.output);
    let plane = oh * ow;
    if plane == 0 {
        return;
    }
    let channels = kernel == Dense::Channels;
    let nx = if ow <= LANES || channels { 1 } else { 2 };
    let mb = if channels { BCAST_MB } else { DIRECT_MB };
    let geo = Padded::with_chunks(h, wa, nx);
    let chan = geo.channel_len();
    let mut padded = vec![0f32; cg * chan];
    let plane_in = h.input * wa.input;
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    par_chunks_mut(&mut padded, chan, min_items(chan * ELEMENT_WORK), || (), |_, c, buf| {
        let channel = &src[c * plane_in..(c + 1) * plane_in];
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the CPU supports AVX-512F, detected above.
            unsafe { geo.fill_into_avx512(channel, buf) }
        } else {
            geo.fill_into(channel, buf)
        }
        #[cfg(not(target_arch = "x86_64"))]
        geo.fill_into(channel, buf);
    });
    let taps = cg * h.kernel * wa.kernel;
    let lines = if channels { pack_direct::<BCAST_MB>(weights, mg, taps) } else { pack_direct::<DIRECT_MB>(weights, mg, taps) };
    let packed: &[f32] = bytemuck::cast_slice(&lines);
    // The sums start at the bias, so blocks are finished without it.
    let ch0 = (base / plane) % fin.channels;
    let blocks = mg.div_ceil(mb);
    let bias: Vec<f32> = (0..blocks * mb).map(|m| if m < mg { fin.bias.map_or(0.0, |b| b[ch0 + m]) } else { 0.0 }).collect();
    let fin = Finish { bias: None, ..fin };
    let rows_per_task = 256usize.div_ceil(ow).min(oh);
    // Fewer row groups than two per thread: each group is split by blocks of channels too.
    let row_groups = oh.div_ceil(rows_per_task);
    let splits = if row_groups >= 2 * threads() { 1 } else { (2 * threads()).div_ceil(row_groups).min(blocks) };
    let blocks_per_task = blocks.div_ceil(splits);
    let splits = blocks.div_ceil(blocks_per_task);
    let out = OutPtr::new(dst);
    assert!(out.len >= mg * plane, "output too small");
    par_steps(row_groups * splits, 1, min_items(rows_per_task * ow * (blocks_per_task * mb).min(mg) * taps), Scratch::new, |scratch, task| {
        let (r0, b0) = (task / splits * rows_per_task, task % splits * blocks_per_task);
        let r1 = (r0 + rows_per_task).min(oh);
        let (m0, m1) = (b0 * mb, ((b0 + blocks_per_task) * mb).min(mg));
        let (w, b) = (&packed[b0 * taps * mb..], &bias[m0..]);
        let (start, count) = (m0 * plane + r0 * ow, m1 - m0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `dense_kernel` chose a kernel whose instructions the CPU supports: for
        // `Dense::Channels` AVX-512F and AVX-512VL, for `Dense::Columns` AVX-512F or else
        // AVX2 and FMA; rows `r0..r1` of channel planes `m0..m1` lie inside the output
        // (asserted above) and belong to this task alone; `w` and `b` start at this task's
        // first block.
        unsafe {
            if channels {
                broadcast_rows_avx512(&geo, &padded, cg, w, b, count, r0..r1, out.at(start), plane);
            } else if !avx512 {
                direct_rows_avx2(&geo, &padded, cg, w, b, count, r0..r1, out.at(start), plane);
            } else if nx == 1 {
                direct_rows_avx512::<1>(&geo, &padded, cg, w, b, count, r0..r1, out.at(start), plane);
            } else {
                direct_rows_avx512::<2>(&geo, &padded, cg, w, b, count, r0..r1, out.at(start), plane);
            }
        }
        // SAFETY: the kernel just wrote these rows of these channels, which no other task
        // touches.
        unsafe { finish_tile(fin, out, start, count, plane, (r1 - r0) * ow, base + start, scratch) };
    });
}

/// Sixteen values aligned to a cache line, so that a vector of packed weights never
/// straddles two lines.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Weights `[mg x taps]` packed for the direct kernels: blocks of `MB` (a divisor of 16)
/// output channels, each `[taps][MB]` (channels past `mg` zero), in lines of [`Line`] (the
/// last one padded with zeros).
fn pack_direct<const MB: usize>(weights: &[f32], mg: usize, taps: usize) -> Vec<Line> {
    let blocks = mg.div_ceil(MB);
    let mut lines = vec![Line([0.0; 16]); (blocks * taps * MB).div_ceil(16)];
    let packed: &mut [f32] = bytemuck::cast_slice_mut(&mut lines);
    for (m, row) in weights[..mg * taps].chunks_exact(taps).enumerate() {
        let block = &mut packed[m / MB * taps * MB..(m / MB + 1) * taps * MB];
        for (dst, &v) in block.chunks_exact_mut(MB).zip(row) {
            dst[m % MB] = v;
        }
    }
    lines
}

/// Output rows `rows` of every channel of [`conv_direct`], written to `out` (row
/// `rows.start` of channel 0; planes `plane` apart), `NX` chunks of [`LANES`] columns at a
/// time, each channel's sums starting at its `bias` value (`mg` rounded up to a multiple
/// of [`DIRECT_MB`] values).
///
/// # Safety
/// The CPU must support AVX-512F; `padded` holds `cg` channels in `geo`'s layout and
/// `packed` the weights as [`conv_direct`] packs them; the rows `rows` of the `mg` planes
/// at `out` are valid for writes and written by nothing else meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn direct_rows_avx512<const NX: usize>(geo: &Padded, padded: &[f32], cg: usize, packed: &[f32], bias: &[f32], mg: usize, rows: std::ops::Range<usize>, out: *mut f32, plane: usize) {
    use std::arch::x86_64::*;
    let (h, wa) = (geo.h, geo.wa);
    let (ow, kh, kw, s) = (wa.output, h.kernel, wa.kernel, wa.stride);
    let chan = geo.channel_len();
    let row_len = s * geo.len;
    let taps = cg * kh * kw;
    assert!(padded.len() >= cg * chan && packed.len() >= mg.div_ceil(DIRECT_MB) * taps * DIRECT_MB && bias.len() >= mg.next_multiple_of(DIRECT_MB));
    assert!(rows.end <= h.output);
    let offsets = &geo.offsets;
    for (r, oy) in rows.clone().enumerate() {
        for blk in 0..mg.div_ceil(DIRECT_MB) {
            let wblk = &packed[blk * taps * DIRECT_MB..(blk + 1) * taps * DIRECT_MB];
            for x0 in (0..ow).step_by(NX * LANES) {
                let mut acc = [std::array::from_fn::<_, DIRECT_MB, _>(|m| _mm512_set1_ps(bias[blk * DIRECT_MB + m])); NX];
                for c in 0..cg {
                    let row0 = c * chan + oy * h.stride * row_len + x0;
                    let wc = &wblk[c * kh * kw * DIRECT_MB..(c + 1) * kh * kw * DIRECT_MB];
                    for (t, &off) in offsets.iter().enumerate() {
                        // SAFETY: `Padded` sizes rows for every chunk of the rounded-up
                        // output width plus the largest tap shift, and every row this
                        // reads is below `rows` rows of channel `c` (asserted above).
                        let p = unsafe { padded.as_ptr().add(row0 + off) };
                        let mut x = [_mm512_setzero_ps(); NX];
                        for (i, v) in x.iter_mut().enumerate() {
                            // SAFETY: see above.
                            *v = unsafe { _mm512_loadu_ps(p.add(i * LANES)) };
                        }
                        let w = &wc[t * DIRECT_MB..(t + 1) * DIRECT_MB];
                        for m in 0..DIRECT_MB {
                            let wv = _mm512_set1_ps(w[m]);
                            for i in 0..NX {
                                acc[i][m] = _mm512_fmadd_ps(x[i], wv, acc[i][m]);
                            }
                        }
                    }
                }
                for m in 0..DIRECT_MB.min(mg - blk * DIRECT_MB) {
                    let ch = blk * DIRECT_MB + m;
                    for (i, a) in acc.iter().enumerate() {
                        let first = x0 + i * LANES;
                        if first >= ow {
                            break;
                        }
                        let n = (ow - first).min(LANES);
                        let mask: __mmask16 = if n == LANES { 0xffff } else { (1u16 << n) - 1 };
                        // SAFETY: the mask keeps the store to the `n` columns left in this
                        // row of channel `ch`, one of the caller's rows.
                        unsafe { _mm512_mask_storeu_ps(out.add(ch * plane + r * ow + first), mask, a[m]) };
                    }
                }
            }
        }
    }
}

/// Output rows `rows` of every channel of [`conv_direct`] with the channel-blocked kernel:
/// for each block of [`BCAST_MB`] output channels and each run of up to [`LANES`] output
/// positions of a row, one register per position holds that position's sums for the
/// block's channels; each (input channel, tap) step loads one vector of packed weights and
/// multiplies it with each position's input value broadcast from memory. The sums (starting
/// at `bias`, `mg` rounded up to a multiple of [`BCAST_MB`] values) are transposed to
/// channel rows and written to `out` (row `rows.start` of channel 0; planes `plane` apart).
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512VL; `padded` holds `cg` channels in `geo`'s
/// layout (built with one chunk of [`LANES`] columns) and `packed` the weights as
/// [`pack_direct`] packs them in blocks of [`BCAST_MB`]; the rows `rows` of the `mg` planes at `out` are valid for
/// writes and written by nothing else meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn broadcast_rows_avx512(geo: &Padded, padded: &[f32], cg: usize, packed: &[f32], bias: &[f32], mg: usize, rows: std::ops::Range<usize>, out: *mut f32, plane: usize) {
    use std::arch::x86_64::*;
    let (h, wa) = (geo.h, geo.wa);
    let ow = wa.output;
    let chan = geo.channel_len();
    let row_len = wa.stride * geo.len;
    let taps = cg * h.kernel * wa.kernel;
    let blocks = mg.div_ceil(BCAST_MB);
    assert!(padded.len() >= cg * chan && packed.len() >= blocks * taps * BCAST_MB && bias.len() >= blocks * BCAST_MB);
    assert!(rows.end <= h.output && geo.chunks == 1);
    for (r, oy) in rows.clone().enumerate() {
        let row0 = oy * h.stride * row_len;
        for blk in 0..blocks {
            // SAFETY: inside `packed` and `bias` (asserted above).
            let (w, b) = unsafe { (packed.as_ptr().add(blk * taps * BCAST_MB), _mm512_loadu_ps(bias.as_ptr().add(blk * BCAST_MB))) };
            let count = BCAST_MB.min(mg - blk * BCAST_MB);
            for x0 in (0..ow).step_by(LANES) {
                // SAFETY: `Padded` sizes each phase row for the output width rounded up to
                // `LANES` plus the largest tap shift, so the positions `x0..x0 + 16` of
                // every tap of the rows below `rows.end` of the `cg` channels are inside
                // `padded` (asserted above); the packed block holds `taps` vectors.
                let sums = unsafe {
                    let p = padded.as_ptr().add(row0 + x0);
                    if count <= BCAST_MB / 2 {
                        match ow - x0 {
                            1..=4 => broadcast_half_avx512::<4>(p, chan, &geo.offsets, cg, w, b),
                            5..=8 => broadcast_half_avx512::<8>(p, chan, &geo.offsets, cg, w, b),
                            9..=12 => broadcast_half_avx512::<12>(p, chan, &geo.offsets, cg, w, b),
                            _ => broadcast_half_avx512::<16>(p, chan, &geo.offsets, cg, w, b),
                        }
                    } else {
                        match ow - x0 {
                            1..=4 => broadcast_block_avx512::<4>(p, chan, &geo.offsets, cg, w, b),
                            5..=8 => broadcast_block_avx512::<8>(p, chan, &geo.offsets, cg, w, b),
                            9..=12 => broadcast_block_avx512::<12>(p, chan, &geo.offsets, cg, w, b),
                            _ => broadcast_block_avx512::<16>(p, chan, &geo.offsets, cg, w, b),
                        }
                    }
                };
                let n = (ow - x0).min(LANES);
                let mask: __mmask16 = if n == LANES { 0xffff } else { (1u16 << n) - 1 };
                for (m, v) in sums.iter().enumerate().take(count) {
                    // SAFETY: the mask keeps the store to the `n` columns left in this row
                    // of channel `blk * BCAST_MB + m`, one of the caller's rows.
                    unsafe { _mm512_mask_storeu_ps(out.add((blk * BCAST_MB + m) * plane + r * ow + x0), mask, *v) };
                }
            }
        }
    }
}

/// The sums of `W` consecutive output positions for one block of [`BCAST_MB`] channels,
/// transposed: register `m` holds channel `m`'s sums for the positions in lanes `0..W`
/// (lanes past `W` hold zero). Position `i` of tap `t` of input channel `c` reads
/// `p[c * chan + offsets[t] + i]`; the weights are `cg * offsets.len()` vectors at `w`;
/// the sums start at `bias`.
///
/// # Safety
/// The CPU must support AVX-512F; every value read is inside one allocation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn broadcast_block_avx512<const W: usize>(p: *const f32, chan: usize, offsets: &[usize], cg: usize, w: *const f32, bias: std::arch::x86_64::__m512) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    let mut acc = [bias; W];
    let mut w = w;
    for c in 0..cg {
        // SAFETY: the caller's guarantee covers every value read.
        let pc = unsafe { p.add(c * chan) };
        for &off in offsets {
            // SAFETY: as above.
            unsafe {
                let wv = _mm512_loadu_ps(w);
                w = w.add(BCAST_MB);
                let x = pc.add(off);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(i)), wv, *a);
                }
            }
        }
    }
    let mut rows = [_mm512_setzero_ps(); 16];
    rows[..W].copy_from_slice(&acc);
    transpose16_avx512(rows)
}

/// [`broadcast_block_avx512`] for a block of at most half [`BCAST_MB`] channels: the sums
/// of `W` positions for the first eight channels of the packed vectors, in 8-lane
/// registers; register `m < 8` of the result holds channel `m`'s sums (lanes past `W`
/// zero), the others are unspecified.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512VL; every value read is inside one allocation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl")]
#[inline]
unsafe fn broadcast_half_avx512<const W: usize>(p: *const f32, chan: usize, offsets: &[usize], cg: usize, w: *const f32, bias: std::arch::x86_64::__m512) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_castps512_ps256(bias); W];
    let mut w = w;
    for c in 0..cg {
        // SAFETY: the caller's guarantee covers every value read.
        let pc = unsafe { p.add(c * chan) };
        for &off in offsets {
            // SAFETY: as above.
            unsafe {
                let wv = _mm256_loadu_ps(w);
                w = w.add(BCAST_MB);
                let x = pc.add(off);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*x.add(i)), wv, *a);
                }
            }
        }
    }
    // Row `i` holds positions `i` and `i + 8`, so column `m` of the transpose holds
    // channel `m` at positions 0..8 and column `m + 8` at positions 8..16.
    let half = |i: usize| if i < W { acc[i] } else { _mm256_setzero_ps() };
    let mut rows = [_mm512_setzero_ps(); 16];
    for (i, r) in rows.iter_mut().enumerate().take(8) {
        *r = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(_mm512_castps256_ps512(half(i))), _mm256_castps_pd(half(i + 8))));
    }
    let t = transpose16_avx512(rows);
    std::array::from_fn(|m| if m < 8 { _mm512_shuffle_f32x4::<0x44>(t[m], t[m + 8]) } else { t[m] })
}

/// The transpose of a 16x16 matrix held as 16 registers of rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16_avx512(r: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // Pairs of rows interleaved within each 128-bit lane.
    let t: [__m512; 16] = std::array::from_fn(|i| if i % 2 == 0 { _mm512_unpacklo_ps(r[i], r[i + 1]) } else { _mm512_unpackhi_ps(r[i - 1], r[i]) });
    // Each 128-bit lane of `u[4q + j]` holds column `j` (plus 4, 8, 12 by lane) of rows
    // `4q..4q + 4`.
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (q, j) = (i / 4 * 4, i % 4);
        let (a, b) = (t[q + (j / 2)], t[q + 2 + (j / 2)]);
        if j % 2 == 0 { _mm512_shuffle_ps::<0x44>(a, b) } else { _mm512_shuffle_ps::<0xEE>(a, b) }
    });
    // The 128-bit lanes of `v[k]` (`v[8 + k]`) hold columns `k` and `k + 8` of rows 0..4,
    // then of rows 4..8 (rows 8..12, then 12..16).
    let v: [__m512; 16] = std::array::from_fn(|i| {
        let (half, k) = (i / 8 * 8, i % 8);
        if k < 4 { _mm512_shuffle_f32x4::<0x88>(u[half + k], u[half + k + 4]) } else { _mm512_shuffle_f32x4::<0xDD>(u[half + k - 4], u[half + k]) }
    });
    std::array::from_fn(|i| {
        let k = i % 8;
        if i < 8 { _mm512_shuffle_f32x4::<0x88>(v[k], v[k + 8]) } else { _mm512_shuffle_f32x4::<0xDD>(v[k], v[k + 8]) }
    })
}

/// [`direct_rows_avx512`] with AVX2 and FMA: each step computes half a block of
/// [`DIRECT_MB`] output channels over two 8-lane registers of columns (sixteen columns of
/// `geo`'s chunks), the sums in registers over every tap of every input channel.
///
/// # Safety
/// The CPU must support AVX2 and FMA; otherwise as [`direct_rows_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn direct_rows_avx2(geo: &Padded, padded: &[f32], cg: usize, packed: &[f32], bias: &[f32], mg: usize, rows: std::ops::Range<usize>, out: *mut f32, plane: usize) {
    use std::arch::x86_64::*;
    const HALF: usize = DIRECT_MB / 2;
    const STEP: usize = 2 * AVX2_LANES;
    let (h, wa) = (geo.h, geo.wa);
    let (ow, kh, kw, s) = (wa.output, h.kernel, wa.kernel, wa.stride);
    let chan = geo.channel_len();
    let row_len = s * geo.len;
    let taps = cg * kh * kw;
    assert!(padded.len() >= cg * chan && packed.len() >= mg.div_ceil(DIRECT_MB) * taps * DIRECT_MB && bias.len() >= mg.next_multiple_of(DIRECT_MB));
    assert!(rows.end <= h.output && (geo.chunks * LANES).is_multiple_of(STEP));
    let offsets = &geo.offsets;
    let lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (r, oy) in rows.clone().enumerate() {
        for m0 in (0..mg).step_by(HALF) {
            let (blk, lane0) = (m0 / DIRECT_MB, m0 % DIRECT_MB);
            let wblk = &packed[blk * taps * DIRECT_MB..(blk + 1) * taps * DIRECT_MB];
            for x0 in (0..ow).step_by(STEP) {
                let mut acc: [[__m256; 2]; HALF] = std::array::from_fn(|m| [_mm256_set1_ps(bias[m0 + m]); 2]);
                for c in 0..cg {
                    let row0 = c * chan + oy * h.stride * row_len + x0;
                    let wc = &wblk[c * kh * kw * DIRECT_MB..(c + 1) * kh * kw * DIRECT_MB];
                    for (t, &off) in offsets.iter().enumerate() {
                        // SAFETY: `Padded` sizes rows for every chunk of the rounded-up
                        // output width (a multiple of `STEP`, asserted above) plus the
                        // largest tap shift, and every row this reads is below `rows` rows
                        // of channel `c` (asserted above); unaligned loads are allowed.
                        let x = unsafe {
                            let p = padded.as_ptr().add(row0 + off);
                            [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(AVX2_LANES))]
                        };
                        let w = &wc[t * DIRECT_MB + lane0..t * DIRECT_MB + lane0 + HALF];
                        for (a, &wm) in acc.iter_mut().zip(w) {
                            let wv = _mm256_set1_ps(wm);
                            a[0] = _mm256_fmadd_ps(x[0], wv, a[0]);
                            a[1] = _mm256_fmadd_ps(x[1], wv, a[1]);
                        }
                    }
                }
                for (m, a) in acc.iter().enumerate().take(mg - m0) {
                    for (i, v) in a.iter().enumerate() {
                        let first = x0 + i * AVX2_LANES;
                        if first >= ow {
                            break;
                        }
                        // SAFETY: `first` is inside row `r` of channel `m0 + m`'s plane,
                        // one of the caller's rows; a partial register is stored through a
                        // mask of the columns left in the row.
                        unsafe {
                            let p = out.add((m0 + m) * plane + r * ow + first);
                            if ow - first >= AVX2_LANES {
                                _mm256_storeu_ps(p, *v);
                            } else {
                                _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((ow - first) as i32), lane_index), *v);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A convolution's kernel state: attributes and constant weights converted once.
pub(crate) struct Conv {
    window: Window,
    group: usize,
    /// Constant weight, converted once.
    weight: Option<(Vec<f32>, Vec<usize>)>,
    /// Constant bias, converted once.
    bias: Option<Vec<f32>>,
    /// The constant weight's Winograd transform, once a run needs it.
    winograd: winograd::Transformed,
}

impl Conv {
    /// Runs the convolution and then `epilogue` (input 0 is the convolution's output, the
    /// other inputs are given as tensors) on each output block while it is in cache.
    /// `Ok(None)` when this path does not apply (an input is not f32, or the program does
    /// not bind to the shapes): the caller then runs the ops one by one.
    pub(crate) fn run_fused(&self, ins: &[Option<&Tensor>], epilogue: &Program, extras: &[&Tensor]) -> RuntimeResult<Option<Tensor>> {
        let x = input(ins, 0)?;
        if x.dtype() != DType::F32 || extras.iter().any(|t| t.dtype() != DType::F32) {
            return Ok(None);
        }
        if epilogue.insts.is_empty() {
            return self.compute(ins, None);
        }
        let views: Vec<(&[f32], &[usize])> = extras.iter().map(|t| (t.as_slice::<f32>().unwrap(), t.shape())).collect();
        self.compute(ins, Some((epilogue, &views)))
    }

    /// Output channels and rank of the constant weight, if the weight is constant.
    pub(crate) fn weight_shape(&self) -> Option<&[usize]> {
        self.weight.as_ref().map(|w| w.1.as_slice())
    }

    /// Folds `y * scale[m] + shift[m]` (per output channel, applied to this convolution's
    /// output including its bias) into the weight and bias. Needs a constant weight with
    /// `scale.len()` output channels; `shift` has as many values.
    pub(crate) fn fold_affine(&mut self, scale: &[f32], shift: &[f32]) {
        let Some((w, shape)) = &mut self.weight else { return };
        let m = shape[0];
        assert!(scale.len() == m && shift.len() == m, "one scale and shift per output channel");
        let per = w.len() / m.max(1);
        for (row, &s) in w.chunks_mut(per.max(1)).zip(scale) {
            row.iter_mut().for_each(|v| *v *= s);
        }
        let bias = self.bias.get_or_insert_with(|| vec![0.0; m]);
        for ((b, &s), &t) in bias.iter_mut().zip(scale).zip(shift) {
            *b = *b * s + t;
        }
        self.winograd = winograd::Transformed::default();
    }

    /// The convolution of `ins` with its bias and an optional epilogue; `None` when the
    /// epilogue does not bind.
    fn compute(&self, ins: &[Option<&Tensor>], epilogue: Epilogue) -> RuntimeResult<Option<Tensor>> {
        let x = input(ins, 0)?;
        let owned_w;
        let (w, wshape): (&[f32], &[usize]) = match &self.weight {
            Some((w, s)) => (w, s),
            None => {
                let t = input(ins, 1)?;
                owned_w = (to_f32(t)?.into_owned(), t.shape().to_vec());
                (&owned_w.0, &owned_w.1)
            }
        };
        let owned_b;
        let bias: Option<&[f32]> = match (&self.bias, opt_input(ins, 2)) {
            (Some(b), _) => Some(b),
            (None, Some(t)) => { owned_b = to_f32(t)?.into_owned(); Some(&owned_b) }
            (None, None) => None,
        };
        let xv = to_f32(x)?;
        let transformed = self.weight.is_some().then_some(&self.winograd);
        Ok(match conv_with(&xv, x.shape(), w, wshape, bias, &self.window, self.group, epilogue, transformed)? {
            Some((out, shape)) => Some(from_f32(x.dtype(), &shape, out)?),
            None => None,
        })
    }
}

impl Kernel for Conv {
    fn run(&self, ins: &[Option<&Tensor>], _: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        Ok(vec![self.compute(ins, None)?.expect("a convolution without epilogue always runs")])
    }
}

/// Convolution of `x` (`[N, C, D1, ..., Dr]`, r >= 1 spatial axes) with weight `w`
/// (`[M, C / group, K1, ..., Kr]`) and an optional bias (`M` values), followed by an optional
/// epilogue program (input 0: the convolution's output; then the given inputs, as data and
/// shape) applied to each output block while it is in cache. Returns the output
/// `[N, M, O1, ..., Or]`, or `Ok(None)` when the program does not bind to the output shape.
/// 1-D and 2-D convolutions run on the 2-D paths (1-D as height 1), others on [`conv_nd`].
/// `transformed`, given when `w` is a constant weight, keeps its Winograd transform.
#[allow(clippy::too_many_arguments)]
fn conv_with(x: &[f32], xshape: &[usize], w: &[f32], wshape: &[usize], bias: Option<&[f32]>, window: &Window, group: usize, epilogue: Epilogue, transformed: Option<&winograd::Transformed>) -> RuntimeResult<Option<(Vec<f32>, Vec<usize>)>> {
    if xshape.len() < 3 || wshape.len() != xshape.len() {
        return Err(kernel_error(format!("Conv needs an input [N, C, D1, ...] with at least one spatial axis and a weight of the same rank; got input {xshape:?}, weight {wshape:?}")));
    }
    let (c, m, cg) = (xshape[1], wshape[0], wshape[1]);
    if group == 0 || c != cg * group || m % group != 0 {
        return Err(kernel_error(format!("input channels {c}, weight {wshape:?} and group {group} do not fit: the weight needs input channels / group = {} on axis 1 and output channels divisible by the group", c / group.max(1))));
    }
    if let Some(b) = bias.filter(|b| b.len() != m) {
        return Err(kernel_error(format!("bias has {} values for {m} output channels", b.len())));
    }
    if let Some(k) = window.kernel.as_ref().filter(|k| k[..] != wshape[2..]) {
        return Err(kernel_error(format!("kernel_shape {k:?} differs from the weight's spatial sizes {:?}", &wshape[2..])));
    }
    let axes = window.axes(&xshape[2..], &wshape[2..])?;
    let shape: Vec<usize> = [xshape[0], m].into_iter().chain(axes.iter().map(|a| a.output)).collect();
    check_output_size("Conv output", DType::F32, &shape)?;
    let bound = match epilogue {
        Some((prog, extras)) => match prog.bind(&shape, extras) {
            Some(b) => Some(b),
            None => return Ok(None),
        },
        None => None,
    };
    let fin = Finish { bias, channels: m, plane: shape[2..].iter().product(), epilogue: bound.as_ref() };
    let out = match axes[..] {
        [wa] => conv_2d(x, xshape, w, wshape, Axis::UNIT, wa, group, fin, transformed),
        [h, wa] => conv_2d(x, xshape, w, wshape, h, wa, group, fin, transformed),
        _ => conv_nd(x, xshape, w, wshape, &axes, group, fin),
    };
    Ok(Some((out, shape)))
}

/// The 2-D convolution of [`conv_with`] (a 1-D input has height `h` = [`Axis::UNIT`]) over
/// validated shapes and the axes' geometry, finished by `fin`: depthwise, pointwise, direct
/// or tiled im2col paths per image and group.
#[allow(clippy::too_many_arguments)]
fn conv_2d(x: &[f32], xshape: &[usize], w: &[f32], wshape: &[usize], h: Axis, wa: Axis, group: usize, fin: Finish, transformed: Option<&winograd::Transformed>) -> Vec<f32> {
    let (n, c, m, cg) = (xshape[0], xshape[1], wshape[0], wshape[1]);
    let (ih, iw, kh, kw) = (h.input, wa.input, h.kernel, wa.kernel);
    let (oh, ow) = (h.output, wa.output);
    let plane = oh * ow;
    let mg = m / group;
    let kdim = cg * kh * kw;
    let mut out = uninit::<f32>(n * m * plane);
    let pointwise = kh == 1 && kw == 1 && h.stride == 1 && wa.stride == 1 && h.pad_begin + h.pad_end + wa.pad_begin + wa.pad_end == 0;
    let depthwise = cg == 1 && mg == 1;
    for b in 0..n {
        let img = &x[b * c * ih * iw..(b + 1) * c * ih * iw];
        let dst = &mut out[b * m * plane..(b + 1) * m * plane];
        if depthwise {
            depthwise_conv(img, w, h, wa, dst, b * m * plane, fin);
        } else {
            for g in 0..group {
                let src = &img[g * cg * ih * iw..(g + 1) * cg * ih * iw];
                let wg = &w[g * mg * kdim..(g + 1) * mg * kdim];
                let out = &mut dst[g * mg * plane..(g + 1) * mg * plane];
                let base = (b * m + g * mg) * plane;
                if kdim == 0 {
                    out.iter_mut().for_each(|v| { v.write(0.0); });
                    // SAFETY: written just above.
                    fin.apply(unsafe { assume_init_mut(out) }, base, &mut Scratch::new());
                } else if pointwise {
                    conv_pointwise(src, kdim, plane, wg, mg, out, base, fin);
                } else {
                    match winograd_isa(cg, h, wa).map_or_else(|| dense_kernel(mg, h.output, wa.output, kdim), Dense::Winograd) {
                        Dense::Tiled => conv_tiled(src, cg, &[h, wa], wg, mg, out, base, fin),
                        Dense::Winograd(isa) => {
                            let owned;
                            let u = match transformed {
                                Some(t) => t.group(w, group, mg, cg, g),
                                None => { owned = winograd::transform_weights(wg, mg, cg); &owned }
                            };
                            winograd::conv_winograd(src, cg, h, wa, u, mg, out, base, fin, isa)
                        }
                        kernel => conv_direct(src, cg, h, wa, wg, mg, out, base, fin, kernel),
                    }
                }
            }
        }
    }
    // SAFETY: every path above writes every element of each group's output planes, and
    // the groups of every image cover the whole output.
    unsafe { assume_init(out) }
}

/// One filter per channel, written to `dst` (whose first element is output element `base`)
/// and finished in groups of rows; channels run in parallel. Each channel's input is first
/// copied into a zero-padded buffer with its columns split by phase modulo the column
/// stride ([`Padded`]), so every tap of every output column reads inside the buffer at a
/// fixed offset; output rows are then computed a few 16-column chunks at a time with the
/// sums held in registers across all taps.
fn depthwise_conv(img: &[f32], w: &[f32], h: Axis, wa: Axis, dst: &mut [MaybeUninit<f32>], base: usize, fin: Finish) {
    let (ih, iw, kh, kw) = (h.input, wa.input, h.kernel, wa.kernel);
    let plane = h.output * wa.output;
    if plane == 0 {
        return;
    }
    let geo = Padded::new(h, wa);
    // The accumulators start at the bias, so rows are finished without it.
    let rest = Finish { bias: None, ..fin };
    #[cfg(target_arch = "x86_64")]
    let (avx512, avx2) = (std::arch::is_x86_feature_detected!("avx512f"), std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"));
    par_chunks_mut(dst, plane, min_items(plane * kh * kw), || (Vec::new(), Scratch::new()), |(buf, scratch): &mut (Vec<f32>, Scratch), ch, out| {
        let src = &img[ch * ih * iw..(ch + 1) * ih * iw];
        let k = &w[ch * kh * kw..(ch + 1) * kh * kw];
        buf.resize(geo.channel_len(), 0.0);
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the CPU supports AVX-512F, detected above.
            unsafe { geo.fill_into_avx512(src, buf) };
        } else {
            geo.fill_into(src, buf);
        }
        #[cfg(not(target_arch = "x86_64"))]
        geo.fill_into(src, buf);
        let at = base + ch * plane;
        let b = fin.bias.map_or(0.0, |b| b[(at / plane) % fin.channels]);
        #[cfg(target_arch = "x86_64")]
        {
            if avx512 {
                // SAFETY: the CPU supports AVX-512F (which implies FMA), detected above.
                return unsafe { depthwise_channel_avx512(&geo, buf, k, b, out, at, rest, scratch) };
            }
            if avx2 {
                // SAFETY: the CPU supports AVX2 and FMA, detected above.
                return unsafe { depthwise_channel_avx2(&geo, buf, k, b, out, at, rest, scratch) };
            }
        }
        depthwise_channel(&geo, buf, k, b, out, at, rest, scratch)
    });
}

/// Lanes of one column chunk of the depthwise kernel.
const LANES: usize = 16;

/// A depthwise window over a zero-padded, phase-split copy of one input channel: padded row
/// `r` (input row `r - pad_top`) holds, for each phase `p < stride`, `len` values at padded
/// columns `p, p + stride, ...` (input column minus the left padding). Output `(oy, ox)` of
/// tap `(ki, kj)` reads padded row `oy * stride_h + ki * dilation_h`, phase
/// `taps[kj].0`, position `ox + taps[kj].1`.
struct Padded {
    h: Axis,
    wa: Axis,
    rows: usize,
    len: usize,
    /// Column chunks computed together (1, 2 or 4 of [`LANES`]).
    chunks: usize,
    taps: Vec<(usize, usize)>,
    /// Per tap `(ki, kj)`, in weight order: where its first value for output `(0, 0)` sits
    /// in the buffer.
    offsets: Vec<usize>,
    /// Per phase: the positions `[lo, hi)` that hold input columns, from input column
    /// `first` (position j holds input column `j * stride + phase - pad_begin`).
    spans: Vec<(usize, usize, usize)>,
}

impl Padded {
    /// The layout for a window.
    fn new(h: Axis, wa: Axis) -> Padded {
        let chunks = match wa.output.div_ceil(LANES) {
            0 | 1 => 1,
            2 => 2,
            _ => 4,
        };
        Self::with_chunks(h, wa, chunks)
    }

    /// The layout for a window whose rows are computed `chunks` chunks of [`LANES`]
    /// columns at a time.
    fn with_chunks(h: Axis, wa: Axis, chunks: usize) -> Padded {
        let s = wa.stride;
        let taps: Vec<(usize, usize)> = (0..wa.kernel).map(|kj| ((kj * wa.dilation) % s, (kj * wa.dilation) / s)).collect();
        let span = chunks * LANES;
        let width = wa.output.div_ceil(span) * span;
        let len = width + taps.iter().map(|t| t.1).max().unwrap_or(0);
        let rows = (h.output - 1) * h.stride + (h.kernel - 1) * h.dilation + 1;
        let row_len = s * len;
        let offsets = (0..h.kernel).flat_map(|ki| taps.iter().map(move |&(phase, shift)| ki * h.dilation * row_len + phase * len + shift)).collect();
        let (iw, pb) = (wa.input, wa.pad_begin);
        let spans = (0..s).map(|p| {
            let lo = pb.saturating_sub(p).div_ceil(s).min(len);
            let hi = ((iw + pb).saturating_sub(p)).div_ceil(s).clamp(lo, len);
            (lo, hi, (lo * s + p).saturating_sub(pb))
        }).collect();
        Padded { h, wa, rows, len, chunks, taps, offsets, spans }
    }

    /// Values one channel takes in this layout.
    fn channel_len(&self) -> usize {
        self.rows * self.wa.stride * self.len
    }

    /// [`Padded::fill_into`] with AVX-512F (the same contract on `buf`). With a column
    /// stride of 1 the input rows are written sixteen values at a time (the zeros a row's
    /// last vector carries past the input land on padding); other strides take
    /// [`Padded::fill_into`] compiled for AVX-512F.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn fill_into_avx512(&self, src: &[f32], buf: &mut [f32]) {
        use std::arch::x86_64::*;
        if self.wa.stride != 1 {
            return self.fill_into(src, buf);
        }
        let (ih, iw, len) = (self.h.input, self.wa.input, self.len);
        let (lo, hi, first) = self.spans[0];
        let count = hi - lo;
        assert!(buf.len() >= self.rows * len && src.len() >= ih * iw && first + count <= iw);
        let top = self.h.pad_begin;
        for iy in 0..ih.min(self.rows.saturating_sub(top)) {
            let from = &src[iy * iw + first..iy * iw + first + count];
            let to = &mut buf[(iy + top) * len + lo..(iy + top + 1) * len];
            for j in (0..count).step_by(LANES) {
                let n = (count - j).min(LANES);
                let load: __mmask16 = if n == LANES { 0xffff } else { (1u16 << n) - 1 };
                // SAFETY: the mask keeps the load to `from[j..j + n]`.
                let v = unsafe { _mm512_maskz_loadu_ps(load, from.as_ptr().add(j)) };
                if j + LANES <= to.len() {
                    // SAFETY: `to[j..j + 16]` is inside this row; the lanes past the input
                    // are zeros, stored on padding positions.
                    unsafe { _mm512_storeu_ps(to.as_mut_ptr().add(j), v) };
                } else {
                    // SAFETY: the mask keeps the store to `to[j..j + n]`.
                    unsafe { _mm512_mask_storeu_ps(to.as_mut_ptr().add(j), load, v) };
                }
            }
        }
    }

    /// Copies one input channel into `buf` (of [`Padded::channel_len`] values) that
    /// already holds zeros at every padding position (freshly zeroed, or last filled for
    /// the same layout): only the positions that hold input values are written.
    #[inline(always)]
    fn fill_into(&self, src: &[f32], buf: &mut [f32]) {
        let (s, iw, pb) = (self.wa.stride, self.wa.input, self.wa.pad_begin);
        let row_len = s * self.len;
        let deinterleave = s == 2 && self.len >= (iw + pb).div_ceil(2);
        for (r, dst) in buf.chunks_mut(row_len).enumerate() {
            let iy = r as isize - self.h.pad_begin as isize;
            if iy < 0 || iy >= self.h.input as isize {
                continue;
            }
            let row = &src[iy as usize * iw..(iy as usize + 1) * iw];
            if deinterleave {
                // Input column q goes to phase (q + pb) % 2 at position (q + pb) / 2.
                let (even, odd) = dst.split_at_mut(self.len);
                let (first, second) = if pb % 2 == 0 { (even, odd) } else { (odd, even) };
                let (f0, s0) = (pb / 2, pb.div_ceil(2));
                let pairs = iw / 2;
                deinterleave_pairs(&mut first[f0..f0 + pairs], &mut second[s0..s0 + pairs], &row[..2 * pairs]);
                if iw % 2 == 1 {
                    first[f0 + pairs] = row[iw - 1];
                }
                continue;
            }
            for (phase, &(lo, hi, first)) in dst.chunks_mut(self.len).zip(&self.spans) {
                if s == 1 {
                    phase[lo..hi].copy_from_slice(&row[first..first + hi - lo]);
                } else if hi > lo {
                    for (d, v) in phase[lo..hi].iter_mut().zip(row[first..].iter().step_by(s)) {
                        *d = *v;
                    }
                }
            }
        }
    }
}

/// `a[k] = src[2k]`, `b[k] = src[2k + 1]` (`src` twice as long as `a` and `b`), sixteen
/// pairs per shuffle with AVX-512F, eight with AVX2.
#[inline(always)]
fn deinterleave_pairs(a: &mut [f32], b: &mut [f32], src: &[f32]) {
    assert!(a.len() == b.len() && src.len() == 2 * a.len(), "src holds one pair per output");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above); lengths asserted above.
        done = unsafe { deinterleave_avx512(a, b, src) };
    } else if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above); lengths asserted above.
        done = unsafe { deinterleave_avx2(a, b, src) };
    }
    for ((x, y), pair) in a[done..].iter_mut().zip(b[done..].iter_mut()).zip(src[2 * done..].chunks_exact(2)) {
        *x = pair[0];
        *y = pair[1];
    }
}

/// [`deinterleave_pairs`] with AVX-512F: blocks of sixteen pairs, then the last pairs with
/// masked loads and stores; returns how many pairs it wrote (all of them).
///
/// # Safety
/// The CPU must support AVX-512F; `b` is as long as `a` and `src` twice as long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn deinterleave_avx512(a: &mut [f32], b: &mut [f32], src: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let n = a.len();
    for k in (0..n).step_by(16) {
        let pairs = (n - k).min(16);
        // Source values `2k .. 2k + 2 pairs`: the first 16 in `lo`, the rest in `hi`.
        let lo_mask: __mmask16 = if 2 * pairs >= 16 { 0xffff } else { (1u16 << (2 * pairs)) - 1 };
        let hi_mask: __mmask16 = if 2 * pairs >= 32 { 0xffff } else if 2 * pairs > 16 { (1u16 << (2 * pairs - 16)) - 1 } else { 0 };
        let out_mask: __mmask16 = if pairs == 16 { 0xffff } else { (1u16 << pairs) - 1 };
        // SAFETY: the masks keep the loads to `src[2k .. 2k + 2 pairs]` and the stores to
        // `a[k .. k + pairs]` and `b[k .. k + pairs]`, inside the slices (the caller's
        // lengths); unaligned masked accesses are allowed.
        unsafe {
            let lo = _mm512_maskz_loadu_ps(lo_mask, src.as_ptr().add(2 * k));
            let hi = _mm512_maskz_loadu_ps(hi_mask, src.as_ptr().add(2 * k + 16));
            _mm512_mask_storeu_ps(a.as_mut_ptr().add(k), out_mask, _mm512_permutex2var_ps(lo, even, hi));
            _mm512_mask_storeu_ps(b.as_mut_ptr().add(k), out_mask, _mm512_permutex2var_ps(lo, odd, hi));
        }
    }
    n
}

/// [`deinterleave_pairs`] with AVX2 on blocks of eight pairs; returns how many pairs it
/// wrote (the pairs after the last whole block are left to the caller).
///
/// # Safety
/// The CPU must support AVX2; `b` is as long as `a` and `src` twice as long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn deinterleave_avx2(a: &mut [f32], b: &mut [f32], src: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let blocks = a.len() / AVX2_LANES;
    for k in (0..blocks * AVX2_LANES).step_by(AVX2_LANES) {
        // SAFETY: `src[2k .. 2k + 16]`, `a[k .. k + 8]` and `b[k .. k + 8]` are inside the
        // slices (whole blocks only, the caller's lengths); unaligned accesses are allowed.
        unsafe {
            let lo = _mm256_loadu_ps(src.as_ptr().add(2 * k));
            let hi = _mm256_loadu_ps(src.as_ptr().add(2 * k + AVX2_LANES));
            // Per 128-bit half: the even (odd) values of `lo` then of `hi`; the 64-bit
            // quarters are then put in order.
            let even = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(_mm256_shuffle_ps::<0b10_00_10_00>(lo, hi))));
            let odd = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(_mm256_shuffle_ps::<0b11_01_11_01>(lo, hi))));
            _mm256_storeu_ps(a.as_mut_ptr().add(k), even);
            _mm256_storeu_ps(b.as_mut_ptr().add(k), odd);
        }
    }
    blocks * AVX2_LANES
}

/// [`depthwise_channel`] with AVX-512F intrinsics: each chunk of 16 output columns is one
/// register, multiply-adds are fused, the last chunk of a row is stored masked. Rows are
/// computed several at a time, so eight independent sums hide the multiply-add latency.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn depthwise_channel_avx512(d: &Padded, buf: &[f32], k: &[f32], bias: f32, out: &mut [MaybeUninit<f32>], at: usize, fin: Finish, scratch: &mut Scratch) {
    match d.chunks {
        1 => depthwise_rows_avx512::<1, 8>(d, buf, k, bias, out, at, fin, scratch),
        2 => depthwise_rows_avx512::<2, 4>(d, buf, k, bias, out, at, fin, scratch),
        _ => depthwise_rows_avx512::<4, 2>(d, buf, k, bias, out, at, fin, scratch),
    }
}

/// [`depthwise_channel_avx512`] with `C` chunks of [`LANES`] columns of `R` rows per step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn depthwise_rows_avx512<const C: usize, const R: usize>(d: &Padded, buf: &[f32], k: &[f32], bias: f32, out: &mut [MaybeUninit<f32>], at: usize, fin: Finish, scratch: &mut Scratch) {
    use std::arch::x86_64::*;
    let (h, wa) = (d.h, d.wa);
    let (oh, ow, kw, s) = (h.output, wa.output, wa.kernel, wa.stride);
    let row_len = s * d.len;
    assert!(buf.len() >= d.rows * row_len && k.len() >= h.kernel * kw && out.len() >= oh * ow);
    let rows_per_finish = 512usize.div_ceil(ow).next_multiple_of(R);
    let mut unfinished = 0;
    for oy0 in (0..oh).step_by(R) {
        // Rows past the last are computed from clamped rows and not stored.
        let rows: [usize; R] = std::array::from_fn(|r| (oy0 + r).min(oh - 1));
        for x0 in (0..ow).step_by(C * LANES) {
            let mut acc = [[_mm512_set1_ps(bias); C]; R];
            for (&off, &wt) in d.offsets.iter().zip(k) {
                let wv = _mm512_set1_ps(wt);
                for (r, row_acc) in acc.iter_mut().enumerate() {
                    let start = rows[r] * h.stride * row_len + off + x0;
                    // SAFETY: `Padded::new` sizes each phase row to hold every chunk of the
                    // rounded-up output width plus the largest tap shift, and `buf` holds
                    // `rows` rows (asserted above), so all `C * LANES` values are inside.
                    let src = unsafe { buf.as_ptr().add(start) };
                    for (c, a) in row_acc.iter_mut().enumerate() {
                        // SAFETY: see above; unaligned loads are allowed.
                        *a = _mm512_fmadd_ps(wv, unsafe { _mm512_loadu_ps(src.add(c * LANES)) }, *a);
                    }
                }
            }
            for (r, row_acc) in acc.iter().enumerate() {
                if oy0 + r >= oh {
                    break;
                }
                let dst = (oy0 + r) * ow + x0;
                for (c, a) in row_acc.iter().enumerate() {
                    let first = x0 + c * LANES;
                    if first >= ow {
                        break;
                    }
                    let n = (ow - first).min(LANES);
                    let mask: __mmask16 = if n == LANES { 0xffff } else { (1u16 << n) - 1 };
                    // SAFETY: the mask keeps the store to the `n` columns left in this output
                    // row, inside `out` (asserted above).
                    unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(dst + c * LANES).cast::<f32>(), mask, *a) };
                }
            }
        }
        let done = (oy0 + R).min(oh);
        if done - unfinished >= rows_per_finish || done == oh {
            // SAFETY: rows up to `done` are stored above.
            fin.apply(unsafe { assume_init_mut(&mut out[unfinished * ow..done * ow]) }, at + unfinished * ow, scratch);
            unfinished = done;
        }
    }
}

/// [`depthwise_channel`] with AVX2 and FMA intrinsics: rows are computed a few at a time
/// in steps of one or two 8-lane registers of columns (one when the output is at most 8
/// columns wide), eight sums per step; columns past the output are computed from padding
/// and not stored.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn depthwise_channel_avx2(d: &Padded, buf: &[f32], k: &[f32], bias: f32, out: &mut [MaybeUninit<f32>], at: usize, fin: Finish, scratch: &mut Scratch) {
    if d.wa.output <= AVX2_LANES {
        depthwise_rows_avx2::<1, 8>(d, buf, k, bias, out, at, fin, scratch)
    } else {
        depthwise_rows_avx2::<2, 4>(d, buf, k, bias, out, at, fin, scratch)
    }
}

/// Lanes of an AVX2 register of f32.
const AVX2_LANES: usize = 8;

/// [`depthwise_channel_avx2`] with `V` registers of [`AVX2_LANES`] columns of `R` rows
/// per step.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `V * AVX2_LANES` divides the width `d` pads rows to.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn depthwise_rows_avx2<const V: usize, const R: usize>(d: &Padded, buf: &[f32], k: &[f32], bias: f32, out: &mut [MaybeUninit<f32>], at: usize, fin: Finish, scratch: &mut Scratch) {
    use std::arch::x86_64::*;
    let (h, wa) = (d.h, d.wa);
    let (oh, ow, kw, s) = (h.output, wa.output, wa.kernel, wa.stride);
    let row_len = s * d.len;
    let step = V * AVX2_LANES;
    assert!(buf.len() >= d.rows * row_len && k.len() >= h.kernel * kw && out.len() >= oh * ow);
    assert!((d.chunks * LANES).is_multiple_of(step), "steps tile the padded width");
    let rows_per_finish = 512usize.div_ceil(ow).next_multiple_of(R);
    let lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut unfinished = 0;
    for oy0 in (0..oh).step_by(R) {
        // Rows past the last are computed from clamped rows and not stored.
        let rows: [usize; R] = std::array::from_fn(|r| (oy0 + r).min(oh - 1) * h.stride * row_len);
        for x0 in (0..ow).step_by(step) {
            let mut acc = [[_mm256_set1_ps(bias); V]; R];
            for (&off, &wt) in d.offsets.iter().zip(k) {
                let wv = _mm256_set1_ps(wt);
                for (row_acc, &first) in acc.iter_mut().zip(&rows) {
                    // SAFETY: `Padded` sizes each phase row to hold every chunk of the
                    // rounded-up output width (a multiple of `step`, asserted above) plus
                    // the largest tap shift, and `buf` holds `rows` rows (asserted above),
                    // so all `step` values are inside.
                    let src = unsafe { buf.as_ptr().add(first + off + x0) };
                    for (c, a) in row_acc.iter_mut().enumerate() {
                        // SAFETY: see above; unaligned loads are allowed.
                        *a = _mm256_fmadd_ps(wv, unsafe { _mm256_loadu_ps(src.add(c * AVX2_LANES)) }, *a);
                    }
                }
            }
            for (r, row_acc) in acc.iter().enumerate() {
                if oy0 + r >= oh {
                    break;
                }
                let dst = (oy0 + r) * ow;
                for (c, a) in row_acc.iter().enumerate() {
                    let first = x0 + c * AVX2_LANES;
                    if first >= ow {
                        break;
                    }
                    // SAFETY: `first` is inside this output row, inside `out` (asserted
                    // above); a partial register is stored through a mask of the columns
                    // left in the row.
                    unsafe {
                        let p = out.as_mut_ptr().add(dst + first).cast::<f32>();
                        if ow - first >= AVX2_LANES {
                            _mm256_storeu_ps(p, *a);
                        } else {
                            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((ow - first) as i32), lane_index);
                            _mm256_maskstore_ps(p, mask, *a);
                        }
                    }
                }
            }
        }
        let done = (oy0 + R).min(oh);
        if done - unfinished >= rows_per_finish || done == oh {
            // SAFETY: rows up to `done` are stored above.
            fin.apply(unsafe { assume_init_mut(&mut out[unfinished * ow..done * ow]) }, at + unfinished * ow, scratch);
            unfinished = done;
        }
    }
}

/// Writes one channel's window sums to `out` (output element `at` onward) from its padded
/// copy `buf`, finishing rows in groups of at least 512 elements.
#[allow(clippy::too_many_arguments)]
fn depthwise_channel(d: &Padded, buf: &[f32], k: &[f32], bias: f32, out: &mut [MaybeUninit<f32>], at: usize, fin: Finish, scratch: &mut Scratch) {
    match d.chunks {
        1 => depthwise_rows::<1>(d, buf, k, bias, out, at, fin, scratch),
        2 => depthwise_rows::<2>(d, buf, k, bias, out, at, fin, scratch),
        _ => depthwise_rows::<4>(d, buf, k, bias, out, at, fin, scratch),
    }
}

/// [`depthwise_channel`] with `C` chunks of [`LANES`] columns computed together.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn depthwise_rows<const C: usize>(d: &Padded, buf: &[f32], k: &[f32], bias: f32, out: &mut [MaybeUninit<f32>], at: usize, fin: Finish, scratch: &mut Scratch) {
    let (h, wa) = (d.h, d.wa);
    let (ow, kw, s) = (wa.output, wa.kernel, wa.stride);
    let row_len = s * d.len;
    let rows_per_finish = 512usize.div_ceil(ow);
    let mut unfinished = 0;
    for oy in 0..h.output {
        let o = &mut out[oy * ow..(oy + 1) * ow];
        for x0 in (0..ow).step_by(C * LANES) {
            let mut acc = [[bias; LANES]; C];
            for ki in 0..h.kernel {
                let row = &buf[(oy * h.stride + ki * h.dilation) * row_len..][..row_len];
                for (kj, &(phase, shift)) in d.taps.iter().enumerate() {
                    let wt = k[ki * kw + kj];
                    let src = &row[phase * d.len + x0 + shift..][..C * LANES];
                    for (c, a) in acc.iter_mut().enumerate() {
                        for (l, v) in a.iter_mut().enumerate() {
                            *v += wt * src[c * LANES + l];
                        }
                    }
                }
            }
            let n = (ow - x0).min(C * LANES);
            for (o, v) in o[x0..x0 + n].iter_mut().zip(acc.iter().flatten()) {
                o.write(*v);
            }
        }
        if oy + 1 - unfinished == rows_per_finish || oy + 1 == h.output {
            // SAFETY: every column of rows up to `oy` is written above.
            fin.apply(unsafe { assume_init_mut(&mut out[unfinished * ow..(oy + 1) * ow]) }, at + unfinished * ow, scratch);
            unfinished = oy + 1;
        }
    }
}

/// Plans a Conv node: reads its attributes and converts constant weight and bias once.
pub(crate) fn build_conv(info: &NodeInfo) -> RuntimeResult<Conv> {
    let window = Window::from_node(info)?;
    let group = info.attr_int("group", 1).max(0) as usize;
    let weight = info.const_input(1).map(|t| to_f32(t).map(|v| (v.into_owned(), t.shape().to_vec()))).transpose()?;
    let bias = info.const_input(2).map(|t| to_f32(t).map(|v| v.into_owned())).transpose()?;
    Ok(Conv { window, group, weight, bias, winograd: Default::default() })
}

fn conv(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    Ok(Box::new(build_conv(info)?))
}

/// Plans a ConvTranspose node: input `[N, C, D1, ..., Dr]` (r >= 1), weight
/// `[C, M / group, K1, ..., Kr]`, optional bias `[M]`; output `[N, M, O1, ..., Or]` with
/// each axis's size and padding from `output_shape`, `auto_pad` or `pads` as the ONNX spec
/// defines them. 1-D and 2-D run on [`transposed_conv_2d`] (1-D as height 1), others on
/// [`transposed_conv_nd`].
fn conv_transpose(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let window = Window::from_node(info)?;
    let group = usize::try_from(info.attr_int("group", 1)).ok().filter(|&g| g > 0).ok_or_else(|| info.error("'group' must be positive"))?;
    let non_negative = |name: &str| -> RuntimeResult<Option<Vec<usize>>> {
        info.attr_ints(name).map(|v| v.iter().map(|&x| usize::try_from(x).map_err(|_| info.error(format!("'{name}' has a negative value {x}")))).collect()).transpose()
    };
    let output_padding = non_negative("output_padding")?;
    let output_shape = non_negative("output_shape")?;
    kernel(move |ins| {
        let (x, wt) = (input(ins, 0)?, input(ins, 1)?);
        let (xs, ws) = (x.shape(), wt.shape());
        if xs.len() < 3 || ws.len() != xs.len() {
            return Err(kernel_error(format!("ConvTranspose needs an input [N, C, D1, ...] with at least one spatial axis and a weight of the same rank; got input {xs:?}, weight {ws:?}")));
        }
        let (n, c, mg) = (xs[0], xs[1], ws[1]);
        if ws[0] != c || c % group != 0 {
            return Err(kernel_error(format!("input channels {c} do not match weight {ws:?} with group {group}: the weight needs {c} rows, a multiple of the group")));
        }
        let axes = transposed_axes(&window, output_padding.as_deref(), output_shape.as_deref(), &xs[2..], &ws[2..])?;
        let m = mg.checked_mul(group).ok_or_else(|| kernel_error("output channel count overflows"))?;
        let shape: Vec<usize> = [n, m].into_iter().chain(axes.iter().map(|a| a.output)).collect();
        check_output_size("ConvTranspose output", x.dtype(), &shape)?;
        let (xv, wv) = (to_f32(x)?, to_f32(wt)?);
        let bias = opt_input(ins, 2).map(to_f32).transpose()?;
        if let Some(b) = bias.as_ref().filter(|b| b.len() != m) {
            return Err(kernel_error(format!("bias has {} values for {m} output channels", b.len())));
        }
        let planar = |h: TransposedAxis, w: TransposedAxis| TransposedConv {
            n, c, ih: h.input, iw: w.input, group, mg, kh: h.kernel, kw: w.kernel, sh: h.stride, sw: w.stride,
            dh: h.dilation, dw: w.dilation, ph: h.pad_begin, pw: w.pad_begin, oh: h.output, ow: w.output,
        };
        let out = match axes[..] {
            [w] => transposed_conv_2d(&xv, &wv, bias.as_deref(), &planar(TransposedAxis::UNIT, w)),
            [h, w] => transposed_conv_2d(&xv, &wv, bias.as_deref(), &planar(h, w)),
            _ => transposed_conv_nd(&xv, &wv, bias.as_deref(), n, c, group, mg, &axes),
        };
        Ok(vec![from_f32(x.dtype(), &shape, out)?])
    })
}

/// A transposed convolution's geometry along one spatial axis: input position `i` reaches
/// output position `i * stride + k * dilation - pad_begin` through kernel tap `k`; taps
/// that land outside `[0, output)` are dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TransposedAxis {
    input: usize,
    kernel: usize,
    stride: usize,
    dilation: usize,
    pad_begin: usize,
    output: usize,
}

impl TransposedAxis {
    /// An axis of size 1 with a 1-tap window: the height a 1-D input gets on the 2-D path.
    const UNIT: TransposedAxis = TransposedAxis { input: 1, kernel: 1, stride: 1, dilation: 1, pad_begin: 0, output: 1 };
}

/// The geometry of each spatial axis of a transposed convolution with input sizes `spatial`
/// and kernel sizes `kernel`. The full output along an axis is `stride * (input - 1) +
/// output_padding + (kernel - 1) * dilation + 1`. With `output_shape` (the spatial sizes,
/// optionally after N and C) the padding is that full size minus the requested one, split
/// as `auto_pad` says (the larger half at the end for SAME_UPPER, else at the start); else
/// SAME_UPPER/SAME_LOWER pad it to `input * stride`, VALID does not pad, and NOTSET takes
/// `pads`. Errors name the attribute or axis that does not fit.
fn transposed_axes(window: &Window, output_padding: Option<&[usize]>, output_shape: Option<&[usize]>, spatial: &[usize], kernel: &[usize]) -> RuntimeResult<Vec<TransposedAxis>> {
    let r = spatial.len();
    for (name, len, want) in [
        ("kernel_shape", window.kernel.as_ref().map(Vec::len), r),
        ("strides", window.strides.as_ref().map(Vec::len), r),
        ("dilations", window.dilations.as_ref().map(Vec::len), r),
        ("pads", window.pads.as_ref().map(Vec::len), 2 * r),
        ("output_padding", output_padding.map(<[usize]>::len), r),
    ] {
        if len.is_some_and(|l| l != want) {
            return Err(kernel_error(format!("'{name}' has {} values; {r} spatial axes need {want}", len.unwrap_or(0))));
        }
    }
    if let Some(k) = window.kernel.as_ref().filter(|k| k[..] != *kernel) {
        return Err(kernel_error(format!("kernel_shape {k:?} differs from the weight's spatial sizes {kernel:?}")));
    }
    let requested = match output_shape {
        Some(os) if os.len() == r => Some(os),
        Some(os) if os.len() == r + 2 => Some(&os[2..]),
        Some(os) => return Err(kernel_error(format!("output_shape {os:?} does not give the {r} spatial output sizes"))),
        None => None,
    };
    let get = |v: Option<&[usize]>, i: usize, d: usize| v.map_or(d, |v| v[i]);
    (0..r).map(|i| {
        let (inp, k) = (spatial[i], kernel[i]);
        let (s, d) = (get(window.strides.as_deref(), i, 1), get(window.dilations.as_deref(), i, 1));
        if inp == 0 || k == 0 || s == 0 || d == 0 {
            return Err(kernel_error(format!("spatial axis {i} has input size {inp}, kernel size {k}, stride {s} and dilation {d}; each must be at least 1")));
        }
        let overflow = || kernel_error(format!("the output size on spatial axis {i} overflows"));
        let full = s.checked_mul(inp - 1).and_then(|v| v.checked_add(get(output_padding, i, 0)))
            .and_then(|v| (k - 1).checked_mul(d).and_then(|span| v.checked_add(span + 1))).ok_or_else(overflow)?;
        let split = |total: usize| if window.auto_pad == "SAME_UPPER" { (total / 2, total - total / 2) } else { (total - total / 2, total / 2) };
        let (pad_begin, output) = if let Some(os) = requested {
            (split(full.saturating_sub(os[i])).0, os[i])
        } else {
            let (pb, pe) = match window.auto_pad.as_str() {
                "SAME_UPPER" | "SAME_LOWER" => split(full.saturating_sub(inp.checked_mul(s).ok_or_else(overflow)?)),
                "VALID" => (0, 0),
                "NOTSET" => (get(window.pads.as_deref(), i, 0), get(window.pads.as_deref(), i + r, 0)),
                other => return Err(kernel_error(format!("auto_pad '{other}' is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID"))),
            };
            let out = pb.checked_add(pe).and_then(|p| full.checked_sub(p))
                .ok_or_else(|| kernel_error(format!("pads {pb} + {pe} exceed the full output size {full} on spatial axis {i}")))?;
            (pb, out)
        };
        Ok(TransposedAxis { input: inp, kernel: k, stride: s, dilation: d, pad_begin, output })
    }).collect()
}

/// A transposed convolution over any number of spatial `axes` (input `[n, c, ...]`, weight
/// `[c, mg, K...]` in `group` groups, output `[n, group * mg, ...]`), its output starting at
/// `bias` (or zero). Per image and group, blocks of output channels run in parallel (their
/// output planes are disjoint); each block takes the input in blocks of lines (runs along
/// the last axis) small enough for the product `cols = w_gᵀ · x_g` to stay in cache, and
/// adds each row of `cols` (one output channel and kernel tap) into the output lines its
/// input lines reach.
#[allow(clippy::too_many_arguments)]
fn transposed_conv_nd(x: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, group: usize, mg: usize, axes: &[TransposedAxis]) -> Vec<f32> {
    let (last, lead) = axes.split_last().expect("at least one spatial axis");
    let (m, cg) = (mg * group, c / group);
    let taps: usize = axes.iter().map(|a| a.kernel).product();
    let image: usize = axes.iter().map(|a| a.input).product();
    let plane: usize = axes.iter().map(|a| a.output).product();
    let mut out = vec![0f32; n * m * plane];
    if let Some(b) = bias {
        for (p, dst) in out.chunks_mut(plane.max(1)).enumerate() {
            dst.fill(b[p % m]);
        }
    }
    if image == 0 || taps == 0 || cg == 0 || plane == 0 || mg == 0 {
        return out;
    }
    let (iw, ow) = (last.input, last.output);
    let lines = image / iw;
    let kdim = mg * taps;
    let oc_step = mg.div_ceil(threads().max(1));
    let lines_per_block = (TRANSPOSED_BLOCK_BYTES / 4 / (oc_step * taps * iw)).clamp(1, lines);
    let parallel_gemm = oc_step == mg;
    for b in 0..n {
        for g in 0..group {
            let src = &x[(b * c + g * cg) * image..(b * c + (g + 1) * cg) * image];
            let wg = &w[g * cg * kdim..(g + 1) * cg * kdim];
            let dst = &mut out[(b * m + g * mg) * plane..(b * m + (g + 1) * mg) * plane];
            par_chunks_mut(dst, oc_step * plane, min_items(oc_step * taps * image * cg), Vec::new, |cols: &mut Vec<f32>, blk, planes| {
                let (oc0, count) = (blk * oc_step, planes.len() / plane);
                for l0 in (0..lines).step_by(lines_per_block) {
                    let block = l0..(l0 + lines_per_block).min(lines);
                    let width = block.len() * iw;
                    cols.resize(count * taps * width, 0.0);
                    // SAFETY: `cols` holds the `count * taps` rows of `width` values written
                    // here and is borrowed by nothing else; the weight rows of this block's
                    // channels and the input lines lie inside `wg` and `src`.
                    unsafe { sgemm_into(count * taps, width, cg, MatRef::transposed(&wg[oc0 * taps..], kdim), MatRef { data: &src[l0 * iw..], rs: image, cs: 1 }, cols.as_mut_ptr(), width, false, parallel_gemm) };
                    for (oc, out_plane) in planes.chunks_mut(plane).enumerate() {
                        for tap in 0..taps {
                            let row = &cols[(oc * taps + tap) * width..(oc * taps + tap + 1) * width];
                            let (lead_tap, kj) = (tap / last.kernel, tap % last.kernel);
                            let offset = (kj * last.dilation) as isize - last.pad_begin as isize;
                            for (t, line) in block.clone().enumerate() {
                                if let Some(o) = output_line(lead, line, lead_tap) {
                                    add_strided(&mut out_plane[o * ow..(o + 1) * ow], &row[t * iw..(t + 1) * iw], offset, last.stride);
                                }
                            }
                        }
                    }
                }
            });
        }
    }
    out
}

/// The output line (index of a run along the last spatial axis, row-major over the `lead`
/// axes' output positions) that input line `line` (row-major over the `lead` axes' input
/// positions) reaches through kernel tap `tap` (row-major over the `lead` axes' kernel) of a
/// transposed convolution, or `None` when that lands outside the output.
fn output_line(lead: &[TransposedAxis], mut line: usize, mut tap: usize) -> Option<usize> {
    let (mut at, mut stride) = (0, 1);
    for a in lead.iter().rev() {
        let (i, k) = (line % a.input, tap % a.kernel);
        (line, tap) = (line / a.input, tap / a.kernel);
        let o = (i * a.stride + k * a.dilation).checked_sub(a.pad_begin).filter(|&o| o < a.output)?;
        at += o * stride;
        stride *= a.output;
    }
    Some(at)
}

/// The geometry of a 2-D transposed convolution, NCHW: input `[n, c, ih, iw]`, weight
/// `[c, mg, kh, kw]` in `group` groups, output `[n, group * mg, oh, ow]`. Input pixel
/// `(y, x)` reaches output pixel `(y * sh + ki * dh - ph, x * sw + kj * dw - pw)` through
/// kernel tap `(ki, kj)`; taps that land outside the output are dropped.
struct TransposedConv {
    n: usize,
    c: usize,
    ih: usize,
    iw: usize,
    group: usize,
    mg: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    dh: usize,
    dw: usize,
    ph: usize,
    pw: usize,
    oh: usize,
    ow: usize,
}

/// Column-buffer bytes a block of input rows aims for, so that the block's product stays in
/// cache until it is added into the output.
const TRANSPOSED_BLOCK_BYTES: usize = 128 << 10;

/// A 2-D transposed convolution (`geo`), its output starting at `bias` (or zero).
///
/// The input is cut into blocks of rows. For each block and group, the product
/// `cols[mg*kh*kw x rows*iw] = w_gᵀ · x_g[cg x rows*iw]` is computed into a cache-sized
/// buffer and each of its rows (one output channel and kernel tap) is added into the output
/// row it lands on. Blocks run in parallel in waves whose output rows are disjoint: every
/// block at once when the kernel's vertical span fits in the stride, else the even blocks,
/// then the odd ones (a block has at least `span / sh` rows, so blocks two apart never touch
/// the same output row).
fn transposed_conv_2d(x: &[f32], w: &[f32], bias: Option<&[f32]>, geo: &TransposedConv) -> Vec<f32> {
    let &TransposedConv { n, c, ih, iw, group, mg, kh, kw, sh, dh, oh, ow, .. } = geo;
    let m = mg * group;
    let kdim = mg * kh * kw;
    let mut out = uninit::<f32>(n * m * oh * ow);
    let span = (kh - 1) * dh + 1;
    let nonempty = ih > 0 && iw > 0 && kdim > 0 && c > 0;
    let tiles = nonempty && kh == sh && kw == geo.sw && dh == 1 && geo.dw == 1 && geo.ph == 0 && geo.pw == 0 && oh == ih * sh && ow == iw * geo.sw;
    let owned_rows = nonempty && span <= sh && !tiles;
    if !owned_rows && !tiles {
        for (plane, dst) in out.chunks_mut((oh * ow).max(1)).enumerate() {
            dst.fill(MaybeUninit::new(bias.map_or(0.0, |b| b[plane % m])));
        }
        if ih == 0 || iw == 0 || kdim == 0 || c == 0 {
            // SAFETY: every element was just set.
            return unsafe { assume_init(out) };
        }
    }
    let min_rows = span.div_ceil(sh);
    let rows = (TRANSPOSED_BLOCK_BYTES / 4 / (kdim * iw)).clamp(min_rows, ih.max(min_rows)).min(ih);
    let blocks = ih.div_ceil(rows);
    let waves: &[(usize, usize)] = if span <= sh || blocks == 1 { &[(0, 1)] } else { &[(0, 2), (1, 2)] };
    let dst = OutPtr::new(&mut out);
    let block_work = kdim * rows * iw * (c / group);
    for &(first, step) in waves {
        let items: Vec<(usize, usize, usize)> =
            (0..n).flat_map(|b| (0..group).flat_map(move |g| (first..blocks).step_by(step).map(move |blk| (b, g, blk)))).collect();
        par_steps(items.len(), 1, min_items(block_work), || uninit::<f32>(kdim * rows * iw), |cols, i| {
            let (b, g, blk) = items[i];
            let (y0, y1) = (blk * rows, (blk * rows + rows).min(ih));
            if owned_rows {
                let lo = if y0 == 0 { 0 } else { (y0 * sh).saturating_sub(geo.ph).min(oh) };
                let hi = if y1 == ih { oh } else { (y1 * sh).saturating_sub(geo.ph).min(oh) };
                fill_rows(dst, bias, geo, b, g, lo..hi);
            }
            // SAFETY: blocks of one wave add into disjoint output rows (see above), and
            // those rows are initialized: before the waves, or just above by the block
            // that alone reaches them.
            unsafe { transposed_conv_block(x, w, geo, b, g, y0, y1, cols, dst, tiles.then_some(bias)) };
        });
    }
    // SAFETY: every element was initialized before the waves, which only add to them.
    unsafe { assume_init(out) }
}

/// Sets output rows `rows` of every channel of batch `b`, group `g` to the channel's bias (or
/// zero). The caller's block of input rows is the only one that reaches them.
fn fill_rows(dst: OutPtr, bias: Option<&[f32]>, geo: &TransposedConv, b: usize, g: usize, rows: std::ops::Range<usize>) {
    let (m, plane_len) = (geo.mg * geo.group, geo.oh * geo.ow);
    for oc in g * geo.mg..(g + 1) * geo.mg {
        let start = (b * m + oc) * plane_len + rows.start * geo.ow;
        let len = rows.len() * geo.ow;
        assert!(start + len <= dst.len, "rows past the output");
        // SAFETY: in bounds (asserted); the rows belong to the caller's block alone.
        let region = unsafe { std::slice::from_raw_parts_mut(dst.at(start).cast::<MaybeUninit<f32>>(), len) };
        region.fill(MaybeUninit::new(bias.map_or(0.0, |bv| bv[oc])));
    }
}

/// Adds the contribution of input rows `y0..y1` of batch `b`, group `g` into the output at
/// `dst`, using `cols` (at least `mg*kh*kw * (y1-y0) * iw` values) as scratch. With
/// `write_from: Some(bias)` the kernel tiles the output (every output pixel has exactly one
/// tap, see [`transposed_conv_2d`]) and the rows are written as the bias (or zero) plus that
/// tap instead of added to.
///
/// # Safety
/// `dst` is the output of `geo`, initialized unless `write_from` is given, and no other thread
/// reads or writes the output rows these input rows reach during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn transposed_conv_block(x: &[f32], w: &[f32], geo: &TransposedConv, b: usize, g: usize, y0: usize, y1: usize, cols: &mut [MaybeUninit<f32>], dst: OutPtr, write_from: Option<Option<&[f32]>>) {
    let &TransposedConv { c, ih, iw, group, mg, kh, kw, sh, sw, dh, dw, ph, pw, oh, ow, .. } = geo;
    let (cg, m) = (c / group, mg * group);
    let kdim = mg * kh * kw;
    let width = (y1 - y0) * iw;
    let src = &x[(b * c + g * cg) * ih * iw + y0 * iw..];
    let wg = &w[g * cg * kdim..(g + 1) * cg * kdim];
    // SAFETY: `cols` holds the `kdim` rows of `width` values written here and is borrowed by
    // nothing else; the input rows of stride `ih * iw` hold `width` values from `src`.
    unsafe { sgemm_into(kdim, width, cg, MatRef::transposed(wg, kdim), MatRef { data: src, rs: ih * iw, cs: 1 }, cols.as_mut_ptr().cast::<f32>(), width, false, false) };
    // SAFETY: the product just wrote the first `kdim * width` values.
    let cols: &[f32] = unsafe { assume_init_mut(&mut cols[..kdim * width]) };
    let dense_taps = dw == 1 && kw == sw && pw == 0 && ow == iw * sw;
    for oc in 0..mg {
        let plane = (b * m + g * mg + oc) * oh * ow;
        for ki in 0..kh {
            let taps = &cols[(oc * kh + ki) * kw * width..(oc * kh + ki + 1) * kw * width];
            for y in y0..y1 {
                let oy = (y * sh + ki * dh) as isize - ph as isize;
                if oy < 0 || oy >= oh as isize {
                    continue;
                }
                let at = (y - y0) * iw;
                if let Some(bias) = write_from {
                    let start = plane + oy as usize * ow;
                    assert!(start + ow <= dst.len, "row past the output");
                    // SAFETY: in bounds (asserted) and exclusive to this call (the caller's
                    // guarantee); written here, never read.
                    let out_row = unsafe { std::slice::from_raw_parts_mut(dst.at(start).cast::<MaybeUninit<f32>>(), ow) };
                    write_interleaved(out_row, taps, width, at, iw, kw, bias.map_or(0.0, |bv| bv[g * mg + oc]));
                    continue;
                }
                // SAFETY: the output row is initialized and exclusive to this call (the
                // caller's guarantee).
                let out_row = unsafe { dst.region(plane + oy as usize * ow, ow) };
                if dense_taps {
                    add_interleaved(out_row, taps, width, at, iw, kw);
                } else {
                    for kj in 0..kw {
                        add_strided(out_row, &taps[kj * width + at..kj * width + at + iw], (kj * dw) as isize - pw as isize, sw);
                    }
                }
            }
        }
    }
}

/// `out[x * kw + kj] += taps[kj * width + at + x]` for every kernel column `kj < kw` and input
/// column `x`: the taps of a kernel as wide as its stride tile the output row exactly.
fn add_interleaved(out: &mut [f32], taps: &[f32], width: usize, at: usize, iw: usize, kw: usize) {
    if kw == 2 {
        let (t0, t1) = (&taps[at..at + iw], &taps[width + at..width + at + iw]);
        for ((o, &a), &b) in out.chunks_exact_mut(2).zip(t0).zip(t1) {
            o[0] += a;
            o[1] += b;
        }
    } else {
        for (x, o) in out.chunks_exact_mut(kw).enumerate() {
            for (kj, v) in o.iter_mut().enumerate() {
                *v += taps[kj * width + at + x];
            }
        }
    }
}

/// `out[x * kw + kj] = bias + taps[kj * width + at + x]`: [`add_interleaved`] into a row that
/// no other tap reaches.
fn write_interleaved(out: &mut [MaybeUninit<f32>], taps: &[f32], width: usize, at: usize, iw: usize, kw: usize, bias: f32) {
    if kw == 2 {
        let (t0, t1) = (&taps[at..at + iw], &taps[width + at..width + at + iw]);
        for ((o, &a), &b) in out.chunks_exact_mut(2).zip(t0).zip(t1) {
            o[0] = MaybeUninit::new(bias + a);
            o[1] = MaybeUninit::new(bias + b);
        }
    } else {
        for (x, o) in out.chunks_exact_mut(kw).enumerate() {
            for (kj, v) in o.iter_mut().enumerate() {
                *v = MaybeUninit::new(bias + taps[kj * width + at + x]);
            }
        }
    }
}

/// `out[x * stride + offset] += row[x]` for the input columns `x` whose output column lies in
/// `out`.
fn add_strided(out: &mut [f32], row: &[f32], offset: isize, stride: usize) {
    let ow = out.len() as isize;
    let lo = if offset >= 0 { 0 } else { ((-offset) as usize).div_ceil(stride) };
    let hi = if offset >= ow { 0 } else { ((ow - offset - 1) as usize / stride + 1).min(row.len()) };
    if lo >= hi {
        return;
    }
    let start = (lo as isize * stride as isize + offset) as usize;
    if stride == 1 {
        for (o, v) in out[start..start + hi - lo].iter_mut().zip(&row[lo..hi]) {
            *o += v;
        }
    } else {
        for (o, v) in out[start..].iter_mut().step_by(stride).zip(&row[lo..hi]) {
            *o += v;
        }
    }
}

/// A positive size of a shape-like input (`image_shape`, `block_shape`); the error names it.
fn positive_sizes(t: &Tensor, what: &str) -> RuntimeResult<Vec<usize>> {
    super::util::ints(t, what)?.iter().map(|&v| usize::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| kernel_error(format!("{what} holds {v}; sizes must be positive")))).collect()
}

/// For each kernel tap (row-major over `axes`' kernel sizes) and each window position
/// (row-major over their outputs), the flat index in the image (row-major over their
/// inputs) that the tap reads at that position, or `None` where it falls in the padding.
fn tap_positions(axes: &[Axis]) -> Vec<Option<usize>> {
    let taps: usize = axes.iter().map(|a| a.kernel).product();
    let blocks: usize = axes.iter().map(|a| a.output).product();
    let mut map = Vec::with_capacity(taps * blocks);
    for tap in 0..taps {
        for block in 0..blocks {
            let (mut t, mut b, mut at) = (tap, block, Some(0usize));
            let mut stride = 1;
            for a in axes.iter().rev() {
                let (k, o) = (t % a.kernel, b % a.output);
                t /= a.kernel;
                b /= a.output;
                let c = (o * a.stride + k * a.dilation) as isize - a.pad_begin as isize;
                at = at.filter(|_| c >= 0 && (c as usize) < a.input).map(|v| v + c as usize * stride);
                stride *= a.input;
            }
            map.push(at);
        }
    }
    map
}

/// Plans a Col2Im node (opset 18): input `[N, C * prod(block_shape), L]`, int64
/// `image_shape` and `block_shape` (one positive size per spatial axis), attributes
/// `dilations`, `pads` (begin values then end values) and `strides` (defaults 1, 0, 1). `L`
/// must be the number of block positions the sliding window has in the padded image. Output
/// `[N, C, image_shape...]`: each column value is added to the image element its kernel tap
/// and block position cover (values in the padding are dropped).
fn col2im(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let window = Window::from_node(info)?;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let image = positive_sizes(input(ins, 1)?, "Col2Im image_shape")?;
        let block = positive_sizes(input(ins, 2)?, "Col2Im block_shape")?;
        if image.len() != block.len() || image.is_empty() {
            return Err(kernel_error(format!("Col2Im: image_shape {image:?} and block_shape {block:?} must have one size per spatial axis (at least one)")));
        }
        let axes = window.axes(&image, &block).map_err(|e| kernel_error(format!("Col2Im: {e}")))?;
        let taps = block.iter().try_fold(1usize, |p, &k| p.checked_mul(k)).ok_or_else(|| kernel_error(format!("Col2Im: block_shape {block:?} is too large")))?;
        let blocks: usize = axes.iter().map(|a| a.output).product();
        let s = x.shape();
        if s.len() != 3 || s[1] % taps != 0 || s[2] != blocks {
            return Err(kernel_error(format!("Col2Im: input shape {s:?} must be [N, C * {taps}, {blocks}] for image_shape {image:?} and block_shape {block:?}")));
        }
        let (n, c) = (s[0], s[1] / taps);
        let mut out_shape = vec![n, c];
        out_shape.extend(&image);
        check_output_size("Col2Im output", x.dtype(), &out_shape)?;
        check_output_size("Col2Im tap map", DType::I64, &[taps, blocks])?;
        let plane: usize = image.iter().product();
        let map = tap_positions(&axes);
        let xv = to_f32(x)?;
        let mut out = vec![0f32; n * c * plane];
        par_chunks_mut(&mut out, plane, min_items(taps * blocks * ELEMENT_WORK), || (), |_, p, dst| {
            let src = &xv[p * taps * blocks..(p + 1) * taps * blocks];
            for (v, at) in src.iter().zip(&map) {
                if let Some(at) = *at {
                    dst[at] += v;
                }
            }
        });
        Ok(vec![from_f32(x.dtype(), &out_shape, out)?])
    })
}

/// The value of the `h x w` image `img` at the fractional position `(y, x)`, interpolated
/// bilinearly from its four neighbours; neighbours outside the image count as zero.
fn bilinear_zero_padded(img: &[f32], h: usize, w: usize, y: f32, x: f32) -> f32 {
    if !(y > -1.0 && x > -1.0 && y < h as f32 && x < w as f32) {
        return 0.0;
    }
    let (y0, x0) = (y.floor(), x.floor());
    let (fy, fx) = (y - y0, x - x0);
    let (y0, x0) = (y0 as isize, x0 as isize);
    let at = |r: isize, c: isize| if r >= 0 && c >= 0 && (r as usize) < h && (c as usize) < w { img[r as usize * w + c as usize] } else { 0.0 };
    (1.0 - fy) * ((1.0 - fx) * at(y0, x0) + fx * at(y0, x0 + 1)) + fy * ((1.0 - fx) * at(y0 + 1, x0) + fx * at(y0 + 1, x0 + 1))
}

/// Plans a DeformConv node (opsets 19, 22), 2-D: X `[N, C, H, W]`, W `[M, C / group, kH,
/// kW]`, offset `[N, offset_group * 2 * kH * kW, oH, oW]` (per offset group and kernel tap,
/// the row then column shift), optional B `[M]` and mask `[N, offset_group * kH * kW, oH,
/// oW]`; attributes `dilations`, `group`, `kernel_shape` (default: W's), `offset_group`,
/// `pads`, `strides`. Output `[N, M, oH, oW]`, where `oH, oW` follow from the window geometry
/// and must match offset's. Each kernel tap reads its input channel bilinearly (zero outside
/// the image) at the tap's regular position plus the shift of the channel's offset group,
/// scaled by the mask; per image and group the sampled columns multiply the weights in one
/// GEMM.
fn deform_conv(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let window = Window::from_node(info)?;
    let group = info.attr_int("group", 1);
    let offset_group = info.attr_int("offset_group", 1);
    if group < 1 || offset_group < 1 {
        return Err(info.error(format!("group {group} and offset_group {offset_group} must be positive")));
    }
    let (group, offset_group) = (group as usize, offset_group as usize);
    kernel(move |ins| {
        let (x, w, offset) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let (xs, ws, os) = (x.shape(), w.shape(), offset.shape());
        if xs.len() != 4 || ws.len() != 4 || os.len() != 4 {
            return Err(kernel_error(format!("DeformConv: X {xs:?}, W {ws:?} and offset {os:?} must all be 4-D (only 2-D DeformConv is supported)")));
        }
        let (n, c, ih, iw) = (xs[0], xs[1], xs[2], xs[3]);
        let m = ws[0];
        if ws[1] * group != c || m % group != 0 || c % offset_group != 0 {
            return Err(kernel_error(format!("DeformConv: X {xs:?} and W {ws:?} do not fit group {group} and offset_group {offset_group}")));
        }
        let kernel_shape = window.kernel.clone().unwrap_or_else(|| ws[2..].to_vec());
        if kernel_shape != ws[2..] {
            return Err(kernel_error(format!("DeformConv: kernel_shape {kernel_shape:?} differs from W's kernel {:?}", &ws[2..])));
        }
        let axes = window.axes(&xs[2..], &kernel_shape).map_err(|e| kernel_error(format!("DeformConv: {e}")))?;
        let (ha, wa) = (axes[0], axes[1]);
        let (oh, ow) = (ha.output, wa.output);
        let taps = ha.kernel * wa.kernel;
        let sites = oh * ow;
        if os != [n, offset_group * 2 * taps, oh, ow] {
            return Err(kernel_error(format!("DeformConv: offset has shape {os:?}; expected {:?}", [n, offset_group * 2 * taps, oh, ow])));
        }
        let mask = match opt_input(ins, 4) {
            Some(t) if t.shape() != [n, offset_group * taps, oh, ow] => return Err(kernel_error(format!("DeformConv: mask has shape {:?}; expected {:?}", t.shape(), [n, offset_group * taps, oh, ow]))),
            Some(t) => Some(to_f32(t)?),
            None => None,
        };
        let bias = match opt_input(ins, 3) {
            Some(t) if t.shape() != [m] => return Err(kernel_error(format!("DeformConv: B has shape {:?}; expected [{m}]", t.shape()))),
            Some(t) => Some(to_f32(t)?),
            None => None,
        };
        let out_shape = [n, m, oh, ow];
        check_output_size("DeformConv output", x.dtype(), &out_shape)?;
        check_output_size("DeformConv columns", DType::F32, &[c * taps, sites])?;
        let (xv, wv, ov) = (to_f32(x)?, to_f32(w)?, to_f32(offset)?);
        let (cg, mg, channels_per_offset_group) = (c / group, m / group, c / offset_group);
        let mut out = vec![0f32; n * m * sites];
        let mut columns = vec![0f32; c * taps * sites];
        for b in 0..n {
            par_chunks_mut(&mut columns, taps * sites, min_items(taps * sites * ELEMENT_WORK), || (), |_, ch, col| {
                let og = ch / channels_per_offset_group;
                let img = &xv[(b * c + ch) * ih * iw..(b * c + ch + 1) * ih * iw];
                let shifts = &ov[(b * offset_group + og) * 2 * taps * sites..(b * offset_group + og + 1) * 2 * taps * sites];
                for tap in 0..taps {
                    let (ky, kx) = (tap / wa.kernel, tap % wa.kernel);
                    let row = &mut col[tap * sites..(tap + 1) * sites];
                    for (site, v) in row.iter_mut().enumerate() {
                        let (oy, ox) = (site / ow, site % ow);
                        let y = (oy * ha.stride + ky * ha.dilation) as f32 - ha.pad_begin as f32 + shifts[2 * tap * sites + site];
                        let xpos = (ox * wa.stride + kx * wa.dilation) as f32 - wa.pad_begin as f32 + shifts[(2 * tap + 1) * sites + site];
                        let scale = mask.as_ref().map_or(1.0, |mv| mv[((b * offset_group + og) * taps + tap) * sites + site]);
                        *v = scale * bilinear_zero_padded(img, ih, iw, y, xpos);
                    }
                }
            });
            for g in 0..group {
                let dst = &mut out[(b * m + g * mg) * sites..(b * m + (g + 1) * mg) * sites];
                if let Some(bv) = &bias {
                    for (o, plane) in dst.chunks_mut(sites.max(1)).enumerate() {
                        plane.fill(bv[g * mg + o]);
                    }
                }
                if mg > 0 && sites > 0 && cg * taps > 0 {
                    let wg = &wv[g * mg * cg * taps..(g + 1) * mg * cg * taps];
                    let colg = &columns[g * cg * taps * sites..(g + 1) * cg * taps * sites];
                    // SAFETY: `dst` holds `mg * sites` elements, the `mg x sites` product with row stride `sites`.
                    unsafe { sgemm_into(mg, sites, cg * taps, MatRef::rows(wg, cg * taps), MatRef::rows(colg, sites), dst.as_mut_ptr(), sites, true, true) };
                }
            }
        }
        Ok(vec![from_f32(x.dtype(), &out_shape, out)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::fused::{Binary, Inst, Operand, Param, ParamShape, Unary};

    /// A direct, unoptimized NCHW convolution with explicit pads.
    #[allow(clippy::too_many_arguments)]
    fn naive(x: &[f32], xs: [usize; 4], w: &[f32], ws: [usize; 4], b: &[f32], stride: [usize; 2], dil: [usize; 2], pads: [usize; 4], group: usize) -> (Vec<f32>, [usize; 4]) {
        let [n, c, ih, iw] = xs;
        let [m, cg, kh, kw] = ws;
        let oh = (ih + pads[0] + pads[2] - (kh - 1) * dil[0] - 1) / stride[0] + 1;
        let ow = (iw + pads[1] + pads[3] - (kw - 1) * dil[1] - 1) / stride[1] + 1;
        let mg = m / group;
        let mut out = vec![0f32; n * m * oh * ow];
        for b0 in 0..n {
            for o in 0..m {
                let g = o / mg;
                for y in 0..oh {
                    for xx in 0..ow {
                        let mut acc = b[o] as f64;
                        for ci in 0..cg {
                            for ki in 0..kh {
                                for kj in 0..kw {
                                    let iy = (y * stride[0] + ki * dil[0]) as isize - pads[0] as isize;
                                    let ix = (xx * stride[1] + kj * dil[1]) as isize - pads[1] as isize;
                                    if iy >= 0 && ix >= 0 && (iy as usize) < ih && (ix as usize) < iw {
                                        let xi = ((b0 * c + g * cg + ci) * ih + iy as usize) * iw + ix as usize;
                                        acc += x[xi] as f64 * w[((o * cg + ci) * kh + ki) * kw + kj] as f64;
                                    }
                                }
                            }
                        }
                        out[((b0 * m + o) * oh + y) * ow + xx] = acc as f32;
                    }
                }
            }
        }
        (out, [n, m, oh, ow])
    }

    /// Input shape, weight shape, strides, dilations, pads and group of one test case.
    type Case = ([usize; 4], [usize; 4], [usize; 2], [usize; 2], [usize; 4], usize);

    #[test]
    fn every_path_matches_the_naive_convolution() {
        // Depthwise, dense 3x3 and 5x5, pointwise, strided, dilated, grouped, asymmetric
        // padding, odd widths, outputs narrower than a vector.
        let cases: &[Case] = &[
            ([1, 4, 9, 13], [4, 1, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 4),
            ([2, 6, 11, 7], [6, 1, 5, 5], [2, 2], [1, 1], [2, 2, 2, 2], 6),
            ([1, 3, 10, 17], [3, 1, 3, 3], [1, 2], [2, 1], [1, 0, 2, 1], 3),
            ([1, 3, 15, 21], [10, 3, 3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 1),
            ([2, 5, 8, 40], [17, 5, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([1, 4, 6, 6], [8, 2, 3, 2], [1, 3], [2, 1], [0, 1, 2, 0], 2),
            ([1, 8, 5, 37], [12, 8, 1, 1], [1, 1], [1, 1], [0, 0, 0, 0], 1),
            ([1, 6, 4, 3], [6, 6, 1, 1], [2, 1], [1, 1], [0, 0, 0, 0], 1),
            ([1, 5, 40, 70], [7, 5, 3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 1),
            ([1, 3, 30, 37], [6, 3, 3, 3], [1, 1], [2, 2], [2, 2, 2, 2], 1),
            // Strided depthwise rows wider than two 16-pair shuffles, odd and even padding.
            ([1, 3, 9, 75], [3, 1, 3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 3),
            ([1, 2, 6, 66], [2, 1, 3, 3], [2, 2], [1, 1], [0, 0, 1, 1], 2),
            // Strided depthwise rows of fewer than sixteen pairs (masked shuffles only).
            ([1, 16, 10, 28], [16, 1, 3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 16),
            ([1, 5, 7, 9], [5, 1, 5, 5], [2, 2], [1, 1], [2, 2, 2, 2], 5),
            // Depthwise over many small planes (a padded buffer reused across channels,
            // split across threads), stride 1 with rows wider than a vector, asymmetric pads.
            ([1, 128, 14, 14], [128, 1, 5, 5], [1, 1], [1, 1], [2, 2, 2, 2], 128),
            ([1, 24, 19, 37], [24, 1, 3, 3], [1, 1], [1, 1], [0, 2, 1, 0], 24),
            ([1, 32, 15, 15], [32, 1, 3, 3], [2, 2], [1, 1], [0, 1, 1, 0], 32),
            // Depthwise rows no wider than one AVX2 register over a row count that is not a
            // multiple of the rows per step; dilated rows with a partial last register;
            // strided rows of whole and partial 8-pair blocks.
            ([1, 10, 11, 5], [10, 1, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 10),
            ([1, 9, 13, 23], [9, 1, 3, 3], [1, 1], [2, 2], [2, 2, 2, 2], 9),
            ([1, 7, 9, 41], [7, 1, 3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 7),
            // A grouped dense conv wide enough for the direct kernel, two images.
            ([2, 6, 10, 40], [12, 3, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 2),
            // Pointwise over few positions (split by output channel) and over many.
            ([1, 64, 12, 12], [96, 64, 1, 1], [1, 1], [1, 1], [0, 0, 0, 0], 1),
            ([1, 40, 7, 7], [72, 40, 1, 1], [1, 1], [1, 1], [0, 0, 0, 0], 1),
            ([1, 48, 33, 35], [40, 48, 1, 1], [1, 1], [1, 1], [0, 0, 0, 0], 1),
        ];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| check_cases(cases));
        }
    }

    /// The dense kernels this CPU can run: always [`Dense::Tiled`], and those
    /// [`dense_kernel`] may choose here.
    fn dense_kernels() -> Vec<Dense> {
        let mut kernels = vec![Dense::Tiled];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") || (has!("avx2") && has!("fma")) {
                kernels.push(Dense::Columns);
            }
            if has!("avx512f") && has!("avx512vl") {
                kernels.push(Dense::Channels);
            }
        }
        kernels
    }

    /// A dense (group 1) 2-D convolution of every image of `x` by `kernel`, with `bias` and
    /// an optional bound epilogue, as [`conv_2d`] runs it.
    #[allow(clippy::too_many_arguments)]
    fn run_dense(kernel: Dense, x: &[f32], xs: [usize; 4], w: &[f32], ws: [usize; 4], bias: &[f32], h: Axis, wa: Axis, epilogue: Option<&Bound>) -> Vec<f32> {
        let ([n, c, ih, iw], m) = (xs, ws[0]);
        let plane = h.output * wa.output;
        let fin = Finish { bias: Some(bias), channels: m, plane, epilogue };
        let mut out = uninit::<f32>(n * m * plane);
        for (b, dst) in out.chunks_mut(m * plane).enumerate() {
            let src = &x[b * c * ih * iw..(b + 1) * c * ih * iw];
            match kernel {
                Dense::Tiled => conv_tiled(src, c, &[h, wa], w, m, dst, b * m * plane, fin),
                k => conv_direct(src, c, h, wa, w, m, dst, b * m * plane, fin, k),
            }
        }
        // SAFETY: each kernel writes every element of each image's output planes.
        unsafe { assume_init(out) }
    }

    #[test]
    fn every_dense_kernel_matches_the_naive_convolution_with_bias_and_epilogue() {
        // Output channels in whole, partial and half blocks of 16 (24, 20, 40, 17, 9, 60);
        // widths in whole and partial 16-column chunks, narrower than one, and one row;
        // stride 2, dilation 2, mixed strides and dilations, asymmetric pads, one input
        // channel, a 5x5 and a 1x3 kernel, two images.
        let cases: &[Case] = &[
            ([1, 7, 9, 37], [24, 7, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([2, 5, 12, 45], [20, 5, 3, 3], [2, 2], [1, 1], [1, 0, 0, 1], 1),
            ([1, 6, 14, 30], [40, 6, 3, 3], [1, 1], [2, 2], [2, 2, 2, 2], 1),
            ([1, 1, 10, 19], [16, 1, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([1, 4, 5, 7], [17, 4, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([1, 3, 20, 50], [33, 3, 5, 5], [2, 1], [1, 2], [2, 4, 1, 3], 1),
            ([1, 8, 6, 16], [32, 8, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([2, 3, 5, 4], [9, 3, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([1, 12, 3, 70], [12, 12, 1, 3], [1, 1], [1, 1], [0, 1, 0, 1], 1),
            ([1, 16, 1, 40], [60, 16, 1, 3], [1, 1], [1, 1], [0, 1, 0, 1], 1),
            ([1, 2, 33, 161], [8, 2, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
        ];
        // The epilogue: (conv + residual).clip(-2, 3) * scale[channel].
        let program = Program {
            inputs: 2,
            insts: vec![Inst::Binary(Binary::Add, Operand::Input(0), Operand::Input(1)), Inst::Unary(Unary::Clip { lo: -2.0, hi: 3.0 }, Operand::Value(0)), Inst::Binary(Binary::Mul, Operand::Value(1), Operand::Param(0))],
            params: vec![],
        };
        for (k, &(xs, ws, stride, dil, pads, _)) in cases.iter().enumerate() {
            let x: Vec<f32> = (0..xs.iter().product::<usize>()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let w: Vec<f32> = (0..ws.iter().product::<usize>()).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
            let b: Vec<f32> = (0..ws[0]).map(|i| i as f32 * 0.25 - 1.0).collect();
            let scale: Vec<f32> = (0..ws[0]).map(|i| 0.5 + (i % 5) as f32 * 0.25).collect();
            let window = Window { kernel: None, strides: Some(stride.to_vec()), dilations: Some(dil.to_vec()), pads: Some(pads.to_vec()), auto_pad: "NOTSET".into(), ceil_mode: false };
            let (conv, shape) = naive(&x, xs, &w, ws, &b, stride, dil, pads, 1);
            let plane = shape[2] * shape[3];
            let residual: Vec<f32> = (0..conv.len()).map(|i| ((i * 29 % 61) as f32 - 30.0) / 20.0).collect();
            let want: Vec<f32> = conv.iter().zip(&residual).enumerate().map(|(i, (v, r))| (v + r).clamp(-2.0, 3.0) * scale[i / plane % ws[0]]).collect();
            let program = Program { params: vec![Param { values: scale.clone(), shape: ParamShape::Channel }], ..program.clone() };
            let bound = program.bind(&shape, &[(&residual, &shape)]).unwrap();
            let [h, wa] = window.axes(&xs[2..], &ws[2..]).unwrap()[..] else { unreachable!() };
            for kernel in dense_kernels() {
                if kernel == Dense::Columns && wa.output < LANES {
                    continue;
                }
                let runs: Vec<Vec<f32>> = [1, 2].iter().map(|&threads| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| run_dense(kernel, &x, xs, &w, ws, &b, h, wa, Some(&bound)))
                }).collect();
                assert!(runs[0].iter().zip(&runs[1]).all(|(p, q)| p.to_bits() == q.to_bits()), "case {k}, {kernel:?}: 1 and 2 threads differ");
                for (i, (g, e)) in runs[0].iter().zip(&want).enumerate() {
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "case {k}, {kernel:?}, element {i}: {g} vs {e}");
                }
            }
        }
    }

    #[test]
    fn a_constant_weight_keeps_its_winograd_transform_per_group() {
        // Grouped 3x3 convolutions with enough channels and tiles for Winograd (with AVX2;
        // the second also with AVX-512F), two images: the transform kept for the constant
        // weight (filled by the first run, reused by the second) gives the bits of the
        // transform made on every call, and both the naive convolution's values.
        let cases: &[Case] = &[
            ([2, 64, 20, 20], [48, 32, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 2),
            ([1, 32, 66, 70], [16, 16, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 2),
        ];
        for (k, &(xs, ws, stride, dil, pads, group)) in cases.iter().enumerate() {
            let x: Vec<f32> = (0..xs.iter().product::<usize>()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let w: Vec<f32> = (0..ws.iter().product::<usize>()).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
            let b: Vec<f32> = (0..ws[0]).map(|i| i as f32 * 0.25 - 1.0).collect();
            let window = Window { kernel: None, strides: Some(stride.to_vec()), dilations: Some(dil.to_vec()), pads: Some(pads.to_vec()), auto_pad: "NOTSET".into(), ceil_mode: false };
            let (want, _) = naive(&x, xs, &w, ws, &b, stride, dil, pads, group);
            let (fresh, _) = conv_with(&x, &xs, &w, &ws, Some(&b), &window, group, None, None).unwrap().unwrap();
            let kept = winograd::Transformed::default();
            for run in 0..2 {
                let (got, _) = conv_with(&x, &xs, &w, &ws, Some(&b), &window, group, None, Some(&kept)).unwrap().unwrap();
                assert!(got.iter().zip(&fresh).all(|(p, q)| p.to_bits() == q.to_bits()), "case {k}, run {run}: the kept transform changes the result");
            }
            // Winograd's rounding grows with the terms' magnitudes, not the result's.
            let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
            for (i, (g, e)) in fresh.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 1e-5 * scale, "case {k}, element {i}: {g} vs {e}");
            }
        }
    }

    /// Runs every case through [`conv_with`] and compares it with [`naive`].
    fn check_cases(cases: &[Case]) {
        for (k, &(xs, ws, stride, dil, pads, group)) in cases.iter().enumerate() {
            let x: Vec<f32> = (0..xs.iter().product::<usize>()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let w: Vec<f32> = (0..ws.iter().product::<usize>()).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
            let b: Vec<f32> = (0..ws[0]).map(|i| i as f32 * 0.25 - 1.0).collect();
            let window = Window { kernel: None, strides: Some(stride.to_vec()), dilations: Some(dil.to_vec()), pads: Some(pads.to_vec()), auto_pad: "NOTSET".into(), ceil_mode: false };
            let (want, wshape) = naive(&x, xs, &w, ws, &b, stride, dil, [pads[0], pads[1], pads[2], pads[3]], group);
            let (got, shape) = conv_with(&x, &xs, &w, &ws, Some(&b), &window, group, None, None).unwrap().unwrap();
            assert_eq!(shape, wshape.to_vec(), "case {k}");
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "case {k}, element {i}: {g} vs {e}");
            }
        }
    }

    /// A transposed convolution by its definition: every input pixel times every tap,
    /// scattered to `(y*sh + ki*dh - ph, x*sw + kj*dw - pw)`, in f64.
    fn naive_transposed(x: &[f32], w: &[f32], b: &[f32], g: &TransposedConv) -> Vec<f32> {
        let m = g.mg * g.group;
        let cg = g.c / g.group;
        let mut out: Vec<f64> = (0..g.n * m * g.oh * g.ow).map(|i| b[i / (g.oh * g.ow) % m] as f64).collect();
        for bi in 0..g.n {
            for ci in 0..g.c {
                let grp = ci / cg;
                for y in 0..g.ih {
                    for xx in 0..g.iw {
                        let v = x[((bi * g.c + ci) * g.ih + y) * g.iw + xx] as f64;
                        for o in 0..g.mg {
                            for ki in 0..g.kh {
                                for kj in 0..g.kw {
                                    let oy = (y * g.sh + ki * g.dh) as isize - g.ph as isize;
                                    let ox = (xx * g.sw + kj * g.dw) as isize - g.pw as isize;
                                    if oy >= 0 && ox >= 0 && (oy as usize) < g.oh && (ox as usize) < g.ow {
                                        let oc = grp * g.mg + o;
                                        out[((bi * m + oc) * g.oh + oy as usize) * g.ow + ox as usize] += v * w[((ci * g.mg + o) * g.kh + ki) * g.kw + kj] as f64;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        out.into_iter().map(|v| v as f32).collect()
    }

    #[test]
    fn transposed_convolution_matches_its_definition() {
        // (n, c, ih, iw, group, mg, kh, kw, sh, sw, dh, dw, ph, pw, extra rows/cols of
        // output padding): kernels that tile the output (2x2 stride 2, 3x1 stride 3x1), that
        // leave gaps (1x1 stride 2, with padding), that overlap (3x3 stride 1 and 2, dilated,
        // grouped, 4x4 stride 2), over enough rows for several blocks and both waves.
        let cases = [
            (1, 24, 70, 58, 1, 24, 2, 2, 2, 2, 1, 1, 0, 0, 0),
            (2, 6, 9, 11, 1, 3, 3, 1, 3, 1, 1, 1, 0, 0, 0),
            (1, 4, 90, 40, 1, 5, 1, 1, 2, 2, 1, 1, 1, 0, 1),
            (1, 8, 100, 33, 1, 6, 3, 3, 1, 1, 1, 1, 1, 1, 0),
            (1, 6, 80, 29, 2, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1),
            (1, 4, 61, 17, 1, 3, 3, 3, 2, 1, 2, 2, 2, 0, 0),
            (2, 4, 40, 21, 4, 2, 4, 4, 2, 2, 1, 1, 1, 1, 0),
            (1, 3, 1, 1, 1, 2, 2, 2, 2, 2, 1, 1, 0, 0, 0),
        ];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (k, &(n, c, ih, iw, group, mg, kh, kw, sh, sw, dh, dw, ph, pw, extra)) in cases.iter().enumerate() {
                let oh = sh * (ih - 1) + extra + (kh - 1) * dh + 1 - 2 * ph;
                let ow = sw * (iw - 1) + extra + (kw - 1) * dw + 1 - 2 * pw;
                let geo = TransposedConv { n, c, ih, iw, group, mg, kh, kw, sh, sw, dh, dw, ph, pw, oh, ow };
                let x: Vec<f32> = (0..n * c * ih * iw).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let w: Vec<f32> = (0..c * mg * kh * kw).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
                let b: Vec<f32> = (0..mg * group).map(|i| i as f32 * 0.25 - 1.0).collect();
                let want = naive_transposed(&x, &w, &b, &geo);
                for bias in [Some(&b[..]), None] {
                    let got = pool.install(|| transposed_conv_2d(&x, &w, bias, &geo));
                    assert_eq!(got.len(), want.len(), "case {k}");
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        let e = if bias.is_some() { *e } else { e - b[i / (oh * ow) % (mg * group)] };
                        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "case {k}, threads {threads}, bias {}, element {i}: {g} vs {e}", bias.is_some());
                    }
                }
            }
        }
    }

    /// The coordinates of row-major offset `flat` in `dims`.
    fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
        let mut at = vec![0; dims.len()];
        for (a, &d) in at.iter_mut().zip(dims).rev() {
            *a = flat % d;
            flat /= d;
        }
        at
    }

    /// The row-major offset of coordinates `at` in `dims`.
    fn ravel(at: &[usize], dims: &[usize]) -> usize {
        at.iter().zip(dims).fold(0, |acc, (&a, &d)| acc * d + a)
    }

    /// Deterministic test values in about [-2, 2].
    fn values(len: usize, mul: usize, modulus: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * mul % modulus) as f32 - (modulus / 2) as f32) / 25.0).collect()
    }

    /// A convolution over any number of spatial axes by its definition, in f64, with explicit
    /// pads (`[begin..., end...]`); returns the output and its shape.
    #[allow(clippy::too_many_arguments)]
    fn naive_nd(x: &[f32], xs: &[usize], w: &[f32], ws: &[usize], b: &[f32], strides: &[usize], dil: &[usize], pads: &[usize], group: usize) -> (Vec<f32>, Vec<usize>) {
        let r = xs.len() - 2;
        let (n, c, m, cg) = (xs[0], xs[1], ws[0], ws[1]);
        let outs: Vec<usize> = (0..r).map(|i| (xs[2 + i] + pads[i] + pads[r + i] - (ws[2 + i] - 1) * dil[i] - 1) / strides[i] + 1).collect();
        let (taps, plane): (usize, usize) = (ws[2..].iter().product(), outs.iter().product());
        let mg = m / group;
        let mut out = vec![0f32; n * m * plane];
        for (i, v) in out.iter_mut().enumerate() {
            let (b0, o, pos) = (i / (m * plane), i / plane % m, unravel(i % plane, &outs));
            let mut acc = b[o] as f64;
            for ci in 0..cg {
                for t in 0..taps {
                    let k = unravel(t, &ws[2..]);
                    let at: Option<Vec<usize>> = (0..r).map(|a| (pos[a] * strides[a] + k[a] * dil[a]).checked_sub(pads[a]).filter(|&p| p < xs[2 + a])).collect();
                    if let Some(at) = at {
                        let xi = (b0 * c + o / mg * cg + ci) * xs[2..].iter().product::<usize>() + ravel(&at, &xs[2..]);
                        acc += x[xi] as f64 * w[(o * cg + ci) * taps + t] as f64;
                    }
                }
            }
            *v = acc as f32;
        }
        (out, [vec![n, m], outs].concat())
    }

    #[test]
    fn convolutions_over_three_and_four_spatial_axes_match_their_definition() {
        // (input shape, weight shape, strides, dilations, pads, group): dense, strided and
        // padded, dilated, grouped, depthwise, pointwise, and four spatial axes.
        type NdCase = (Vec<usize>, Vec<usize>, Vec<usize>, Vec<usize>, Vec<usize>, usize);
        let cases: Vec<NdCase> = vec![
            (vec![2, 3, 3, 4, 5], vec![4, 3, 2, 3, 4], vec![1, 1, 1], vec![1, 1, 1], vec![0; 6], 1),
            (vec![1, 3, 6, 7, 9], vec![5, 3, 3, 2, 3], vec![2, 1, 3], vec![1, 2, 1], vec![1, 0, 2, 2, 1, 1], 1),
            (vec![1, 4, 5, 6, 7], vec![6, 2, 3, 3, 3], vec![1, 2, 1], vec![2, 1, 1], vec![1, 1, 1, 0, 1, 1], 2),
            (vec![1, 5, 4, 5, 6], vec![5, 1, 3, 3, 3], vec![1, 1, 2], vec![1, 1, 1], vec![1, 1, 1, 1, 1, 1], 5),
            (vec![2, 6, 3, 4, 5], vec![7, 6, 1, 1, 1], vec![1, 1, 1], vec![1, 1, 1], vec![0; 6], 1),
            (vec![1, 2, 3, 4, 3, 5], vec![3, 2, 2, 3, 2, 3], vec![1, 2, 1, 2], vec![1, 1, 2, 1], vec![0, 1, 1, 0, 1, 0, 0, 1], 1),
        ];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (k, (xs, ws, strides, dil, pads, group)) in cases.iter().enumerate() {
                let x = values(xs.iter().product(), 37, 101);
                let w = values(ws.iter().product(), 53, 89);
                let b: Vec<f32> = (0..ws[0]).map(|i| i as f32 * 0.25 - 1.0).collect();
                let window = Window { kernel: None, strides: Some(strides.clone()), dilations: Some(dil.clone()), pads: Some(pads.clone()), auto_pad: "NOTSET".into(), ceil_mode: false };
                let (want, wshape) = naive_nd(&x, xs, &w, ws, &b, strides, dil, pads, *group);
                let (got, shape) = pool.install(|| conv_with(&x, xs, &w, ws, Some(&b), &window, *group, None, None)).unwrap().unwrap();
                assert_eq!(shape, wshape, "case {k}");
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "case {k}, threads {threads}, element {i}: {g} vs {e}");
                }
            }
        }
    }

    #[test]
    fn convolution_shape_errors_are_reported() {
        let window = Window { kernel: None, strides: None, dilations: None, pads: None, auto_pad: "NOTSET".into(), ceil_mode: false };
        let x = vec![0f32; 2 * 3 * 4 * 4 * 4];
        let w = vec![0f32; 4 * 3 * 2 * 2 * 2];
        let err = |xs: &[usize], ws: &[usize], window: &Window, group: usize| conv_with(&x, xs, &w, ws, None, window, group, None, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(&[2, 3], &[4, 3], &window, 1).contains("at least one spatial axis"));
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2], &window, 1).contains("same rank"));
        assert!(err(&[2, 3, 4, 4, 4], &[4, 2, 2, 2, 2], &window, 1).contains("do not fit"));
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2, 2], &window, 0).contains("do not fit"));
        let short_strides = Window { strides: Some(vec![1, 1]), ..window.clone() };
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2, 2], &short_strides, 1).contains("'strides' has 2 values"));
        let zero_stride = Window { strides: Some(vec![1, 0, 1]), ..window.clone() };
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2, 2], &zero_stride, 1).contains("must be at least 1"));
        let huge_pads = Window { pads: Some(vec![usize::MAX, 0, 0, usize::MAX, 0, 0]), ..window.clone() };
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2, 2], &huge_pads, 1).contains("overflows"));
        let big_pads = Window { pads: Some(vec![1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20]), ..window.clone() };
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2, 2], &big_pads, 1).contains("too large"));
        let kernel_shape = Window { kernel: Some(vec![3, 3, 3]), ..window };
        assert!(err(&[2, 3, 4, 4, 4], &[4, 3, 2, 2, 2], &kernel_shape, 1).contains("differs from the weight"));
    }

    #[test]
    fn transposed_convolutions_over_three_spatial_axes_match_their_definition() {
        // (input shape, output channels per group, kernel, strides, dilations, pads begin,
        // extra output per axis, group).
        type NdCase = ([usize; 5], usize, [usize; 3], [usize; 3], [usize; 3], [usize; 3], [usize; 3], usize);
        let cases: [NdCase; 4] = [
            ([1, 1, 3, 4, 5], 2, [3, 3, 3], [1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0], 1),
            ([2, 4, 3, 5, 4], 3, [2, 3, 2], [2, 1, 3], [1, 2, 1], [1, 0, 1], [1, 0, 0], 2),
            ([1, 3, 4, 3, 6], 5, [3, 2, 3], [2, 2, 2], [1, 1, 2], [1, 1, 2], [0, 1, 1], 1),
            ([1, 2, 2, 2, 40], 9, [1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0], 1),
        ];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (k, &(xs, mg, kernel, strides, dil, pads, extra, group)) in cases.iter().enumerate() {
                let axes: Vec<TransposedAxis> = (0..3).map(|i| TransposedAxis {
                    input: xs[2 + i], kernel: kernel[i], stride: strides[i], dilation: dil[i], pad_begin: pads[i],
                    output: strides[i] * (xs[2 + i] - 1) + extra[i] + (kernel[i] - 1) * dil[i] + 1 - 2 * pads[i],
                }).collect();
                let (n, c, m) = (xs[0], xs[1], mg * group);
                let outs: Vec<usize> = axes.iter().map(|a| a.output).collect();
                let (image, plane, taps) = (xs[2..].iter().product::<usize>(), outs.iter().product::<usize>(), kernel.iter().product::<usize>());
                let x = values(n * c * image, 37, 101);
                let w = values(c * mg * taps, 53, 89);
                let b: Vec<f32> = (0..m).map(|i| i as f32 * 0.25 - 1.0).collect();
                let mut want: Vec<f64> = (0..n * m * plane).map(|i| b[i / plane % m] as f64).collect();
                for (xi, &v) in x.iter().enumerate() {
                    let (b0, ci, pos) = (xi / (c * image), xi / image % c, unravel(xi % image, &xs[2..]));
                    for o in 0..mg {
                        for t in 0..taps {
                            let kk = unravel(t, &kernel);
                            let at: Option<Vec<usize>> = (0..3).map(|a| (pos[a] * strides[a] + kk[a] * dil[a]).checked_sub(pads[a]).filter(|&p| p < outs[a])).collect();
                            if let Some(at) = at {
                                let oc = ci / (c / group) * mg + o;
                                want[(b0 * m + oc) * plane + ravel(&at, &outs)] += v as f64 * w[(ci * mg + o) * taps + t] as f64;
                            }
                        }
                    }
                }
                let got = pool.install(|| transposed_conv_nd(&x, &w, Some(&b), n, c, group, mg, &axes));
                assert_eq!(got.len(), want.len(), "case {k}");
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!((*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()), "case {k}, threads {threads}, element {i}: {g} vs {e}");
                }
            }
        }
    }
}
