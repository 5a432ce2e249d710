//! The f32 matrix product behind MatMul, Gemm, Conv and the RNNs: one entry point so the
//! underlying library (the `gemm` crate, with runtime AVX2/AVX-512 dispatch) can be swapped.

use super::util::{par_steps, threads, vectorized_wide, PAR_MIN_WORK};

/// A row-major-or-strided f32 matrix view: element (i, j) is at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        MatRef { data, rs: cols, cs: 1 }
    }
    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        MatRef { data, rs: 1, cs: cols }
    }
}

/// `c[m x n] (+)= a[m x k] * b[k x n]`, `c` row-major with leading dimension `n`.
/// Accumulates into `c` when `accumulate`, else overwrites it. Splits large products across
/// [`threads`].
pub fn sgemm(m: usize, n: usize, k: usize, a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool) {
    assert!(c.len() >= m * n, "output too small");
    // SAFETY: `c` is exclusively borrowed, initialized, and long enough (asserted above).
    unsafe { sgemm_into(m, n, k, a, b, c.as_mut_ptr(), n, accumulate, true) }
}

/// [`sgemm`] into raw output memory with leading dimension `ldc`: row `i` of the `m x n`
/// result is written to `c.add(i * ldc)..` (and, when `accumulate`, added to the values
/// there). `parallel`: whether it may use several threads (callers that already run in
/// parallel pass `false`).
///
/// # Safety
/// `ldc >= n`; the `m` rows of `n` elements at `c` are valid for writes, and for reads when
/// `accumulate` (otherwise they may be uninitialized: they are only written); nothing else
/// reads or writes them during the call, and they do not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_into(m: usize, n: usize, k: usize, a: MatRef, b: MatRef, c: *mut f32, ldc: usize, accumulate: bool, parallel: bool) {
    assert!(ldc >= n, "the leading dimension is shorter than a row");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    // SAFETY: element (i, j) is inside the caller's rows.
                    unsafe { c.add(i * ldc + j).write(0.0) };
                }
            }
        }
        return;
    }
    let last = |v: &MatRef, r: usize, cc: usize| (r - 1) * v.rs + (cc - 1) * v.cs;
    assert!(last(&a, m, k) < a.data.len() && last(&b, k, n) < b.data.len(), "input view out of bounds");
    let threads = threads();
    let work = m * n * k;
    let pieces = if parallel { threads.min(work / PAR_MIN_WORK).max(1) } else { 1 };
    if n <= SKINNY && a.cs == 1 {
        // SAFETY: row `i` of `a` is `k` contiguous values from `a.data[i * a.rs]` (bounds
        // asserted above), and output element (i, j) is at `c + i * ldc + j`.
        return unsafe { dot_rows(m, n, k, a.data, a.rs, b, c, ldc, 1, accumulate, pieces) };
    }
    if m <= SKINNY && b.rs == 1 {
        let at = MatRef { data: a.data, rs: a.cs, cs: a.rs };
        // SAFETY: column `j` of `b` is `k` contiguous values from `b.data[j * b.cs]` (bounds
        // asserted above), `at` is `a` transposed, and output element (i, j) is at
        // `c + j + i * ldc`.
        return unsafe { dot_rows(n, m, k, b.data, b.cs, at, c, 1, ldc, accumulate, pieces) };
    }
    if !parallel || threads == 1 || work < 2 * PAR_MIN_WORK {
        // SAFETY: the caller's guarantees, passed on.
        return unsafe { gemm_call(m, n, k, a, b, c, ldc, accumulate, gemm::Parallelism::None) };
    }
    if work >= CRATE_PAR_WORK {
        // SAFETY: the caller's guarantees, passed on.
        return unsafe { gemm_call(m, n, k, a, b, c, ldc, accumulate, gemm::Parallelism::Rayon(threads)) };
    }
    // A mid-sized product: split the longer of the row and column ranges into one piece per
    // thread (at most one per PAR_MIN_WORK of work), each a single-threaded product.
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let step = len.div_ceil(pieces).next_multiple_of(if by_rows { 8 } else { 16 }).min(len);
    let out = SendPtr(c);
    let run = |start: usize| {
        let count = step.min(len - start);
        // SAFETY: each piece is a disjoint block of rows (or columns) of the caller's
        // output, so the caller's guarantees hold for it; the views start at the piece's
        // first row of `a` (or column of `b`), which the bounds assert above covers.
        unsafe {
            if by_rows {
                let ap = MatRef { data: &a.data[start * a.rs..], ..a };
                gemm_call(count, n, k, ap, b, out.get().add(start * ldc), ldc, accumulate, gemm::Parallelism::None)
            } else {
                let bp = MatRef { data: &b.data[start * b.cs..], ..b };
                gemm_call(m, count, k, a, bp, out.get().add(start), ldc, accumulate, gemm::Parallelism::None)
            }
        }
    };
    par_steps(len, step, 1, || (), |_, start| run(start));
}

/// Products from this many multiply-adds use the `gemm` crate's own threading, which
/// shares packed operands between threads; smaller ones are split by rows or columns.
const CRATE_PAR_WORK: usize = 1 << 22;

/// Products with at most this many columns (or rows) are computed as dot products
/// ([`dot_rows`]): reading the long operand once, unpacked, is then what bounds them, and
/// the `gemm` crate's packing costs as much again.
const SKINNY: usize = 8;

/// The skinny product: output element `(i, j)`, at `c + i * ci + j * cj`, is (or, when
/// `accumulate`, gains) the dot product of row `i < rows` of `long` (`k` contiguous values
/// from `long[i * lr]`) with column `j < few` of `short` (`k x few`, `few <= SKINNY`).
/// `short` is first copied transposed so its columns are contiguous too; the rows are
/// split into `pieces` tasks across threads.
///
/// # Safety
/// Every row of `long` and every element of `short` lies inside its slice; the output
/// elements are valid for writes (and reads when `accumulate`), distinct, not read or written
/// by anyone else during the call, and apart from `long` and `short`.
#[allow(clippy::too_many_arguments)]
unsafe fn dot_rows(rows: usize, few: usize, k: usize, long: &[f32], lr: usize, short: MatRef, c: *mut f32, ci: usize, cj: usize, accumulate: bool, pieces: usize) {
    let mut cols = vec![0f32; few * k];
    for (j, col) in cols.chunks_exact_mut(k).enumerate() {
        for (t, v) in col.iter_mut().enumerate() {
            *v = short.data[t * short.rs + j * short.cs];
        }
    }
    let out = SendPtr(c);
    let step = rows.div_ceil(pieces.max(1)).max(1);
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    par_steps(rows, step, 1, || (), |_, start| {
        let end = (start + step).min(rows);
        let (block, count, dst) = (&long[start * lr..], end - start, out.get().wrapping_add(start * ci));
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the CPU supports AVX-512F (detected above); the output rows
            // `start..end` are this task's alone, and the caller's guarantees cover the rest.
            return unsafe { dot_block_avx512(block, lr, count, &cols, k, dst, ci, cj, accumulate) };
        }
        // SAFETY: as just above.
        vectorized_wide(#[inline(always)] || unsafe { dot_block(block, lr, count, &cols, k, dst, ci, cj, accumulate, dot) })
    });
}

/// [`dot_rows`] for `rows` rows of `long` (`lr` apart, from its start) and the contiguous
/// columns `cols` of `k` values each, into the output from `c`, with `dot` as the dot
/// product of two equal-length slices.
///
/// # Safety
/// As for [`dot_rows`], for these rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_block(long: &[f32], lr: usize, rows: usize, cols: &[f32], k: usize, c: *mut f32, ci: usize, cj: usize, accumulate: bool, dot: impl Fn(&[f32], &[f32]) -> f32) {
    for i in 0..rows {
        let row = &long[i * lr..i * lr + k];
        for (j, col) in cols.chunks_exact(k).enumerate() {
            let sum = dot(row, col);
            // SAFETY: element (i, j) of this block (the caller's guarantee).
            unsafe {
                let p = c.add(i * ci + j * cj);
                p.write(if accumulate { p.read() + sum } else { sum });
            }
        }
    }
}

/// [`dot_block`] with [`dot_avx512`].
///
/// # Safety
/// As for [`dot_block`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_block_avx512(long: &[f32], lr: usize, rows: usize, cols: &[f32], k: usize, c: *mut f32, ci: usize, cj: usize, accumulate: bool) {
    // SAFETY: the caller's guarantees; the closure runs with this function's AVX-512F.
    unsafe { dot_block(long, lr, rows, cols, k, c, ci, cj, accumulate, |x, y| dot_avx512(x, y)) }
}

/// `sum x[t] * y[t]` over equal-length slices, in sixteen interleaved lanes so the loop
/// vectorizes.
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (xs, ys) = (x.chunks_exact(L), y.chunks_exact(L));
    let tail: f32 = xs.remainder().iter().zip(ys.remainder()).map(|(a, b)| a * b).sum();
    for (xc, yc) in xs.zip(ys) {
        for ((a, &p), &q) in acc.iter_mut().zip(xc).zip(yc) {
            *a = p.mul_add(q, *a);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// [`dot`] in four independent AVX-512 sums of sixteen lanes (so consecutive fused
/// multiply-adds do not wait on each other), then one, then element by element.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn dot_avx512(x: &[f32], y: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(y.len());
    let (xp, yp) = (x.as_ptr(), y.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut t = 0;
    // SAFETY: every load reads sixteen values at `t + 16 * u < n`, `t + 16 * u + 16 <= n`,
    // inside both slices.
    unsafe {
        while t + 64 <= n {
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(t + 16 * u)), _mm512_loadu_ps(yp.add(t + 16 * u)), *a);
            }
            t += 64;
        }
        while t + 16 <= n {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(t)), _mm512_loadu_ps(yp.add(t)), acc[0]);
            t += 16;
        }
    }
    let sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    sum + x[t..n].iter().zip(&y[t..n]).map(|(a, b)| a * b).sum::<f32>()
}

/// The output pointer shared by the pieces of a split product.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the pieces write disjoint blocks of the output.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One call of the `gemm` crate for [`sgemm_into`], with `par` as its threading.
///
/// # Safety
/// As for [`sgemm_into`], with `m, n, k >= 1` and the views of `a` and `b` in bounds.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_call(m: usize, n: usize, k: usize, a: MatRef, b: MatRef, c: *mut f32, ldc: usize, accumulate: bool, par: gemm::Parallelism) {
    // SAFETY: the caller keeps every element read from `a` and `b` inside the slices, and
    // the output rows valid, exclusive and disjoint from them; the `gemm` crate reads the
    // output only when `accumulate` (`read_dst`).
    unsafe {
        gemm::gemm(
            m, n, k,
            c, 1, ldc as isize,
            accumulate,
            a.data.as_ptr(), a.cs as isize, a.rs as isize,
            b.data.as_ptr(), b.cs as isize, b.rs as isize,
            1.0, 1.0, false, false, false, par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_product() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32).sin()).collect();
        let mut c = vec![1.0; m * n];
        sgemm(m, n, k, MatRef::rows(&a, k), MatRef::rows(&b, n), &mut c, true);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = 1.0 + (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
                assert!((c[i * n + j] - want).abs() < 1e-4);
            }
        }
        // B given transposed ([n x k] row-major).
        let bt: Vec<f32> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
        let mut c2 = vec![0.0; m * n];
        sgemm(m, n, k, MatRef::rows(&a, k), MatRef::transposed(&bt, k), &mut c2, false);
        for (x, y) in c.iter().zip(&c2) {
            assert!((x - 1.0 - y).abs() < 1e-4);
        }
    }

    /// Products large enough to be split by rows, by columns, or threaded by the `gemm`
    /// crate, on 1 and 2 threads, with transposed views, accumulation and a leading
    /// dimension longer than a row, against an f64 reference.
    #[test]
    fn split_products_match_the_reference() {
        let shapes = [(131, 77, 67), (45, 201, 99), (9, 1000, 70), (300, 129, 120), (258, 4, 256), (1, 512, 128), (3, 300, 45), (2000, 8, 300), (5, 1, 17)];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for &(m, n, k) in &shapes {
                let a: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let b: Vec<f32> = (0..k * n).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
                let bt: Vec<f32> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
                let ldc = n + 3;
                for (transposed, accumulate) in [(false, false), (true, true)] {
                    let mut c: Vec<f32> = (0..m * ldc).map(|i| (i % 7) as f32).collect();
                    let before = c.clone();
                    let bv = if transposed { MatRef::transposed(&bt, k) } else { MatRef::rows(&b, n) };
                    // SAFETY: `c` holds `m` rows of `ldc >= n` values, exclusively borrowed.
                    pool.install(|| unsafe { sgemm_into(m, n, k, MatRef::rows(&a, k), bv, c.as_mut_ptr(), ldc, accumulate, true) });
                    for i in 0..m {
                        for j in 0..ldc {
                            let got = c[i * ldc + j];
                            if j >= n {
                                assert_eq!(got, before[i * ldc + j], "padding past a row is left alone");
                                continue;
                            }
                            let dot: f64 = (0..k).map(|p| a[i * k + p] as f64 * b[p * n + j] as f64).sum();
                            let want = dot + if accumulate { before[i * ldc + j] as f64 } else { 0.0 };
                            assert!((got as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()), "{m}x{n}x{k}, {threads} threads, ({i}, {j}): {got} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
