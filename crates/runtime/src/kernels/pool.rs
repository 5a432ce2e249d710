//! Pooling: MaxPool, AveragePool, their global forms, and LRN. NC(H)W, 1-D or 2-D.

use rayon::prelude::*;

use super::conv::Window;
use super::elementwise::{from_f32, to_f32, values_f32, values_from_f32};
use super::util::{input, kernel, tensor};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

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
        let xv = if max { values_f32(x)? } else { to_f32(x)? };
        let mut out = vec![0f32; n * c * oh * ow];
        let planes: Vec<(usize, &mut [f32])> = out.chunks_mut(oh * ow).enumerate().collect();
        let results: Vec<Vec<i64>> = planes.into_par_iter().map(|(p, dst)| {
            let src = &xv[p * ih * iw..(p + 1) * ih * iw];
            let mut ind = vec![];
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut best, mut best_i, mut sum, mut count) = (f32::NEG_INFINITY, 0usize, 0f32, 0usize);
                    for ki in 0..kh {
                        let iy = (oy * h.stride + ki * h.dilation) as isize - h.pad_begin as isize;
                        for kj in 0..kw {
                            let ix = (ox * w.stride + kj * w.dilation) as isize - w.pad_begin as isize;
                            let inside = iy >= 0 && iy < ih as isize && ix >= 0 && ix < iw as isize;
                            if inside {
                                let v = src[iy as usize * iw + ix as usize];
                                if v > best || (best.is_infinite() && count == 0) {
                                    best = v;
                                    best_i = iy as usize * iw + ix as usize;
                                }
                                sum += v;
                                count += 1;
                            } else if include_pad {
                                // Padding counts only up to the padded extent, not beyond (ceil_mode).
                                let in_pad = iy < (ih + h.pad_end) as isize && ix < (iw + w.pad_end) as isize;
                                if in_pad { count += 1; }
                            }
                        }
                    }
                    dst[oy * ow + ox] = if max { best } else if count > 0 { sum / count as f32 } else { 0.0 };
                    if wants_indices {
                        let (y, x) = (best_i / iw, best_i % iw);
                        let flat = if storage_order == 0 { (p * ih + y) * iw + x } else { p * ih * iw + x * ih + y };
                        ind.push(flat as i64);
                    }
                }
            }
            ind
        }).collect();
        let shape = if one_d { vec![n, c, ow] } else { vec![n, c, oh, ow] };
        let mut outs = vec![values_from_f32(x.dtype(), &shape, out)?];
        if wants_indices {
            outs.push(tensor(&shape, results.into_iter().flatten().collect::<Vec<i64>>())?);
        }
        Ok(outs)
    })
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
        let out: Vec<f32> = xv.par_chunks(plane.max(1)).take(s[0] * s[1]).map(|p| {
            if max { p.iter().copied().fold(f32::NEG_INFINITY, f32::max) } else { p.iter().sum::<f32>() / plane as f32 }
        }).collect();
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
