//! Quantization schemes and their parameters.
//!
//! Two reference conventions exist and both are implemented exactly:
//! * [`Convention::PyTorch`] follows `torch.ao.quantization` observers
//!   (`UniformQuantizationObserverBase._calculate_qparams` and `calculate_qmin_qmax`):
//!   float32 arithmetic, `scale = max(scale, eps)`, zero point clamped to the range, unsigned
//!   symmetric zero point 128 (or the midpoint of a custom range).
//! * [`Convention::Ort`] follows ONNX Runtime's `quant_utils.compute_scale_zp` and
//!   `get_qmin_qmax_for_qType`: float64 arithmetic rounded to float32 at the end, scales
//!   below the smallest normal float32 replaced by 1.0, symmetric ranges `[-127, 127]` for int8
//!   and `[-32767, 32767]` for int16, and ORT's reduced ranges (`[-64, 64]` for int8).

use serde::{Deserialize, Serialize};

use qforge_ir::DType;

/// Integer types a tensor can be quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QType {
    U4,
    S4,
    U8,
    S8,
    U16,
    S16,
    S32,
}

impl QType {
    /// The full representable range.
    pub fn range(self) -> (i64, i64) {
        match self {
            QType::U4 => (0, 15),
            QType::S4 => (-8, 7),
            QType::U8 => (0, 255),
            QType::S8 => (-128, 127),
            QType::U16 => (0, 65535),
            QType::S16 => (-32768, 32767),
            QType::S32 => (i32::MIN as i64, i32::MAX as i64),
        }
    }

    pub fn is_signed(self) -> bool {
        matches!(self, QType::S4 | QType::S8 | QType::S16 | QType::S32)
    }

    /// The ONNX element type.
    pub fn dtype(self) -> DType {
        match self {
            QType::U4 => DType::U4,
            QType::S4 => DType::I4,
            QType::U8 => DType::U8,
            QType::S8 => DType::I8,
            QType::U16 => DType::U16,
            QType::S16 => DType::I16,
            QType::S32 => DType::I32,
        }
    }

    pub fn from_dtype(d: DType) -> Option<QType> {
        Some(match d {
            DType::U4 => QType::U4,
            DType::I4 => QType::S4,
            DType::U8 => QType::U8,
            DType::I8 => QType::S8,
            DType::U16 => QType::U16,
            DType::I16 => QType::S16,
            DType::I32 => QType::S32,
            _ => return None,
        })
    }
}

/// Which reference implementation a scheme reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Convention {
    PyTorch,
    Ort,
}

/// How real values map to integers: `real = scale * (q - zero_point)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QScheme {
    pub qtype: QType,
    /// Symmetric around zero (zero point fixed) or affine.
    pub symmetric: bool,
    /// Use half the range (one bit less), for kernels whose accumulation would overflow.
    pub reduce_range: bool,
    /// An explicit integer range, e.g. `[-127, 127]` for narrow-range weights.
    pub quant_range: Option<(i64, i64)>,
    /// Smallest allowed scale (PyTorch convention; ORT uses the smallest normal float32).
    pub eps: f32,
    pub convention: Convention,
}

/// A scale and zero point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QParams {
    pub scale: f32,
    pub zero_point: i64,
}

impl QScheme {
    /// An affine or symmetric scheme with the convention's defaults: PyTorch's
    /// `eps = finfo(float32).eps`, full range, no range reduction.
    pub fn new(qtype: QType, symmetric: bool, convention: Convention) -> QScheme {
        QScheme { qtype, symmetric, reduce_range: false, quant_range: None, eps: f32::EPSILON, convention }
    }

    /// The integer range `[qmin, qmax]` the scheme uses.
    ///
    /// PyTorch (`calculate_qmin_qmax`): an explicit range is halved (floor division) under
    /// `reduce_range`; otherwise `reduce_range` gives `[-64, 63]` / `[0, 127]` for 8 bits.
    /// ORT (`get_qmin_qmax_for_qType`): `reduce_range` gives ORT's reduced table, `symmetric`
    /// gives `[-127, 127]` / `[-32767, 32767]` for int8 / int16, else the full range.
    pub fn qrange(&self) -> (i64, i64) {
        match self.convention {
            Convention::PyTorch => {
                if let Some((lo, hi)) = self.quant_range {
                    return if self.reduce_range { (lo.div_euclid(2), hi.div_euclid(2)) } else { (lo, hi) };
                }
                match (self.qtype, self.reduce_range) {
                    (QType::S8, true) => (-64, 63),
                    (QType::U8, true) => (0, 127),
                    (t, _) => t.range(),
                }
            }
            Convention::Ort => {
                if let Some(r) = self.quant_range {
                    return r;
                }
                match (self.qtype, self.reduce_range, self.symmetric) {
                    (QType::U8, true, _) => (0, 127),
                    (QType::S8, true, _) => (-64, 64),
                    (QType::U16, true, _) => (0, 32767),
                    (QType::S16, true, _) => (-16384, 16384),
                    (QType::U4, true, _) => (0, 7),
                    (QType::S4, true, _) => (-4, 3),
                    (QType::S8, false, true) => (-127, 127),
                    (QType::S16, false, true) => (-32767, 32767),
                    (t, _, _) => t.range(),
                }
            }
        }
    }

    /// Scale and zero point for an observed range `[min, max]`. The range is first widened
    /// to contain zero. An empty or non-finite range (nothing observed) gives scale 1, zero point 0.
    pub fn qparams(&self, min: f32, max: f32) -> QParams {
        let (qmin, qmax) = self.qrange();
        if !(min.is_finite() && max.is_finite()) || min > max {
            return QParams { scale: 1.0, zero_point: 0 };
        }
        match self.convention {
            Convention::PyTorch => self.torch_qparams(min, max, qmin, qmax),
            Convention::Ort => ort_qparams(min, max, qmin, qmax, self.symmetric),
        }
    }

    fn torch_qparams(&self, min: f32, max: f32, qmin: i64, qmax: i64) -> QParams {
        let min_neg = min.min(0.0);
        let max_pos = max.max(0.0);
        if self.symmetric {
            let m = (-min_neg).max(max_pos);
            let scale = (m / ((qmax - qmin) as f32 / 2.0)).max(self.eps);
            let zero_point = if self.qtype.is_signed() {
                0
            } else if self.quant_range.is_some() {
                (qmin + qmax).div_euclid(2)
            } else {
                128
            };
            QParams { scale, zero_point }
        } else {
            let scale = ((max_pos - min_neg) / (qmax - qmin) as f32).max(self.eps);
            let zp = qmin - (min_neg / scale).round_ties_even() as i64;
            QParams { scale, zero_point: zp.clamp(qmin, qmax) }
        }
    }

    /// Quantizes one value: `clamp(round_half_even(x / scale) + zero_point, qmin, qmax)`, the
    /// ONNX `QuantizeLinear` definition.
    pub fn quantize(&self, x: f32, q: QParams) -> i64 {
        let (qmin, qmax) = self.qrange();
        quantize(x, q, qmin, qmax)
    }
}

/// ORT's `compute_scale_zp`, with `rmin`/`rmax` given as float32 as ORT's calibrators produce.
fn ort_qparams(rmin: f32, rmax: f32, qmin: i64, qmax: i64, symmetric: bool) -> QParams {
    let (mut rmin, mut rmax) = (rmin.min(0.0), rmax.max(0.0));
    if symmetric {
        let absmax = rmin.abs().max(rmax.abs());
        rmin = -absmax;
        rmax = absmax;
    }
    let scale = (rmax as f64 - rmin as f64) / (qmax as f64 - qmin as f64);
    if scale < f32::MIN_POSITIVE as f64 {
        return QParams { scale: 1.0, zero_point: 0 };
    }
    let zero_point = if symmetric {
        ((qmin + qmax) as f64 / 2.0).round_ties_even() as i64
    } else {
        (qmin as f64 - rmin as f64 / scale).round_ties_even() as i64
    };
    QParams { scale: scale as f32, zero_point }
}

/// `clamp(round_half_even(x / scale) + zero_point, qmin, qmax)` (ONNX `QuantizeLinear`).
pub fn quantize(x: f32, q: QParams, qmin: i64, qmax: i64) -> i64 {
    let r = round_ties_even(x / q.scale);
    if r.is_nan() {
        return q.zero_point.clamp(qmin, qmax);
    }
    ((r as f64) as i64).saturating_add(q.zero_point).clamp(qmin, qmax)
}

/// `x.round_ties_even()` without a libm call where the CPU has no rounding instruction in the
/// baseline target (x86-64 before SSE4.1): below 2^22 in magnitude, adding and subtracting
/// 1.5 · 2^23 lands on the float grid of spacing 1, where the default rounding mode rounds half
/// to even; larger magnitudes take `round_ties_even` itself. Equal for every input, the sign
/// of zero aside.
#[inline]
pub fn round_ties_even(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        (x + SHIFT) - SHIFT
    } else {
        x.round_ties_even()
    }
}

/// `(q - zero_point) * scale` (ONNX `DequantizeLinear`).
pub fn dequantize(q: i64, p: QParams) -> f32 {
    (q - p.zero_point) as f32 * p.scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_each_reference() {
        let t = |q, sym, rr| QScheme { reduce_range: rr, ..QScheme::new(q, sym, Convention::PyTorch) }.qrange();
        let o = |q, sym, rr| QScheme { reduce_range: rr, ..QScheme::new(q, sym, Convention::Ort) }.qrange();
        assert_eq!(t(QType::S8, false, true), (-64, 63));
        assert_eq!(o(QType::S8, false, true), (-64, 64));
        assert_eq!(o(QType::S8, true, false), (-127, 127));
        assert_eq!(t(QType::S8, true, false), (-128, 127));
        assert_eq!(o(QType::U8, false, false), (0, 255));
        let narrow = QScheme { quant_range: Some((-127, 127)), ..QScheme::new(QType::S8, true, Convention::PyTorch) };
        assert_eq!(narrow.qrange(), (-127, 127));
    }

    #[test]
    fn fast_rounding_equals_the_standard_library_on_every_kind_of_float() {
        let same = |x: f32| {
            let (fast, std) = (round_ties_even(x), x.round_ties_even());
            assert!(fast == std || (fast.is_nan() && std.is_nan()), "{x:e}: {fast:e} against {std:e}");
        };
        // Every half and quarter around the switch to the standard path and the float grid's
        // spacings 0.5 (2^22..2^23) and 1 (2^23..2^24), on both signs.
        for base in [0.0f32, 4_194_304.0, 8_388_608.0, 16_777_216.0] {
            for k in -64..64 {
                for sign in [1.0f32, -1.0] {
                    same(sign * (base + k as f32 * 0.25));
                    same(sign * (base + k as f32 * 0.25).next_up());
                    same(sign * (base + k as f32 * 0.25).next_down());
                }
            }
        }
        // Random bit patterns: subnormals, NaNs, infinities, the largest floats.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1_000_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            same(f32::from_bits(state as u32));
        }
        for x in [f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE, 0.5, 1.5, 2.5, -0.5, -2.5] {
            same(x);
        }
    }

    #[test]
    fn quantize_rounds_half_to_even_and_saturates() {
        let p = QParams { scale: 1.0, zero_point: 0 };
        assert_eq!(quantize(2.5, p, -128, 127), 2);
        assert_eq!(quantize(3.5, p, -128, 127), 4);
        assert_eq!(quantize(-2.5, p, -128, 127), -2);
        assert_eq!(quantize(1e9, p, -128, 127), 127);
        assert_eq!(quantize(f32::NEG_INFINITY, p, 0, 255), 0);
        assert_eq!(quantize(f32::NAN, QParams { scale: 1.0, zero_point: 7 }, 0, 255), 7);
    }

    #[test]
    fn nothing_observed_gives_unit_scale() {
        let s = QScheme::new(QType::U8, false, Convention::PyTorch);
        assert_eq!(s.qparams(f32::INFINITY, f32::NEG_INFINITY), QParams { scale: 1.0, zero_point: 0 });
    }
}
