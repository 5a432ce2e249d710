//! Resize (opsets 10-19) and Upsample: nearest, linear and cubic (optionally antialiased),
//! separable per axis, with every coordinate transformation mode and aspect-ratio policy.

use qforge_ir::DType;
use super::elementwise::{from_f32, to_f32, values_f32, values_from_f32};
use super::util::{assume_init, input, ints, kernel, opt_input, par_chunks_mut, tensor, uninit};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers Resize and Upsample.
pub fn register(r: &mut Registry) {
    r.add("", "Resize", 10, LATEST, resize);
    r.add("", "Upsample", 7, 9, resize);
}

#[derive(Clone)]
struct Params {
    mode: String,
    coord: String,
    nearest: String,
    cubic_a: f32,
    exclude_outside: bool,
    extrapolation: f32,
    /// Index of the scales input (1 for opset 10 and Upsample 9, 2 for opset >= 11); `None`
    /// when scales come from an attribute (Upsample 7).
    scales_input: Option<usize>,
    scales_attr: Option<Vec<f32>>,
    axes: Option<Vec<i64>>,
    /// Whether linear and cubic filters widen by `1 / scale` when downsampling.
    antialias: bool,
    /// How output `sizes` are fitted to the input's aspect ratio.
    keep_aspect: KeepAspect,
}

/// Resize's `keep_aspect_ratio_policy` for output sizes given by `sizes`.
#[derive(Clone, Copy, PartialEq)]
enum KeepAspect {
    /// Every resized axis takes its requested size.
    Stretch,
    /// One scale for all resized axes, the smallest of the requested ones.
    NotLarger,
    /// One scale for all resized axes, the largest of the requested ones.
    NotSmaller,
}

/// Interpolation taps for one output coordinate: (input index, weight). `x_out` is the
/// output index along an axis of `in_len` inputs resized to `out_len` outputs by `scale`;
/// `roi` is the axis's region of interest for `tf_crop_and_resize`. No taps means the
/// extrapolation value.
fn taps(p: &Params, x_out: usize, in_len: usize, out_len: usize, scale: f32, roi: (f32, f32)) -> Vec<(usize, f32)> {
    let x = x_out as f32;
    let (n_in, n_out) = (in_len as f32, out_len as f32);
    let x_ori = match p.coord.as_str() {
        "half_pixel" => (x + 0.5) / scale - 0.5,
        "half_pixel_symmetric" => {
            let adj = n_out / (scale * n_in);
            let center = n_in / 2.0;
            center * (1.0 - adj) + (x + 0.5) / scale - 0.5
        }
        "pytorch_half_pixel" => if out_len > 1 { (x + 0.5) / scale - 0.5 } else { 0.0 },
        "align_corners" => {
            // The resized length is the unrounded `scale * in_len`, as the ONNX reference has it.
            let resized = scale * n_in;
            if resized == 1.0 || out_len == 1 { 0.0 } else { x * (n_in - 1.0) / (resized - 1.0) }
        }
        "tf_half_pixel_for_nn" => (x + 0.5) / scale,
        "tf_crop_and_resize" => if out_len > 1 { roi.0 * (n_in - 1.0) + x * (roi.1 - roi.0) * (n_in - 1.0) / (n_out - 1.0) } else { 0.5 * (roi.0 + roi.1) * (n_in - 1.0) },
        _ => x / scale,
    };
    let last = in_len as isize - 1;
    if p.coord == "tf_crop_and_resize" && (x_ori < 0.0 || x_ori > n_in - 1.0) {
        return vec![];
    }
    match p.mode.as_str() {
        "nearest" => {
            let i = match p.nearest.as_str() {
                "round_prefer_ceil" => (x_ori + 0.5).floor(),
                "floor" => x_ori.floor(),
                "ceil" => x_ori.ceil(),
                _ => if x_ori == x_ori.floor() + 0.5 { x_ori.floor() } else { x_ori.round() },
            } as isize;
            vec![(i.clamp(0, last) as usize, 1.0)]
        }
        "linear" | "cubic" if p.antialias => antialiased_taps(p, x_ori, in_len, scale),
        "linear" => {
            let xc = x_ori.clamp(0.0, n_in - 1.0);
            let i0 = xc.floor() as isize;
            let i1 = (i0 + 1).min(last);
            let w = xc - i0 as f32;
            vec![(i0 as usize, 1.0 - w), (i1 as usize, w)]
        }
        _ => {
            let a = p.cubic_a;
            let i0 = x_ori.floor();
            let t = x_ori - i0;
            let coeff = |d: f32| {
                let d = d.abs();
                if d <= 1.0 { ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0 } else if d < 2.0 { ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a } else { 0.0 }
            };
            let mut v: Vec<(usize, f32)> = vec![];
            let mut total = 0.0;
            for k in -1..=2isize {
                let idx = i0 as isize + k;
                let w = coeff(t - k as f32);
                if p.exclude_outside && (idx < 0 || idx > last) {
                    continue;
                }
                total += w;
                v.push((idx.clamp(0, last) as usize, w));
            }
            if p.exclude_outside && total != 0.0 {
                v.iter_mut().for_each(|x| x.1 /= total);
            }
            v
        }
    }
}

/// The taps of an antialiased linear or cubic filter at input coordinate `x_ori` along an
/// axis of `in_len` inputs resized by `scale`: when downsampling the filter's support widens
/// by `1 / scale` (its argument shrinks by `scale`), so every input within the support
/// contributes; the weights are normalized to sum to one. Taps past the ends read the edge
/// input, or with `exclude_outside` are dropped and the rest renormalized.
fn antialiased_taps(p: &Params, x_ori: f32, in_len: usize, scale: f32) -> Vec<(usize, f32)> {
    let s = scale.min(1.0);
    // Taps at offsets `first..1 - first` from the input just left of `x_ori` (or from the one
    // before `x_ori`, when it is an input position): `ratio` is in (0, 1].
    let radius = if p.mode == "cubic" { 2.0 } else { 1.0 };
    let first = (-radius / s).floor() as isize + 1;
    let base = x_ori.floor();
    let (left, ratio) = if x_ori == base { (base as isize - 1, 1.0) } else { (base as isize, x_ori - base) };
    let a = p.cubic_a;
    let weight = |d: f32| {
        let d = d.abs();
        if p.mode == "linear" {
            (1.0 - d).clamp(0.0, 1.0)
        } else if d <= 1.0 {
            ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0
        } else if d < 2.0 {
            ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a
        } else {
            0.0
        }
    };
    let last = in_len as isize - 1;
    let mut v: Vec<(isize, f32)> = (first..1 - first + 1).map(|k| (left + k, weight(s * (k as f32 - ratio)))).collect();
    let total: f32 = v.iter().map(|t| t.1).sum();
    v.iter_mut().for_each(|t| t.1 /= total);
    if p.exclude_outside {
        v.retain(|t| (0..=last).contains(&t.0));
        let kept: f32 = v.iter().map(|t| t.1).sum();
        if kept != 0.0 {
            v.iter_mut().for_each(|t| t.1 /= kept);
        }
    }
    v.into_iter().map(|(i, w)| (i.clamp(0, last) as usize, w)).collect()
}

/// Nearest-neighbour resize as one gather: `tables[a][o]` is the source index along axis `a`
/// of output index `o`. Output rows are filled in parallel, a run of rows per task; a row
/// whose source row is the one before it (a height scaled up) is a copy of that row. Any
/// element type: 8-bit tensors are gathered as bytes, other types as their `f32` values.
fn nearest<T: Copy + Send + Sync>(x: &[T], s: &[usize], out: &[usize], tables: &[Vec<usize>]) -> Vec<T> {
    /// Output elements per task, in whole rows.
    const TASK: usize = 1 << 14;
    let r = s.len();
    let (ow, last) = (out[r - 1], &tables[r - 1]);
    let n: usize = out.iter().product();
    if n == 0 {
        return Vec::new();
    }
    let ist = super::shape::strides(s);
    // The flat offset of output row `row`'s source row.
    let source = |row: usize| {
        let (mut rem, mut off) = (row, 0);
        for a in (0..r - 1).rev() {
            off += tables[a][rem % out[a]] * ist[a];
            rem /= out[a];
        }
        off
    };
    let rows = (TASK / ow).max(1);
    let mut dst = uninit::<T>(n);
    par_chunks_mut(&mut dst, rows * ow, 1, || (), |_, task, d| {
        let mut previous = None;
        for (i, row) in (task * rows..).take(d.len() / ow).enumerate() {
            let off = source(row);
            let (done, rest) = d.split_at_mut(i * ow);
            if previous == Some(off) {
                rest[..ow].copy_from_slice(&done[(i - 1) * ow..]);
            } else {
                let src = &x[off..off + s[r - 1]];
                for (o, &j) in rest[..ow].iter_mut().zip(last) {
                    o.write(src[j]);
                }
            }
            previous = Some(off);
        }
    });
    // SAFETY: every row of every task was gathered or copied from a gathered row.
    unsafe { assume_init(dst) }
}

fn resize(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let upsample = info.node.op_type == "Upsample";
    let mode = info.attr_str("mode", "nearest").to_lowercase();
    let mode = match mode.as_str() { "bilinear" | "trilinear" => "linear".to_string(), m => m.to_string() };
    if !["nearest", "linear", "cubic"].contains(&mode.as_str()) {
        return Err(info.error(format!("unknown mode '{mode}'")));
    }
    let legacy = upsample || info.opset == 10;
    let p = Params {
        mode,
        coord: if legacy { "asymmetric".into() } else { info.attr_str("coordinate_transformation_mode", "half_pixel") },
        nearest: if legacy { "floor".into() } else { info.attr_str("nearest_mode", "round_prefer_floor") },
        cubic_a: info.attr_float("cubic_coeff_a", -0.75),
        exclude_outside: info.attr_int("exclude_outside", 0) != 0,
        extrapolation: info.attr_float("extrapolation_value", 0.0),
        scales_input: if upsample && info.opset < 9 { None } else if legacy { Some(1) } else { Some(2) },
        scales_attr: info.node.attr("scales").and_then(|a| match a { qforge_ir::Attr::Floats(v) => Some(v.clone()), _ => None }),
        axes: info.attr_ints("axes"),
        antialias: info.attr_int("antialias", 0) != 0,
        keep_aspect: match info.attr_str("keep_aspect_ratio_policy", "stretch").as_str() {
            "stretch" => KeepAspect::Stretch,
            "not_larger" => KeepAspect::NotLarger,
            "not_smaller" => KeepAspect::NotSmaller,
            other => return Err(info.error(format!("keep_aspect_ratio_policy '{other}' is not one of stretch, not_larger, not_smaller"))),
        },
    };
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape().to_vec();
        let r = s.len();
        let axes: Vec<usize> = match &p.axes {
            Some(a) => a.iter().map(|&v| super::util::axis(v, r)).collect::<RuntimeResult<_>>()?,
            None => (0..r).collect(),
        };
        let scales_t = p.scales_input.and_then(|i| opt_input(ins, i)).filter(|t| !t.is_empty());
        let sizes_t = if p.scales_input == Some(2) { opt_input(ins, 3).filter(|t| !t.is_empty()) } else { None };
        let roi_t = if p.scales_input == Some(2) { opt_input(ins, 1).filter(|t| !t.is_empty()) } else { None };
        let mut scales = vec![1f32; r];
        let mut out = s.clone();
        if let Some(sz) = sizes_t {
            let v = ints(sz, "sizes")?;
            if v.len() != axes.len() { return Err(kernel_error("sizes do not match the axes")); }
            for (k, &a) in axes.iter().enumerate() {
                out[a] = v[k].max(0) as usize;
                scales[a] = out[a] as f32 / s[a] as f32;
            }
            if p.keep_aspect != KeepAspect::Stretch && !axes.is_empty() {
                let requested = axes.iter().map(|&a| out[a] as f64 / s[a] as f64);
                let scale = if p.keep_aspect == KeepAspect::NotLarger { requested.fold(f64::INFINITY, f64::min) } else { requested.fold(f64::NEG_INFINITY, f64::max) };
                for &a in &axes {
                    scales[a] = scale as f32;
                    out[a] = (scale * s[a] as f64 + 0.5).floor() as usize;
                }
            }
        } else {
            let v: Vec<f32> = match (scales_t, &p.scales_attr) {
                (Some(t), _) => to_f32(t)?.into_owned(),
                (None, Some(v)) => v.clone(),
                _ => return Err(kernel_error("Resize needs scales or sizes")),
            };
            if v.len() != axes.len() { return Err(kernel_error(format!("{} scales for rank {r}", v.len()))); }
            for (k, &a) in axes.iter().enumerate() {
                scales[a] = v[k];
                out[a] = (s[a] as f32 * v[k]).floor() as usize;
            }
        }
        let roi: Vec<(f32, f32)> = match roi_t {
            Some(t) => {
                let v = to_f32(t)?;
                let n = v.len() / 2;
                (0..r).map(|i| axes.iter().position(|&a| a == i).map_or((0.0, 1.0), |k| (v[k], v[k + n]))).collect()
            }
            None => vec![(0.0, 1.0); r],
        };
        if p.mode == "nearest" && p.coord != "tf_crop_and_resize" {
            let tables: Vec<Vec<usize>> = (0..r).map(|a| (0..out[a]).map(|o| taps(&p, o, s[a], out[a], scales[a], roi[a])[0].0).collect()).collect();
            return Ok(vec![match x.dtype() {
                DType::U8 => tensor(&out, nearest(x.as_slice::<u8>().map_err(|e| kernel_error(e.to_string()))?, &s, &out, &tables))?,
                DType::I8 => tensor(&out, nearest(x.as_slice::<i8>().map_err(|e| kernel_error(e.to_string()))?, &s, &out, &tables))?,
                _ => values_from_f32(x.dtype(), &out, nearest(&values_f32(x)?, &s, &out, &tables))?,
            }]);
        }
        let mut data = to_f32(x)?.into_owned();
        let mut shape = s.clone();
        for a in 0..r {
            if out[a] == shape[a] && scales[a] == 1.0 && p.coord != "tf_crop_and_resize" {
                continue;
            }
            let outer: usize = shape[..a].iter().product();
            let inner: usize = shape[a + 1..].iter().product();
            let tp: Vec<Vec<(usize, f32)>> = (0..out[a]).map(|o| taps(&p, o, shape[a], out[a], scales[a], roi[a])).collect();
            let mut next = vec![0f32; outer * out[a] * inner];
            for o in 0..outer {
                for (j, t) in tp.iter().enumerate() {
                    let dst = &mut next[(o * out[a] + j) * inner..(o * out[a] + j + 1) * inner];
                    if t.is_empty() {
                        dst.fill(p.extrapolation);
                        continue;
                    }
                    for &(i, w) in t {
                        let src = &data[(o * shape[a] + i) * inner..(o * shape[a] + i + 1) * inner];
                        if w == 1.0 && t.len() == 1 {
                            dst.copy_from_slice(src);
                        } else {
                            dst.iter_mut().zip(src).for_each(|(d, s)| *d += w * s);
                        }
                    }
                }
            }
            data = next;
            shape[a] = out[a];
        }
        Ok(vec![from_f32(x.dtype(), &shape, data)?])
    })
}
