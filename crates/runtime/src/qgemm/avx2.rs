//! AVX2 micro-kernels, on bytes ([`super::Isa::Avx2Pairs`]) or on 16-bit values
//! ([`super::Isa::Avx2`]).
//!
//! * Bytes: A stored as `u8` and B as `i8`, four depths per 32-bit lane as for VNNI;
//!   `vpmaddubsw` multiplies the 32 byte pairs and adds each two neighbouring products into a
//!   *saturating* `i16`, and `vpmaddwd` against ones adds those two sums into the lane. Two
//!   products such as `255 * 127 + 255 * 127 = 64770` would be clamped to 32767, so B packs for
//!   this kernel only when no pair of its values can get there (`pack::pairs_fit`), which
//!   qforge's `ort` backend guarantees for the weights it writes.
//! * 16-bit values: A and B are stored sign- or zero-extended to `i16` and `vpmaddwd`
//!   multiplies pairs of them and adds each pair into a 32-bit lane. With operands in
//!   [-128, 255] every pair sum is at most `2 * 255 * 255 = 130050` in magnitude, far inside
//!   `i32`, so the result is exact for all u8/i8 inputs, at half the multiply rate.
//!
//! Tiles are `R x 16` (R <= 6): 2R accumulators of 8 lanes, two B vectors and one broadcast
//! of A (and the ones of the byte kernel), 2R + 4 <= 16 registers. A panel whose wanted
//! columns end within its first 8 runs an `R x 8` tile, half the work.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::Epilogue;

/// Computes an `R x 8V` tile (`V` of 1 or 2 vectors of 8 columns): `c[r][j] (+)= sum_d
/// a[r][d] * b[g][j][d % G]` over `G groups` depths `d` (`g = d / G`) of `u8` x `i8` bytes
/// (`BYTES`, `G = 4`) or `i16` values (`G = 2`) and the first `8V` of the panel's 16 columns, A's rows at stride `lda` bytes, `c` with row stride
/// `ldc` (in `i32`), accumulating when `acc`, and adding the zero point terms of `epi` when
/// given. Columns `8V..16` of `c` are left untouched.
///
/// # Safety
/// The CPU must support AVX2. `a` must hold `R` rows of `4 groups` bytes at stride `lda`, `b`
/// `groups * 64` bytes and `c` `R` rows of `8V` `i32` at stride `ldc`; `epi`'s pointers must
/// hold `8V` (`col`, `bz`) and `R` (`row`) values. With `BYTES`, no two neighbouring products
/// of a lane may leave the `i16` range (the packing checks B for it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile<const R: usize, const V: usize, const BYTES: bool>(groups: usize, a: *const u8, lda: usize, b: *const u8, c: *mut i32, ldc: usize, acc: bool, epi: Option<&Epilogue>) {
    let mut sum = [[_mm256_setzero_si256(); V]; R];
    let ones = _mm256_set1_epi16(1);
    let rows: [*const u8; R] = std::array::from_fn(|r| a.add(r * lda));
    let mut bp = b;
    for g in 0..groups {
        let bv: [__m256i; V] = std::array::from_fn(|v| _mm256_loadu_si256(bp.add(32 * v) as *const __m256i));
        for (s, &row) in sum.iter_mut().zip(&rows) {
            let av = _mm256_set1_epi32((row.add(4 * g) as *const i32).read_unaligned());
            for (sv, &b) in s.iter_mut().zip(&bv) {
                let lanes = if BYTES { _mm256_madd_epi16(_mm256_maddubs_epi16(av, b), ones) } else { _mm256_madd_epi16(av, b) };
                *sv = _mm256_add_epi32(*sv, lanes);
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

/// The tile function (on bytes with `BYTES`) for `rows` rows (1..=6) of a panel whose first
/// `cols` columns are wanted: 8 columns wide when `cols <= 8`, else 16.
#[cfg(target_arch = "x86_64")]
pub(crate) fn tile_fn<const BYTES: bool>(rows: usize, cols: usize) -> super::TileFn {
    /// The `rows`-row tile of `V` vectors.
    fn of<const V: usize, const BYTES: bool>(rows: usize) -> super::TileFn {
        match rows {
            1 => tile::<1, V, BYTES>,
            2 => tile::<2, V, BYTES>,
            3 => tile::<3, V, BYTES>,
            4 => tile::<4, V, BYTES>,
            5 => tile::<5, V, BYTES>,
            _ => tile::<6, V, BYTES>,
        }
    }
    if cols <= 8 {
        of::<1, BYTES>(rows)
    } else {
        of::<2, BYTES>(rows)
    }
}
