//! Pooling: MaxPool, AveragePool, LpPool, their global forms, and LRN. Channels first, over
//! any number of spatial axes, with fast paths for 1-D and 2-D.

use rayon::prelude::*;

use super::conv::{Axis, Window};
use super::util::check_output_size;
use super::elementwise::{from_f32, to_f32, values_f32, values_from_f32};
use super::shape::{cast_tensor, concat_with_value, strides as strides_of};
use super::util::{gather_elements, input, ints, kernel, opt_input, lane_sum, min_items, par_chunks_mut, tensor, threads, vectorized, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};
use qforge_ir::DType;

/// Registers the pooling operators.
pub fn register(r: &mut Registry) {
    r.add("", "MaxPool", 1, LATEST, pool);
    r.add("", "AveragePool", 1, LATEST, pool);
    r.add("", "GlobalAveragePool", 1, LATEST, global);
    r.add("", "GlobalMaxPool", 1, LATEST, global);
    r.add("", "LpPool", 1, LATEST, pool);
    r.add("", "GlobalLpPool", 1, LATEST, global);
    r.add("", "LRN", 1, LATEST, lrn);
    r.add("", "MaxUnpool", 9, LATEST, max_unpool);
}

/// The exponent `p` of LpPool and GlobalLpPool: a float attribute in opset 1, an integer one
/// (default 2) from opset 2.
fn lp_exponent(info: &NodeInfo) -> RuntimeResult<f32> {
    let p = if info.opset < 2 { info.attr_float("p", 2.0) } else { info.attr_int("p", 2) as f32 };
    if !(p > 0.0 && p.is_finite()) {
        return Err(info.error(format!("p must be positive, got {p}")));
    }
    Ok(p)
}

/// `|x|^p`, exact for the common `p` of 1 and 2.
#[inline(always)]
fn abs_pow(x: f32, p: f32) -> f32 {
    if p == 2.0 { x * x } else if p == 1.0 { x.abs() } else { x.abs().powf(p) }
}

/// Plans a MaxPool, AveragePool or LpPool node: input `[N, C, D1, ..., Dr]` (r >= 1, one
/// `kernel_shape` entry per spatial axis), output `[N, C, O1, ..., Or]` with the window
/// geometry of [`Window::axes`] (`auto_pad`, `pads`, `strides`, `dilations`, `ceil_mode`).
/// MaxPool takes the largest value of each window (taps in the padding are ignored; an
/// all-padding window gives the lowest value) and, when its second output is wanted, the
/// flat index of that value in the input (the first one on ties): row-major, or with
/// `storage_order` 1 column-major within each `[N, C]` plane. AveragePool divides each
/// window's sum by its taps inside the input, or with `count_include_pad` by its taps inside
/// the padded input. LpPool gives `(sum |x|^p)^(1/p)` over each window's taps inside the
/// input (padding adds nothing).
fn pool(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let max = info.node.op_type == "MaxPool";
    let lp = if info.node.op_type == "LpPool" { Some(lp_exponent(info)?) } else { None };
    let window = Window::from_node(info)?;
    let kernel_shape = window.kernel.clone().ok_or_else(|| info.error("'kernel_shape' is required"))?;
    let include_pad = info.attr_int("count_include_pad", 0) != 0;
    let storage_order = info.attr_int("storage_order", 0);
    if !(0..=1).contains(&storage_order) {
        return Err(info.error(format!("'storage_order' is {storage_order}; it must be 0 (row-major) or 1 (column-major)")));
    }
    let wants_indices = info.node.outputs.len() > 1 && info.node.output(1).is_some();
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() < 3 || kernel_shape.len() != s.len() - 2 {
            return Err(kernel_error(format!("pooling needs an input [N, C, D1, ...] with at least one spatial axis and one kernel_shape entry per spatial axis; got input {s:?}, kernel_shape {kernel_shape:?}")));
        }
        let axes = window.axes(&s[2..], &kernel_shape)?;
        let shape: Vec<usize> = s[..2].iter().copied().chain(axes.iter().map(|a| a.output)).collect();
        check_output_size("pooling output", x.dtype(), &shape)?;
        let (n, c) = (s[0], s[1]);
        let (h, w) = match axes[..] {
            [w] => (Axis::UNIT, w),
            [h, w] => (h, w),
            _ => {
                let xv = match lp {
                    Some(p) => to_f32(x)?.iter().map(|&v| abs_pow(v, p)).collect::<Vec<f32>>().into(),
                    None if max => values_f32(x)?,
                    None => to_f32(x)?,
                };
                let order = if storage_order == 0 { IndexOrder::RowMajor } else { IndexOrder::ColumnMajor };
                let mode = match lp {
                    Some(p) => PoolMode::Lp { p },
                    None if max => PoolMode::Max { indices: wants_indices.then_some(order) },
                    None => PoolMode::Average { include_pad },
                };
                let (out, ind) = pool_nd(&xv, n * c, &axes, mode);
                let mut outs = vec![values_from_f32(x.dtype(), &shape, out)?];
                if wants_indices {
                    outs.push(tensor(&shape, ind)?);
                }
                return Ok(outs);
            }
        };
        let (ih, iw) = (h.input, w.input);
        let (oh, ow) = (h.output, w.output);
        let (rows, cols) = (Taps::of(h), Taps::of(w));
        if max && !wants_indices {
            match x.dtype() {
                DType::U8 => return Ok(vec![tensor(&shape, max_pool_integers(x.as_slice::<u8>()?, u8::MIN, n * c, [ih, iw], [oh, ow], &rows, &cols, [h.dilation, w.dilation]))?]),
                DType::I8 => return Ok(vec![tensor(&shape, max_pool_integers(x.as_slice::<i8>()?, i8::MIN, n * c, [ih, iw], [oh, ow], &rows, &cols, [h.dilation, w.dilation]))?]),
                _ => {}
            }
        }
        let xv = match lp {
            Some(p) => to_f32(x)?.iter().map(|&v| abs_pow(v, p)).collect::<Vec<f32>>().into(),
            None if max => values_f32(x)?,
            None => to_f32(x)?,
        };
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
                    } else if let Some(p) = lp {
                        dst[at] = window_sum(src, iw, ys, yn, h.dilation, xs, xn, w.dilation).powf(1.0 / p);
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

/// What [`pool_nd`] computes per window.
#[derive(Debug, Clone, Copy)]
enum PoolMode {
    /// The largest value, and its input index in this order when wanted.
    Max { indices: Option<IndexOrder> },
    /// The mean, over the taps inside the padded input when `include_pad`, else over those
    /// inside the input.
    Average { include_pad: bool },
    /// The sum of the values, which the caller raised to `|x|^p`, raised to `1/p`.
    Lp { p: f32 },
}

/// How MaxPool numbers an input element in its Indices output.
#[derive(Debug, Clone, Copy, PartialEq)]
enum IndexOrder {
    /// Row-major over the whole input tensor.
    RowMajor,
    /// The plane's row-major offset plus the element's column-major offset within its plane.
    ColumnMajor,
}

/// Pooling of `planes` planes of `x` (each row-major over `axes`' input sizes, any number of
/// spatial axes) into planes over `axes`' output sizes, as `mode` says; returns the pooled
/// values and, for MaxPool with indices, the index of each maximum (else no indices). An
/// empty window gives -inf and index 0 for MaxPool, 0 for AveragePool and LpPool. Planes run in
/// parallel.
fn pool_nd(x: &[f32], planes: usize, axes: &[Axis], mode: PoolMode) -> (Vec<f32>, Vec<i64>) {
    let (last, lead) = axes.split_last().expect("at least one spatial axis");
    let image: usize = axes.iter().map(|a| a.input).product();
    let plane: usize = axes.iter().map(|a| a.output).product();
    let taps: Vec<Taps> = axes.iter().map(|&a| Taps::of(a)).collect();
    let (lead_taps, last_taps) = taps.split_last().map(|(l, t)| (t, l)).expect("at least one spatial axis");
    // Input strides of the leading axes, row-major.
    let mut in_strides = vec![0; lead.len()];
    let mut stride = last.input;
    for (s, a) in in_strides.iter_mut().zip(lead).rev() {
        *s = stride;
        stride *= a.input;
    }
    let indices = match mode {
        PoolMode::Max { indices } => indices,
        PoolMode::Average { .. } | PoolMode::Lp { .. } => None,
    };
    let mut out = vec![0f32; planes * plane];
    let mut ind = vec![0i64; if indices.is_some() { planes * plane } else { 0 }];
    if plane == 0 {
        return (out, ind);
    }
    let pool_plane = |p: usize, dst: &mut [f32], idx: &mut [i64]| {
        let src = &x[p * image..(p + 1) * image];
        // Output position along the leading axes, row-major.
        let mut at = vec![0usize; lead.len()];
        // Window tap along the leading axes, per axis, while visiting a window.
        let mut k = vec![0usize; lead.len()];
        for (line, dst) in dst.chunks_mut(last.output).enumerate() {
            if line > 0 {
                for (o, a) in at.iter_mut().zip(lead).rev() {
                    *o += 1;
                    if *o < a.output {
                        break;
                    }
                    *o = 0;
                }
            }
            let lead_inside: usize = lead_taps.iter().zip(&at).map(|(t, &o)| t.count[o]).product();
            let lead_padded: usize = lead_taps.iter().zip(&at).map(|(t, &o)| t.padded[o]).product();
            for (ox, d) in dst.iter_mut().enumerate() {
                let (xs, xn) = last_taps.valid(ox);
                if lead_inside == 0 || xn == 0 {
                    *d = if matches!(mode, PoolMode::Max { .. }) { f32::NEG_INFINITY } else { 0.0 };
                    continue;
                }
                let (mut best, mut best_i, mut sum) = (f32::NAN, usize::MAX, 0f32);
                k.fill(0);
                for _ in 0..lead_inside {
                    let base: usize = lead_taps.iter().zip(&at).zip(&k).zip(&in_strides).zip(lead).map(|((((t, &o), &ki), &s), a)| (t.start[o] + ki * a.dilation) * s).sum::<usize>() + xs;
                    for kx in 0..xn {
                        let i = base + kx * last.dilation;
                        let v = src[i];
                        if best_i == usize::MAX || v > best {
                            (best, best_i) = (v, i);
                        }
                        sum += v;
                    }
                    for ((ki, t), &o) in k.iter_mut().zip(lead_taps).zip(&at).rev() {
                        *ki += 1;
                        if *ki < t.count[o] {
                            break;
                        }
                        *ki = 0;
                    }
                }
                *d = match mode {
                    PoolMode::Max { .. } => best,
                    PoolMode::Average { include_pad: true } => sum / (lead_padded * last_taps.padded[ox]) as f32,
                    PoolMode::Average { include_pad: false } => sum / (lead_inside * xn) as f32,
                    PoolMode::Lp { p } => sum.powf(1.0 / p),
                };
                if let Some(order) = indices {
                    let within = if order == IndexOrder::RowMajor { best_i } else { column_major(best_i, axes) };
                    idx[line * last.output + ox] = (p * image + within) as i64;
                }
            }
        }
    };
    let work = min_items(plane * axes.iter().map(|a| a.kernel).product::<usize>() * ELEMENT_WORK);
    if indices.is_some() {
        let mut pairs: Vec<(&mut [f32], &mut [i64])> = out.chunks_mut(plane).zip(ind.chunks_mut(plane)).collect();
        par_chunks_mut(&mut pairs, 1, work, || (), |_, p, pair| {
            let (dst, idx) = &mut pair[0];
            pool_plane(p, dst, idx);
        });
    } else {
        par_chunks_mut(&mut out, plane, work, || (), |_, p, dst| pool_plane(p, dst, &mut []));
    }
    (out, ind)
}

/// The column-major offset (first axis fastest) of the element at row-major offset `flat`
/// of a plane over `axes`' input sizes.
fn column_major(mut flat: usize, axes: &[Axis]) -> usize {
    let coords: Vec<usize> = axes.iter().rev().map(|a| {
        let c = flat % a.input;
        flat /= a.input;
        c
    }).collect();
    let (mut at, mut stride) = (0, 1);
    for (c, a) in coords.iter().rev().zip(axes) {
        at += c * stride;
        stride *= a.input;
    }
    at
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

/// GlobalAveragePool, GlobalMaxPool and GlobalLpPool (`(sum |x|^p)^(1/p)`): each
/// `(n, c)` plane of an `(N, C, ...)` input reduced to one value.
fn global(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let max = info.node.op_type == "GlobalMaxPool";
    let lp = if info.node.op_type == "GlobalLpPool" { Some(lp_exponent(info)?) } else { None };
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() < 3 {
            return Err(kernel_error(format!("global pooling needs rank >= 3, got {s:?}")));
        }
        let plane: usize = s[2..].iter().product();
        let xv = to_f32(x)?;
        let reduce = |v: &[f32]| vectorized(|| match lp {
            Some(p) => lane_sum(v, |x| abs_pow(x, p)).powf(1.0 / p),
            None if max => v.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            None => lane_sum(v, |x| x) / plane as f32,
        });
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

/// Plans a MaxUnpool node (opsets 9, 11, 22): X `[N, C, D1, ..., Dr]`, int64 indices I of
/// X's shape, optional int64 `output_shape` (opset 11 on; rank r + 2). The unpooled shape is
/// `[N, C, (Di - 1) * stride_i - pad_begin_i - pad_end_i + kernel_i, ...]` (`kernel_shape`
/// required; `strides` default 1, `pads` default 0). Each X value goes to the flat position
/// its index names in a zero tensor of the unpooled shape (a later duplicate index wins);
/// with `output_shape` that tensor is placed at the start of a zero output of that shape,
/// which must be at least as large on every axis and keep N and C.
fn max_unpool(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let kernel_shape = info.attr_ints("kernel_shape").ok_or_else(|| info.error("'kernel_shape' is required"))?;
    let r = kernel_shape.len();
    let strides = info.attr_ints("strides").unwrap_or_else(|| vec![1; r]);
    let pads = info.attr_ints("pads").unwrap_or_else(|| vec![0; 2 * r]);
    if strides.len() != r || pads.len() != 2 * r {
        return Err(info.error(format!("kernel_shape {kernel_shape:?} needs {r} strides and {} pads; got strides {strides:?} and pads {pads:?}", 2 * r)));
    }
    if kernel_shape.iter().chain(&strides).any(|&v| v < 1) || pads.iter().any(|&p| p < 0) {
        return Err(info.error(format!("kernel_shape {kernel_shape:?} and strides {strides:?} must be positive and pads {pads:?} not negative")));
    }
    kernel(move |ins| {
        let (x, indices) = (input(ins, 0)?, input(ins, 1)?);
        let s = x.shape();
        if s.len() != r + 2 {
            return Err(kernel_error(format!("MaxUnpool: X has shape {s:?}; kernel_shape {kernel_shape:?} needs rank {}", r + 2)));
        }
        if indices.shape() != s {
            return Err(kernel_error(format!("MaxUnpool: indices have shape {:?}; X has shape {s:?}", indices.shape())));
        }
        let mut unpooled = s[..2].to_vec();
        for i in 0..r {
            let size = (s[i + 2] as i64 - 1).checked_mul(strides[i]).and_then(|v| v.checked_add(kernel_shape[i])).and_then(|v| v.checked_sub(pads[i] + pads[i + r]));
            match size.and_then(|v| usize::try_from(v).ok()) {
                Some(v) => unpooled.push(v),
                None => return Err(kernel_error(format!("MaxUnpool: spatial axis {i} of size {} with kernel {}, stride {} and pads {}+{} gives no valid output size", s[i + 2], kernel_shape[i], strides[i], pads[i], pads[i + r]))),
            }
        }
        let out: Vec<usize> = match opt_input(ins, 2) {
            Some(t) => {
                let v = ints(t, "MaxUnpool output_shape")?;
                let fits = v.len() == r + 2 && v[..2].iter().zip(&unpooled).all(|(&o, &u)| o == u as i64) && v[2..].iter().zip(&unpooled[2..]).all(|(&o, &u)| o >= u as i64);
                if !fits {
                    return Err(kernel_error(format!("MaxUnpool: output_shape {v:?} must have rank {} and hold the unpooled shape {unpooled:?}", r + 2)));
                }
                v.iter().map(|&d| d as usize).collect()
            }
            None => unpooled.clone(),
        };
        check_output_size("MaxUnpool output", x.dtype(), &out)?;
        let total: usize = unpooled.iter().product();
        let mut source: Vec<Option<usize>> = vec![None; total];
        for (j, idx) in ints(indices, "MaxUnpool indices")?.into_iter().enumerate() {
            match usize::try_from(idx).ok().filter(|&p| p < total) {
                Some(p) => source[p] = Some(j),
                None => return Err(kernel_error(format!("MaxUnpool: index {idx} is outside the unpooled tensor {unpooled:?} of {total} elements"))),
            }
        }
        let zero = cast_tensor(&qforge_ir::Tensor::scalar(0f32), x.dtype())?;
        let joined = concat_with_value(x, &zero)?;
        let fill = x.len();
        let unpooled_strides = strides_of(&unpooled);
        let out_strides = strides_of(&out);
        let out_len: usize = out.iter().product();
        let picks = (0..out_len).map(|o| {
            let mut at = 0;
            for (d, (&os, &us)) in out_strides.iter().zip(&unpooled_strides).enumerate() {
                let c = (o / os) % out[d];
                if c >= unpooled[d] {
                    return fill;
                }
                at += c * us;
            }
            source[at].unwrap_or(fill)
        });
        Ok(vec![gather_elements(&joined, &out, picks)?])
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Pooling of one output element by its definition: every tap of the window at output
    /// coordinates `pos`, skipping taps outside the input.
    fn naive_window(x: &[f32], axes: &[Axis], pos: &[usize]) -> (Vec<(usize, f32)>, usize) {
        let (mut inside, mut padded) = (vec![], 0);
        let taps: usize = axes.iter().map(|a| a.kernel).product();
        for t in 0..taps {
            let (mut rest, mut flat, mut ok, mut in_padded) = (t, 0, true, true);
            let mut k = vec![0; axes.len()];
            for (ki, a) in k.iter_mut().zip(axes).rev() {
                *ki = rest % a.kernel;
                rest /= a.kernel;
            }
            for ((&ki, a), &o) in k.iter().zip(axes).zip(pos) {
                let p = (o * a.stride + ki * a.dilation) as isize - a.pad_begin as isize;
                ok &= p >= 0 && p < a.input as isize;
                in_padded &= p < (a.input + a.pad_end) as isize;
                flat = flat * a.input + p.max(0) as usize;
            }
            padded += in_padded as usize;
            if ok {
                inside.push((flat, x[flat]));
            }
        }
        (inside, padded)
    }

    #[test]
    fn three_dimensional_pooling_matches_its_definition() {
        let window = Window { kernel: Some(vec![2, 3, 2]), strides: Some(vec![2, 1, 3]), dilations: Some(vec![1, 2, 1]), pads: Some(vec![1, 0, 1, 1, 2, 0]), auto_pad: "NOTSET".into(), ceil_mode: true };
        let dims = [5, 6, 7];
        let axes = window.axes(&dims, &[2, 3, 2]).unwrap();
        let image: usize = dims.iter().product();
        let planes = 3;
        let x: Vec<f32> = (0..planes * image).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let outs: Vec<usize> = axes.iter().map(|a| a.output).collect();
        let plane: usize = outs.iter().product();
        for mode in [PoolMode::Max { indices: Some(IndexOrder::RowMajor) }, PoolMode::Max { indices: Some(IndexOrder::ColumnMajor) }, PoolMode::Average { include_pad: false }, PoolMode::Average { include_pad: true }, PoolMode::Lp { p: 3.0 }] {
            // LpPool's caller passes |x|^p.
            let raised: Vec<f32> = match mode {
                PoolMode::Lp { p } => x.iter().map(|v| abs_pow(*v, p)).collect(),
                _ => x.clone(),
            };
            let (got, ind) = pool_nd(&raised, planes, &axes, mode);
            for (i, &g) in got.iter().enumerate() {
                let (p, o) = (i / plane, i % plane);
                let pos = [o / (outs[1] * outs[2]), o / outs[2] % outs[1], o % outs[2]];
                let (inside, padded) = naive_window(&x[p * image..(p + 1) * image], &axes, &pos);
                match mode {
                    PoolMode::Max { indices } => {
                        let (at, best) = inside.iter().fold((usize::MAX, f32::NEG_INFINITY), |(bi, b), &(j, v)| if bi == usize::MAX || v > b { (j, v) } else { (bi, b) });
                        assert_eq!(g, best, "{mode:?} element {i}");
                        let (z, y, xx) = (at / (dims[1] * dims[2]), at / dims[2] % dims[1], at % dims[2]);
                        let within = if indices == Some(IndexOrder::RowMajor) { at } else { z + y * dims[0] + xx * dims[0] * dims[1] };
                        assert_eq!(ind[i], (p * image + within) as i64, "{mode:?} element {i}");
                    }
                    PoolMode::Average { include_pad } => {
                        let sum: f32 = inside.iter().map(|&(_, v)| v).sum();
                        let count = if include_pad { padded } else { inside.len() };
                        assert!((g - sum / count as f32).abs() < 1e-5, "{mode:?} element {i}: {g} vs {}", sum / count as f32);
                    }
                    PoolMode::Lp { p } => {
                        let want = inside.iter().map(|&(_, v)| v.abs().powf(p)).sum::<f32>().powf(1.0 / p);
                        assert!((g - want).abs() < 1e-4 * want.max(1.0), "{mode:?} element {i}: {g} vs {want}");
                    }
                }
            }
        }
    }
}
