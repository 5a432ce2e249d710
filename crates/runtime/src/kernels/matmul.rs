//! MatMul (numpy batch broadcasting), Gemm and Det.

use qforge_ir::DType;

use super::elementwise::{from_f32, to_f32};
use super::gemm::{sgemm, sgemm_into, MatRef};
use super::util::{broadcast_shape, input, kernel, min_items, opt_input, par_chunks_mut, threads, PAR_MIN_WORK, tensor};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers MatMul, Gemm and Det.
pub fn register(r: &mut Registry) {
    r.add("", "MatMul", 1, LATEST, matmul);
    r.add("", "Gemm", 1, LATEST, gemm_op);
    r.add("", "Det", 11, LATEST, det);
}

/// The determinant of an `n x n` row-major matrix, by LU decomposition with partial
/// pivoting (in place).
fn determinant(a: &mut [f64], n: usize) -> f64 {
    let mut det = 1.0;
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i * n + col].abs().total_cmp(&a[j * n + col].abs())).unwrap_or(col);
        if a[pivot * n + col] == 0.0 {
            return 0.0;
        }
        if pivot != col {
            for k in 0..n {
                a.swap(pivot * n + k, col * n + k);
            }
            det = -det;
        }
        let p = a[col * n + col];
        det *= p;
        for row in col + 1..n {
            let f = a[row * n + col] / p;
            if f != 0.0 {
                for k in col..n {
                    a[row * n + k] -= f * a[col * n + k];
                }
            }
        }
    }
    det
}

/// Det (opsets 11 and 22): the determinants of the square matrices in the last two
/// dimensions of a float tensor `[*, M, M]`, of shape `[*]`; computed in f64.
fn det(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() < 2 || s[s.len() - 1] != s[s.len() - 2] {
            return Err(kernel_error(format!("Det needs square matrices in the last two dimensions, got shape {s:?}")));
        }
        if !x.dtype().is_float() {
            return Err(kernel_error(format!("Det needs a float tensor, got {}", x.dtype())));
        }
        let n = s[s.len() - 1];
        let v = x.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?;
        let batch = &s[..s.len() - 2];
        let dets: Vec<f32> = if n == 0 {
            vec![1.0; batch.iter().product()]
        } else {
            v.chunks(n * n).map(|m| determinant(&mut m.to_vec(), n) as f32).collect()
        };
        Ok(vec![from_f32(x.dtype(), batch, dets)?])
    })
}

/// `a @ b` with numpy semantics: 1-D operands are promoted and the promoted dimension removed,
/// leading dimensions broadcast.
pub fn matmul_f32(a: &[f32], ashape: &[usize], b: &[f32], bshape: &[usize]) -> RuntimeResult<(Vec<f32>, Vec<usize>)> {
    let (mut ash, mut bsh) = (ashape.to_vec(), bshape.to_vec());
    let (a1, b1) = (ash.len() == 1, bsh.len() == 1);
    if a1 { ash.insert(0, 1); }
    if b1 { bsh.push(1); }
    if ash.is_empty() || bsh.is_empty() {
        return Err(kernel_error("MatMul operands must have rank at least 1"));
    }
    let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
    let (k2, n) = (bsh[bsh.len() - 2], bsh[bsh.len() - 1]);
    if k != k2 {
        return Err(kernel_error(format!("MatMul shapes {ashape:?} and {bshape:?} do not align")));
    }
    let (abatch, bbatch) = (&ash[..ash.len() - 2], &bsh[..bsh.len() - 2]);
    let batch = broadcast_shape(abatch, bbatch)?;
    let nb: usize = batch.iter().product();
    let mut out = vec![0f32; nb * m * n];
    let index = |shape: &[usize], flat: usize| -> usize {
        // The broadcast source batch index for an output batch index.
        let mut idx = 0;
        let mut rem = flat;
        let mut mult = 1;
        let off = batch.len() - shape.len();
        let mut coords = vec![0; batch.len()];
        for d in (0..batch.len()).rev() {
            coords[d] = rem % batch[d];
            rem /= batch[d];
        }
        for d in (0..shape.len()).rev() {
            let c = if shape[d] == 1 { 0 } else { coords[d + off] };
            idx += c * mult;
            mult *= shape[d];
        }
        idx
    };
    if nb > 1 && bbatch.iter().product::<usize>() == 1 && abatch.len() >= bbatch.len() && abatch == &batch[batch.len() - abatch.len()..] {
        // Every batch shares B: one (nb*m) x k by k x n product.
        sgemm(nb * m, n, k, MatRef::rows(a, k), MatRef::rows(b, n), &mut out, false);
    } else if m * n > 0 {
        let product = |i: usize, dst: &mut [f32], parallel: bool| {
            let (ia, ib) = (index(abatch, i), index(bbatch, i));
            let (av, bv) = (MatRef::rows(&a[ia * m * k..(ia + 1) * m * k], k), MatRef::rows(&b[ib * k * n..(ib + 1) * k * n], n));
            // SAFETY: `dst` is an exclusively borrowed, initialized block of `m * n` values,
            // row-major with `n` columns, apart from `a` and `b`.
            unsafe { sgemm_into(m, n, k, av, bv, dst.as_mut_ptr(), n, false, parallel) }
        };
        let threads = threads();
        if threads > 1 && nb >= threads && nb * m * n * k >= 2 * PAR_MIN_WORK {
            // Whole products per task: no product is split across threads.
            par_chunks_mut(&mut out, m * n, min_items(m * n * k), || (), |_, i, dst| product(i, dst, false));
        } else {
            out.chunks_mut(m * n).enumerate().for_each(|(i, dst)| product(i, dst, true));
        }
    }
    let mut shape = batch;
    if !a1 { shape.push(m); }
    if !b1 { shape.push(n); }
    Ok((out, shape))
}

fn matmul(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        if a.dtype().is_float() && a.dtype() == b.dtype() {
            let (v, s) = matmul_f32(&to_f32(a)?, a.shape(), &to_f32(b)?, b.shape())?;
            return Ok(vec![from_f32(a.dtype(), &s, v)?]);
        }
        if matches!(a.dtype(), DType::I32 | DType::I64) && a.dtype() == b.dtype() {
            let to = |t: &qforge_ir::Tensor| t.to_f64_vec().map(|v| v.into_iter().map(|x| x as f32).collect::<Vec<_>>()).map_err(|e| kernel_error(e.to_string()));
            let (v, s) = matmul_f32(&to(a)?, a.shape(), &to(b)?, b.shape())?;
            let ints: Vec<i64> = v.into_iter().map(|x| x.round() as i64).collect();
            return Ok(vec![super::shape::cast_tensor(&tensor(&s, ints)?, a.dtype())?]);
        }
        Err(kernel_error(format!("MatMul of {} and {} is not supported", a.dtype(), b.dtype())))
    })
}

fn gemm_op(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (alpha, beta) = (info.attr_float("alpha", 1.0), info.attr_float("beta", 1.0));
    let (ta, tb) = (info.attr_int("transA", 0) != 0, info.attr_int("transB", 0) != 0);
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        if a.rank() != 2 || b.rank() != 2 {
            return Err(kernel_error(format!("Gemm needs 2-D A and B, got {:?} and {:?}", a.shape(), b.shape())));
        }
        let (av, bv) = (to_f32(a)?, to_f32(b)?);
        let (m, k) = if ta { (a.shape()[1], a.shape()[0]) } else { (a.shape()[0], a.shape()[1]) };
        let (k2, n) = if tb { (b.shape()[1], b.shape()[0]) } else { (b.shape()[0], b.shape()[1]) };
        if k != k2 {
            return Err(kernel_error(format!("Gemm shapes {:?} and {:?} do not align (transA={ta}, transB={tb})", a.shape(), b.shape())));
        }
        let mut out = vec![0f32; m * n];
        let accumulate = match opt_input(ins, 2) {
            Some(c) if beta != 0.0 => {
                let cv = to_f32(c)?;
                let (bc, _) = super::util::binary(&vec![0f32; m * n], &[m, n], &cv, c.shape(), |_, y| y * beta)?;
                out.copy_from_slice(&bc);
                true
            }
            _ => false,
        };
        let am = if ta { MatRef::transposed(&av, m) } else { MatRef::rows(&av, k) };
        let bm = if tb { MatRef::transposed(&bv, k) } else { MatRef::rows(&bv, n) };
        if alpha == 1.0 {
            sgemm(m, n, k, am, bm, &mut out, accumulate);
        } else {
            let mut prod = vec![0f32; m * n];
            sgemm(m, n, k, am, bm, &mut prod, false);
            out.iter_mut().zip(prod).for_each(|(o, p)| *o += alpha * p);
        }
        Ok(vec![from_f32(a.dtype(), &[m, n], out)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batched products (broadcast batch dimensions, a shared B, one batch) on 1 and 2
    /// threads against an f64 reference.
    #[test]
    fn batched_products_match_the_reference() {
        let cases: [(&[usize], &[usize]); 4] = [
            (&[3, 2, 37, 70], &[3, 2, 70, 45]),
            (&[3, 1, 37, 70], &[1, 2, 70, 45]),
            (&[4, 33, 90], &[90, 41]),
            (&[1, 2, 128, 64], &[1, 2, 64, 128]),
        ];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (ash, bsh) in cases {
                let a: Vec<f32> = (0..ash.iter().product::<usize>()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let b: Vec<f32> = (0..bsh.iter().product::<usize>()).map(|i| ((i * 53 % 89) as f32 - 44.0) / 40.0).collect();
                let (got, shape) = pool.install(|| matmul_f32(&a, ash, &b, bsh)).unwrap();
                let (m, k, n) = (ash[ash.len() - 2], ash[ash.len() - 1], bsh[bsh.len() - 1]);
                let batch = broadcast_shape(&ash[..ash.len() - 2], &bsh[..bsh.len() - 2]).unwrap();
                assert_eq!(shape, [batch.clone(), vec![m, n]].concat());
                // The source batch of an operand for output batch `o`: its coordinates,
                // 0 where the operand's dimension is 1 (or missing).
                let source = |sh: &[usize], o: usize| -> usize {
                    let dims = &sh[..sh.len() - 2];
                    let (mut rem, mut idx, mut mult) = (o, 0, 1);
                    for d in (0..batch.len()).rev() {
                        let c = rem % batch[d];
                        rem /= batch[d];
                        if let Some(e) = (d + dims.len()).checked_sub(batch.len()) {
                            idx += if dims[e] == 1 { 0 } else { c } * mult;
                            mult *= dims[e];
                        }
                    }
                    idx
                };
                for o in 0..batch.iter().product::<usize>() {
                    let (ia, ib) = (source(ash, o), source(bsh, o));
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k).map(|p| a[(ia * m + i) * k + p] as f64 * b[(ib * k + p) * n + j] as f64).sum();
                            let g = got[(o * m + i) * n + j] as f64;
                            assert!((g - want).abs() <= 1e-4 * (1.0 + want.abs()), "{ash:?} @ {bsh:?}, {threads} threads, batch {o} ({i}, {j}): {g} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
