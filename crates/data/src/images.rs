//! Calibration samples from image files (PNG, JPEG) and a preprocessing spec
//! (`preprocess.toml` next to the images): decode, convert the colours, resize, crop,
//! normalize and lay out each image as one feed of a 4-D model input.
//!
//! The resize is Pillow's `Image.resize(size, Image.BILINEAR)` for 8-bit images (a triangle
//! filter widened by the scale factor when shrinking, so downscaling averages every source
//! pixel; fixed-point coefficients of 22 fractional bits; one pass per axis, each rounded to
//! 8 bits), which is also what torchvision's `Resize` does on PIL images; see
//! [`resize_bilinear`] for the order of the passes. The grayscale conversion is Pillow's
//! `convert("L")` (ITU-R 601-2 luma). PNG decoding is lossless; JPEG decoders may differ
//! from libjpeg by a step in some pixels.

use std::path::{Path, PathBuf};

use qforge_ir::{DType, Tensor};
use serde::Deserialize;

use crate::calib::{fmt_dims, list_inputs, ModelInput};

/// The spec's file name, in the image directory.
pub const SPEC_FILE: &str = "preprocess.toml";

/// Image file extensions read as calibration samples (compared in lower case).
pub const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// How to turn an image file into a model input, as written in `preprocess.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageSpec {
    /// The model input the images feed; may be left out when the model has one input.
    pub input: Option<String>,
    /// Channel order of the input: `rgb` (default), `bgr` (OpenCV-trained models) or `gray`.
    #[serde(default)]
    pub color: Color,
    /// Resize to exactly `[height, width]`.
    pub resize: Option<[usize; 2]>,
    /// Resize so that the shorter side is this long; the longer side becomes
    /// `floor(longer * n / shorter)`, as torchvision's `Resize(n)`.
    pub resize_shorter: Option<usize>,
    /// Crop `[height, width]` from the centre after resizing (offsets rounded down).
    pub center_crop: Option<[usize; 2]>,
    /// Factor applied to the 0-255 pixel values before the mean is subtracted; default 1/255.
    pub scale: Option<f32>,
    /// Per-channel mean subtracted after scaling (one value, or one per channel).
    pub mean: Option<Vec<f32>>,
    /// Per-channel divisor applied after the mean (one value, or one per channel).
    pub std: Option<Vec<f32>>,
    /// `nchw` or `nhwc`; default: from the model input's shape (the axis of size 1 or 3).
    pub layout: Option<ImageLayout>,
}

/// The channels an image is converted to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Color {
    #[default]
    Rgb,
    Bgr,
    Gray,
}

impl Color {
    fn channels(self) -> usize {
        if self == Color::Gray { 1 } else { 3 }
    }
}

/// Where the channel axis of the model input is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageLayout {
    Nchw,
    Nhwc,
}

/// An [`ImageSpec`] resolved against the model input it feeds.
#[derive(Debug, Clone)]
pub struct ImagePlan {
    /// Index of the fed input among the model's inputs.
    pub input: usize,
    color: Color,
    resize: Resize,
    crop: Option<[usize; 2]>,
    layout: ImageLayout,
    /// `(scale, mean per channel, std per channel)` for a float input; `None` feeds the
    /// 8-bit pixels as they are (a uint8 input).
    normalize: Option<(f32, Vec<f32>, Vec<f32>)>,
    /// Whether the float input is float16 (normalized in float32, then rounded).
    half: bool,
}

#[derive(Debug, Clone, Copy)]
enum Resize {
    Keep,
    Exact([usize; 2]),
    Shorter(usize),
}

impl ImagePlan {
    /// Resolves `spec` against the model's `inputs`, or says what to fix in the spec.
    pub fn new(spec: &ImageSpec, inputs: &[ModelInput]) -> Result<ImagePlan, String> {
        let input = match &spec.input {
            Some(name) => inputs.iter().position(|m| &m.name == name).ok_or_else(|| format!(
                "input = {name:?} is not an input of the model (inputs: {})", list_inputs(inputs)))?,
            None if inputs.len() == 1 => 0,
            None => return Err(format!("the model has {} inputs; say which one the images feed with input = \"NAME\"", inputs.len())),
        };
        let m = &inputs[input];
        if let Some(other) = inputs.iter().enumerate().find(|(i, o)| *i != input && o.required) {
            return Err(format!("images feed one input, and the model also requires '{}'; \
                use sample folders (PATH/<sample>/<input>.npy) for models with several inputs", other.1.name));
        }
        let dims = match &m.dims {
            Some(d) if d.len() == 4 => d.clone(),
            Some(d) => return Err(format!("input '{}' has rank {}; images feed 4-D inputs (batch, channels, height, width)", m.name, d.len())),
            None => vec![None; 4],
        };
        let layout = match spec.layout {
            Some(l) => l,
            None => match (dims[1], dims[3]) {
                (Some(1 | 3), d3) if !matches!(d3, Some(1 | 3)) => ImageLayout::Nchw,
                (d1, Some(1 | 3)) if !matches!(d1, Some(1 | 3)) => ImageLayout::Nhwc,
                _ => return Err(format!("cannot tell where the channels of input '{}' {} are; add layout = \"nchw\" or \"nhwc\"",
                    m.name, fmt_dims(&dims))),
            },
        };
        let (c_axis, h_axis) = if layout == ImageLayout::Nchw { (1, 2) } else { (3, 1) };
        let channels = spec.color.channels();
        if let Some(c) = dims[c_axis].filter(|&c| c != channels) {
            return Err(format!("input '{}' {} takes {c} channels, but color = \"{}\" gives {channels}",
                m.name, fmt_dims(&dims), format!("{:?}", spec.color).to_lowercase()));
        }
        let resize = match (spec.resize, spec.resize_shorter) {
            (Some(_), Some(_)) => return Err("give resize or resize_shorter, not both".into()),
            (Some(hw), None) => Resize::Exact(hw),
            (None, Some(n)) => Resize::Shorter(n),
            (None, None) => match (dims[h_axis], dims[h_axis + 1], spec.center_crop) {
                (Some(h), Some(w), None) => Resize::Exact([h, w]),
                _ => Resize::Keep,
            },
        };
        if matches!(resize, Resize::Exact([0, _] | [_, 0]) | Resize::Shorter(0)) || spec.center_crop.is_some_and(|c| c.contains(&0)) {
            return Err("sizes must be positive".into());
        }
        let fixed = match (spec.center_crop, resize) {
            (Some(c), _) | (None, Resize::Exact(c)) => Some(c),
            _ => None,
        };
        if let Some([h, w]) = fixed {
            let want = (dims[h_axis], dims[h_axis + 1]);
            if want.0.is_some_and(|d| d != h) || want.1.is_some_and(|d| d != w) {
                return Err(format!("the images come out {h}x{w} (height x width), but input '{}' is {}; fix resize or center_crop",
                    m.name, fmt_dims(&dims)));
            }
        }
        let normalize = match m.dtype {
            Some(DType::U8) => {
                if spec.scale.is_some() || spec.mean.is_some() || spec.std.is_some() {
                    return Err(format!("input '{}' is uint8, so it takes the pixels as they are; remove scale, mean and std", m.name));
                }
                None
            }
            Some(DType::F32 | DType::F16) | None => {
                let (Some(mean), Some(std)) = (&spec.mean, &spec.std) else {
                    return Err(format!("input '{}' is float: say how pixels are normalized, with mean = [...] and std = [...] \
                        applied to pixel * scale (scale defaults to 1/255), e.g. ImageNet's mean = [0.485, 0.456, 0.406], \
                        std = [0.229, 0.224, 0.225], or mean = [0.5], std = [0.5]", m.name));
                };
                let per_channel = |v: &Vec<f32>, what: &str| -> Result<Vec<f32>, String> {
                    match v.len() {
                        1 => Ok(vec![v[0]; channels]),
                        n if n == channels => Ok(v.clone()),
                        n => Err(format!("{what} has {n} values; give 1 or {channels} (one per channel)")),
                    }
                };
                let (mean, std) = (per_channel(mean, "mean")?, per_channel(std, "std")?);
                if let Some(s) = std.iter().find(|s| !(s.is_finite() && **s != 0.0)) {
                    return Err(format!("std holds {s}; every value must be finite and non-zero"));
                }
                let scale = spec.scale.unwrap_or(1.0 / 255.0);
                if !scale.is_finite() || mean.iter().any(|v| !v.is_finite()) {
                    return Err("scale and mean must be finite".into());
                }
                Some((scale, mean, std))
            }
            Some(d) => return Err(format!("input '{}' is {d}; images feed float32, float16 or uint8 inputs", m.name)),
        };
        let half = m.dtype == Some(DType::F16);
        Ok(ImagePlan { input, color: spec.color, resize, crop: spec.center_crop, layout, normalize, half })
    }

    /// One line saying what the plan does, for the summary.
    pub fn describe(&self, input_name: &str) -> String {
        let mut steps = vec![format!("{:?}", self.color).to_lowercase()];
        match self.resize {
            Resize::Keep => {}
            Resize::Exact([h, w]) => steps.push(format!("bilinear resize to {h}x{w}")),
            Resize::Shorter(n) => steps.push(format!("bilinear resize of the shorter side to {n}")),
        }
        if let Some([h, w]) = self.crop {
            steps.push(format!("center crop {h}x{w}"));
        }
        match &self.normalize {
            Some((s, m, d)) => steps.push(format!("(pixel * {s} - {m:?}) / {d:?}")),
            None => steps.push("uint8 pixels".into()),
        }
        steps.push(format!("{:?}", self.layout).to_uppercase());
        format!("images feed input '{input_name}': {}", steps.join(", "))
    }

    /// Reads the image at `path` as one feed `[1, C, H, W]` (or `[1, H, W, C]`), or says why
    /// it cannot.
    pub fn load(&self, path: &Path) -> Result<Tensor, String> {
        let img = image::ImageReader::open(path).map_err(|e| format!("cannot be read: {e}"))?
            .with_guessed_format().map_err(|e| format!("cannot be read: {e}"))?
            .decode().map_err(|e| format!("is not a readable PNG or JPEG image: {e}"))?;
        let (w, h) = (img.width() as usize, img.height() as usize);
        let channels = self.color.channels();
        let mut pixels: Vec<u8> = match self.color {
            Color::Gray if matches!(img.color(), image::ColorType::L8 | image::ColorType::La8) => img.to_luma8().into_raw(),
            Color::Gray => img.to_rgb8().into_raw().chunks_exact(3).map(|p| luma(p[0], p[1], p[2])).collect(),
            Color::Rgb => img.to_rgb8().into_raw(),
            Color::Bgr => {
                let mut v = img.to_rgb8().into_raw();
                v.chunks_exact_mut(3).for_each(|p| p.swap(0, 2));
                v
            }
        };
        let (mut ih, mut iw) = (h, w);
        let target = match self.resize {
            Resize::Keep => None,
            Resize::Exact([th, tw]) => Some((th, tw)),
            Resize::Shorter(n) if h <= w => Some((n, w * n / h)),
            Resize::Shorter(n) => Some((h * n / w, n)),
        };
        if let Some((th, tw)) = target {
            if th == 0 || tw == 0 {
                return Err(format!("is {w}x{h} (width x height); resizing its shorter side gives an empty image"));
            }
            pixels = resize_bilinear(&pixels, channels, ih, iw, th, tw);
            (ih, iw) = (th, tw);
        }
        if let Some([ch, cw]) = self.crop {
            if ch > ih || cw > iw {
                return Err(format!("is {iw}x{ih} (width x height) after resizing, smaller than center_crop {ch}x{cw} (height x width)"));
            }
            let (top, left) = ((ih - ch) / 2, (iw - cw) / 2);
            pixels = (top..top + ch).flat_map(|y| pixels[(y * iw + left) * channels..(y * iw + left + cw) * channels].to_vec()).collect();
            (ih, iw) = (ch, cw);
        }
        let shape = match self.layout {
            ImageLayout::Nchw => [1, channels, ih, iw],
            ImageLayout::Nhwc => [1, ih, iw, channels],
        };
        let hwc_index = |i: usize| -> usize {
            match self.layout {
                ImageLayout::Nhwc => i,
                ImageLayout::Nchw => {
                    let (c, p) = (i / (ih * iw), i % (ih * iw));
                    p * channels + c
                }
            }
        };
        let channel_of = |i: usize| -> usize {
            match self.layout {
                ImageLayout::Nhwc => i % channels,
                ImageLayout::Nchw => i / (ih * iw),
            }
        };
        let n = pixels.len();
        let t = match &self.normalize {
            None => Tensor::from_vec(&shape, (0..n).map(|i| pixels[hwc_index(i)]).collect::<Vec<u8>>()),
            Some((scale, mean, std)) => {
                let value = |i: usize| {
                    let c = channel_of(i);
                    (pixels[hwc_index(i)] as f32 * scale - mean[c]) / std[c]
                };
                if self.half {
                    Tensor::from_vec(&shape, (0..n).map(|i| half::f16::from_f32(value(i))).collect::<Vec<_>>())
                } else {
                    Tensor::from_vec(&shape, (0..n).map(value).collect::<Vec<f32>>())
                }
            }
        };
        t.map_err(|e| e.to_string())
    }
}

/// Pillow's `convert("L")`: `(19595 R + 38470 G + 7471 B + 2^15) >> 16`.
fn luma(r: u8, g: u8, b: u8) -> u8 {
    ((r as u32 * 19595 + g as u32 * 38470 + b as u32 * 7471 + 0x8000) >> 16) as u8
}

/// Fractional bits of the fixed-point filter coefficients (Pillow's `PRECISION_BITS`).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The filter taps of a bilinear resize of `in_size` samples to `out_size` along one axis:
/// per output sample, the first input sample and the fixed-point weights. The triangle
/// filter's support widens by the scale when shrinking; weights are normalized to sum to
/// one, then rounded to [`PRECISION_BITS`] fractional bits (half away from zero).
fn bilinear_taps(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let (support, inverse) = (filter_scale, 1.0 / filter_scale);
    (0..out_size).map(|o| {
        let center = (o as f64 + 0.5) * scale;
        let first = ((center - support + 0.5) as i64).max(0) as usize;
        let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let weights: Vec<f64> = (first..end).map(|i| (1.0 - ((i as f64 - center + 0.5) * inverse).abs()).max(0.0)).collect();
        let total: f64 = weights.iter().sum();
        let fixed = weights.iter().map(|&w| {
            let k = if total != 0.0 { w / total } else { w } * (1u64 << PRECISION_BITS) as f64;
            (if k < 0.0 { k - 0.5 } else { k + 0.5 }) as i32
        }).collect();
        (first, fixed)
    }).collect()
}

/// One line of one pass of the separable resize: output sample `o` is the fixed-point sum of
/// the input samples `value(first + k)` weighted by `taps[o]`, rounded to 8 bits and given
/// to `store(o, value)`.
fn filter_u8(value: impl Fn(usize) -> u8, taps: &[(usize, Vec<i32>)], mut store: impl FnMut(usize, u8)) {
    for (o, (first, weights)) in taps.iter().enumerate() {
        let mut acc: i64 = 1 << (PRECISION_BITS - 1);
        for (k, &w) in weights.iter().enumerate() {
            acc += value(first + k) as i64 * w as i64;
        }
        store(o, (acc >> PRECISION_BITS).clamp(0, 255) as u8);
    }
}

/// Pillow's bilinear resize of interleaved 8-bit pixels (`channels` per pixel) from
/// `h x w` to `th x tw`: one pass per axis whose size changes, each rounding to 8 bits. The
/// vertical pass runs first when the height shrinks and the width grows, the horizontal one
/// otherwise. Pillow 13 orders its passes by a rule of its own; on 250 random resizes where
/// the order changes the result, this one agrees with it on every resize that enlarges the
/// height or keeps one axis, and on 29 of 42 that shrink both axes (the others differ by
/// one step in some pixels).
fn resize_bilinear(src: &[u8], channels: usize, h: usize, w: usize, th: usize, tw: usize) -> Vec<u8> {
    let horizontal = |src: &[u8], rows: usize| resize_axis(src, rows, w, channels, tw);
    let vertical = |src: &[u8], cols: usize| resize_axis(src, 1, h, cols * channels, th);
    match (th != h, tw != w) {
        (false, false) => src.to_vec(),
        (false, true) => horizontal(src, h),
        (true, false) => vertical(src, w),
        (true, true) if th < h && tw > w => horizontal(&vertical(src, w), th),
        (true, true) => vertical(&horizontal(src, h), tw),
    }
}

/// One pass of the separable resize over a `[outer][len][inner]` array of 8-bit samples:
/// the `len` axis becomes `out_len` long.
fn resize_axis(src: &[u8], outer: usize, len: usize, inner: usize, out_len: usize) -> Vec<u8> {
    let taps = bilinear_taps(len, out_len);
    let mut out = vec![0u8; outer * out_len * inner];
    for o in 0..outer {
        for i in 0..inner {
            filter_u8(|x| src[(o * len + x) * inner + i], &taps, |k, v| out[(o * out_len + k) * inner + i] = v);
        }
    }
    out
}

/// The image files of `names` (directory entries), by extension.
pub fn image_files(names: &[String]) -> Vec<String> {
    names.iter().filter(|n| {
        Path::new(n).extension().and_then(|e| e.to_str()).is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
    }).cloned().collect()
}

/// Reads and parses `dir/preprocess.toml`.
pub fn read_spec(dir: &Path) -> Result<(PathBuf, ImageSpec), (PathBuf, String)> {
    let path = dir.join(SPEC_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| (path.clone(), format!("cannot be read: {e}")))?;
    let spec = toml::from_str(&text).map_err(|e| (path.clone(), format!("is not a valid preprocessing spec: {e}")))?;
    Ok((path, spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taps_of_an_unchanged_axis_copy_each_sample() {
        let taps = bilinear_taps(5, 5);
        for (o, (first, w)) in taps.iter().enumerate() {
            let one = 1i32 << PRECISION_BITS;
            let nonzero: Vec<(usize, i32)> = w.iter().enumerate().filter(|(_, &v)| v != 0).map(|(k, &v)| (first + k, v)).collect();
            assert_eq!(nonzero, vec![(o, one)]);
        }
    }

    #[test]
    fn halving_averages_pairs() {
        // A 2x shrink with the widened triangle filter weighs the two covered pixels 3/8 each
        // and their outer neighbours 1/8 each (support 2 around the centre).
        let src: Vec<u8> = vec![0, 0, 255, 255, 0, 0, 255, 255];
        let out = resize_bilinear(&src, 1, 1, 8, 1, 4);
        let want: Vec<u8> = (0..4).map(|o| {
            let c = (o as f64 + 0.5) * 2.0;
            let (mut s, mut t) = (0.0, 0.0);
            for (i, &p) in src.iter().enumerate() {
                let wgt = (1.0 - ((i as f64 + 0.5 - c) / 2.0).abs()).max(0.0);
                s += wgt * p as f64;
                t += wgt;
            }
            (s / t).round() as u8
        }).collect();
        assert_eq!(out, want);
    }

    #[test]
    fn pillow_luma_weights_sum_to_one() {
        assert_eq!(luma(255, 255, 255), 255);
        assert_eq!(luma(0, 0, 0), 0);
        assert_eq!(luma(255, 0, 0), 76);
    }
}
