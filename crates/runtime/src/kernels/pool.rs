//! Pooling: MaxPool, AveragePool, their global forms, and LRN. NC(H)W, 1-D or 2-D.

use rayon::prelude::*;

use super::conv::{Axis, Window};
use super::elementwise::{from_f32, to_f32, values_f32, values_from_f32};
use super::util::{input, kernel, lane_sum, tensor, threads, vectorized};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};
use qforge_ir::DType;

/// Registers the pooling operators.
pub fn register(r: &mut Registry) {
    r.add("", "MaxPool", 1, LATEST, pool);
    r.add("", "AveragePool", 1, LATEST, pool);
    r.add("", "GlobalAveragePool", 1, LATEST, global);
    r.add("", "GlobalMaxPool", 1, LATEST, global);
    r.add("", "LRN", 1, LATEST, lrn);
}

fn pool(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let max = info.node.op_type == "MaxPool";
    let window = Window::from_node(info)?;
    let kernel_shape = window.kernel.clone().ok_or_else(|| info.error("'kernel_shape' is required"))?;
    let include_pad = info.attr_int("count_include_pad", 0) != 0;
    let storage_order = info.attr_int("storage_order", 0);
    let wants_indices = info.node.outputs.len() > 1 && info.node.output(1).is_some();
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if !(s.len() == 3 || s.len() == 4) || kernel_shape.len() != s.len() - 2 {
            return Err(kernel_error(format!("only 1-D and 2-D pooling is supported (input {s:?}, kernel {kernel_shape:?})")));
        }
        let one_d = s.len() == 3;
        let (n, c) = (s[0], s[1]);
        let (ih, iw) = if one_d { (1, s[2]) } else { (s[2], s[3]) };
        let (kh, kw) = if one_d { (1, kernel_shape[0]) } else { (kernel_shape[0], kernel_shape[1]) };
        let win = if one_d { window.lifted_1d() } else { window.clone() };
        let axes = win.axes(&[ih, iw], &[kh, kw])?;
        let (h, w) = (axes[0], axes[1]);
        let (oh, ow) = (h.output, w.output);
        let (rows, cols) = (Taps::of(h), Taps::of(w));
        let shape = if one_d { vec![n, c, ow] } else { vec![n, c, oh, ow] };
        if max && !wants_indices {
            match x.dtype() {
                DType::U8 => return Ok(vec![tensor(&shape, max_pool_integers(x.as_slice::<u8>()?, u8::MIN, n * c, [ih, iw], [oh, ow], &rows, &cols, [h.dilation, w.dilation]))?]),
                DType::I8 => return Ok(vec![tensor(&shape, max_pool_integers(x.as_slice::<i8>()?, i8::MIN, n * c, [ih, iw], [oh, ow], &rows, &cols, [h.dilation, w.dilation]))?]),
                _ => {}
            }
        }
        let xv = if max { values_f32(x)? } else { to_f32(x)? };
        let mut out = vec![0f32; n * c * oh * ow];
        let mut ind = if wants_indices { vec![0i64; out.len()] } else { vec![] };
        let pool_plane = |p: usize, dst: &mut [f32], ind: &mut [i64]| {
            let src = &xv[p * ih * iw..(p + 1) * ih * iw];
            for oy in 0..oh {
                let (ys, yn) = rows.valid(oy);
                for ox in 0..ow {
                    let (xs, xn) = cols.valid(ox);
                    let at = oy * ow + ox;
                    if max {
                        let (best, best_i) = window_max(src, iw, ys, yn, h.dilation, xs, xn, w.dilation);
                        dst[at] = best;
                        if wants_indices {
                            let (y, x) = (best_i / iw, best_i % iw);
                            ind[at] = if storage_order == 0 { (p * ih + y) * iw + x } else { p * ih * iw + x * ih + y } as i64;
                        }
                    } else {
                        let count = if include_pad { rows.padded[oy] * cols.padded[ox] } else { yn * xn };
                        let sum = window_sum(src, iw, ys, yn, h.dilation, xs, xn, w.dilation);
                        dst[at] = if count > 0 { sum / count as f32 } else { 0.0 };
                    }
                }
            }
        };
        let planes = n * c;
        let plane_out = (oh * ow).max(1);
        if planes * ih * iw < 1 << 15 || threads() == 1 {
            for (p, dst) in out.chunks_mut(plane_out).enumerate() {
                let idx = if wants_indices { &mut ind[p * plane_out..(p + 1) * plane_out] } else { &mut [][..] };
                pool_plane(p, dst, idx);
            }
        } else if wants_indices {
            out.par_chunks_mut(plane_out).zip(ind.par_chunks_mut(plane_out)).enumerate().for_each(|(p, (dst, idx))| pool_plane(p, dst, idx));
        } else {
            out.par_chunks_mut(plane_out).enumerate().for_each(|(p, dst)| pool_plane(p, dst, &mut []));
        }
        let mut outs = vec![values_from_f32(x.dtype(), &shape, out)?];
        if wants_indices {
            outs.push(tensor(&shape, ind)?);
        }
        Ok(outs)
    })
}

/// MaxPool of `planes` planes of 8-bit integers (`[ih, iw]` each) into `[oh, ow]`, on the
/// integers themselves: the largest integer of a window is the integer of its largest real
/// value under any positive scale. A window with no input (all padding) gives `lowest`, as
/// the f32 path's -inf saturates to. Planes are split across [`threads`] when large.
#[allow(clippy::too_many_arguments)]
fn max_pool_integers<T: Copy + Ord + Send + Sync>(x: &[T], lowest: T, planes: usize, [ih, iw]: [usize; 2], [oh, ow]: [usize; 2], rows: &Taps, cols: &Taps, [dy, dx]: [usize; 2]) -> Vec<T> {
    let mut out = vec![lowest; planes * oh * ow];
    // Columns whose windows tile the row from its start (stride = kernel, no left padding, no
    // dilation): their width.
    let k = cols.count.first().copied().unwrap_or(0);
    let tiled = (k > 0 && dx == 1 && (0..ow).all(|o| cols.valid(o) == (o * k, k))).then_some(k);
    // Per output row: the column maxima over the window's rows (contiguous, vectorizes), then
    // the maximum over each window's columns.
    let pool_plane = |p: usize, dst: &mut [T], columns: &mut Vec<T>| {
        let src = &x[p * ih * iw..][..ih * iw];
        for (oy, dst) in dst.chunks_exact_mut(ow).enumerate() {
            let (ys, yn) = rows.valid(oy);
            columns.clear();
            columns.resize(iw, lowest);
            for ky in 0..yn {
                for (m, &v) in columns.iter_mut().zip(&src[(ys + ky * dy) * iw..][..iw]) {
                    *m = (*m).max(v);
                }
            }
            match tiled {
                // Windows side by side: each output is the maximum of its own k columns.
                Some(2) => dst.iter_mut().zip(columns.chunks_exact(2)).for_each(|(d, w)| *d = w[0].max(w[1])),
                Some(k) => dst.iter_mut().zip(columns.chunks_exact(k)).for_each(|(d, w)| *d = w.iter().fold(lowest, |b, &v| b.max(v))),
                None => {
                    for (ox, d) in dst.iter_mut().enumerate() {
                        let (xs, xn) = cols.valid(ox);
                        *d = (0..xn).fold(lowest, |b, kx| b.max(columns[xs + kx * dx]));
                    }
                }
            }
        }
    };
    let plane_out = (oh * ow).max(1);
    if oh * ow == 0 {
        return out;
    }
    if planes * ih * iw < 1 << 17 || threads() == 1 {
        let mut columns = Vec::with_capacity(iw);
        out.chunks_mut(plane_out).enumerate().for_each(|(p, dst)| pool_plane(p, dst, &mut columns));
    } else {
        out.par_chunks_mut(plane_out).enumerate().for_each_init(|| Vec::with_capacity(iw), |columns, (p, dst)| pool_plane(p, dst, columns));
    }
    out
}

/// The kernel taps of a pooling window along one axis, per output position: the input index
/// of the first tap inside the input, the number of taps inside the input, and the number
/// inside the padded extent (taps past the trailing padding, which `ceil_mode` can reach,
/// do not count).
struct Taps {
    count: Vec<usize>,
    /// Taps at an input index or in the padding, for `count_include_pad`.
    padded: Vec<usize>,
    /// Input index of the first valid tap.
    start: Vec<usize>,
}

impl Taps {
    fn of(a: Axis) -> Taps {
        let mut t = Taps { count: vec![], padded: vec![], start: vec![] };
        for o in 0..a.output {
            let pos = |k: usize| (o * a.stride + k * a.dilation) as isize - a.pad_begin as isize;
            let mut inside = (0..a.kernel).filter(|&k| pos(k) >= 0 && pos(k) < a.input as isize);
            let first = inside.next();
            t.count.push(first.map_or(0, |_| 1 + inside.count()));
            t.start.push(first.map_or(0, |k| pos(k) as usize));
            t.padded.push((0..a.kernel).filter(|&k| pos(k) < (a.input + a.pad_end) as isize).count());
        }
        t
    }

    /// Input index of the first valid tap and the number of valid taps at output `o`.
    fn valid(&self, o: usize) -> (usize, usize) {
        (self.start[o], self.count[o])
    }
}

/// The largest of the `yn x xn` window of `src` (rows `iw` long) starting at row `ys`,
/// column `xs`, taps `dy`/`dx` apart, and its flat index (the first one on ties; NaNs are
/// skipped unless first). `(-inf, 0)` for an empty window.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn window_max(src: &[f32], iw: usize, ys: usize, yn: usize, dy: usize, xs: usize, xn: usize, dx: usize) -> (f32, usize) {
    if yn == 0 || xn == 0 {
        return (f32::NEG_INFINITY, 0);
    }
    let first = ys * iw + xs;
    let (mut best, mut best_i) = (src[first], first);
    for ky in 0..yn {
        let row = (ys + ky * dy) * iw;
        for kx in 0..xn {
            let i = row + xs + kx * dx;
            let v = src[i];
            if v > best {
                best = v;
                best_i = i;
            }
        }
    }
    (best, best_i)
}

/// The sum of the window of [`window_max`], row by row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn window_sum(src: &[f32], iw: usize, ys: usize, yn: usize, dy: usize, xs: usize, xn: usize, dx: usize) -> f32 {
    let mut sum = 0f32;
    for ky in 0..yn {
        let row = (ys + ky * dy) * iw;
        for kx in 0..xn {
            sum += src[row + xs + kx * dx];
        }
    }
    sum
}

fn global(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let max = info.node.op_type == "GlobalMaxPool";
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() < 3 {
            return Err(kernel_error(format!("global pooling needs rank >= 3, got {s:?}")));
        }
        let plane: usize = s[2..].iter().product();
        let xv = to_f32(x)?;
        let reduce = |p: &[f32]| vectorized(|| if max { p.iter().copied().fold(f32::NEG_INFINITY, f32::max) } else { lane_sum(p, |v| v) / plane as f32 });
        let planes = xv.chunks(plane.max(1)).take(s[0] * s[1]);
        let out: Vec<f32> = if xv.len() < 1 << 15 || threads() == 1 {
            planes.map(reduce).collect()
        } else {
            xv.par_chunks(plane.max(1)).take(s[0] * s[1]).map(reduce).collect()
        };
        let mut shape = s[..2].to_vec();
        shape.extend(std::iter::repeat_n(1, s.len() - 2));
        Ok(vec![from_f32(x.dtype(), &shape, out)?])
    })
}

fn lrn(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (alpha, beta, bias) = (info.attr_float("alpha", 1e-4), info.attr_float("beta", 0.75), info.attr_float("bias", 1.0));
    let size = info.attr_int("size", 0);
    if size <= 0 {
        return Err(info.error("'size' must be positive"));
    }
    let size = size as usize;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        let (n, c) = (s[0], s[1]);
        let plane: usize = s[2..].iter().product();
        let xv = to_f32(x)?;
        let mut out = vec![0f32; xv.len()];
        let (lo, hi) = ((size - 1) / 2, size.div_ceil(2) - 1);
        for b in 0..n {
            for ch in 0..c {
                let from = ch.saturating_sub(lo);
                let to = (ch + hi).min(c - 1);
                for p in 0..plane {
                    let sq: f32 = (from..=to).map(|k| { let v = xv[(b * c + k) * plane + p]; v * v }).sum();
                    let i = (b * c + ch) * plane + p;
                    out[i] = xv[i] / (bias + alpha / size as f32 * sq).powf(beta);
                }
            }
        }
        Ok(vec![from_f32(x.dtype(), s, out)?])
    })
}
