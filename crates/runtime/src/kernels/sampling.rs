//! Spatial sampling: GridSample (values at normalized grid locations), AffineGrid (the grid
//! of an affine transform) and RoiAlign (bilinear pooling over regions of interest).

use qforge_ir::DType;

use super::elementwise::{from_f32, to_f32};
use super::shape::cast_tensor;
use super::util::{check_output_size, input, ints, kernel, par_chunks_mut, tensor};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers GridSample, AffineGrid and RoiAlign.
pub fn register(r: &mut Registry) {
    r.add("", "GridSample", 16, LATEST, grid_sample);
    r.add("", "AffineGrid", 20, LATEST, affine_grid);
    r.add("", "RoiAlign", 10, LATEST, roi_align);
}

/// How GridSample interpolates between input elements.
#[derive(Clone, Copy, PartialEq)]
enum Interpolation {
    Nearest,
    Linear,
    Cubic,
}

/// How GridSample treats locations outside the input.
#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

#[derive(Clone, Copy)]
struct GridSampleParams {
    mode: Interpolation,
    padding: Padding,
    align_corners: bool,
}

/// Up to four taps along one spatial axis: element offsets (index times the axis's stride)
/// and weights.
#[derive(Clone, Copy, Default)]
struct AxisTaps {
    len: usize,
    offset: [usize; 4],
    weight: [f32; 4],
}

impl AxisTaps {
    fn push(&mut self, offset: usize, weight: f32) {
        self.offset[self.len] = offset;
        self.weight[self.len] = weight;
        self.len += 1;
    }
}

/// `x` reflected between `lo` and `hi` until it lies within them (`lo` when they coincide).
fn reflect(x: f32, lo: f32, hi: f32) -> f32 {
    let range = hi - lo;
    if range <= 0.0 {
        return lo;
    }
    let (dx, from_lo) = if x < lo { (lo - x, true) } else if x > hi { (x - hi, false) } else { return x };
    let flips = (dx / range).floor();
    let rest = dx - flips * range;
    let even = flips % 2.0 == 0.0;
    if even == from_lo { lo + rest } else { hi - rest }
}

/// Keys' cubic convolution weights (a = -0.75) of the four taps at `-1, 0, 1, 2` relative to
/// the integer part of a location whose fractional part is `t`.
fn cubic_weights(t: f32) -> [f32; 4] {
    const A: f32 = -0.75;
    let near = |d: f32| ((A + 2.0) * d - (A + 3.0)) * d * d + 1.0;
    let far = |d: f32| ((A * d - 5.0 * A) * d + 8.0 * A) * d - 4.0 * A;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

impl GridSampleParams {
    /// The input location (in elements) of normalized coordinate `g` along an axis of `len`.
    fn denormalize(&self, g: f32, len: usize) -> f32 {
        let n = len as f32;
        if self.align_corners { (g + 1.0) / 2.0 * (n - 1.0) } else { ((g + 1.0) * n - 1.0) / 2.0 }
    }

    /// The extent of the input along an axis of `len` that grid values in `[-1, 1]` cover.
    fn bounds(&self, len: usize) -> (f32, f32) {
        if self.align_corners { (0.0, len as f32 - 1.0) } else { (-0.5, len as f32 - 0.5) }
    }

    /// The in-range index that integer position `i` reads under the padding mode, or `None`
    /// when it reads zero.
    fn pixel(&self, i: f32, len: usize) -> Option<usize> {
        let last = len as f32 - 1.0;
        match self.padding {
            Padding::Zeros => (i >= 0.0 && i <= last).then_some(i as usize),
            Padding::Border => Some(i.clamp(0.0, last) as usize),
            Padding::Reflection => {
                let (lo, hi) = self.bounds(len);
                Some((reflect(i, lo, hi).trunc()).clamp(0.0, last) as usize)
            }
        }
    }

    /// The taps along one axis of `len` elements (`len > 0`) with element stride `stride`
    /// for normalized coordinate `g`.
    fn axis_taps(&self, g: f32, len: usize, stride: usize) -> AxisTaps {
        let mut x = self.denormalize(g, len);
        if self.mode == Interpolation::Nearest {
            x = x.round_ties_even();
        }
        let (lo, hi) = self.bounds(len);
        if x < lo || x > hi {
            match self.padding {
                Padding::Border => x = x.clamp(0.0, len as f32 - 1.0),
                Padding::Reflection => x = reflect(x, lo, hi),
                Padding::Zeros => {}
            }
        }
        let mut taps = AxisTaps::default();
        let mut add = |i: f32, w: f32| {
            if let Some(k) = self.pixel(i, len) {
                taps.push(k * stride, w);
            }
        };
        match self.mode {
            Interpolation::Nearest => add(x.trunc(), 1.0),
            Interpolation::Linear => {
                let x0 = x.floor();
                let t = x - x0;
                add(x0, 1.0 - t);
                add(x0 + 1.0, t);
            }
            Interpolation::Cubic => {
                let x0 = x.floor();
                for (k, w) in cubic_weights(x - x0).into_iter().enumerate() {
                    add(x0 + k as f32 - 1.0, w);
                }
            }
        }
        taps
    }
}

/// GridSample (opset 16: 4-D input, modes `bilinear`/`nearest`/`bicubic`; opset 20+: any
/// number of spatial axes, modes `linear`/`nearest`/`cubic`). `X` is `(N, C, D1..Dr)`,
/// `grid` is `(N, O1..Or, r)` with normalized locations listed innermost axis first; `Y` is
/// `(N, C, O1..Or)`. Float inputs are sampled in f32; integer inputs are sampled as floats and
/// truncated back.
fn grid_sample(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let legacy = info.opset < 20;
    let mode_name = info.attr_str("mode", if legacy { "bilinear" } else { "linear" });
    let mode = match (mode_name.as_str(), legacy) {
        ("nearest", _) => Interpolation::Nearest,
        ("bilinear", true) | ("linear", false) => Interpolation::Linear,
        ("bicubic", true) | ("cubic", false) => Interpolation::Cubic,
        (m, true) => return Err(info.error(format!("mode '{m}' is not one of bilinear, nearest, bicubic (opset {})", info.opset))),
        (m, false) => return Err(info.error(format!("mode '{m}' is not one of linear, nearest, cubic (opset {})", info.opset))),
    };
    let padding = match info.attr_str("padding_mode", "zeros").as_str() {
        "zeros" => Padding::Zeros,
        "border" => Padding::Border,
        "reflection" => Padding::Reflection,
        p => return Err(info.error(format!("padding_mode '{p}' is not one of zeros, border, reflection"))),
    };
    let params = GridSampleParams { mode, padding, align_corners: info.attr_int("align_corners", 0) != 0 };
    kernel(move |ins| {
        let (x, grid) = (input(ins, 0)?, input(ins, 1)?);
        let (xs, gs) = (x.shape(), grid.shape());
        if legacy && xs.len() != 4 {
            return Err(kernel_error(format!("X must be 4-D (N, C, H, W) at opset 16, got shape {xs:?}")));
        }
        if xs.len() < 3 {
            return Err(kernel_error(format!("X must have rank 3 or more (N, C, spatial...), got shape {xs:?}")));
        }
        let r = xs.len() - 2;
        if gs.len() != r + 2 || gs[0] != xs[0] || gs[r + 1] != r {
            return Err(kernel_error(format!("grid must have shape (N, out spatial..., {r}) with N = {} for X of shape {xs:?}, got {gs:?}", xs[0])));
        }
        let (n, c) = (xs[0], xs[1]);
        let spatial = &xs[2..];
        let out_spatial = &gs[1..=r];
        let mut out_shape = vec![n, c];
        out_shape.extend_from_slice(out_spatial);
        check_output_size("GridSample output", x.dtype(), &out_shape)?;
        let points: usize = out_spatial.iter().product();
        let plane: usize = spatial.iter().product();
        let compute_type = if x.dtype().is_float() { x.dtype() } else { DType::F32 };
        let xf = match x.dtype() {
            DType::Bool | DType::String => return Err(kernel_error(format!("X of type {} cannot be sampled", x.dtype()))),
            d if d.is_float() => x.clone(),
            _ => cast_tensor(x, DType::F32)?,
        };
        let xv = to_f32(&xf)?;
        let gv = to_f32(grid).map_err(|_| kernel_error(format!("grid must be a float tensor, got {}", grid.dtype())))?;
        let total = n * c * points;
        let mut by_point = vec![0f32; total];
        if total > 0 && plane == 0 && padding != Padding::Zeros {
            return Err(kernel_error(format!("X has an empty spatial axis (shape {xs:?}); only padding_mode zeros can sample it")));
        }
        if total > 0 && plane > 0 {
            let strides = super::shape::strides(spatial);
            let (xv, gv) = (&xv[..], &gv[..]);
            let init = || (Vec::<(usize, f32)>::new(), Vec::<(usize, f32)>::new());
            par_chunks_mut(&mut by_point, c, 64, init, |(taps, next), i, out| {
                let (b, p) = (i / points, i % points);
                let coords = &gv[(b * points + p) * r..(b * points + p + 1) * r];
                taps.clear();
                taps.push((0, 1.0));
                for a in 0..r {
                    let t = params.axis_taps(coords[r - 1 - a], spatial[a], strides[a]);
                    next.clear();
                    for &(off, w) in taps.iter() {
                        for k in 0..t.len {
                            next.push((off + t.offset[k], w * t.weight[k]));
                        }
                    }
                    std::mem::swap(taps, next);
                }
                for (ch, o) in out.iter_mut().enumerate() {
                    let src = &xv[(b * c + ch) * plane..(b * c + ch + 1) * plane];
                    *o = taps.iter().map(|&(off, w)| w * src[off]).sum();
                }
            });
        }
        let mut y = vec![0f32; total];
        for b in 0..n {
            for p in 0..points {
                for ch in 0..c {
                    y[(b * c + ch) * points + p] = by_point[(b * points + p) * c + ch];
                }
            }
        }
        let sampled = from_f32(compute_type, &out_shape, y)?;
        Ok(vec![if compute_type == x.dtype() { sampled } else { cast_tensor(&sampled, x.dtype())? }])
    })
}

/// AffineGrid (opset 20): for `theta` of shape `(N, 2, 3)` and `size` `(N, C, H, W)`, the
/// grid `(N, H, W, 2)` of `theta` applied to the normalized locations `(x, y, 1)` of the
/// output pixels; for `(N, 3, 4)` and `(N, C, D, H, W)`, the grid `(N, D, H, W, 3)`.
/// Locations are pixel centers in `[-1, 1]` (`align_corners=0`) or span the corner pixels'
/// centers (`align_corners=1`).
fn affine_grid(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let align_corners = info.attr_int("align_corners", 0) != 0;
    kernel(move |ins| {
        let (theta, size) = (input(ins, 0)?, input(ins, 1)?);
        let size = ints(size, "size")?;
        let r = match size.len() {
            4 => 2,
            5 => 3,
            k => return Err(kernel_error(format!("size must have 4 (N, C, H, W) or 5 (N, C, D, H, W) elements, got {k}"))),
        };
        let dims: Vec<usize> = size.iter().map(|&d| usize::try_from(d).map_err(|_| kernel_error(format!("size {size:?} has a negative dimension")))).collect::<RuntimeResult<_>>()?;
        let n = dims[0];
        if theta.shape() != [n, r, r + 1] {
            return Err(kernel_error(format!("theta must have shape [{n}, {r}, {}] for size {size:?}, got {:?}", r + 1, theta.shape())));
        }
        let spatial = &dims[2..];
        let mut out_shape = vec![n];
        out_shape.extend_from_slice(spatial);
        out_shape.push(r);
        check_output_size("AffineGrid output", theta.dtype(), &out_shape)?;
        let th = theta.to_f64_vec().map_err(|_| kernel_error(format!("theta must be a float tensor, got {}", theta.dtype())))?;
        let location = |i: usize, len: usize| -> f64 {
            let (i, len) = (i as f64, len as f64);
            if align_corners {
                if len <= 1.0 { -1.0 } else { -1.0 + 2.0 * i / (len - 1.0) }
            } else {
                -1.0 + (2.0 * i + 1.0) / len
            }
        };
        let points: usize = spatial.iter().product();
        let mut out = Vec::with_capacity(n * points * r);
        let mut homog = vec![0f64; r + 1];
        for b in 0..n {
            let m = &th[b * r * (r + 1)..(b + 1) * r * (r + 1)];
            for p in 0..points {
                let mut rem = p;
                for a in (0..r).rev() {
                    homog[r - 1 - a] = location(rem % spatial[a], spatial[a]);
                    rem /= spatial[a];
                }
                homog[r] = 1.0;
                for row in m.chunks_exact(r + 1) {
                    out.push(row.iter().zip(&homog).map(|(a, b)| a * b).sum::<f64>());
                }
            }
        }
        Ok(vec![match theta.dtype() {
            DType::F64 => tensor(&out_shape, out)?,
            d => from_f32(d, &out_shape, out.into_iter().map(|v| v as f32).collect())?,
        }])
    })
}

/// One bilinear sample of RoiAlign: four element offsets within a channel plane and their
/// weights (all zero for a sample outside the feature map).
#[derive(Clone, Copy, Default)]
struct BilinearSample {
    offset: [usize; 4],
    weight: [f32; 4],
}

/// The location `v` (at least -1) along an axis of `size` elements clamped into it, with the
/// indices of the elements below and above it (the last element twice at the far end).
fn neighbours(v: f64, size: usize) -> (f64, usize, usize) {
    let v = v.max(0.0);
    let low = v as usize;
    if low >= size - 1 { ((size - 1) as f64, size - 1, size - 1) } else { (v, low, low + 1) }
}

/// The bilinear sample at `(y, x)` of an `height x width` plane.
fn bilinear_sample(y: f64, x: f64, height: usize, width: usize) -> BilinearSample {
    let (h, w) = (height as f64, width as f64);
    if y < -1.0 || y > h || x < -1.0 || x > w || y.is_nan() || x.is_nan() {
        return BilinearSample::default();
    }
    let (y, y_low, y_high) = neighbours(y, height);
    let (x, x_low, x_high) = neighbours(x, width);
    let (ly, lx) = (y - y_low as f64, x - x_low as f64);
    let (hy, hx) = (1.0 - ly, 1.0 - lx);
    BilinearSample {
        offset: [y_low * width + x_low, y_low * width + x_high, y_high * width + x_low, y_high * width + x_high],
        weight: [(hy * hx) as f32, (hy * lx) as f32, (ly * hx) as f32, (ly * lx) as f32],
    }
}

/// Most bilinear samples one region may take (regions larger than this need a
/// `sampling_ratio`).
const MAX_ROI_SAMPLES: usize = 1 << 26;

/// RoiAlign (opsets 10 and 16): `X` `(N, C, H, W)`, `rois` `(R, 4)` as `[x1, y1, x2, y2]`
/// scaled by `spatial_scale`, `batch_indices` `(R)`; `Y` `(R, C, output_height,
/// output_width)`, each bin the average (`mode=avg`) or maximum (`mode=max`, of the weighted
/// corner values, as ONNX Runtime defines it) of a grid of bilinear samples: `sampling_ratio`
/// per axis, or `ceil(roi size / bins)` when 0. `coordinate_transformation_mode`
/// (opset 16, default `half_pixel`) shifts regions by -0.5 pixel; `output_half_pixel` (the
/// only behaviour of opset 10) does not, and enlarges regions to at least one pixel.
fn roi_align(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let half_pixel = match info.attr_str("coordinate_transformation_mode", if info.opset >= 16 { "half_pixel" } else { "output_half_pixel" }).as_str() {
        "half_pixel" => true,
        "output_half_pixel" => false,
        m => return Err(info.error(format!("coordinate_transformation_mode '{m}' is not one of half_pixel, output_half_pixel"))),
    };
    let max_mode = match info.attr_str("mode", "avg").as_str() {
        "avg" => false,
        "max" => true,
        m => return Err(info.error(format!("mode '{m}' is not one of avg, max"))),
    };
    let (oh, ow) = (info.attr_int("output_height", 1), info.attr_int("output_width", 1));
    if oh < 1 || ow < 1 {
        return Err(info.error(format!("output_height and output_width must be positive, got {oh} and {ow}")));
    }
    let (oh, ow) = (oh as usize, ow as usize);
    let sampling_ratio = info.attr_int("sampling_ratio", 0);
    if sampling_ratio < 0 {
        return Err(info.error(format!("sampling_ratio must not be negative, got {sampling_ratio}")));
    }
    let spatial_scale = info.attr_float("spatial_scale", 1.0) as f64;
    kernel(move |ins| {
        let (x, rois, batch) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let xs = x.shape();
        if xs.len() != 4 {
            return Err(kernel_error(format!("X must be 4-D (N, C, H, W), got shape {xs:?}")));
        }
        let (n, c, height, width) = (xs[0], xs[1], xs[2], xs[3]);
        let num_rois = rois.shape().first().copied().unwrap_or(0);
        if rois.shape() != [num_rois, 4] {
            return Err(kernel_error(format!("rois must have shape (num_rois, 4), got {:?}", rois.shape())));
        }
        if batch.shape() != [num_rois] {
            return Err(kernel_error(format!("batch_indices must have shape [{num_rois}] to match rois, got {:?}", batch.shape())));
        }
        let batch = ints(batch, "batch_indices")?;
        if let Some(&b) = batch.iter().find(|&&b| b < 0 || b as u64 >= n as u64) {
            return Err(kernel_error(format!("batch index {b} is out of range for a batch of {n}")));
        }
        let out_shape = [num_rois, c, oh, ow];
        check_output_size("RoiAlign output", x.dtype(), &out_shape)?;
        if num_rois > 0 && c > 0 && (height == 0 || width == 0) {
            return Err(kernel_error(format!("X has an empty feature map ({height} x {width})")));
        }
        let xv = to_f32(x)?;
        let boxes = rois.to_f64_vec().map_err(|_| kernel_error(format!("rois must be a float tensor, got {}", rois.dtype())))?;
        let per_roi = c * oh * ow;
        let mut y = vec![0f32; num_rois * per_roi];
        let failure = std::sync::Mutex::new(None);
        let xv = &xv[..];
        par_chunks_mut(&mut y, per_roi.max(1), 1, Vec::<BilinearSample>::new, |samples, r, out| {
            let offset = if half_pixel { 0.5 } else { 0.0 };
            let b = &boxes[r * 4..r * 4 + 4];
            let (start_w, start_h) = (b[0] * spatial_scale - offset, b[1] * spatial_scale - offset);
            let (end_w, end_h) = (b[2] * spatial_scale - offset, b[3] * spatial_scale - offset);
            let (mut roi_w, mut roi_h) = (end_w - start_w, end_h - start_h);
            if !half_pixel {
                roi_w = roi_w.max(1.0);
                roi_h = roi_h.max(1.0);
            }
            let (bin_h, bin_w) = (roi_h / oh as f64, roi_w / ow as f64);
            let grid = |ratio: f64| if sampling_ratio > 0 { sampling_ratio as f64 } else { ratio.ceil().max(0.0) };
            let (grid_h, grid_w) = (grid(bin_h), grid(bin_w));
            if grid_h * grid_w * (oh * ow) as f64 > MAX_ROI_SAMPLES as f64 {
                *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("region {r} ({b:?}) needs {grid_h} x {grid_w} samples per bin; more than {MAX_ROI_SAMPLES} in all"));
                return;
            }
            let (grid_h, grid_w) = (grid_h as usize, grid_w as usize);
            let count = (grid_h * grid_w).max(1) as f32;
            samples.clear();
            for ph in 0..oh {
                for pw in 0..ow {
                    for iy in 0..grid_h {
                        let yy = start_h + ph as f64 * bin_h + (iy as f64 + 0.5) * bin_h / grid_h as f64;
                        for ix in 0..grid_w {
                            let xx = start_w + pw as f64 * bin_w + (ix as f64 + 0.5) * bin_w / grid_w as f64;
                            samples.push(bilinear_sample(yy, xx, height, width));
                        }
                    }
                }
            }
            let per_bin = grid_h * grid_w;
            let image = batch[r] as usize;
            for (ch, dst) in out.chunks_exact_mut(oh * ow).enumerate() {
                let src = &xv[(image * c + ch) * height * width..(image * c + ch + 1) * height * width];
                for (bin, d) in dst.iter_mut().enumerate() {
                    let taps = &samples[bin * per_bin..(bin + 1) * per_bin];
                    let weighted = |s: &BilinearSample| -> [f32; 4] { std::array::from_fn(|k| s.weight[k] * src[s.offset[k]]) };
                    *d = if max_mode {
                        taps.iter().map(|s| weighted(s).into_iter().fold(f32::MIN, f32::max)).reduce(f32::max).unwrap_or(0.0)
                    } else {
                        taps.iter().map(|s| weighted(s).into_iter().sum::<f32>()).sum::<f32>() / count
                    };
                }
            }
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(kernel_error(e));
        }
        Ok(vec![from_f32(x.dtype(), &out_shape, y)?])
    })
}
