//! Output stages applied to finished blocks of 32-bit accumulators: requantization to 8 bits
//! and scaling to f32, computed exactly as ONNX Runtime's CPU kernels do.
//!
//! ONNX Runtime (MLAS `MlasRequantizeOutput`, used by QLinearMatMul, QLinearConv and QGemm)
//! computes, per element, in this order: `v = f32(acc)` (round to nearest even), `v = v *
//! scale` (one f32 multiply, no FMA), `v = max(v, qmin - zp)`, `v = min(v, qmax - zp)` (SSE
//! `maxps`/`minps` operand order, so a NaN product becomes `qmin - zp`), round to nearest
//! even (`cvtps2dq`), then `+ zp`. The scale is one f32 per tensor or per output column,
//! computed by the operator as `(a_scale * b_scale) / y_scale` in f32.

use crate::kernels::math::round_even_int;

/// One scale for every column or one per column (indexed from the block's first column).
#[derive(Clone, Copy, Debug)]
pub enum Scale<'a> {
    Tensor(f32),
    Each(&'a [f32]),
}

impl<'a> Scale<'a> {
    /// The scales of columns `from..from + len`.
    pub fn columns(self, from: usize, len: usize) -> Scale<'a> {
        match self {
            Scale::Tensor(s) => Scale::Tensor(s),
            Scale::Each(v) => Scale::Each(&v[from..from + len]),
        }
    }
}

/// An 8-bit quantized element (`u8` or `i8`).
pub trait Out8: Copy + Default + Send + Sync + qforge_ir::Elem + 'static {
    /// The smallest value.
    const MIN: i32;
    /// The largest value.
    const MAX: i32;
    /// `v` must be in `MIN..=MAX`.
    fn from_i32(v: i32) -> Self;
    fn get(self) -> i32;
    /// The element whose byte is `b` (how ONNX Runtime indexes its tables).
    fn from_byte(b: u8) -> Self;
    fn byte(self) -> u8;
}

macro_rules! out8 {
    ($($t:ty: $min:expr, $max:expr);*) => { $(impl Out8 for $t {
        const MIN: i32 = $min;
        const MAX: i32 = $max;
        #[inline(always)] fn from_i32(v: i32) -> Self { v as $t }
        #[inline(always)] fn get(self) -> i32 { self as i32 }
        #[inline(always)] fn from_byte(b: u8) -> Self { b as $t }
        #[inline(always)] fn byte(self) -> u8 { self as u8 }
    })* };
}
out8!(u8: 0, 255; i8: -128, 127);

/// `round_half_even(min(max(v, lo), hi))` as an integer, with `maxps`/`minps` semantics (a
/// NaN `v` gives `lo`); `lo` and `hi` are integers with magnitude below 2^22.
#[inline(always)]
fn clamp_round(v: f32, lo: f32, hi: f32) -> i32 {
    let v = if v > lo { v } else { lo };
    let v = if v < hi { v } else { hi };
    round_even_int(v)
}

/// [`requantize`]'s loop.
#[inline(always)]
fn requantize_body<T: Out8>(acc: &[i32], scale: Scale, zero_point: i32, out: &mut [T]) {
    let (lo, hi) = ((T::MIN - zero_point) as f32, (T::MAX - zero_point) as f32);
    match scale {
        Scale::Tensor(s) => {
            for (o, &v) in out.iter_mut().zip(acc) {
                *o = T::from_i32(clamp_round(v as f32 * s, lo, hi) + zero_point);
            }
        }
        Scale::Each(s) => {
            for ((o, &v), &s) in out.iter_mut().zip(acc).zip(s) {
                *o = T::from_i32(clamp_round(v as f32 * s, lo, hi) + zero_point);
            }
        }
    }
}

/// [`requantize_block`]'s loops (same contract).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn requantize_block_body<T: Out8>(acc: &[i32], ld: usize, rows: usize, cols: usize, bias: Option<&[i32]>, scale: Scale, zero_point: i32, out: *mut T, ld_out: usize) {
    let (lo, hi) = ((T::MIN - zero_point) as f32, (T::MAX - zero_point) as f32);
    for r in 0..rows {
        let src = &acc[r * ld..r * ld + cols];
        let dst = std::slice::from_raw_parts_mut(out.add(r * ld_out), cols);
        let q = |v: i32, s: f32| T::from_i32(clamp_round(v as f32 * s, lo, hi) + zero_point);
        match (bias, scale) {
            (None, Scale::Tensor(s)) => dst.iter_mut().zip(src).for_each(|(o, &v)| *o = q(v, s)),
            (None, Scale::Each(sc)) => dst.iter_mut().zip(src).zip(sc).for_each(|((o, &v), &s)| *o = q(v, s)),
            (Some(b), Scale::Tensor(s)) => dst.iter_mut().zip(src).zip(b).for_each(|((o, &v), &b)| *o = q(v.wrapping_add(b), s)),
            (Some(b), Scale::Each(sc)) => dst.iter_mut().zip(src).zip(b).zip(sc).for_each(|(((o, &v), &b), &s)| *o = q(v.wrapping_add(b), s)),
        }
    }
}

/// Requantizes a block of accumulators (`rows x cols`, row stride `ld`) into 8-bit outputs
/// at `out` (row stride `ld_out`), adding a per-column `bias` first (wrapping) when given:
/// [`requantize`] row by row, with one dispatch for the whole block.
///
/// # Safety
/// `out` must be valid for writes of `rows` rows of `cols` elements at stride `ld_out`, not
/// aliased by any live reference; `acc` must hold the block; `bias` and per-column scales
/// must have `cols` values.
#[allow(clippy::too_many_arguments)]
pub unsafe fn requantize_block<T: Out8>(acc: &[i32], ld: usize, rows: usize, cols: usize, bias: Option<&[i32]>, scale: Scale, zero_point: i32, out: *mut T, ld_out: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!((rows - 1) * ld + cols <= acc.len() && bias.is_none_or(|b| b.len() >= cols));
    if let Scale::Each(s) = scale {
        assert!(s.len() >= cols);
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx512<T: Out8>(acc: &[i32], ld: usize, rows: usize, cols: usize, bias: Option<&[i32]>, scale: Scale, zero_point: i32, out: *mut T, ld_out: usize) {
            requantize_block_body(acc, ld, rows, cols, bias, scale, zero_point, out, ld_out)
        }
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx2<T: Out8>(acc: &[i32], ld: usize, rows: usize, cols: usize, bias: Option<&[i32]>, scale: Scale, zero_point: i32, out: *mut T, ld_out: usize) {
            requantize_block_body(acc, ld, rows, cols, bias, scale, zero_point, out, ld_out)
        }
        if std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl") {
            return avx512(acc, ld, rows, cols, bias, scale, zero_point, out, ld_out);
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return avx2(acc, ld, rows, cols, bias, scale, zero_point, out, ld_out);
        }
    }
    requantize_block_body(acc, ld, rows, cols, bias, scale, zero_point, out, ld_out)
}

/// [`scale_to_f32`]'s loop.
#[inline(always)]
fn scale_body(acc: &[i32], scale: Scale, out: &mut [f32]) {
    match scale {
        Scale::Tensor(s) => out.iter_mut().zip(acc).for_each(|(o, &v)| *o = v as f32 * s),
        Scale::Each(s) => out.iter_mut().zip(acc).zip(s).for_each(|((o, &v), &s)| *o = v as f32 * s),
    }
}

/// Requantizes accumulators to 8 bits: `out[j] = clamp(round_half_even(f32(acc[j]) *
/// scale[j]) + zero_point)`, bit-identical to ONNX Runtime (see the module documentation).
/// `out`, `acc` and per-column scales must have the same length; `zero_point` must lie in
/// the output type's range.
pub fn requantize<T: Out8>(acc: &[i32], scale: Scale, zero_point: i32, out: &mut [T]) {
    debug_assert!(acc.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn avx512<T: Out8>(acc: &[i32], scale: Scale, zero_point: i32, out: &mut [T]) {
            requantize_body(acc, scale, zero_point, out)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<T: Out8>(acc: &[i32], scale: Scale, zero_point: i32, out: &mut [T]) {
            requantize_body(acc, scale, zero_point, out)
        }
        if std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl") {
            // SAFETY: the CPU supports the enabled features, checked just above.
            return unsafe { avx512(acc, scale, zero_point, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(acc, scale, zero_point, out) };
        }
    }
    requantize_body(acc, scale, zero_point, out)
}

/// Scales accumulators to f32: `out[j] = f32(acc[j]) * scale[j]` (ONNX Runtime's QGemm
/// without an output zero point).
pub fn scale_to_f32(acc: &[i32], scale: Scale, out: &mut [f32]) {
    debug_assert!(acc.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(acc: &[i32], scale: Scale, out: &mut [f32]) {
            scale_body(acc, scale, out)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(acc, scale, out) };
        }
    }
    scale_body(acc, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_half_to_even_and_clamps_like_maxps_minps() {
        let acc = [5, 7, -5, -7, 1000, -1000, 0, 3];
        let mut out = [0u8; 8];
        requantize(&acc, Scale::Tensor(0.5), 10, &mut out);
        // 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, -3.5 -> -4; saturation at both ends.
        assert_eq!(out, [12, 14, 8, 6, 255, 0, 10, 12]);
        let mut out = [0i8; 2];
        requantize(&[1, 1], Scale::Each(&[f32::NAN, f32::INFINITY]), -3, &mut out);
        assert_eq!(out, [-128, 127]);
    }
}
