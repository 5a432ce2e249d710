//! Signal processing: DFT and STFT (radix-2 FFT for power-of-two lengths, Bluestein's
//! chirp-z transform otherwise), the Hann, Hamming and Blackman windows, and
//! MelWeightMatrix. Transforms compute in f64.

use std::ops::{Add, Mul, Sub};

use qforge_ir::{DType, Tensor};

use super::elementwise::from_f32;
use super::shape::cast_tensor;
use super::util::{axis, check_output_size, input, ints, kernel, opt_input, par_chunks_mut, tensor};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers DFT, STFT, the window functions and MelWeightMatrix.
pub fn register(r: &mut Registry) {
    r.add("", "DFT", 17, LATEST, dft);
    r.add("", "STFT", 17, LATEST, stft);
    r.add("", "HannWindow", 17, LATEST, window);
    r.add("", "HammingWindow", 17, LATEST, window);
    r.add("", "BlackmanWindow", 17, LATEST, window);
    r.add("", "MelWeightMatrix", 17, LATEST, mel_weight_matrix);
}

/// Longest transform the kernels compute (Bluestein's method works on up to four times as
/// many points).
const MAX_DFT_LENGTH: usize = 1 << 24;

/// A complex number in f64.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
struct Complex {
    re: f64,
    im: f64,
}

impl Complex {
    fn new(re: f64, im: f64) -> Complex {
        Complex { re, im }
    }
    /// `e^(i * angle)`.
    fn unit(angle: f64) -> Complex {
        Complex::new(angle.cos(), angle.sin())
    }
    fn conj(self) -> Complex {
        Complex::new(self.re, -self.im)
    }
    fn scale(self, k: f64) -> Complex {
        Complex::new(self.re * k, self.im * k)
    }
}

impl Add for Complex {
    type Output = Complex;
    fn add(self, o: Complex) -> Complex {
        Complex::new(self.re + o.re, self.im + o.im)
    }
}

impl Sub for Complex {
    type Output = Complex;
    fn sub(self, o: Complex) -> Complex {
        Complex::new(self.re - o.re, self.im - o.im)
    }
}

impl Mul for Complex {
    type Output = Complex;
    fn mul(self, o: Complex) -> Complex {
        Complex::new(self.re * o.re - self.im * o.im, self.re * o.im + self.im * o.re)
    }
}

/// An in-place radix-2 FFT of a power-of-two length: `twiddles[k] = e^(-2 pi i k / n)` for
/// `k < n / 2`.
struct Radix2 {
    n: usize,
    twiddles: Vec<Complex>,
}

impl Radix2 {
    fn new(n: usize) -> Radix2 {
        debug_assert!(n.is_power_of_two());
        let twiddles = (0..n / 2).map(|k| Complex::unit(-2.0 * std::f64::consts::PI * k as f64 / n as f64)).collect();
        Radix2 { n, twiddles }
    }

    /// `a` (length `n`) replaced by its forward DFT `sum_j a[j] e^(-2 pi i jk / n)`.
    fn forward(&self, a: &mut [Complex]) {
        let n = self.n;
        if n <= 1 {
            return;
        }
        let bits = n.trailing_zeros();
        for i in 0..n {
            let j = i.reverse_bits() >> (usize::BITS - bits);
            if i < j {
                a.swap(i, j);
            }
        }
        let mut len = 2;
        while len <= n {
            let half = len / 2;
            let step = n / len;
            for block in a.chunks_exact_mut(len) {
                let (lo, hi) = block.split_at_mut(half);
                for (j, (u, v)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                    let t = *v * self.twiddles[j * step];
                    *v = *u - t;
                    *u = *u + t;
                }
            }
            len *= 2;
        }
    }
}

/// How a [`FftPlan`] transforms its length.
enum Method {
    Radix2(Radix2),
    /// Bluestein's chirp-z transform: `chirp[k] = e^(-pi i k^2 / n)`, and the FFT (of the
    /// power-of-two length of `fft`) of the convolution kernel built from its conjugate.
    Bluestein { chirp: Vec<Complex>, kernel: Vec<Complex>, fft: Radix2 },
}

/// A complex DFT of one length, planned once and applied to many signals.
struct FftPlan {
    n: usize,
    method: Method,
}

impl FftPlan {
    fn new(n: usize) -> FftPlan {
        if n.is_power_of_two() {
            return FftPlan { n, method: Method::Radix2(Radix2::new(n)) };
        }
        let m = (2 * n - 1).next_power_of_two();
        let two_n = 2 * n as u128;
        let chirp: Vec<Complex> = (0..n).map(|k| {
            let k2 = ((k as u128 * k as u128) % two_n) as f64;
            Complex::unit(-std::f64::consts::PI * k2 / n as f64)
        }).collect();
        let mut kernel = vec![Complex::default(); m];
        kernel[0] = chirp[0].conj();
        for k in 1..n {
            kernel[k] = chirp[k].conj();
            kernel[m - k] = chirp[k].conj();
        }
        let fft = Radix2::new(m);
        fft.forward(&mut kernel);
        FftPlan { n, method: Method::Bluestein { chirp, kernel, fft } }
    }

    /// `a` (length `n`) replaced by its DFT: forward `sum_j a[j] e^(-2 pi i jk / n)`, or with
    /// `inverse` the unnormalized `sum_j a[j] e^(2 pi i jk / n)`. `scratch` is working space.
    fn transform(&self, a: &mut [Complex], inverse: bool, scratch: &mut Vec<Complex>) {
        debug_assert_eq!(a.len(), self.n, "a signal of the planned length");
        if inverse {
            a.iter_mut().for_each(|v| *v = v.conj());
        }
        match &self.method {
            Method::Radix2(r) => r.forward(a),
            Method::Bluestein { chirp, kernel, fft } => {
                let m = kernel.len();
                scratch.clear();
                scratch.extend(a.iter().zip(chirp).map(|(&x, &w)| x * w));
                scratch.resize(m, Complex::default());
                fft.forward(scratch);
                for (s, &k) in scratch.iter_mut().zip(kernel) {
                    *s = (*s * k).conj();
                }
                fft.forward(scratch);
                let norm = 1.0 / m as f64;
                for ((d, s), &w) in a.iter_mut().zip(scratch.iter()).zip(chirp) {
                    *d = s.conj().scale(norm) * w;
                }
            }
        }
        if inverse {
            a.iter_mut().for_each(|v| *v = v.conj());
        }
    }
}

/// The one integer of a scalar (or one-element) int32/int64 input.
fn scalar_int(t: &Tensor, what: &str) -> RuntimeResult<i64> {
    match ints(t, what)?.as_slice() {
        [v] => Ok(*v),
        _ => Err(kernel_error(format!("{what} must be a scalar, got shape {:?}", t.shape()))),
    }
}

/// A transform length from an integer input: positive and at most [`MAX_DFT_LENGTH`].
fn transform_length(v: i64, what: &str) -> RuntimeResult<usize> {
    if v < 1 || v as u64 > MAX_DFT_LENGTH as u64 {
        return Err(kernel_error(format!("{what} must be in [1, {MAX_DFT_LENGTH}], got {v}")));
    }
    Ok(v as usize)
}

/// Input values of a float tensor as f64.
fn float_values(t: &Tensor, what: &str) -> RuntimeResult<Vec<f64>> {
    if !t.dtype().is_float() {
        return Err(kernel_error(format!("{what} must be a float tensor, got {}", t.dtype())));
    }
    t.to_f64_vec().map_err(|e| kernel_error(e.to_string()))
}

/// A float tensor of `dtype` from f64 values.
fn float_tensor(dtype: DType, shape: &[usize], v: Vec<f64>) -> RuntimeResult<Tensor> {
    match dtype {
        DType::F64 => tensor(shape, v),
        d => from_f32(d, shape, v.into_iter().map(|x| x as f32).collect()),
    }
}

/// What a DFT node computes along its axis.
#[derive(Clone, Copy)]
struct DftParams {
    inverse: bool,
    onesided: bool,
}

/// DFT (opset 17: `axis` attribute, default 1; opset 20+: optional `axis` input, default
/// -2). The input is `[..., 1]` (real) or `[..., 2]` (complex); `axis` (in `[-r, -2]` or
/// `[0, r - 2]`) is transformed over `dft_length` points (the axis truncated or zero-padded;
/// default its length). Forward: complex output of `dft_length` bins, or with `onesided` the
/// first `dft_length / 2 + 1`. Inverse (normalized by `1 / dft_length`): complex output, or
/// with `onesided` (IRFFT) the input is the first half of a Hermitian spectrum
/// (`dft_length` defaults to `2 * (axis length - 1)`) and the output is real `[..., 1]`.
fn dft(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let params = DftParams { inverse: info.attr_int("inverse", 0) != 0, onesided: info.attr_int("onesided", 0) != 0 };
    let axis_attr = (info.opset < 20).then(|| info.attr_int("axis", 1));
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let length = opt_input(ins, 1).filter(|t| !t.is_empty()).map(|t| scalar_int(t, "dft_length")).transpose()?;
        let axis_value = match axis_attr {
            Some(a) => a,
            None => opt_input(ins, 2).filter(|t| !t.is_empty()).map(|t| scalar_int(t, "axis")).transpose()?.unwrap_or(-2),
        };
        let s = x.shape();
        let r = s.len();
        if r < 2 || !(s[r - 1] == 1 || s[r - 1] == 2) {
            return Err(kernel_error(format!("input must have rank 2 or more and a last axis of 1 (real) or 2 (complex), got shape {s:?}")));
        }
        let ax = axis(axis_value, r)?;
        if ax == r - 1 {
            return Err(kernel_error(format!("axis {axis_value} is the real/imaginary axis of an input of rank {r}; it must be in [-{r}, -2] or [0, {}]", r - 2)));
        }
        let irfft = params.inverse && params.onesided;
        let n = match length {
            Some(v) => transform_length(v, "dft_length")?,
            None if irfft => transform_length(2 * (s[ax] as i64 - 1), "the default IRFFT length 2 * (axis length - 1)")?,
            None => transform_length(s[ax] as i64, "the axis length")?,
        };
        let bins = if params.onesided && !params.inverse { n / 2 + 1 } else { n };
        let mut out_shape = s.to_vec();
        out_shape[ax] = bins;
        out_shape[r - 1] = if irfft { 1 } else { 2 };
        check_output_size("DFT output", x.dtype(), &out_shape)?;
        let v = float_values(x, "input")?;
        let out = transform_axis(&v, s, ax, n, &out_shape, params);
        Ok(vec![float_tensor(x.dtype(), &out_shape, out)?])
    })
}

/// The DFT of `v` (shape `s`, last axis real or complex) along `ax` over `n` points, laid out
/// as `out_shape` (see [`dft`]).
fn transform_axis(v: &[f64], s: &[usize], ax: usize, n: usize, out_shape: &[usize], p: DftParams) -> Vec<f64> {
    let r = s.len();
    let comps = s[r - 1];
    let out_comps = out_shape[r - 1];
    let (len, bins) = (s[ax], out_shape[ax]);
    let inner: usize = s[ax + 1..r - 1].iter().product();
    let outer: usize = s[..ax].iter().product();
    let mut out = vec![0f64; outer * bins * inner * out_comps];
    if out.is_empty() {
        return out;
    }
    let plan = FftPlan::new(n);
    let irfft = p.inverse && p.onesided;
    let norm = if p.inverse { 1.0 / n as f64 } else { 1.0 };
    let read = |o: usize, k: usize, i: usize| -> Complex {
        let at = ((o * len + k) * inner + i) * comps;
        Complex::new(v[at], if comps == 2 { v[at + 1] } else { 0.0 })
    };
    par_chunks_mut(&mut out, bins * inner * out_comps, 1, || (vec![Complex::default(); n], vec![]), |(line, scratch), o, dst| {
        for i in 0..inner {
            if irfft {
                let half = n / 2 + 1;
                for (k, c) in line.iter_mut().enumerate().take(half) {
                    *c = if k < len { read(o, k, i) } else { Complex::default() };
                }
                for k in half..n {
                    line[k] = line[n - k].conj();
                }
            } else {
                for (k, c) in line.iter_mut().enumerate() {
                    *c = if k < len { read(o, k, i) } else { Complex::default() };
                }
            }
            plan.transform(line, p.inverse, scratch);
            for (k, c) in line.iter().take(bins).enumerate() {
                let at = (k * inner + i) * out_comps;
                dst[at] = c.re * norm;
                if out_comps == 2 {
                    dst[at + 1] = c.im * norm;
                }
            }
        }
    });
    out
}

/// STFT (opset 17): `signal` `[batch, length, 1 or 2]`, scalar `frame_step`, optional 1-D
/// `window` and scalar `frame_length` (either gives the other; both omitted: the whole
/// signal is one frame; window omitted: rectangular). Output `[batch, frames, bins, 2]`
/// with `frames = (length - frame_length) / frame_step + 1` and `bins = frame_length / 2 + 1`
/// when `onesided` (default 1), else `frame_length`: the DFT of each windowed frame.
fn stft(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let onesided = info.attr_int("onesided", 1) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() != 3 || !(s[2] == 1 || s[2] == 2) {
            return Err(kernel_error(format!("signal must have shape [batch, length, 1 or 2], got {s:?}")));
        }
        let (batch, length, comps) = (s[0], s[1], s[2]);
        let step = scalar_int(input(ins, 1)?, "frame_step")?;
        if step < 1 {
            return Err(kernel_error(format!("frame_step must be positive, got {step}")));
        }
        let window = opt_input(ins, 2).filter(|t| !t.is_empty());
        let frame_length = opt_input(ins, 3).filter(|t| !t.is_empty()).map(|t| scalar_int(t, "frame_length")).transpose()?;
        let n = match (frame_length, window) {
            (Some(v), _) => transform_length(v, "frame_length")?,
            (None, Some(w)) => transform_length(w.len() as i64, "the window length")?,
            (None, None) => transform_length(length as i64, "the signal length")?,
        };
        let weights = match window {
            Some(w) => {
                if w.shape() != [n] {
                    return Err(kernel_error(format!("window must have shape [{n}] (the frame length), got {:?}", w.shape())));
                }
                float_values(w, "window")?
            }
            None => vec![1.0; n],
        };
        if n > length {
            return Err(kernel_error(format!("the frame length {n} exceeds the signal length {length}")));
        }
        let frames = (length - n) / step as usize + 1;
        let bins = if onesided { n / 2 + 1 } else { n };
        let out_shape = [batch, frames, bins, 2];
        check_output_size("STFT output", x.dtype(), &out_shape)?;
        let v = float_values(x, "signal")?;
        let mut out = vec![0f64; batch * frames * bins * 2];
        let plan = FftPlan::new(n);
        let step = step as usize;
        par_chunks_mut(&mut out, bins * 2, 1, || (vec![Complex::default(); n], vec![]), |(line, scratch), bf, dst| {
            let (b, f) = (bf / frames, bf % frames);
            for (k, c) in line.iter_mut().enumerate() {
                let at = (b * length + f * step + k) * comps;
                let im = if comps == 2 { v[at + 1] } else { 0.0 };
                *c = Complex::new(v[at], im).scale(weights[k]);
            }
            plan.transform(line, false, scratch);
            for (d, c) in dst.chunks_exact_mut(2).zip(line.iter()) {
                d[0] = c.re;
                d[1] = c.im;
            }
        });
        Ok(vec![float_tensor(x.dtype(), &out_shape, out)?])
    })
}

/// The output type of a generator op from its `output_datatype` attribute (default float).
fn output_type(info: &NodeInfo) -> RuntimeResult<DType> {
    let code = info.attr_int("output_datatype", 1);
    let dtype = i32::try_from(code).ok().and_then(DType::from_onnx).ok_or_else(|| info.error(format!("output_datatype {code} is not a tensor element type")))?;
    let numeric = matches!(dtype, DType::U8 | DType::U16 | DType::U32 | DType::U64 | DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::F16 | DType::BF16 | DType::F32 | DType::F64);
    if !numeric {
        return Err(info.error(format!("output_datatype {dtype} is not a numeric type")));
    }
    Ok(dtype)
}

/// A tensor of `dtype` from f64 values (integer types truncate toward zero).
fn typed(dtype: DType, shape: &[usize], v: Vec<f64>) -> RuntimeResult<Tensor> {
    cast_tensor(&tensor(shape, v)?, dtype)
}

/// HannWindow, HammingWindow and BlackmanWindow (opset 17): a window of scalar `size`
/// points of type `output_datatype`. With `periodic` (default 1) the window has period
/// `size`, else it is symmetric over `size - 1` intervals (a one-point symmetric window is
/// `[1]`). Hann: `sin^2(pi n / N)`; Hamming: `25/46 - 21/46 cos(2 pi n / N)`; Blackman:
/// `0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)`.
fn window(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    use std::f64::consts::PI;
    let dtype = output_type(info)?;
    let periodic = info.attr_int("periodic", 1) != 0;
    let shape: fn(f64) -> f64 = match info.node.op_type.as_str() {
        "HannWindow" => |t| (PI * t).sin().powi(2),
        "HammingWindow" => |t| 25.0 / 46.0 - 21.0 / 46.0 * (2.0 * PI * t).cos(),
        _ => |t| 0.42 - 0.5 * (2.0 * PI * t).cos() + 0.08 * (4.0 * PI * t).cos(),
    };
    kernel(move |ins| {
        let size = scalar_int(input(ins, 0)?, "size")?;
        let size = usize::try_from(size).map_err(|_| kernel_error(format!("size must not be negative, got {size}")))?;
        check_output_size("window", dtype, &[size])?;
        let period = if periodic { size } else { size.saturating_sub(1) };
        let v: Vec<f64> = if period == 0 {
            vec![1.0; size]
        } else {
            (0..size).map(|i| shape(i as f64 / period as f64)).collect()
        };
        Ok(vec![typed(dtype, &[size], v)?])
    })
}

/// MelWeightMatrix (opset 17): the `[dft_length / 2 + 1, num_mel_bins]` matrix of
/// triangular filters (peak 1) that maps a one-sided spectrum to `num_mel_bins` mel bands
/// spanning `[lower_edge_hertz, upper_edge_hertz]`, with `mel(f) = 2595 log10(1 + f / 700)`
/// and band edges snapped to spectrum bins as `floor((dft_length + 1) * f / sample_rate)`.
fn mel_weight_matrix(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let dtype = output_type(info)?;
    kernel(move |ins| {
        let mel_bins = scalar_int(input(ins, 0)?, "num_mel_bins")?;
        let dft_length = scalar_int(input(ins, 1)?, "dft_length")?;
        let sample_rate = scalar_int(input(ins, 2)?, "sample_rate")?;
        let edge = |i: usize, what: &str| -> RuntimeResult<f64> {
            match float_values(input(ins, i)?, what)?.as_slice() {
                [v] => Ok(*v),
                _ => Err(kernel_error(format!("{what} must be a scalar"))),
            }
        };
        let (lower, upper) = (edge(3, "lower_edge_hertz")?, edge(4, "upper_edge_hertz")?);
        if mel_bins < 1 || dft_length < 1 || sample_rate < 1 {
            return Err(kernel_error(format!("num_mel_bins, dft_length and sample_rate must be positive, got {mel_bins}, {dft_length}, {sample_rate}")));
        }
        if !(lower.is_finite() && upper.is_finite() && 0.0 <= lower && lower <= upper) {
            return Err(kernel_error(format!("need 0 <= lower_edge_hertz <= upper_edge_hertz, got {lower} and {upper}")));
        }
        let (mels, spectrum) = (mel_bins as usize, (dft_length / 2 + 1) as usize);
        check_output_size("MelWeightMatrix output", dtype, &[spectrum, mels])?;
        let mel = |f: f64| 2595.0 * (f / 700.0).ln_1p() / std::f64::consts::LN_10;
        let (low, high) = (mel(lower), mel(upper));
        let step = (high - low) / (mels + 2) as f64;
        let edges: Vec<i64> = (0..mels + 2).map(|i| {
            let hz = 700.0 * ((i as f64 * step + low) / 2595.0 * std::f64::consts::LN_10).exp_m1();
            ((dft_length + 1) as f64 * hz / sample_rate as f64).floor() as i64
        }).collect();
        let mut out = vec![0f64; spectrum * mels];
        let mut set = |j: i64, band: usize, w: f64| -> RuntimeResult<()> {
            match usize::try_from(j).ok().filter(|&j| j < spectrum) {
                Some(j) => {
                    out[j * mels + band] = w;
                    Ok(())
                }
                None => Err(kernel_error(format!("mel band {band} reaches spectrum bin {j}, outside [0, {spectrum}); upper_edge_hertz {upper} exceeds the Nyquist frequency of sample_rate {sample_rate}"))),
            }
        };
        for band in 0..mels {
            let (left, center, right) = (edges[band], edges[band + 1], edges[band + 2]);
            if center == left {
                set(center, band, 1.0)?;
            } else {
                for j in left..=center {
                    set(j, band, (j - left) as f64 / (center - left) as f64)?;
                }
            }
            for j in center..right {
                set(j, band, (right - j) as f64 / (right - center) as f64)?;
            }
        }
        Ok(vec![typed(dtype, &[spectrum, mels], out)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planned FFT matches the O(n^2) definition for power-of-two and other lengths, in
    /// both directions.
    #[test]
    fn fft_matches_the_definition() {
        for n in [1usize, 2, 3, 5, 8, 12, 17, 64, 100] {
            let x: Vec<Complex> = (0..n).map(|k| Complex::new((k as f64 * 0.7).sin(), (k as f64 * 1.3).cos())).collect();
            let plan = FftPlan::new(n);
            for inverse in [false, true] {
                let sign = if inverse { 1.0 } else { -1.0 };
                let want: Vec<Complex> = (0..n).map(|k| {
                    x.iter().enumerate().fold(Complex::default(), |acc, (j, &v)| acc + v * Complex::unit(sign * 2.0 * std::f64::consts::PI * (j * k) as f64 / n as f64))
                }).collect();
                let mut got = x.clone();
                plan.transform(&mut got, inverse, &mut vec![]);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g.re - w.re).abs() < 1e-9 && (g.im - w.im).abs() < 1e-9, "n={n} inverse={inverse}: {g:?} vs {w:?}");
                }
            }
        }
    }
}
