//! Convolutions (1-D and 2-D, grouped and depthwise) and transposed convolutions, NCHW.

use rayon::prelude::*;

use super::elementwise::{from_f32, to_f32};
use super::gemm::{sgemm, sgemm_strided, MatRef};
use super::util::{input, kernel, opt_input};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RunCtx, RuntimeResult, LATEST};
use qforge_ir::Tensor;

/// Registers Conv and ConvTranspose.
pub fn register(r: &mut Registry) {
    r.add("", "Conv", 1, LATEST, conv);
    r.add("", "ConvTranspose", 1, LATEST, conv_transpose);
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

    /// Geometry for spatial input sizes and kernel sizes (from the weight when not given).
    pub fn axes(&self, spatial: &[usize], kernel: &[usize]) -> RuntimeResult<Vec<Axis>> {
        let r = spatial.len();
        let get = |v: &Option<Vec<usize>>, i: usize, d: usize| v.as_ref().and_then(|v| v.get(i).copied()).unwrap_or(d);
        (0..r).map(|i| {
            let (n, k, s, d) = (spatial[i], kernel[i], get(&self.strides, i, 1).max(1), get(&self.dilations, i, 1).max(1));
            let span = (k - 1) * d + 1;
            let (pb, pe) = match self.auto_pad.as_str() {
                "SAME_UPPER" | "SAME_LOWER" => {
                    let out = n.div_ceil(s);
                    let total = ((out - 1) * s + span).saturating_sub(n);
                    if self.auto_pad == "SAME_UPPER" { (total / 2, total - total / 2) } else { (total - total / 2, total / 2) }
                }
                "VALID" => (0, 0),
                _ => (get(&self.pads, i, 0), get(&self.pads, i + r, 0)),
            };
            let padded = n + pb + pe;
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

/// A raw output pointer that tiles of one convolution write to disjointly.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every tile writes a disjoint set of output columns.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: callers stay within the output slice this pointer came from.
        unsafe { self.0.add(offset) }
    }
}

/// Convolution of one image and group by tiles of output rows, added to `dst`: each tile
/// unfolds its own columns (small enough to stay in cache) and accumulates their product with
/// the weights; tiles run in parallel.
#[allow(clippy::too_many_arguments)]
fn conv_tiled(src: &[f32], cg: usize, h: Axis, w: Axis, weights: &[f32], mg: usize, dst: &mut [f32]) {
    let (oh, ow) = (h.output, w.output);
    let plane = oh * ow;
    let kdim = cg * h.kernel * w.kernel;
    // About 256 KiB of columns per tile, at least one output row.
    let rows_per_tile = ((64 * 1024) / (kdim * ow).max(1)).clamp(1, oh);
    let tiles: Vec<std::ops::Range<usize>> = (0..oh).step_by(rows_per_tile).map(|r| r..(r + rows_per_tile).min(oh)).collect();
    let out = OutPtr(dst.as_mut_ptr());
    let len = dst.len();
    tiles.into_par_iter().for_each_init(Vec::new, |col: &mut Vec<f32>, rows| {
        let width = rows.len() * ow;
        col.resize(kdim * width, 0.0);
        im2col_rows(src, cg, h, w, rows.clone(), col);
        // SAFETY: rows are disjoint across tiles, so the column ranges written are disjoint;
        // the slice covers from this tile's first column to the end of the output.
        let c = unsafe { std::slice::from_raw_parts_mut(out.at(rows.start * ow), len - rows.start * ow) };
        sgemm_strided(mg, width, kdim, MatRef::rows(weights, kdim), MatRef::rows(col, width), c, plane, true, false);
    });
}

struct Conv {
    window: Window,
    group: usize,
    /// Constant weight, converted once.
    weight: Option<(Vec<f32>, Vec<usize>)>,
    bias: Option<Vec<f32>>,
}

impl Kernel for Conv {
    fn run(&self, ins: &[Option<&Tensor>], _: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
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
        let (out, shape) = conv2d(&xv, x.shape(), w, wshape, bias, &self.window, self.group)?;
        Ok(vec![from_f32(x.dtype(), &shape, out)?])
    }
}

/// NC(H)W convolution. 1-D inputs are treated as height 1.
pub fn conv2d(x: &[f32], xshape: &[usize], w: &[f32], wshape: &[usize], bias: Option<&[f32]>, window: &Window, group: usize) -> RuntimeResult<(Vec<f32>, Vec<usize>)> {
    let one_d = xshape.len() == 3;
    if !(xshape.len() == 4 || one_d) || wshape.len() != xshape.len() {
        return Err(kernel_error(format!("only 1-D and 2-D convolutions are supported (input {xshape:?}, weight {wshape:?})")));
    }
    let (n, c) = (xshape[0], xshape[1]);
    let (ih, iw) = if one_d { (1, xshape[2]) } else { (xshape[2], xshape[3]) };
    let (m, cg) = (wshape[0], wshape[1]);
    let (kh, kw) = if one_d { (1, wshape[2]) } else { (wshape[2], wshape[3]) };
    if group == 0 || c != cg * group || m % group != 0 {
        return Err(kernel_error(format!("input channels {c}, weight {wshape:?} and group {group} do not fit")));
    }
    if bias.is_some_and(|b| b.len() != m) {
        return Err(kernel_error(format!("bias has {} values for {m} output channels", bias.unwrap().len())));
    }
    let win = if one_d { window.lifted_1d() } else { window.clone() };
    let axes = win.axes(&[ih, iw], &[kh, kw])?;
    let (h, wa) = (axes[0], axes[1]);
    let (oh, ow) = (h.output, wa.output);
    let plane = oh * ow;
    let mg = m / group;
    let kdim = cg * kh * kw;
    // The output starts as the bias (or zero), written once, and the products accumulate onto it.
    let mut out: Vec<f32> = match bias {
        Some(bias) => {
            let mut out = Vec::with_capacity(n * m * plane);
            for row in 0..n * m {
                out.extend(std::iter::repeat_n(bias[row % m], plane));
            }
            out
        }
        None => vec![0f32; n * m * plane],
    };
    let pointwise = kh == 1 && kw == 1 && h.stride == 1 && wa.stride == 1 && h.pad_begin + h.pad_end + wa.pad_begin + wa.pad_end == 0;
    let depthwise = cg == 1 && mg == 1;
    for b in 0..n {
        let img = &x[b * c * ih * iw..(b + 1) * c * ih * iw];
        let dst = &mut out[b * m * plane..(b + 1) * m * plane];
        if depthwise {
            depthwise_conv(img, w, h, wa, dst);
        } else {
            for g in 0..group {
                let src = &img[g * cg * ih * iw..(g + 1) * cg * ih * iw];
                let wg = &w[g * mg * kdim..(g + 1) * mg * kdim];
                let out = &mut dst[g * mg * plane..(g + 1) * mg * plane];
                if pointwise {
                    sgemm(mg, plane, kdim, MatRef::rows(wg, kdim), MatRef::rows(src, plane), out, true);
                } else {
                    conv_tiled(src, cg, h, wa, wg, mg, out);
                }
            }
        }
    }
    let shape = if one_d { vec![n, m, ow] } else { vec![n, m, oh, ow] };
    Ok((out, shape))
}

/// One filter per channel, added to `dst`: a direct sliding window, channels in parallel. Each
/// output row accumulates all its taps while it is in cache. With a column stride `s > 1`, each
/// input row is first split into its `s` phases (columns `p, p + s, ...`), so every tap reads a
/// contiguous run and the multiply-add vectorizes; on CPUs with AVX2 the channel loop is
/// compiled for it (eight lanes instead of four).
fn depthwise_conv(img: &[f32], w: &[f32], h: Axis, wa: Axis, dst: &mut [f32]) {
    let (ih, iw, kh, kw) = (h.input, wa.input, h.kernel, wa.kernel);
    let s = wa.stride;
    let phase_len = iw.div_ceil(s);
    let taps: Vec<Tap> = (0..kw).map(|kj| {
        let dx = (kj * wa.dilation) as isize - wa.pad_begin as isize;
        let (lo, hi) = wa.valid_outputs(dx);
        Tap { lo, hi, phase: dx.rem_euclid(s as isize) as usize, base: dx.div_euclid(s as isize) }
    }).collect();
    let geometry = Depthwise { h, wa, phase_len, taps };
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    dst.par_chunks_mut(h.output * wa.output).enumerate().for_each_init(Vec::new, |phases: &mut Vec<f32>, (ch, out)| {
        let src = &img[ch * ih * iw..(ch + 1) * ih * iw];
        let k = &w[ch * kh * kw..(ch + 1) * kh * kw];
        phases.resize(s * phase_len, 0.0);
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU supports AVX2, detected above.
            return unsafe { depthwise_channel_avx2(&geometry, src, k, out, phases) };
        }
        depthwise_channel(&geometry, src, k, out, phases)
    });
}

/// One kernel column of a depthwise window: the output columns `[lo, hi)` it reaches inside
/// the input, and where it reads them: input column `s * ox + s * base + phase`.
struct Tap {
    lo: usize,
    hi: usize,
    phase: usize,
    base: isize,
}

/// The window of a depthwise convolution, prepared once for all channels.
struct Depthwise {
    h: Axis,
    wa: Axis,
    phase_len: usize,
    taps: Vec<Tap>,
}

/// [`depthwise_channel`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn depthwise_channel_avx2(d: &Depthwise, src: &[f32], k: &[f32], out: &mut [f32], phases: &mut [f32]) {
    depthwise_channel(d, src, k, out, phases)
}

/// Adds one channel's window sums to `out` (`phases`: scratch of `stride * phase_len`).
#[inline(always)]
fn depthwise_channel(d: &Depthwise, src: &[f32], k: &[f32], out: &mut [f32], phases: &mut [f32]) {
    let (h, wa) = (d.h, d.wa);
    let (ih, iw, kh, kw, s) = (h.input, wa.input, h.kernel, wa.kernel, wa.stride);
    let ow = wa.output;
    for oy in 0..h.output {
        let o = &mut out[oy * ow..(oy + 1) * ow];
        for ki in 0..kh {
            let iy = (oy * h.stride + ki * h.dilation) as isize - h.pad_begin as isize;
            if iy < 0 || iy >= ih as isize {
                continue;
            }
            let row = &src[iy as usize * iw..(iy as usize + 1) * iw];
            let read: &[f32] = if s == 1 {
                row
            } else {
                for (p, phase) in phases.chunks_mut(d.phase_len).enumerate() {
                    for (dst, &v) in phase.iter_mut().zip(row[p.min(iw)..].iter().step_by(s)) {
                        *dst = v;
                    }
                }
                phases
            };
            for (kj, t) in d.taps.iter().enumerate() {
                let wt = k[ki * kw + kj];
                let start = ((t.phase * d.phase_len) as isize + t.lo as isize + t.base) as usize;
                for (acc, v) in o[t.lo..t.hi].iter_mut().zip(&read[start..start + (t.hi - t.lo)]) {
                    *acc += wt * v;
                }
            }
        }
    }
}

fn conv(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let window = Window::from_node(info)?;
    let group = info.attr_int("group", 1).max(0) as usize;
    let weight = info.const_input(1).map(|t| to_f32(t).map(|v| (v.into_owned(), t.shape().to_vec()))).transpose()?;
    let bias = info.const_input(2).map(|t| to_f32(t).map(|v| v.into_owned())).transpose()?;
    Ok(Box::new(Conv { window, group, weight, bias }))
}

fn conv_transpose(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let window = Window::from_node(info)?;
    let group = info.attr_int("group", 1).max(1) as usize;
    let output_padding = info.attr_ints("output_padding");
    let output_shape = info.attr_ints("output_shape");
    kernel(move |ins| {
        let (x, wt) = (input(ins, 0)?, input(ins, 1)?);
        let (xs, ws) = (x.shape(), wt.shape());
        if xs.len() != 4 || ws.len() != 4 {
            return Err(kernel_error(format!("only 2-D transposed convolutions are supported (input {xs:?}, weight {ws:?})")));
        }
        let (n, c, ih, iw) = (xs[0], xs[1], xs[2], xs[3]);
        let (mg, kh, kw) = (ws[1], ws[2], ws[3]);
        if ws[0] != c || c % group != 0 {
            return Err(kernel_error(format!("input channels {c} do not match weight {ws:?} with group {group}")));
        }
        let cg = c / group;
        let m = mg * group;
        let get = |v: &Option<Vec<usize>>, i: usize, d: usize| v.as_ref().and_then(|v| v.get(i).copied()).unwrap_or(d);
        let op = |i: usize| output_padding.as_ref().and_then(|v| v.get(i).copied()).unwrap_or(0).max(0) as usize;
        let mut geo = vec![];
        for (i, (&inp, &k)) in [ih, iw].iter().zip(&[kh, kw]).enumerate() {
            let (s, d) = (get(&window.strides, i, 1).max(1), get(&window.dilations, i, 1).max(1));
            let span = (k - 1) * d + 1;
            let (pb, pe, out) = if let Some(os) = &output_shape {
                let out = *os.get(os.len() - 2 + i).ok_or_else(|| kernel_error("output_shape needs the spatial sizes"))? as usize;
                let total = (s * (inp - 1) + op(i) + span).saturating_sub(out);
                if window.auto_pad == "SAME_UPPER" { (total / 2, total - total / 2, out) } else { (total - total / 2, total / 2, out) }
            } else {
                let (pb, pe) = match window.auto_pad.as_str() {
                    "SAME_UPPER" | "SAME_LOWER" => {
                        let total = (s * (inp - 1) + op(i) + span).saturating_sub(inp * s);
                        if window.auto_pad == "SAME_UPPER" { (total / 2, total - total / 2) } else { (total - total / 2, total / 2) }
                    }
                    "VALID" => (0, 0),
                    _ => (get(&window.pads, i, 0), get(&window.pads, i + 2, 0)),
                };
                let full = s * (inp - 1) + op(i) + span;
                (pb, pe, full.checked_sub(pb + pe).ok_or_else(|| kernel_error("padding exceeds the output"))?)
            };
            geo.push((s, d, pb, pe, out));
        }
        let ((sh, dh, ph, _, oh), (sw, dw, pw, _, ow)) = (geo[0], geo[1]);
        let (xv, wv) = (to_f32(x)?, to_f32(wt)?);
        let kdim = mg * kh * kw;
        let mut out = vec![0f32; n * m * oh * ow];
        let mut col = vec![0f32; kdim * ih * iw];
        for b in 0..n {
            for g in 0..group {
                let src = &xv[(b * c + g * cg) * ih * iw..(b * c + (g + 1) * cg) * ih * iw];
                let wg = &wv[g * cg * kdim..(g + 1) * cg * kdim];
                // col[kdim x ih*iw] = wg^T [kdim x cg] * src [cg x ih*iw]
                sgemm(kdim, ih * iw, cg, MatRef::transposed(wg, kdim), MatRef::rows(src, ih * iw), &mut col, false);
                let dst = &mut out[(b * m + g * mg) * oh * ow..(b * m + (g + 1) * mg) * oh * ow];
                dst.par_chunks_mut(oh * ow).enumerate().for_each(|(oc, plane)| {
                    for ki in 0..kh {
                        for kj in 0..kw {
                            let row = &col[((oc * kh + ki) * kw + kj) * ih * iw..((oc * kh + ki) * kw + kj + 1) * ih * iw];
                            for y in 0..ih {
                                let oy = (y * sh + ki * dh) as isize - ph as isize;
                                if oy < 0 || oy >= oh as isize {
                                    continue;
                                }
                                for xx in 0..iw {
                                    let ox = (xx * sw + kj * dw) as isize - pw as isize;
                                    if ox >= 0 && ox < ow as isize {
                                        plane[oy as usize * ow + ox as usize] += row[y * iw + xx];
                                    }
                                }
                            }
                        }
                    }
                });
            }
        }
        if let Some(bt) = opt_input(ins, 2) {
            let bv = to_f32(bt)?;
            out.chunks_mut(oh * ow).enumerate().for_each(|(i, p)| p.iter_mut().for_each(|v| *v += bv[i % m]));
        }
        Ok(vec![from_f32(x.dtype(), &[n, m, oh, ow], out)?])
    })
}
