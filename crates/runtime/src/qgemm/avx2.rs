//! AVX2 micro-kernel on 16-bit values: A and B are stored sign- or zero-extended to `i16`
//! and `vpmaddwd` multiplies pairs of them and adds each pair into a 32-bit lane.
//!
//! `vpmaddubsw` (u8 x i8 pairs summed into a *saturating* `i16`) is deliberately not used: two
//! products such as `255 * 127 + 255 * 127 = 64770` exceed 32767 and would be clamped. With
//! 16-bit operands in [-128, 255] every pair sum is at most `2 * 255 * 255 = 130050` in
//! magnitude, far inside `i32`, so the result is exact for all u8/i8 inputs, at half the
//! multiply rate of the byte instruction. Tiles are `R x 16` (R <= 6): 2R accumulators of
//! 8 lanes, two B vectors and one broadcast of A, 2R + 3 <= 15 of the 16 registers. A panel
//! whose wanted columns end within its first 8 runs an `R x 8` tile, half the work.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::Epilogue;

/// Computes an `R x 8V` tile (`V` of 1 or 2 vectors of 8 columns): `c[r][j] (+)= sum_d
/// a[r][d] * b[g][j][d % 2]` over `2 groups` depths `d` (`g = d / 2`) of `i16` values and the
/// first `8V` of the panel's 16 columns, A's rows at stride `lda` bytes, `c` with row stride
/// `ldc` (in `i32`), accumulating when `acc`, and adding the zero point terms of `epi` when
/// given. Columns `8V..16` of `c` are left untouched.
///
/// # Safety
/// The CPU must support AVX2. `a` must hold `R` rows of `4 groups` bytes at stride `lda`, `b`
/// `groups * 64` bytes and `c` `R` rows of `8V` `i32` at stride `ldc`; `epi`'s pointers must
/// hold `8V` (`col`, `bz`) and `R` (`row`) values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile<const R: usize, const V: usize>(groups: usize, a: *const u8, lda: usize, b: *const u8, c: *mut i32, ldc: usize, acc: bool, epi: Option<&Epilogue>) {
    let mut sum = [[_mm256_setzero_si256(); V]; R];
    let rows: [*const u8; R] = std::array::from_fn(|r| a.add(r * lda));
    let mut bp = b;
    for g in 0..groups {
        let bv: [__m256i; V] = std::array::from_fn(|v| _mm256_loadu_si256(bp.add(32 * v) as *const __m256i));
        for (s, &row) in sum.iter_mut().zip(&rows) {
            let av = _mm256_set1_epi32((row.add(4 * g) as *const i32).read_unaligned());
            for (sv, &b) in s.iter_mut().zip(&bv) {
                *sv = _mm256_add_epi32(*sv, _mm256_madd_epi16(av, b));
            }
        }
        bp = bp.add(64);
    }
    if let Some(e) = epi {
        let col: [__m256i; V] = std::array::from_fn(|v| _mm256_loadu_si256(e.col.add(8 * v) as *const __m256i));
        if e.bz.is_null() {
            for (r, s) in sum.iter_mut().enumerate() {
                let rv = _mm256_set1_epi32(*e.row.add(r));
                for (sv, &cv) in s.iter_mut().zip(&col) {
                    *sv = _mm256_add_epi32(*sv, _mm256_add_epi32(cv, rv));
                }
            }
        } else {
            let bz: [__m256i; V] = std::array::from_fn(|v| _mm256_loadu_si256(e.bz.add(8 * v) as *const __m256i));
            for (r, s) in sum.iter_mut().enumerate() {
                let rv = _mm256_set1_epi32(*e.row.add(r));
                for ((sv, &cv), &zv) in s.iter_mut().zip(&col).zip(&bz) {
                    *sv = _mm256_add_epi32(*sv, _mm256_add_epi32(cv, _mm256_mullo_epi32(zv, rv)));
                }
            }
        }
    }
    for (r, s) in sum.iter().enumerate() {
        let row = c.add(r * ldc);
        for (v, &sv) in s.iter().enumerate() {
            let at = row.add(8 * v) as *mut __m256i;
            let out = if acc { _mm256_add_epi32(sv, _mm256_loadu_si256(at)) } else { sv };
            _mm256_storeu_si256(at, out);
        }
    }
}

/// The tile function for `rows` rows (1..=6) of a panel whose first `cols` columns are
/// wanted: 8 columns wide when `cols <= 8`, else 16.
#[cfg(target_arch = "x86_64")]
pub(crate) fn tile_fn(rows: usize, cols: usize) -> super::TileFn {
    /// The `rows`-row tile of `V` vectors.
    fn of<const V: usize>(rows: usize) -> super::TileFn {
        match rows {
            1 => tile::<1, V>,
            2 => tile::<2, V>,
            3 => tile::<3, V>,
            4 => tile::<4, V>,
            5 => tile::<5, V>,
            _ => tile::<6, V>,
        }
    }
    if cols <= 8 {
        of::<1>(rows)
    } else {
        of::<2>(rows)
    }
}
