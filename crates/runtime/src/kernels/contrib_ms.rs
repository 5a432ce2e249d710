//! ONNX Runtime's contrib operators that its transformer optimizer fuses BERT-, GPT-2- and
//! ViT-class models into, other than attention (see `attention_ms`), with the contracts of
//! ONNX Runtime's CPU kernels:
//!
//! * `Gelu`, `BiasGelu`, `FastGelu`, `QuickGelu` (`com.microsoft`): activations, the first
//!   three after adding an optional (BiasGelu: required) bias along the last axis.
//! * `FusedMatMul` (`com.microsoft`): MatMul of operands transposed on request, scaled.
//! * `SkipLayerNormalization`, `SkipSimplifiedLayerNormalization` (`com.microsoft`): residual
//!   sum then layer (RMS) normalization over the last axis.
//! * `SimplifiedLayerNormalization` (default domain, where ONNX Runtime registers it): RMS
//!   normalization with the inverse root mean square as an optional output.
//! * `EmbedLayerNormalization` (`com.microsoft`): BERT's embedding sum and layer normalization,
//!   with the sequence lengths of its attention mask.
//!
//! Every kernel computes in f32 (inputs of any float type are read as f32 and outputs written
//! in the input's type). Errors name the input or attribute at fault and never panic.

use qforge_ir::{DType, Tensor, MS_DOMAIN};

use super::elementwise::{from_f32, gelu_erf, gelu_tanh, sigmoid, to_f32, unary};
use super::norm::{layer_norm_row, rms_inv};
use super::util::{axis, binary, check_output_size, input, ints, kernel, min_items, opt_input, par_chunks_mut, tensor, vectorized, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the operators of this file.
pub fn register(r: &mut Registry) {
    r.add(MS_DOMAIN, "Gelu", 1, LATEST, gelu);
    r.add(MS_DOMAIN, "BiasGelu", 1, LATEST, bias_gelu);
    r.add(MS_DOMAIN, "FastGelu", 1, LATEST, fast_gelu);
    r.add(MS_DOMAIN, "QuickGelu", 1, LATEST, quick_gelu);
    r.add(MS_DOMAIN, "FusedMatMul", 1, LATEST, fused_matmul);
    r.add(MS_DOMAIN, "SkipLayerNormalization", 1, LATEST, skip_layer_norm);
    r.add(MS_DOMAIN, "SkipSimplifiedLayerNormalization", 1, LATEST, skip_layer_norm);
    r.add("", "SimplifiedLayerNormalization", 1, LATEST, simplified_layer_norm);
    r.add(MS_DOMAIN, "EmbedLayerNormalization", 1, LATEST, embed_layer_norm);
}

/// `f(x + bias)` with `bias` (1-D, as long as X's last axis) added along X's last axis, or
/// `f(x)` without one.
fn biased(x: &Tensor, bias: Option<&Tensor>, f: impl Fn(f32) -> f32 + Sync) -> RuntimeResult<Tensor> {
    let last = x.shape().last().copied().ok_or_else(|| kernel_error("X must have rank 1 or more, got a scalar"))?;
    let xv = to_f32(x)?;
    let v = match bias {
        Some(b) => {
            if b.shape() != [last] {
                return Err(kernel_error(format!("bias must be 1-D of X's last dimension {last}, got shape {:?}", b.shape())));
            }
            binary(&xv, x.shape(), &to_f32(b)?, b.shape(), |a, b| f(a + b))?.0
        }
        None => {
            let mut v = xv.into_owned();
            v.iter_mut().for_each(|a| *a = f(*a));
            v
        }
    };
    from_f32(x.dtype(), x.shape(), v)
}

/// `Gelu` (`com.microsoft`): `0.5 x (1 + erf(x / sqrt 2))`, elementwise.
fn gelu(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    unary(gelu_erf)
}

/// `BiasGelu` (`com.microsoft`): `Gelu(A + B)` with `B` 1-D, as long as A's last axis.
fn bias_gelu(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| Ok(vec![biased(input(ins, 0)?, Some(input(ins, 1)?), gelu_erf)?]))
}

/// `FastGelu` (`com.microsoft`): GELU's tanh approximation of `X + bias`, the optional `bias`
/// 1-D and as long as X's last axis.
fn fast_gelu(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| Ok(vec![biased(input(ins, 0)?, opt_input(ins, 1), gelu_tanh)?]))
}

/// `QuickGelu` (`com.microsoft`): `x · sigmoid(alpha · x)`, `alpha` 1.702 by default.
fn quick_gelu(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let alpha = info.attr_float("alpha", 1.702);
    unary(move |x: f32| x * sigmoid(alpha * x))
}

/// `FusedMatMul` (`com.microsoft`): `alpha · (A' @ B')` with numpy MatMul semantics, where
/// `A'` is A with, when `transBatchA` is set, its first axis moved to the second-to-last place
/// (`[d0, d1, ..., dn-2, dn-1]` becomes `[d1, ..., dn-2, d0, dn-1]`) and then, when `transA`
/// is set, its last two axes swapped (likewise B). A 1-D operand is never transposed; with
/// either `transBatch` flag both operands must have one rank of at least 3.
fn fused_matmul(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let alpha = info.attr_float("alpha", 1.0);
    let flag = |name: &str| info.attr_int(name, 0) != 0;
    let (ta, tb, tba, tbb) = (flag("transA"), flag("transB"), flag("transBatchA"), flag("transBatchB"));
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        if !a.dtype().is_float() || a.dtype() != b.dtype() {
            return Err(kernel_error(format!("A and B must be float tensors of one type, got {} and {}", a.dtype(), b.dtype())));
        }
        if (tba || tbb) && (a.rank() < 3 || a.rank() != b.rank()) {
            return Err(kernel_error(format!("transBatchA and transBatchB need A and B of one rank of at least 3, got shapes {:?} and {:?}", a.shape(), b.shape())));
        }
        let arranged = |t: &Tensor, trans: bool, trans_batch: bool| -> RuntimeResult<Tensor> {
            let r = t.rank();
            let mut perm: Vec<usize> = (0..r).collect();
            if trans_batch {
                perm = (1..r - 1).chain([0, r - 1]).collect();
            }
            if trans && r >= 2 {
                perm.swap(r - 2, r - 1);
            }
            if perm.iter().enumerate().all(|(i, &p)| i == p) {
                return Ok(t.clone());
            }
            super::shape::transpose_tensor(t, &perm)
        };
        let (a2, b2) = (arranged(a, ta, tba)?, arranged(b, tb, tbb)?);
        if a2.rank() == 0 || b2.rank() == 0 {
            return Err(kernel_error("A and B must have rank 1 or more"));
        }
        let (m, n) = (if a2.rank() >= 2 { a2.shape()[a2.rank() - 2] } else { 1 }, if b2.rank() >= 2 { b2.shape()[b2.rank() - 1] } else { 1 });
        let batch = super::util::broadcast_shape(&a2.shape()[..a2.rank().saturating_sub(2)], &b2.shape()[..b2.rank().saturating_sub(2)])?;
        check_output_size("Y", DType::F32, &[batch.iter().product::<usize>(), m, n])?;
        let (mut y, shape) = super::matmul::matmul_f32(&to_f32(&a2)?, a2.shape(), &to_f32(&b2)?, b2.shape())?;
        if alpha != 1.0 {
            y.iter_mut().for_each(|v| *v *= alpha);
        }
        Ok(vec![from_f32(a.dtype(), &shape, y)?])
    })
}

/// A 1-D parameter of `len` f32 values, naming it `what` in errors.
fn param(t: &Tensor, len: usize, what: &str) -> RuntimeResult<Vec<f32>> {
    if t.shape() != [len] {
        return Err(kernel_error(format!("{what} must be 1-D of the hidden size {len}, got shape {:?}", t.shape())));
    }
    Ok(to_f32(t)?.into_owned())
}

/// `SkipLayerNormalization` and `SkipSimplifiedLayerNormalization` (`com.microsoft`): inputs
/// `(input, skip, gamma, beta?, bias?)`, or `(input, skip, gamma, bias?)` for the simplified
/// op, which has no beta; input 2-D or 3-D with hidden size `H` last, skip of
/// input's shape or (for a 3-D input) `[S, H]` or `[1, S, H]`, repeated over the batch, and
/// gamma, beta and bias 1-D of `H` values; attribute `epsilon` (default 1e-12). Each row
/// `x = input + skip + bias` is normalized: `(x - mean) / sqrt(var + epsilon) · gamma + beta`,
/// or for the simplified op `x / sqrt(mean(x^2) + epsilon) · gamma` (no beta). Outputs: the
/// result, the mean of each row (0 for the simplified op) and `1 / sqrt(var + epsilon)` (the
/// inverse root mean square), both shaped like the input with a last dimension of 1, and
/// `input + skip + bias`.
fn skip_layer_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let eps = info.attr_float("epsilon", 1e-12);
    if eps.is_nan() || eps < 0.0 {
        return Err(info.error(format!("epsilon must be nonnegative, got {eps}")));
    }
    let simplified = info.node.op_type == "SkipSimplifiedLayerNormalization";
    kernel(move |ins| {
        let (x, skip, gamma) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let s = x.shape();
        if s.len() != 2 && s.len() != 3 {
            return Err(kernel_error(format!("input must be 2-D or 3-D, got shape {s:?}")));
        }
        let h = s[s.len() - 1];
        let ss = skip.shape();
        let skip_fits = ss == s || (s.len() == 3 && (ss == &s[1..] || ss == [1, s[1], h]));
        if !skip_fits {
            return Err(kernel_error(format!("skip must have input's shape {s:?}, or [{}, {h}] or [1, {}, {h}] for a 3-D input, got {ss:?}", s[s.len() - 2], s[s.len() - 2])));
        }
        let gamma = param(gamma, h, "gamma")?;
        let (beta, bias) = if simplified { (None, opt_input(ins, 3)) } else { (opt_input(ins, 3), opt_input(ins, 4)) };
        let beta = beta.map(|b| param(b, h, "beta")).transpose()?;
        let bias = bias.map(|b| param(b, h, "bias")).transpose()?;
        let (xv, sv) = (to_f32(x)?, to_f32(skip)?);
        let mut sum: Vec<f32> = xv.to_vec();
        let skip_len = sv.len().max(1);
        for (i, v) in sum.iter_mut().enumerate() {
            *v += sv[i % skip_len] + bias.as_ref().map_or(0.0, |b| b[i % h]);
        }
        let mut y = sum.clone();
        let rows = y.len() / h.max(1);
        let (mut means, mut invs) = (vec![0f32; rows], vec![0f32; rows]);
        if h > 0 {
            for ((row, m), iv) in y.chunks_mut(h).zip(&mut means).zip(&mut invs) {
                vectorized(|| {
                    if simplified {
                        *iv = rms_inv(row, eps);
                        row.iter_mut().zip(&gamma).for_each(|(x, &g)| *x *= *iv * g);
                    } else {
                        (*m, *iv) = layer_norm_row(row, &gamma, beta.as_deref(), eps);
                    }
                });
            }
        }
        let mut stat_shape = s.to_vec();
        stat_shape[s.len() - 1] = 1;
        Ok(vec![
            from_f32(x.dtype(), s, y)?,
            tensor(&stat_shape, means)?,
            tensor(&stat_shape, invs)?,
            from_f32(x.dtype(), s, sum)?,
        ])
    })
}

/// `SimplifiedLayerNormalization` (ONNX Runtime's, in the default domain): RMS normalization
/// `x / sqrt(mean(x^2) + epsilon) · scale` over the dimensions from `axis` (default -1) on,
/// `scale` holding one value per normalized element (or a single one); `epsilon` 1e-5 by
/// default. The optional second output is `1 / sqrt(mean(x^2) + epsilon)` of each row (f32),
/// shaped like X with 1s from `axis` on.
fn simplified_layer_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", -1);
    let eps = info.attr_float("epsilon", 1e-5);
    kernel(move |ins| {
        let (x, scale) = (input(ins, 0)?, input(ins, 1)?);
        let s = x.shape();
        let ax = axis(a, s.len())?;
        let d: usize = s[ax..].iter().product();
        let scale = to_f32(scale)?;
        let scale: Vec<f32> = match scale.len() {
            n if n == d => scale.into_owned(),
            1 => vec![scale[0]; d],
            n => return Err(kernel_error(format!("scale of {n} values does not fit the {d} normalized elements of X {s:?} from axis {ax}"))),
        };
        let mut v = to_f32(x)?.into_owned();
        let rows = v.len().checked_div(d).unwrap_or(0);
        let mut invs = vec![0f32; rows];
        if d > 0 {
            for (row, iv) in v.chunks_mut(d).zip(&mut invs) {
                vectorized(|| {
                    *iv = rms_inv(row, eps);
                    row.iter_mut().zip(&scale).for_each(|(x, &g)| *x *= *iv * g);
                });
            }
        }
        let stat_shape: Vec<usize> = s.iter().enumerate().map(|(i, &n)| if i < ax { n } else { 1 }).collect();
        Ok(vec![from_f32(x.dtype(), s, v)?, tensor(&stat_shape, invs)?])
    })
}

/// Row indices of an integer ids tensor, each checked to be in `0..rows` (the embedding table
/// named `table`).
fn ids(t: &Tensor, what: &str, rows: usize, table: &str) -> RuntimeResult<Vec<usize>> {
    ints(t, what)?.into_iter().map(|id| usize::try_from(id).ok().filter(|&i| i < rows)
        .ok_or_else(|| kernel_error(format!("{what} holds {id}, out of range for the {rows} rows of {table}")))).collect()
}

/// The rows of a 2-D embedding table `[rows, hidden]` (hidden nonzero, and `hidden` when
/// given), naming it `what` in errors.
fn table(t: &Tensor, hidden: Option<usize>, what: &str) -> RuntimeResult<usize> {
    match (t.shape(), hidden) {
        (&[rows, h], Some(want)) if h == want => Ok(rows),
        (&[rows, h], None) if h > 0 => Ok(rows),
        (s, want) => Err(kernel_error(format!("{what} must be 2-D [rows, {}], got shape {s:?}", want.map_or("hidden (nonzero)".to_string(), |w| w.to_string())))),
    }
}

/// `EmbedLayerNormalization` (`com.microsoft`): inputs `(input_ids, segment_ids?,
/// word_embedding, position_embedding, segment_embedding?, gamma, beta, mask?,
/// position_ids?)`; ids and mask are int32 (int64 is taken too) of shape `[B, S]`, tables are
/// 2-D `[rows, H]`, gamma and beta 1-D of `H`. Each token's embedding is
/// `word[input_ids] + position[p] + segment[segment_ids]` (the segment term only when both
/// segment inputs are given), `p` from `position_ids` (`[B, S]`, or `[1, S]` for every batch)
/// or else the token's index in its sequence; it is layer-normalized with `epsilon` (default
/// 1e-12), scaled by gamma and shifted by beta. Outputs: the result `[B, S, H]`, `mask_index`
/// `[B]` (int32: how many mask values of each sequence are 1; zeros without a mask) and the
/// embedding sum before normalization `[B, S, H]`. An id outside its table is an error.
fn embed_layer_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let eps = info.attr_float("epsilon", 1e-12);
    if eps.is_nan() || eps < 0.0 {
        return Err(info.error(format!("epsilon must be nonnegative, got {eps}")));
    }
    kernel(move |ins| {
        let input_ids = input(ins, 0)?;
        let &[batch, seq] = input_ids.shape() else {
            return Err(kernel_error(format!("input_ids must be 2-D [batch, sequence], got shape {:?}", input_ids.shape())));
        };
        let word = input(ins, 2)?;
        let words = table(word, None, "word_embedding")?;
        let hidden = word.shape()[1];
        let position = input(ins, 3)?;
        let positions = table(position, Some(hidden), "position_embedding")?;
        let segment = match (opt_input(ins, 1), opt_input(ins, 4)) {
            (Some(ids_t), Some(table_t)) => {
                if ids_t.shape() != [batch, seq] {
                    return Err(kernel_error(format!("segment_ids must have input_ids' shape [{batch}, {seq}], got {:?}", ids_t.shape())));
                }
                let rows = table(table_t, Some(hidden), "segment_embedding")?;
                Some((ids(ids_t, "segment_ids", rows, "segment_embedding")?, to_f32(table_t)?))
            }
            (None, None) => None,
            _ => return Err(kernel_error("segment_ids and segment_embedding must be given together")),
        };
        let gamma = param(input(ins, 5)?, hidden, "gamma")?;
        let beta = param(input(ins, 6)?, hidden, "beta")?;
        let word_ids = ids(input_ids, "input_ids", words, "word_embedding")?;
        let position_ids: Vec<usize> = match opt_input(ins, 8) {
            Some(p) => {
                let rows = match p.shape() {
                    &[b, s] if (b == batch || b == 1) && s == seq => b,
                    other => return Err(kernel_error(format!("position_ids must have shape [{batch}, {seq}] or [1, {seq}], got {other:?}"))),
                };
                let v = ids(p, "position_ids", positions, "position_embedding")?;
                (0..batch * seq).map(|t| if rows == 1 { v[t % seq] } else { v[t] }).collect()
            }
            None => {
                if seq > positions {
                    return Err(kernel_error(format!("the sequence length {seq} exceeds the {positions} rows of position_embedding")));
                }
                (0..batch * seq).map(|t| t % seq).collect()
            }
        };
        let mask_index: Vec<i32> = match opt_input(ins, 7) {
            Some(m) => {
                if m.shape() != [batch, seq] {
                    return Err(kernel_error(format!("mask must have input_ids' shape [{batch}, {seq}], got {:?}", m.shape())));
                }
                let v = ints(m, "mask")?;
                v.chunks(seq.max(1)).take(batch).map(|row| row.iter().filter(|&&x| x == 1).count() as i32).collect()
            }
            None => vec![0; batch],
        };
        check_output_size("output", DType::F32, &[batch, seq, hidden])?;
        let (wv, pv) = (to_f32(word)?, to_f32(position)?);
        let mut sum = vec![0f32; batch * seq * hidden];
        par_chunks_mut(&mut sum, hidden, min_items(hidden * ELEMENT_WORK), || (), |_, t, row| {
            let (w, p) = (&wv[word_ids[t] * hidden..][..hidden], &pv[position_ids[t] * hidden..][..hidden]);
            match &segment {
                Some((sids, sv)) => {
                    let g = &sv[sids[t] * hidden..][..hidden];
                    row.iter_mut().zip(w).zip(p).zip(g).for_each(|(((o, &a), &b), &c)| *o = a + b + c);
                }
                None => row.iter_mut().zip(w).zip(p).for_each(|((o, &a), &b)| *o = a + b),
            }
        });
        let mut y = sum.clone();
        par_chunks_mut(&mut y, hidden, min_items(hidden * ELEMENT_WORK), || (), |_, _, row| {
            vectorized(|| layer_norm_row(row, &gamma, Some(&beta), eps));
        });
        let dtype = word.dtype();
        Ok(vec![from_f32(dtype, &[batch, seq, hidden], y)?, tensor(&[batch], mask_index)?, from_f32(dtype, &[batch, seq, hidden], sum)?])
    })
}
