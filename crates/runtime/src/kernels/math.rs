//! Branch-free f32 `exp`, `tanh` and `erf` that compile to straight-line arithmetic and selects, so
//! loops over them vectorize (the `std`/`libm` versions are opaque calls and do not).
//!
//! Both are written with plain multiplies and adds (no `mul_add`, which is a library call
//! without FMA hardware) and no float-to-int conversions the baseline x86-64 target lacks,
//! so the portable build computes the same values as the AVX2/AVX-512 builds.

/// `1.5 * 2^23`: adding it to a float of magnitude below `2^22` rounds that float to an
/// integer (ties to even) held in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// `round_half_to_even(v)` as an integer, for `|v| <= 2^22`: adding [`ROUND`] rounds in the
/// default rounding mode (as `nearbyint`) and leaves the integer in the low mantissa bits, so
/// loops over it stay in vector registers.
#[inline(always)]
pub(crate) fn round_even_int(v: f32) -> i32 {
    (v + ROUND).to_bits() as i32 - ROUND.to_bits() as i32
}

/// `e^x` within 2 ulp for results in the normal range; `+inf` above `ln(f32::MAX)`, `0`
/// below `ln(f32::MIN_POSITIVE)` (results that would be subnormal flush to zero), NaN for
/// NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const HI: f32 = 88.722_84;
    const LO: f32 = -87.336_55;
    // ln 2 split so that `n * LN2_HI` is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(LO, HI);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    // n lies in [-126, 128]: the low bits of `t` hold n + 2^22 (as two's complement offset).
    let ni = (t.to_bits() as i32) - (ROUND.to_bits() as i32);
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Minimax polynomial for e^r - 1 - r on |r| <= ln(2)/2 (the Cephes coefficients).
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    // 2^n as two factors, so n = 128 does not overflow the exponent field.
    let half = ni >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((ni - half + 127) as u32) << 23);
    let v = y * s1 * s2;
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        v
    }
}

/// The hyperbolic tangent within 3 ulp: Cephes' odd polynomial for `|x| < 0.625`, else
/// `1 - 2 / (e^(2|x|) + 1)` with the sign of `x` (`±1` once `e^(2|x|)` overflows). NaN for NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let near = ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z - 3.333_328e-1) * z * x + x;
    let far = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        near
    } else {
        far
    }
}

/// The error function within about 3e-7 absolute (and 1e-8 relative for |x| < 0.5): a
/// Taylor polynomial near zero, Abramowitz & Stegun 7.1.26 elsewhere. NaN for NaN.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    // 2/sqrt(pi) * sum (-1)^k x^(2k+1) / (k! (2k+1)), k <= 6: error < 1e-9 for |x| <= 0.5.
    let near = x * (std::f32::consts::FRAC_2_SQRT_PI + z * (-0.376_126_4 + z * (0.112_837_92 + z * (-0.026_866_17 + z * (5.223_977_6e-3 + z * (-8.548_327e-4 + z * 1.205_533_3e-4))))));
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let q = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let far = 1.0 - q * exp(-z);
    if a < 0.5 {
        near
    } else {
        far.copysign(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units of the last place between two finite floats of one sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_matches_std_within_two_ulp() {
        let mut x = -87.0f32;
        while x < 88.7 {
            let (got, want) = (exp(x), x.exp());
            assert!(ulps(got, want) <= 2, "exp({x}) = {got}, std gives {want}");
            x += 0.000_97;
        }
        for x in [0.0f32, -0.0, 1.0, -1.0, 1e-8, -1e-8, 88.72, -87.33] {
            assert!(ulps(exp(x), x.exp()) <= 2, "exp({x})");
        }
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_matches_libm_within_three_ulp() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let (got, want) = (tanh(x), libm::tanhf(x));
            assert!(ulps(got.abs(), want.abs()) <= 3 && got.signum() == want.signum(), "tanh({x}) = {got}, libm gives {want}");
            x += 0.000_37;
        }
        for x in [0.0f32, -0.0, 1e-30, -1e-7, 0.624_999_9, 0.625, -0.625, 9.0, 44.0, 100.0, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(ulps(tanh(x).abs(), libm::tanhf(x).abs()) <= 3, "tanh({x}) = {}, libm gives {}", tanh(x), libm::tanhf(x));
        }
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn erf_matches_libm() {
        let mut x = -6.0f32;
        while x < 6.0 {
            let (got, want) = (erf(x), libm::erff(x));
            assert!((got - want).abs() <= 3e-7, "erf({x}) = {got}, libm gives {want}");
            if x.abs() < 0.5 {
                assert!((got - want).abs() <= 1e-8 + 2.5e-7 * want.abs(), "erf({x}) = {got}, libm gives {want}");
            }
            x += 0.000_31;
        }
        for x in [0.0f32, 1e-30, -1e-20, 1e-6, 0.5, -0.5, 10.0, -10.0, f32::INFINITY, f32::NEG_INFINITY] {
            assert!((erf(x) - libm::erff(x)).abs() <= 3e-7 * (1.0 + x.abs().min(1.0)), "erf({x})");
        }
        assert!(erf(f32::NAN).is_nan());
    }
}
