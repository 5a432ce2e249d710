//! Reductions, arg-reductions, softmax and cumulative sums.

use qforge_ir::{DType, Tensor};

use super::elementwise::{from_f32, to_f32};
use super::math::exp;
use super::util::{axis, input, ints, kernel, lane_sum, map_in_place, min_items, opt_input, par_chunks_mut, single_int, slice, tensor, vectorized, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the reduction operators.
pub fn register(r: &mut Registry) {
    for op in ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "ReduceLogSum"] {
        r.add("", op, 1, LATEST, reduce);
    }
    r.add("", "ArgMax", 1, LATEST, arg);
    r.add("", "ArgMin", 1, LATEST, arg);
    r.add("", "Softmax", 1, LATEST, softmax);
    r.add("", "LogSoftmax", 1, LATEST, softmax);
    r.add("", "Hardmax", 1, LATEST, softmax);
    r.add("", "CumSum", 11, LATEST, cumsum);
    r.add("", "CumProd", 26, LATEST, cumprod);
}

/// (outer, reduced, inner) sizes when `axes` (sorted) are consecutive.
fn contiguous(shape: &[usize], axes: &[usize]) -> Option<(usize, usize, usize)> {
    let (&first, &last) = (axes.first()?, axes.last()?);
    if last - first + 1 != axes.len() {
        return None;
    }
    Some((shape[..first].iter().product(), shape[first..=last].iter().product(), shape[last + 1..].iter().product()))
}

/// Reduces `x` over `axes` (sorted, distinct) with `init`, `step(acc, x)` and
/// `finish(acc, count)`; the result is laid out as `x` with the reduced axes of size 1.
pub(super) fn reduce_f32(x: &[f32], shape: &[usize], axes: &[usize], init: f32, step: impl Fn(f32, f32) -> f32, finish: impl Fn(f32, usize) -> f32) -> Vec<f32> {
    let count: usize = axes.iter().map(|&a| shape[a]).product();
    if let Some((outer, red, inner)) = contiguous(shape, axes) {
        let mut out = vec![init; outer * inner];
        for o in 0..outer {
            let acc = &mut out[o * inner..(o + 1) * inner];
            for r in 0..red {
                let row = &x[(o * red + r) * inner..(o * red + r + 1) * inner];
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a = step(*a, v);
                }
            }
        }
        return out.into_iter().map(|a| finish(a, count)).collect();
    }
    let out_shape: Vec<usize> = shape.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let ost = super::shape::strides(&out_shape);
    let ist = super::shape::strides(shape);
    let mut out = vec![init; out_shape.iter().product()];
    for (flat, &v) in x.iter().enumerate() {
        let o: usize = (0..shape.len()).map(|k| if axes.contains(&k) { 0 } else { (flat / ist[k]) % shape[k] * ost[k] }).sum();
        out[o] = step(out[o], v);
    }
    out.into_iter().map(|a| finish(a, count)).collect()
}

fn reduce(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    let axes_from_input = (op == "ReduceSum" && info.opset >= 13) || info.opset >= 18;
    let attr_axes = info.attr_ints("axes");
    let keep = info.attr_int("keepdims", 1) != 0;
    let noop = info.attr_int("noop_with_empty_axes", 0) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let r = x.rank();
        let axes = if axes_from_input { opt_input(ins, 1).map(|t| ints(t, "axes")).transpose()? } else { attr_axes.clone() };
        let mut axes: Vec<usize> = match axes {
            Some(a) if !a.is_empty() => a.iter().map(|&v| axis(v, r)).collect::<RuntimeResult<_>>()?,
            _ if noop => return Ok(vec![x.clone()]),
            _ => (0..r).collect(),
        };
        axes.sort();
        axes.dedup();
        let out_shape: Vec<usize> = (0..r).filter_map(|i| if axes.contains(&i) { keep.then_some(1) } else { Some(x.shape()[i]) }).collect();
        if !x.dtype().is_float() {
            return reduce_int(&op, x, &axes, &out_shape);
        }
        let v = to_f32(x)?;
        let s = x.shape();
        let out = match op.as_str() {
            "ReduceMean" => reduce_f32(&v, s, &axes, 0.0, |a, b| a + b, |a, n| a / n as f32),
            "ReduceSum" => reduce_f32(&v, s, &axes, 0.0, |a, b| a + b, |a, _| a),
            "ReduceMax" => reduce_f32(&v, s, &axes, f32::NEG_INFINITY, |a, b| if b.is_nan() || a.is_nan() { f32::NAN } else { a.max(b) }, |a, _| a),
            "ReduceMin" => reduce_f32(&v, s, &axes, f32::INFINITY, |a, b| if b.is_nan() || a.is_nan() { f32::NAN } else { a.min(b) }, |a, _| a),
            "ReduceProd" => reduce_f32(&v, s, &axes, 1.0, |a, b| a * b, |a, _| a),
            "ReduceL1" => reduce_f32(&v, s, &axes, 0.0, |a, b| a + b.abs(), |a, _| a),
            "ReduceL2" => reduce_f32(&v, s, &axes, 0.0, |a, b| a + b * b, |a, _| a.sqrt()),
            "ReduceSumSquare" => reduce_f32(&v, s, &axes, 0.0, |a, b| a + b * b, |a, _| a),
            "ReduceLogSum" => reduce_f32(&v, s, &axes, 0.0, |a, b| a + b, |a, _| a.ln()),
            _ => {
                let m = reduce_f32(&v, s, &axes, f32::NEG_INFINITY, |a, b| a.max(b), |a, _| a);
                let full: Vec<usize> = s.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
                let (mx, _) = super::util::binary(&v, s, &m, &full, |a, b| exp(a - b))?;
                let sum = reduce_f32(&mx, s, &axes, 0.0, |a, b| a + b, |a, _| a);
                sum.iter().zip(&m).map(|(s, m)| s.ln() + m).collect()
            }
        };
        Ok(vec![from_f32(x.dtype(), &out_shape, out)?])
    })
}

fn reduce_int(op: &str, x: &Tensor, axes: &[usize], out_shape: &[usize]) -> RuntimeResult<Vec<Tensor>> {
    let v = x.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?;
    let s = x.shape();
    let full: Vec<usize> = s.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let (ist, ost) = (super::shape::strides(s), super::shape::strides(&full));
    // An empty reduction of Max/Min gives the type's lowest/highest value (false/true for bool).
    let (lowest, highest) = match x.dtype() {
        DType::Bool => (0, 1),
        d => d.int_range().unwrap_or((i64::MIN, i64::MAX)),
    };
    let (init, f): (i64, fn(i64, i64) -> i64) = match op {
        "ReduceSum" | "ReduceMean" => (0, |a, b| a + b),
        "ReduceMax" => (lowest, |a, b| a.max(b)),
        "ReduceMin" => (highest, |a, b| a.min(b)),
        "ReduceProd" => (1, |a, b| a * b),
        "ReduceSumSquare" => (0, |a, b| a + b * b),
        "ReduceL1" => (0, |a, b| a + b.abs()),
        other => return Err(kernel_error(format!("{other} does not support {}", x.dtype()))),
    };
    let mut out = vec![init; full.iter().product()];
    for (flat, &val) in v.iter().enumerate() {
        let o: usize = (0..s.len()).map(|k| if axes.contains(&k) { 0 } else { (flat / ist[k]) % s[k] * ost[k] }).sum();
        out[o] = f(out[o], val);
    }
    if op == "ReduceMean" {
        let n = axes.iter().map(|&a| s[a]).product::<usize>().max(1) as i64;
        out.iter_mut().for_each(|a| *a /= n);
    }
    Ok(vec![super::shape::cast_tensor(&tensor(out_shape, out)?, x.dtype())?])
}

fn arg(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let max = info.node.op_type == "ArgMax";
    let (a, keep, last) = (info.attr_int("axis", 0), info.attr_int("keepdims", 1) != 0, info.attr_int("select_last_index", 0) != 0);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let ax = axis(a, x.rank())?;
        let v = x.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?;
        let s = x.shape();
        let (outer, d, inner) = (s[..ax].iter().product::<usize>(), s[ax], s[ax + 1..].iter().product::<usize>());
        let mut out = vec![0i64; outer * inner];
        for o in 0..outer {
            for i in 0..inner {
                let mut best = 0;
                for k in 1..d {
                    let (cur, b) = (v[(o * d + k) * inner + i], v[(o * d + best) * inner + i]);
                    let better = if max { cur > b || (last && cur == b) } else { cur < b || (last && cur == b) };
                    if better {
                        best = k;
                    }
                }
                out[o * inner + i] = best as i64;
            }
        }
        let mut shape = s.to_vec();
        if keep { shape[ax] = 1 } else { shape.remove(ax); }
        Ok(vec![tensor(&shape, out)?])
    })
}

fn softmax(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    let legacy = info.opset < 13;
    let a = info.attr_int("axis", if legacy { 1 } else { -1 });
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let ax = axis(a, x.rank())?;
        let s = x.shape();
        let (outer, d, inner) = if legacy {
            (s[..ax].iter().product::<usize>(), s[ax..].iter().product::<usize>(), 1)
        } else {
            (s[..ax].iter().product::<usize>(), s[ax], s[ax + 1..].iter().product::<usize>())
        };
        let mut v = to_f32(x)?.into_owned();
        let log = op == "LogSoftmax";
        if op == "Hardmax" {
            for o in 0..outer {
                for i in 0..inner {
                    let at = |k: usize| (o * d + k) * inner + i;
                    let m = (0..d).map(|k| v[at(k)]).fold(f32::NEG_INFINITY, f32::max);
                    let first = (0..d).find(|&k| v[at(k)] == m).unwrap_or(0);
                    (0..d).for_each(|k| v[at(k)] = (k == first) as u8 as f32);
                }
            }
        } else if inner == 1 {
            par_chunks_mut(&mut v, d, min_items(d * ELEMENT_WORK), || (), |_, _, row| vectorized(|| softmax_row(row, log)));
        } else if d > 0 {
            par_chunks_mut(&mut v, d * inner, min_items(d * inner * ELEMENT_WORK), || (), |_, _, block| vectorized(|| softmax_columns(block, d, inner, log)));
        }
        Ok(vec![from_f32(x.dtype(), s, v)?])
    })
}

/// Softmax (or LogSoftmax) of one row in place: `exp(x - max) / sum` (`x - max - ln(sum)`).
/// The max and the sum are taken over sixteen interleaved lanes, so both loops vectorize.
#[inline(always)]
fn softmax_row(row: &mut [f32], log: bool) {
    const L: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; L];
    let chunks = row.chunks_exact(L);
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    // NaNs are skipped here; they reach every output through the sum.
    let m = lanes.iter().copied().fold(tail, f32::max);
    if log {
        let shift = m + lane_sum(row, |x| exp(x - m)).ln();
        map_in_place(row, |x| x - shift);
    } else {
        map_in_place(row, |x| exp(x - m));
        let inv = 1.0 / lane_sum(row, |x| x);
        map_in_place(row, |x| x * inv);
    }
}

/// Softmax (or LogSoftmax) over the `d` rows of a `[d, inner]` block, column by column, in
/// tiles of columns so every pass runs along contiguous memory and vectorizes: the column
/// maxima, then `exp(x - max)` and its column sums, then the product with the sums' inverses
/// (or the subtraction of their logarithms). A NaN is skipped by the maximum and reaches its column through the sum.
#[inline(always)]
fn softmax_columns(block: &mut [f32], d: usize, inner: usize, log: bool) {
    const TILE: usize = 256;
    let (mut m, mut sum) = ([0f32; TILE], [0f32; TILE]);
    for start in (0..inner).step_by(TILE) {
        let len = TILE.min(inner - start);
        let (m, sum) = (&mut m[..len], &mut sum[..len]);
        m.fill(f32::NEG_INFINITY);
        sum.fill(0.0);
        for k in 0..d {
            column_max(m, &block[k * inner + start..][..len]);
        }
        for k in 0..d {
            let row = &mut block[k * inner + start..][..len];
            if log {
                column_log_terms(row, m, sum);
            } else {
                column_exp_terms(row, m, sum);
            }
        }
        for s in sum.iter_mut() {
            *s = if log { s.ln() } else { 1.0 / *s };
        }
        for k in 0..d {
            let row = &mut block[k * inner + start..][..len];
            if log {
                column_sub(row, sum);
            } else {
                column_mul(row, sum);
            }
        }
    }
}

#[inline(always)]
fn column_max(m: &mut [f32], row: &[f32]) {
    for (m, &x) in m.iter_mut().zip(row) {
        *m = if x > *m { x } else { *m };
    }
}

#[inline(always)]
fn column_exp_terms(row: &mut [f32], m: &[f32], sum: &mut [f32]) {
    for ((x, &m), s) in row.iter_mut().zip(m).zip(sum.iter_mut()) {
        *x = exp(*x - m);
        *s += *x;
    }
}

#[inline(always)]
fn column_log_terms(row: &mut [f32], m: &[f32], sum: &mut [f32]) {
    for ((x, &m), s) in row.iter_mut().zip(m).zip(sum.iter_mut()) {
        *x -= m;
        *s += exp(*x);
    }
}

#[inline(always)]
fn column_mul(row: &mut [f32], by: &[f32]) {
    for (x, &b) in row.iter_mut().zip(by) {
        *x *= b;
    }
}

#[inline(always)]
fn column_sub(row: &mut [f32], by: &[f32]) {
    for (x, &b) in row.iter_mut().zip(by) {
        *x -= b;
    }
}

fn cumsum(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (exclusive, reverse) = (info.attr_int("exclusive", 0) != 0, info.attr_int("reverse", 0) != 0);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let a = ints(input(ins, 1)?, "axis")?.first().copied().ok_or_else(|| kernel_error("axis is empty"))?;
        let ax = axis(a, x.rank())?;
        let s = x.shape();
        let (outer, d, inner) = (s[..ax].iter().product::<usize>(), s[ax], s[ax + 1..].iter().product::<usize>());
        let float = x.dtype().is_float();
        let v = x.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?;
        let mut out = vec![0f64; v.len()];
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = 0.0;
                let ks: Box<dyn Iterator<Item = usize>> = if reverse { Box::new((0..d).rev()) } else { Box::new(0..d) };
                for k in ks {
                    let idx = (o * d + k) * inner + i;
                    if exclusive { out[idx] = acc; acc += v[idx]; } else { acc += v[idx]; out[idx] = acc; }
                }
            }
        }
        let t = if float { tensor(s, out)? } else { tensor(s, out.into_iter().map(|x| x as i64).collect::<Vec<_>>())? };
        Ok(vec![super::shape::cast_tensor(&t, x.dtype())?])
    })
}


/// `CumProd` (opset 26): the running product of `x` along the axis given by input `axis` (an
/// int32 or int64 scalar, negative counting from the end); with `exclusive = 1` each output
/// leaves out its own element (the first is 1), with `reverse = 1` the products run from the
/// end of the axis. Integers wrap on overflow; 16-bit floats multiply in f32.
fn cumprod(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (exclusive, reverse) = (info.attr_int("exclusive", 0) != 0, info.attr_int("reverse", 0) != 0);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let a = single_int(input(ins, 1)?, "axis")?;
        if x.rank() == 0 {
            return Err(kernel_error(format!("CumProd needs an input of rank 1 or more to take axis {a} of, got a scalar")));
        }
        let ax = axis(a, x.rank())?;
        let s = x.shape();
        let lines = Lines { d: s[ax], inner: s[ax + 1..].iter().product(), exclusive, reverse };
        let out = match x.dtype() {
            DType::F32 => tensor(s, lines.scan(slice::<f32>(x, "x")?, 1.0, |p, q| p * q))?,
            DType::F64 => tensor(s, lines.scan(slice::<f64>(x, "x")?, 1.0, |p, q| p * q))?,
            DType::I32 => tensor(s, lines.scan(slice::<i32>(x, "x")?, 1, i32::wrapping_mul))?,
            DType::I64 => tensor(s, lines.scan(slice::<i64>(x, "x")?, 1, i64::wrapping_mul))?,
            DType::U32 => tensor(s, lines.scan(slice::<u32>(x, "x")?, 1, u32::wrapping_mul))?,
            DType::U64 => tensor(s, lines.scan(slice::<u64>(x, "x")?, 1, u64::wrapping_mul))?,
            DType::F16 | DType::BF16 => from_f32(x.dtype(), s, lines.scan(&to_f32(x)?, 1.0, |p, q| p * q))?,
            d => return Err(kernel_error(format!("CumProd does not support {d}"))),
        };
        Ok(vec![out])
    })
}

/// The lines of a running scan: a `[outer, d, inner]` layout scanned along its middle axis.
struct Lines {
    d: usize,
    inner: usize,
    /// Each output leaves out its own element.
    exclusive: bool,
    /// The scan runs from the end of the axis.
    reverse: bool,
}

impl Lines {
    /// The running `combine` of `x` along the lines, starting from `identity`: each step
    /// combines a whole row of `inner` elements with the previous output row, so the inner
    /// loop runs along contiguous memory.
    fn scan<T: Copy>(&self, x: &[T], identity: T, combine: impl Fn(T, T) -> T) -> Vec<T> {
        let (d, inner) = (self.d, self.inner);
        let mut out = vec![identity; x.len()];
        if d == 0 || inner == 0 {
            return out;
        }
        for (src, dst) in x.chunks_exact(d * inner).zip(out.chunks_exact_mut(d * inner)) {
            for step in 0..d {
                let k = if self.reverse { d - 1 - step } else { step };
                if step == 0 {
                    if !self.exclusive {
                        dst[k * inner..(k + 1) * inner].copy_from_slice(&src[k * inner..(k + 1) * inner]);
                    }
                    continue;
                }
                let prev = if self.reverse { k + 1 } else { k - 1 };
                let operand = &src[if self.exclusive { prev } else { k } * inner..][..inner];
                let (row, before) = if self.reverse {
                    let (lo, hi) = dst.split_at_mut(prev * inner);
                    (&mut lo[k * inner..], &hi[..inner])
                } else {
                    let (lo, hi) = dst.split_at_mut(k * inner);
                    (&mut hi[..inner], &lo[prev * inner..])
                };
                for ((o, &p), &v) in row.iter_mut().zip(before).zip(operand) {
                    *o = combine(p, v);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_products_in_all_four_modes() {
        let x = [1, 2, 3, 4, 5, 6];
        let scan = |exclusive, reverse, d, inner| Lines { d, inner, exclusive, reverse }.scan(&x, 1, |p, q| p * q);
        assert_eq!(scan(false, false, 6, 1), vec![1, 2, 6, 24, 120, 720]);
        assert_eq!(scan(true, false, 6, 1), vec![1, 1, 2, 6, 24, 120]);
        assert_eq!(scan(false, true, 6, 1), vec![720, 720, 360, 120, 30, 6]);
        assert_eq!(scan(true, true, 6, 1), vec![720, 360, 120, 30, 6, 1]);
        // [2, 3] along axis 0 and along axis 1.
        assert_eq!(scan(false, false, 2, 3), vec![1, 2, 3, 4, 10, 18]);
        assert_eq!(scan(true, true, 3, 1), vec![6, 3, 1, 30, 6, 1]);
    }
}
