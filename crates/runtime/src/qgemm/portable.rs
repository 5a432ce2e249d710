//! Portable micro-kernel: plain 32-bit integer arithmetic on the AVX2 layout (`i16` values in
//! pairs, tiles of `R x 16`). It is the reference the vector kernels are tested against and
//! the fallback on CPUs without AVX2. Products of `i16` values in [-128, 255] and their sums
//! are exact in `i32` up to wrap-around, which every path shares.

use super::Epilogue;

/// Computes an `R x 16` tile like [`super::avx2::tile`], in scalar code.
///
/// # Safety
/// `a` must hold `R` rows of `4 groups` bytes at stride `lda`, `b` `groups * 64` bytes and `c`
/// `R` rows of 16 `i32` at stride `ldc`; `epi`'s pointers must hold 16 (`col`, `bz`) and `R`
/// (`row`) values.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile<const R: usize>(groups: usize, a: *const u8, lda: usize, b: *const u8, c: *mut i32, ldc: usize, acc: bool, epi: Option<&Epilogue>) {
    let mut sum = [[0i32; 16]; R];
    let read = |p: *const u8| -> i32 { (p as *const i16).read_unaligned() as i32 };
    for g in 0..groups {
        let bg = b.add(g * 64);
        for (r, s) in sum.iter_mut().enumerate() {
            let ar = a.add(r * lda + g * 4);
            let (a0, a1) = (read(ar), read(ar.add(2)));
            for (j, v) in s.iter_mut().enumerate() {
                let (b0, b1) = (read(bg.add(j * 4)), read(bg.add(j * 4 + 2)));
                *v = v.wrapping_add(a0 * b0).wrapping_add(a1 * b1);
            }
        }
    }
    if let Some(e) = epi {
        for (r, s) in sum.iter_mut().enumerate() {
            let rv = *e.row.add(r);
            for (j, v) in s.iter_mut().enumerate() {
                let z = if e.bz.is_null() { 1 } else { *e.bz.add(j) };
                *v = v.wrapping_add(*e.col.add(j)).wrapping_add(z.wrapping_mul(rv));
            }
        }
    }
    for (r, s) in sum.iter().enumerate() {
        let row = std::slice::from_raw_parts_mut(c.add(r * ldc), 16);
        for (d, &v) in row.iter_mut().zip(s) {
            *d = if acc { d.wrapping_add(v) } else { v };
        }
    }
}

/// The tile function for `rows` rows (1..=6).
pub(crate) fn tile_fn(rows: usize) -> super::TileFn {
    match rows {
        1 => tile::<1>,
        2 => tile::<2>,
        3 => tile::<3>,
        4 => tile::<4>,
        5 => tile::<5>,
        _ => tile::<6>,
    }
}
