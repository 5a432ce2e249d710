//! Einsum (opsets 12 and 28): Einstein summation over any number of operands.
//!
//! Operands are contracted pairwise, left to right. Each contraction groups its labels into
//! batch, kept-left, kept-right and summed ones and runs as a batched matrix product (the
//! crate's gemm for floats); operands are transposed only when their layout does not already
//! fit. Repeated labels within an operand (diagonals), labels summed within one operand,
//! broadcast size-1 dimensions and ellipses are resolved by strided gathers.

use std::borrow::Cow;

use qforge_ir::{DType, Tensor};

use super::elementwise::{from_f32, to_f32};
use super::gemm::{sgemm_into, MatRef};
use super::util::{input, kernel, min_items, par_chunks_mut, tensor, threads, PAR_MIN_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers Einsum.
pub fn register(r: &mut Registry) {
    r.add("", "Einsum", 12, LATEST, einsum);
}

/// Letters are labels `0..LETTERS` in ASCII order (`A..Z` then `a..z`); the dimensions an
/// ellipsis stands for are labels `LETTERS..`.
const LETTERS: usize = 52;

/// One subscript symbol of an einsum term.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Sym {
    Letter(usize),
    Ellipsis,
}

/// A parsed einsum equation: one term per input, and the output term when explicit (`->`).
#[derive(Debug)]
struct Equation {
    inputs: Vec<Vec<Sym>>,
    output: Option<Vec<Sym>>,
}

fn letter_label(c: char) -> Option<usize> {
    match c {
        'A'..='Z' => Some(c as usize - 'A' as usize),
        'a'..='z' => Some(26 + c as usize - 'a' as usize),
        _ => None,
    }
}

fn label_name(l: usize) -> String {
    match l {
        0..=25 => char::from(b'A' + l as u8).to_string(),
        26..=51 => char::from(b'a' + (l - 26) as u8).to_string(),
        _ => format!("ellipsis dimension {}", l - LETTERS),
    }
}

/// Parses one term: letters and at most one `...`.
fn parse_term(term: &str) -> Result<Vec<Sym>, String> {
    let mut syms = vec![];
    let mut chars = term.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '.' {
            if chars.next() != Some('.') || chars.next() != Some('.') {
                return Err(format!("term '{term}' has a '.' that is not part of an ellipsis '...'"));
            }
            if syms.contains(&Sym::Ellipsis) {
                return Err(format!("term '{term}' has more than one ellipsis"));
            }
            syms.push(Sym::Ellipsis);
        } else {
            let l = letter_label(c).ok_or_else(|| format!("term '{term}' has '{c}', which is neither a letter nor an ellipsis"))?;
            syms.push(Sym::Letter(l));
        }
    }
    Ok(syms)
}

/// Parses an equation: comma-separated input terms, optionally `->` and the output term;
/// spaces are ignored. Output letters must be distinct and appear in some input.
fn parse_equation(equation: &str) -> Result<Equation, String> {
    let eq: String = equation.chars().filter(|c| *c != ' ').collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let inputs = lhs.split(',').map(parse_term).collect::<Result<Vec<_>, _>>()?;
    let output = rhs.map(parse_term).transpose()?;
    if let Some(out) = &output {
        for (i, s) in out.iter().enumerate() {
            if out[..i].contains(s) {
                let name = match s { Sym::Letter(l) => label_name(*l), Sym::Ellipsis => "...".into() };
                return Err(format!("output label '{name}' appears more than once"));
            }
            if let Sym::Letter(l) = s {
                if !inputs.iter().any(|t| t.contains(s)) {
                    return Err(format!("output label '{}' appears in no input term", label_name(*l)));
                }
            }
        }
    }
    Ok(Equation { inputs, output })
}

/// An operand as a strided view over its elements: dimension `i` has label `labels[i]`
/// (distinct), size `dims[i]` and element stride `strides[i]`.
struct Operand<'a, T: Clone> {
    data: Cow<'a, [T]>,
    labels: Vec<usize>,
    dims: Vec<usize>,
    strides: Vec<usize>,
}

impl<T: Clone> Operand<'_, T> {
    /// Whether the elements lie densely in row-major order of the labels.
    fn is_dense(&self) -> bool {
        let mut expect = 1;
        for (&d, &s) in self.dims.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }
    fn stride_of(&self, label: usize) -> usize {
        self.labels.iter().position(|&l| l == label).map_or(0, |i| self.strides[i])
    }
    fn has(&self, label: usize) -> bool {
        self.labels.contains(&label)
    }
}

/// The element arithmetic einsum needs, and the batched matrix product it runs on.
trait Scalar: Copy + Default + Send + Sync + 'static {
    fn plus(self, o: Self) -> Self;
    fn times(self, o: Self) -> Self;
    /// `batch` products of `m x k` by `k x n` matrices, densely stored one after another;
    /// `a_t`: each left matrix is stored as its `k x m` transpose; `b_t`: each right one as
    /// its `n x k` transpose. The results are `m x n`, row-major, one after another.
    #[allow(clippy::too_many_arguments)]
    fn batched_matmul(batch: usize, m: usize, n: usize, k: usize, a: &[Self], a_t: bool, b: &[Self], b_t: bool) -> Vec<Self> {
        let mut out = vec![Self::default(); batch * m * n];
        for p in 0..batch {
            let (a, b) = (&a[p * m * k..(p + 1) * m * k], &b[p * k * n..(p + 1) * k * n]);
            for i in 0..m {
                for j in 0..n {
                    let mut acc = Self::default();
                    for q in 0..k {
                        let x = if a_t { a[q * m + i] } else { a[i * k + q] };
                        let y = if b_t { b[j * k + q] } else { b[q * n + j] };
                        acc = acc.plus(x.times(y));
                    }
                    out[(p * m + i) * n + j] = acc;
                }
            }
        }
        out
    }
}

impl Scalar for i64 {
    fn plus(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    fn times(self, o: Self) -> Self {
        self.wrapping_mul(o)
    }
}

impl Scalar for f32 {
    fn plus(self, o: Self) -> Self {
        self + o
    }
    fn times(self, o: Self) -> Self {
        self * o
    }
    fn batched_matmul(batch: usize, m: usize, n: usize, k: usize, a: &[f32], a_t: bool, b: &[f32], b_t: bool) -> Vec<f32> {
        let mut out = vec![0f32; batch * m * n];
        if m * n == 0 {
            return out;
        }
        let product = |p: usize, dst: &mut [f32], parallel: bool| {
            let (a, b) = (&a[p * m * k..(p + 1) * m * k], &b[p * k * n..(p + 1) * k * n]);
            let av = if a_t { MatRef::transposed(a, m) } else { MatRef::rows(a, k) };
            let bv = if b_t { MatRef::transposed(b, k) } else { MatRef::rows(b, n) };
            // SAFETY: `dst` is an exclusively borrowed, initialized block of `m * n` values,
            // row-major with `n` columns, apart from `a` and `b`.
            unsafe { sgemm_into(m, n, k, av, bv, dst.as_mut_ptr(), n, false, parallel) }
        };
        let threads = threads();
        if threads > 1 && batch >= threads && batch * m * n * k >= 2 * PAR_MIN_WORK {
            par_chunks_mut(&mut out, m * n, min_items(m * n * k), || (), |_, p, dst| product(p, dst, false));
        } else {
            out.chunks_mut(m * n).enumerate().for_each(|(p, dst)| product(p, dst, true));
        }
        out
    }
}

/// Calls `f(offset)` for every index of `dims` in row-major order, `offset` being `base`
/// plus the index dotted with `strides` (once for no dimensions, never for an empty one).
fn for_each_offset(dims: &[usize], strides: &[usize], base: usize, mut f: impl FnMut(usize)) {
    if dims.contains(&0) {
        return;
    }
    let mut idx = vec![0usize; dims.len()];
    let mut off = base;
    loop {
        f(off);
        let mut d = dims.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            off += strides[d];
            if idx[d] < dims[d] {
                break;
            }
            off -= strides[d] * dims[d];
            idx[d] = 0;
        }
    }
}

/// Elements of `dims`, or an error when an f64 tensor of them would exceed
/// [`MAX_KERNEL_BYTES`](super::util::MAX_KERNEL_BYTES).
fn checked_len(dims: &[usize]) -> RuntimeResult<usize> {
    super::util::check_output_size("Einsum operand", DType::F64, dims)?;
    Ok(dims.iter().product())
}

/// `op` densely laid out over `labels` (in that order), summed over its other labels; a
/// label `op` lacks is broadcast. Returns `op` itself when it is already so laid out.
fn arrange<'a, T: Scalar>(op: Operand<'a, T>, labels: &[usize], sizes: &[usize]) -> RuntimeResult<Operand<'a, T>> {
    if op.labels == labels && op.is_dense() {
        return Ok(op);
    }
    let dims: Vec<usize> = labels.iter().map(|&l| sizes[l]).collect();
    let strides: Vec<usize> = labels.iter().map(|&l| op.stride_of(l)).collect();
    let summed: Vec<usize> = (0..op.labels.len()).filter(|&i| !labels.contains(&op.labels[i])).collect();
    let (sum_dims, sum_strides): (Vec<usize>, Vec<usize>) = summed.iter().map(|&i| (op.dims[i], op.strides[i])).unzip();
    let mut out = Vec::with_capacity(checked_len(&dims)?);
    let src = &op.data[..];
    if summed.is_empty() {
        for_each_offset(&dims, &strides, 0, |o| out.push(src[o]));
    } else {
        for_each_offset(&dims, &strides, 0, |o| {
            let mut acc = T::default();
            for_each_offset(&sum_dims, &sum_strides, o, |i| acc = acc.plus(src[i]));
            out.push(acc);
        });
    }
    let strides = super::shape::strides(&dims);
    Ok(Operand { data: Cow::Owned(out), labels: labels.to_vec(), dims, strides })
}

/// `op` summed over the labels `keep` rejects (the others keep their order).
fn sum_out<'a, T: Scalar>(op: Operand<'a, T>, keep: impl Fn(usize) -> bool, sizes: &[usize]) -> RuntimeResult<Operand<'a, T>> {
    let kept: Vec<usize> = op.labels.iter().copied().filter(|&l| keep(l)).collect();
    if kept.len() == op.labels.len() {
        return Ok(op);
    }
    arrange(op, &kept, sizes)
}

/// Whether `labels` is `first` followed by `second` and then `third`, each group in order.
fn is_concat(labels: &[usize], first: &[usize], second: &[usize], third: &[usize]) -> bool {
    labels.len() == first.len() + second.len() + third.len() && labels.iter().eq(first.iter().chain(second).chain(third))
}

/// Contracts two operands over their shared labels that `needed` (the output's and the
/// remaining operands' labels) does not hold, as a batched matrix product.
fn contract<T: Scalar>(a: Operand<'_, T>, b: Operand<'_, T>, needed: &[bool], sizes: &[usize]) -> RuntimeResult<Operand<'static, T>> {
    let a = sum_out(a, |l| needed[l] || b.has(l), sizes)?;
    let b = sum_out(b, |l| needed[l] || a.has(l), sizes)?;
    let batch: Vec<usize> = a.labels.iter().copied().filter(|&l| b.has(l) && needed[l]).collect();
    let summed: Vec<usize> = a.labels.iter().copied().filter(|&l| b.has(l) && !needed[l]).collect();
    let left: Vec<usize> = a.labels.iter().copied().filter(|&l| !b.has(l)).collect();
    let right: Vec<usize> = b.labels.iter().copied().filter(|&l| !a.has(l)).collect();
    let size = |ls: &[usize]| ls.iter().map(|&l| sizes[l]).product::<usize>();
    let (nb, m, n, k) = (size(&batch), size(&left), size(&right), size(&summed));
    let a_t = a.is_dense() && is_concat(&a.labels, &batch, &summed, &left) && !is_concat(&a.labels, &batch, &left, &summed);
    let a = if a_t { a } else { arrange(a, &[&batch[..], &left, &summed].concat(), sizes)? };
    let b_t = b.is_dense() && is_concat(&b.labels, &batch, &right, &summed) && !is_concat(&b.labels, &batch, &summed, &right);
    let b = if b_t { b } else { arrange(b, &[&batch[..], &summed, &right].concat(), sizes)? };
    let labels = [&batch[..], &left, &right].concat();
    let dims: Vec<usize> = labels.iter().map(|&l| sizes[l]).collect();
    checked_len(&dims)?;
    let data = T::batched_matmul(nb, m, n, k, &a.data, a_t, &b.data, b_t);
    let strides = super::shape::strides(&dims);
    Ok(Operand { data: Cow::Owned(data), labels, dims, strides })
}

/// Evaluates `eq` on operands of `shapes` with elements `values`; returns the output's
/// elements and shape.
fn evaluate<T: Scalar>(eq: &Equation, shapes: &[&[usize]], values: Vec<Cow<'_, [T]>>) -> RuntimeResult<(Vec<T>, Vec<usize>)> {
    if shapes.len() != eq.inputs.len() {
        return Err(kernel_error(format!("the equation has {} input terms but the node has {} inputs", eq.inputs.len(), shapes.len())));
    }
    // The rank each operand's ellipsis stands for; the ellipsis dimensions align to the right.
    let mut ellipsis_ranks = vec![];
    for (i, (term, shape)) in eq.inputs.iter().zip(shapes).enumerate() {
        let letters = term.iter().filter(|s| **s != Sym::Ellipsis).count();
        let has_ellipsis = term.contains(&Sym::Ellipsis);
        if shape.len() < letters || (!has_ellipsis && shape.len() != letters) {
            return Err(kernel_error(format!("input {i} has shape {shape:?}, which does not fit its term of {letters} letters{}", if has_ellipsis { " and an ellipsis" } else { "" })));
        }
        ellipsis_ranks.push(shape.len() - letters);
    }
    let ellipsis_rank = ellipsis_ranks.iter().copied().max().unwrap_or(0);
    let mut sizes = vec![1usize; LETTERS + ellipsis_rank];
    // Each operand's label per dimension.
    let mut dim_labels: Vec<Vec<usize>> = vec![];
    for (term, &er) in eq.inputs.iter().zip(&ellipsis_ranks) {
        let mut labels = vec![];
        for s in term {
            match s {
                Sym::Letter(l) => labels.push(*l),
                Sym::Ellipsis => labels.extend(LETTERS + ellipsis_rank - er..LETTERS + ellipsis_rank),
            }
        }
        dim_labels.push(labels);
    }
    let mut seen = vec![false; sizes.len()];
    for (i, (labels, shape)) in dim_labels.iter().zip(shapes).enumerate() {
        for (&l, &d) in labels.iter().zip(shape.iter()) {
            if !seen[l] || sizes[l] == 1 {
                seen[l] = true;
                sizes[l] = d;
            } else if d != sizes[l] && d != 1 {
                return Err(kernel_error(format!("label '{}' has size {} elsewhere but size {d} in input {i} of shape {shape:?}", label_name(l), sizes[l])));
            }
        }
    }
    // The operands as views: repeated labels become one dimension whose stride is the sum of
    // theirs (the diagonal); size-1 dimensions broadcast against larger ones are dropped.
    let mut operands = vec![];
    for (i, ((labels, shape), data)) in dim_labels.iter().zip(shapes).zip(values).enumerate() {
        let dense = super::shape::strides(shape);
        let mut op = Operand { data, labels: vec![], dims: vec![], strides: vec![] };
        for (d, &l) in labels.iter().enumerate() {
            if shape[d] == 1 && sizes[l] != 1 && labels.iter().filter(|&&x| x == l).count() == 1 {
                continue;
            }
            match op.labels.iter().position(|&x| x == l) {
                Some(j) if op.dims[j] != shape[d] => {
                    return Err(kernel_error(format!("label '{}' repeats in input {i} with sizes {} and {} (shape {shape:?})", label_name(l), op.dims[j], shape[d])));
                }
                Some(j) => op.strides[j] += dense[d],
                None => {
                    op.labels.push(l);
                    op.dims.push(shape[d]);
                    op.strides.push(dense[d]);
                }
            }
        }
        operands.push(op);
    }
    let output: Vec<usize> = match &eq.output {
        Some(out) => {
            if ellipsis_rank > 0 && !out.contains(&Sym::Ellipsis) {
                return Err(kernel_error(format!("the inputs' ellipses stand for {ellipsis_rank} dimensions, but the output term has no ellipsis")));
            }
            out.iter().flat_map(|s| match s {
                Sym::Letter(l) => vec![*l],
                Sym::Ellipsis => (LETTERS..LETTERS + ellipsis_rank).collect(),
            }).collect()
        }
        None => {
            let mut counts = [0usize; LETTERS];
            eq.inputs.iter().flatten().for_each(|s| if let Sym::Letter(l) = s { counts[*l] += 1 });
            (LETTERS..LETTERS + ellipsis_rank).chain((0..LETTERS).filter(|&l| counts[l] == 1)).collect()
        }
    };
    let out_dims: Vec<usize> = output.iter().map(|&l| sizes[l]).collect();
    checked_len(&out_dims)?;
    let mut pending = operands.into_iter();
    let Some(mut acc) = pending.next() else {
        return Err(kernel_error("Einsum needs at least one input"));
    };
    let mut rest: Vec<Operand<'_, T>> = pending.collect();
    rest.reverse();
    while let Some(next) = rest.pop() {
        let mut needed = vec![false; sizes.len()];
        output.iter().chain(rest.iter().flat_map(|o| o.labels.iter())).for_each(|&l| needed[l] = true);
        acc = contract(acc, next, &needed, &sizes)?;
    }
    let result = arrange(acc, &output, &sizes)?;
    Ok((result.data.into_owned(), out_dims))
}

/// Einsum (opset 12 on; opset 28 only clarifies the letters allowed): the `equation`
/// attribute's sum of products over the inputs, in explicit (`->`) or implicit form, with
/// ellipses (broadcast, right-aligned), repeated labels (diagonals) and size-1 dimensions
/// broadcast. Float inputs (f16, bf16, f32, f64) compute in f32; integer inputs in wrapping
/// 64-bit arithmetic, cast back to their type.
fn einsum(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let text = info.node.attr_str("equation").ok_or_else(|| info.error("the 'equation' attribute is required"))?;
    let eq = parse_equation(text).map_err(|e| info.error(format!("bad equation '{text}': {e}")))?;
    kernel(move |ins| {
        let tensors: Vec<&Tensor> = (0..ins.len()).map(|i| input(ins, i)).collect::<RuntimeResult<_>>()?;
        let dtype = tensors.first().map(|t| t.dtype()).ok_or_else(|| kernel_error("Einsum needs at least one input"))?;
        if let Some(t) = tensors.iter().find(|t| t.dtype() != dtype) {
            return Err(kernel_error(format!("Einsum inputs must share one type, got {dtype} and {}", t.dtype())));
        }
        let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
        if dtype.is_float() {
            let values = tensors.iter().map(|t| to_f32(t)).collect::<RuntimeResult<Vec<_>>>()?;
            let (v, shape) = evaluate(&eq, &shapes, values)?;
            return Ok(vec![from_f32(dtype, &shape, v)?]);
        }
        if !dtype.is_integer() || dtype.bits() < 8 {
            return Err(kernel_error(format!("Einsum does not support {dtype}")));
        }
        let values = tensors.iter().map(|t| t.to_i64_vec().map(Cow::Owned).map_err(|e| kernel_error(e.to_string()))).collect::<RuntimeResult<Vec<_>>>()?;
        let (v, shape) = evaluate(&eq, &shapes, values)?;
        Ok(vec![super::shape::cast_tensor(&tensor(&shape, v)?, dtype)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Evaluates by the definition: every assignment of all labels, the product of the
    /// operands' elements added to the output element.
    fn reference(eq: &str, ops: &[(&[usize], Vec<f32>)]) -> (Vec<f32>, Vec<usize>) {
        let e = parse_equation(eq).unwrap();
        let shapes: Vec<&[usize]> = ops.iter().map(|o| o.0).collect();
        // Only letters, no broadcasting: the test equations below keep to that.
        let mut sizes = [0usize; LETTERS];
        for (t, s) in e.inputs.iter().zip(&shapes) {
            for (sym, &d) in t.iter().zip(s.iter()) {
                if let Sym::Letter(l) = sym { sizes[*l] = d }
            }
        }
        let used: Vec<usize> = (0..LETTERS).filter(|&l| e.inputs.iter().flatten().any(|s| *s == Sym::Letter(l))).collect();
        let out: Vec<usize> = e.output.as_ref().unwrap().iter().map(|s| match s { Sym::Letter(l) => *l, _ => unreachable!() }).collect();
        let out_dims: Vec<usize> = out.iter().map(|&l| sizes[l]).collect();
        let mut res = vec![0f32; out_dims.iter().product()];
        let dims: Vec<usize> = used.iter().map(|&l| sizes[l]).collect();
        let total: usize = dims.iter().product();
        for flat in 0..total {
            let mut val = [0usize; LETTERS];
            let mut rem = flat;
            for (i, &l) in used.iter().enumerate().rev() {
                val[l] = rem % dims[i];
                rem /= dims[i];
            }
            let mut p = 1f32;
            for ((t, s), (_, v)) in e.inputs.iter().zip(&shapes).zip(ops) {
                let st = super::super::shape::strides(s);
                let off: usize = t.iter().enumerate().map(|(d, sym)| match sym { Sym::Letter(l) => val[*l] * st[d], _ => 0 }).sum();
                p *= v[off];
            }
            let ost = super::super::shape::strides(&out_dims);
            let o: usize = out.iter().enumerate().map(|(d, &l)| val[l] * ost[d]).sum();
            res[o] += p;
        }
        (res, out_dims)
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 + seed * 11) % 23) as f32 / 7.0 - 1.5).collect()
    }

    #[test]
    fn contractions_match_the_definition() {
        let cases: &[(&str, &[&[usize]])] = &[
            ("bhqd,bhkd->bhqk", &[&[2, 3, 4, 5], &[2, 3, 6, 5]]),
            ("bhqk,bhkd->bhqd", &[&[2, 3, 4, 6], &[2, 3, 6, 5]]),
            ("ij,jk->ik", &[&[3, 4], &[4, 5]]),
            ("ji,jk->ki", &[&[4, 3], &[4, 5]]),
            ("ii->i", &[&[4, 4]]),
            ("iij,jk->ik", &[&[3, 3, 2], &[2, 4]]),
            ("ij,jk,kl->il", &[&[2, 3], &[3, 4], &[4, 2]]),
            ("ab,cd->abcd", &[&[2, 3], &[2, 2]]),
            ("abc,cb->", &[&[2, 3, 4], &[4, 3]]),
            ("ijk->kji", &[&[2, 3, 4]]),
            ("ij,ij->ij", &[&[3, 4], &[3, 4]]),
            ("ai,bi,ci->abc", &[&[2, 3], &[2, 3], &[2, 3]]),
        ];
        for (eq, shapes) in cases {
            let ops: Vec<(&[usize], Vec<f32>)> = shapes.iter().enumerate().map(|(i, s)| (*s, values(s.iter().product(), i))).collect();
            let (want, wshape) = reference(eq, &ops);
            let parsed = parse_equation(eq).unwrap();
            let (got, gshape) = evaluate(&parsed, shapes, ops.iter().map(|o| Cow::Borrowed(&o.1[..])).collect()).unwrap();
            assert_eq!(gshape, wshape, "{eq}");
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{eq}: {got:?} vs {want:?}");
            }
        }
    }

    #[test]
    fn implicit_output_ellipsis_and_broadcasting() {
        let eval = |eq: &str, shapes: &[&[usize]], vals: Vec<Vec<f32>>| evaluate::<f32>(&parse_equation(eq).unwrap(), shapes, vals.into_iter().map(Cow::Owned).collect());
        // Implicit: labels once each, ASCII order (upper case first).
        let (v, s) = eval("bA", &[&[2, 3]], vec![values(6, 0)]).unwrap();
        assert_eq!(s, vec![3, 2]);
        assert_eq!(v[1], values(6, 0)[3]);
        // A trace in implicit form is a scalar.
        let (v, s) = eval("ii", &[&[2, 2]], vec![vec![1.0, 2.0, 3.0, 4.0]]).unwrap();
        assert_eq!((v, s), (vec![5.0], vec![]));
        // Batch diagonal with an ellipsis and a space.
        let (v, s) = eval("...ii ->...i", &[&[2, 2, 2]], vec![(0..8).map(|x| x as f32).collect()]).unwrap();
        assert_eq!((v, s), (vec![0.0, 3.0, 4.0, 7.0], vec![2, 2]));
        // Ellipses of different ranks (here none and one dimension) broadcast, right-aligned.
        let (v, s) = eval("...ij,...jk->...ik", &[&[2, 2], &[3, 2, 1]], vec![vec![1.0, 2.0, 3.0, 4.0], vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0]]).unwrap();
        assert_eq!(s, vec![3, 2, 1]);
        assert_eq!(v, vec![3.0, 7.0, 6.0, 14.0, 9.0, 21.0]);
        // A size-1 letter dimension broadcasts.
        let (v, s) = eval("i,i->i", &[&[1], &[3]], vec![vec![2.0], vec![1.0, 2.0, 3.0]]).unwrap();
        assert_eq!((v, s), (vec![2.0, 4.0, 6.0], vec![3]));
        // Empty dimensions: a zero-length contraction gives zeros.
        let (v, s) = eval("ij,jk->ik", &[&[2, 0], &[0, 3]], vec![vec![], vec![]]).unwrap();
        assert_eq!((v, s), (vec![0.0; 6], vec![2, 3]));
        // Integers.
        let (v, _) = evaluate::<i64>(&parse_equation("ij,j->i").unwrap(), &[&[2, 2], &[2]], vec![Cow::Owned(vec![1, 2, 3, 4]), Cow::Owned(vec![10, 100])]).unwrap();
        assert_eq!(v, vec![210, 430]);
    }

    #[test]
    fn bad_equations_and_shapes_are_errors() {
        for eq in ["ij.,jk", "i..j", "ij->ii", "ij->k", "i1", "......"] {
            assert!(parse_equation(eq).is_err(), "{eq}");
        }
        let eval = |eq: &str, shapes: &[&[usize]]| {
            let vals: Vec<Cow<[f32]>> = shapes.iter().map(|s| Cow::Owned(vec![0.0; s.iter().product()])).collect();
            evaluate::<f32>(&parse_equation(eq).unwrap(), shapes, vals)
        };
        assert!(eval("ij,jk", &[&[2, 3], &[4, 5]]).is_err());
        assert!(eval("ij", &[&[2, 3, 4]]).is_err());
        assert!(eval("ij,jk", &[&[2, 3]]).is_err());
        assert!(eval("ii->i", &[&[2, 3]]).is_err());
        assert!(eval("...i->i", &[&[2, 3]]).is_err());
        let huge = usize::MAX / 4;
        assert!(eval("i,j->ij", &[&[0], &[0]]).is_ok());
        let err = evaluate::<f32>(&parse_equation("i,j->ij").unwrap(), &[&[huge], &[huge]], vec![Cow::Owned(vec![]), Cow::Owned(vec![])]);
        assert!(err.is_err());
    }
}
