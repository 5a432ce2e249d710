//! The f32 matrix product behind MatMul, Gemm, Conv and the RNNs: one entry point so the
//! underlying library (the `gemm` crate, with runtime AVX2/AVX-512 dispatch) can be swapped.

use super::util::{par_steps, threads, PAR_MIN_WORK};

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
    let pieces = threads.min(work / PAR_MIN_WORK).max(1);
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
        let shapes = [(131, 77, 67), (45, 201, 99), (9, 1000, 70), (300, 129, 120)];
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
