//! The f32 matrix product behind MatMul, Gemm, Conv and the RNNs: one entry point so the
//! underlying library (the `gemm` crate, with runtime AVX2/AVX-512 dispatch) can be swapped.

use super::util::PAR_MIN_WORK;

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
/// Accumulates into `c` when `accumulate`, else overwrites it. Uses the current rayon pool's
/// threads for large products.
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
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 && m * n * k >= 4 * PAR_MIN_WORK { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the assert above keeps every element read from `a` and `b` inside the slices;
    // the caller guarantees the output rows are valid, exclusive and disjoint from them,
    // and the `gemm` crate reads the output only when `accumulate` (`read_dst`).
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
}
