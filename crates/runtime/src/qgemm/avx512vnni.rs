//! AVX-512 VNNI micro-kernel: `vpdpbusd` multiplies 4 unsigned bytes of A by 4 signed bytes
//! of B and adds the four products to a 32-bit lane, without intermediate saturation (the
//! non-saturating form; the `vpdpbusds` variant would clamp). Every product is exact: A is
//! stored as `u8` (signed activations are flipped by `xor 0x80`, i.e. `+128`) and B as `i8`
//! (unsigned weights flipped to `b - 128`), and the driver folds both shifts into the zero
//! points. Tiles are `R x 32` (R <= 12): 2R accumulators of 16 lanes, two B vectors and one
//! broadcast of A, 2R + 3 <= 27 of the 32 registers. A last panel of at most 24 wanted
//! columns (24 output channels, say) takes `R x 24` tiles whose upper 8 columns are 8-lane
//! vectors, one of at most 16 `R x 16` tiles.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::Epilogue;

/// Computes an `R x 32` tile: `c[r][j] (+)= sum_d a[r * lda + d] * b[g][j][d % 4]` over
/// `4 groups` depths `d` (`g = d / 4`), A as `u8` and B as `i8`, `c` with row stride `ldc` (in
/// `i32`), accumulating when `acc`, and adding the zero point terms of `epi` when given.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI. `a` must hold `R` rows of `4 groups` bytes
/// at stride `lda`, `b` `groups * 128` bytes and `c` `R` rows of 32 `i32` at stride `ldc`;
/// `epi`'s pointers must hold 32 (`col`, `bz`) and `R` (`row`) values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile<const R: usize>(groups: usize, a: *const u8, lda: usize, b: *const u8, c: *mut i32, ldc: usize, acc: bool, epi: Option<&Epilogue>) {
    let mut sum = dot_rows::<R, true>(groups, a, lda, b);
    if let Some(e) = epi {
        let (c0, c1) = (_mm512_loadu_si512(e.col as *const _), _mm512_loadu_si512(e.col.add(16) as *const _));
        if e.bz.is_null() {
            for (r, s) in sum.iter_mut().enumerate() {
                let rv = _mm512_set1_epi32(*e.row.add(r));
                s[0] = _mm512_add_epi32(s[0], _mm512_add_epi32(c0, rv));
                s[1] = _mm512_add_epi32(s[1], _mm512_add_epi32(c1, rv));
            }
        } else {
            let (z0, z1) = (_mm512_loadu_si512(e.bz as *const _), _mm512_loadu_si512(e.bz.add(16) as *const _));
            for (r, s) in sum.iter_mut().enumerate() {
                let rv = _mm512_set1_epi32(*e.row.add(r));
                s[0] = _mm512_add_epi32(s[0], _mm512_add_epi32(c0, _mm512_mullo_epi32(z0, rv)));
                s[1] = _mm512_add_epi32(s[1], _mm512_add_epi32(c1, _mm512_mullo_epi32(z1, rv)));
            }
        }
    }
    for (r, s) in sum.iter().enumerate() {
        let row = c.add(r * ldc);
        let (mut v0, mut v1) = (s[0], s[1]);
        if acc {
            v0 = _mm512_add_epi32(v0, _mm512_loadu_si512(row as *const _));
            v1 = _mm512_add_epi32(v1, _mm512_loadu_si512(row.add(16) as *const _));
        }
        _mm512_storeu_si512(row as *mut _, v0);
        _mm512_storeu_si512(row.add(16) as *mut _, v1);
    }
}

/// The `R x 32` sums `sum[r][j / 16][j % 16] = sum_d a[r * lda + d] * b[g][j][d % 4]` over `4
/// groups` depths `d` (`g = d / 4`): per group, each row's 4 bytes are broadcast against the
/// group's 128 bytes of `b` (32 columns of 4) with `vpdpbusd`. `A_UNSIGNED`: `a`'s bytes are
/// the instruction's unsigned operand and `b`'s the signed one; otherwise the reverse (`b`
/// holds the unsigned activations, `a` the signed weights).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `a` must hold `R` rows of `4 groups` bytes at
/// stride `lda` and `b` `groups * 128` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) unsafe fn dot_rows<const R: usize, const A_UNSIGNED: bool>(groups: usize, a: *const u8, lda: usize, b: *const u8) -> [[__m512i; 2]; R] {
    let mut sum = [[_mm512_setzero_si512(); 2]; R];
    let rows: [*const u8; R] = std::array::from_fn(|r| a.add(r * lda));
    let mut bp = b;
    for g in 0..groups {
        let b0 = _mm512_loadu_si512(bp as *const _);
        let b1 = _mm512_loadu_si512(bp.add(64) as *const _);
        for (s, &row) in sum.iter_mut().zip(&rows) {
            let av = _mm512_set1_epi32((row.add(4 * g) as *const i32).read_unaligned());
            if A_UNSIGNED {
                s[0] = _mm512_dpbusd_epi32(s[0], av, b0);
                s[1] = _mm512_dpbusd_epi32(s[1], av, b1);
            } else {
                s[0] = _mm512_dpbusd_epi32(s[0], b0, av);
                s[1] = _mm512_dpbusd_epi32(s[1], b1, av);
            }
        }
        bp = bp.add(128);
    }
    sum
}

/// [`tile`] for a panel of which only the first 24 columns (`HI`) or 16 are wanted: columns
/// 16..24 are accumulated in 8-lane vectors (half the work of 16-lane ones on CPUs that split
/// 512-bit operations), and the columns beyond the wanted ones are neither read nor written
/// in `c`. Same packed B panel and epilogue as [`tile`].
///
/// # Safety
/// As [`tile`], and the CPU must also support AVX-512 VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_narrow<const R: usize, const HI: bool>(groups: usize, a: *const u8, lda: usize, b: *const u8, c: *mut i32, ldc: usize, acc: bool, epi: Option<&Epilogue>) {
    let mut lo = [_mm512_setzero_si512(); R];
    let mut hi = [_mm256_setzero_si256(); R];
    let rows: [*const u8; R] = std::array::from_fn(|r| a.add(r * lda));
    let mut bp = b;
    for g in 0..groups {
        let b0 = _mm512_loadu_si512(bp as *const _);
        let b1 = _mm256_loadu_si256(bp.add(64) as *const _);
        for r in 0..R {
            let word = (rows[r].add(4 * g) as *const i32).read_unaligned();
            lo[r] = _mm512_dpbusd_epi32(lo[r], _mm512_set1_epi32(word), b0);
            if HI {
                hi[r] = _mm256_dpbusd_epi32(hi[r], _mm256_set1_epi32(word), b1);
            }
        }
        bp = bp.add(128);
    }
    if let Some(e) = epi {
        let (c0, c1) = (_mm512_loadu_si512(e.col as *const _), _mm256_loadu_si256(e.col.add(16) as *const _));
        for r in 0..R {
            let rv = *e.row.add(r);
            if e.bz.is_null() {
                lo[r] = _mm512_add_epi32(lo[r], _mm512_add_epi32(c0, _mm512_set1_epi32(rv)));
                hi[r] = _mm256_add_epi32(hi[r], _mm256_add_epi32(c1, _mm256_set1_epi32(rv)));
            } else {
                let (z0, z1) = (_mm512_loadu_si512(e.bz as *const _), _mm256_loadu_si256(e.bz.add(16) as *const _));
                lo[r] = _mm512_add_epi32(lo[r], _mm512_add_epi32(c0, _mm512_mullo_epi32(z0, _mm512_set1_epi32(rv))));
                hi[r] = _mm256_add_epi32(hi[r], _mm256_add_epi32(c1, _mm256_mullo_epi32(z1, _mm256_set1_epi32(rv))));
            }
        }
    }
    for r in 0..R {
        let row = c.add(r * ldc);
        let (mut v0, mut v1) = (lo[r], hi[r]);
        if acc {
            v0 = _mm512_add_epi32(v0, _mm512_loadu_si512(row as *const _));
            if HI {
                v1 = _mm256_add_epi32(v1, _mm256_loadu_si256(row.add(16) as *const _));
            }
        }
        _mm512_storeu_si512(row as *mut _, v0);
        if HI {
            _mm256_storeu_si256(row.add(16) as *mut _, v1);
        }
    }
}

/// `$f::<rows, $extra>` for `rows` in 1..=12 (12 for larger values).
macro_rules! by_rows {
    ($rows:expr, $f:ident $(, $extra:expr)?) => {
        match $rows {
            1 => $f::<1 $(, $extra)?>,
            2 => $f::<2 $(, $extra)?>,
            3 => $f::<3 $(, $extra)?>,
            4 => $f::<4 $(, $extra)?>,
            5 => $f::<5 $(, $extra)?>,
            6 => $f::<6 $(, $extra)?>,
            7 => $f::<7 $(, $extra)?>,
            8 => $f::<8 $(, $extra)?>,
            9 => $f::<9 $(, $extra)?>,
            10 => $f::<10 $(, $extra)?>,
            11 => $f::<11 $(, $extra)?>,
            _ => $f::<12 $(, $extra)?>,
        }
    };
}

/// The tile function for `rows` rows (1..=12) of a panel whose first `cols` columns are
/// wanted: [`tile_narrow`] when `cols <= 24` and the CPU has AVX-512 VL, else [`tile`].
#[cfg(target_arch = "x86_64")]
pub(crate) fn tile_fn(rows: usize, cols: usize) -> super::TileFn {
    static VL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if cols <= 24 && *VL.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vl")) {
        return if cols <= 16 { by_rows!(rows, tile_narrow, false) } else { by_rows!(rows, tile_narrow, true) };
    }
    by_rows!(rows, tile)
}
