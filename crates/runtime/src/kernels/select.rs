//! Selection by value: `TopK`, `NonZero`, `Compress` and `Unique`, whose outputs are the
//! elements (or slices), or the positions, that comparing or testing the input's values picks.

use std::cmp::Ordering;

use half::{bf16, f16};
use qforge_ir::{DType, Elem, Tensor};

use super::util::{axis, gather_elements, input, kernel, single_int, tensor};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the selection operators.
pub fn register(r: &mut Registry) {
    r.add("", "TopK", 1, LATEST, top_k);
    r.add("", "NonZero", 9, LATEST, non_zero);
    r.add("", "Compress", 9, LATEST, compress);
    r.add("", "Unique", 11, LATEST, unique);
}

/// Element types with a total order: numbers by value, `-0.0` equal to `0.0`, and NaN above
/// every number and equal to any NaN (numpy's sort order).
trait Ordered: Elem {
    fn order(self, other: Self) -> Ordering;
    fn is_zero(self) -> bool;
}

macro_rules! ordered_int {
    ($($t:ty),*) => {$(
        impl Ordered for $t {
            #[inline(always)]
            fn order(self, other: Self) -> Ordering {
                self.cmp(&other)
            }
            #[inline(always)]
            fn is_zero(self) -> bool {
                self == 0
            }
        }
    )*};
}
ordered_int!(i8, i16, i32, i64, u8, u16, u32, u64);

macro_rules! ordered_float {
    ($($t:ty => $zero:expr),*) => {$(
        impl Ordered for $t {
            #[inline(always)]
            fn order(self, other: Self) -> Ordering {
                self.partial_cmp(&other).unwrap_or_else(|| self.is_nan().cmp(&other.is_nan()))
            }
            #[inline(always)]
            fn is_zero(self) -> bool {
                self == $zero
            }
        }
    )*};
}
ordered_float!(f32 => 0.0, f64 => 0.0, f16 => f16::ZERO, bf16 => bf16::ZERO);

/// Evaluates `$body` with `$T` naming the [`Ordered`] Rust type of the element type `$dtype`
/// (bool as `u8`, its storage), or `$other` for element types without one.
macro_rules! with_ordered_type {
    ($dtype:expr, $T:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            DType::F32 => { type $T = f32; $body }
            DType::F64 => { type $T = f64; $body }
            DType::F16 => { type $T = half::f16; $body }
            DType::BF16 => { type $T = half::bf16; $body }
            DType::I8 => { type $T = i8; $body }
            DType::I16 => { type $T = i16; $body }
            DType::I32 => { type $T = i32; $body }
            DType::I64 => { type $T = i64; $body }
            DType::U8 | DType::Bool => { type $T = u8; $body }
            DType::U16 => { type $T = u16; $body }
            DType::U32 => { type $T = u32; $body }
            DType::U64 => { type $T = u64; $body }
            _ => $other,
        }
    };
}

/// The elements of `t` as `T`, which the caller has matched to its element type (bool as `u8`).
fn elements<T: Elem>(t: &Tensor) -> RuntimeResult<&[T]> {
    let raw = t.raw_bytes().ok_or_else(|| kernel_error(format!("{} tensors have no numeric elements", t.dtype())))?;
    bytemuck::try_cast_slice(raw).map_err(|e| kernel_error(format!("{} elements cannot be read as {}: {e}", t.dtype(), T::DTYPE)))
}

/// A tensor of `x`'s element type and `shape` made of whole blocks of `block` consecutive
/// elements of `x`: output block `i` is the block of `x` that `sources` yields `i`-th (block
/// `b` starts at element `b * block`). Works for every element type of whole bytes and for
/// strings. The caller keeps every source block inside `x` and yields one per output block.
pub(crate) fn gather_blocks(x: &Tensor, shape: &[usize], block: usize, sources: impl Iterator<Item = usize>) -> RuntimeResult<Tensor> {
    if x.strings().is_some() {
        return gather_elements(x, shape, sources.flat_map(|b| b * block..(b + 1) * block));
    }
    let bits = x.dtype().bits();
    if bits == 0 || !bits.is_multiple_of(8) {
        return Err(kernel_error(format!("{} tensors are not supported here", x.dtype())));
    }
    let mut out = Tensor::zeros(x.dtype(), shape).map_err(|e| kernel_error(e.to_string()))?;
    if block == 0 || out.is_empty() {
        return Ok(out);
    }
    let no_bytes = || kernel_error(format!("{} tensors have no element bytes", x.dtype()));
    let src = x.raw_bytes().ok_or_else(no_bytes)?;
    let dst = out.raw_bytes_mut().ok_or_else(no_bytes)?;
    let width = bits / 8;
    let misaligned = |e| kernel_error(format!("{} storage is not aligned for its width: {e}", x.dtype()));
    match width {
        2 => copy_blocks::<u16>(bytemuck::try_cast_slice(src).map_err(misaligned)?, bytemuck::try_cast_slice_mut(dst).map_err(misaligned)?, block, sources),
        4 => copy_blocks::<u32>(bytemuck::try_cast_slice(src).map_err(misaligned)?, bytemuck::try_cast_slice_mut(dst).map_err(misaligned)?, block, sources),
        8 => copy_blocks::<u64>(bytemuck::try_cast_slice(src).map_err(misaligned)?, bytemuck::try_cast_slice_mut(dst).map_err(misaligned)?, block, sources),
        _ => copy_blocks::<u8>(src, dst, block * width, sources),
    }
    Ok(out)
}

/// Fills `dst` block by block (`block` elements each) with the blocks of `src` that
/// `sources` names, element by element when blocks are single elements.
fn copy_blocks<T: Copy>(src: &[T], dst: &mut [T], block: usize, sources: impl Iterator<Item = usize>) {
    if block == 1 {
        for (d, b) in dst.iter_mut().zip(sources) {
            *d = src[b];
        }
    } else {
        for (d, b) in dst.chunks_exact_mut(block).zip(sources) {
            d.copy_from_slice(&src[b * block..(b + 1) * block]);
        }
    }
}

/// `(outer, d, inner)`: the sizes before, along and after axis `ax` of `shape`.
fn around(shape: &[usize], ax: usize) -> (usize, usize, usize) {
    (shape[..ax].iter().product(), shape[ax], shape[ax + 1..].iter().product())
}

/// An axis attribute resolved against the rank of `x`, which must be at least 1.
fn axis_of(a: i64, x: &Tensor, what: &str) -> RuntimeResult<usize> {
    if x.rank() == 0 {
        return Err(kernel_error(format!("{what} needs an input of rank 1 or more to take axis {a} of, got a scalar")));
    }
    axis(a, x.rank())
}

/// `TopK`: the `k` largest (or, with `largest = 0`, smallest) elements of `X` along `axis`
/// (default -1) and their int64 indices along it, best first, equal values in index order.
/// Opset 1 takes `k` as an attribute; opset 10 as input `K` (one int64); opset 11 adds
/// `largest` and `sorted` (the output is sorted either way, which `sorted = 0` allows). NaN
/// ranks above every number. `k` may be 0 up to the size of the axis.
fn top_k(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let k_attr = if info.opset < 10 { Some(info.node.attr_int("k").ok_or_else(|| info.error("attribute 'k' is required before opset 10"))?) } else { None };
    let a = info.attr_int("axis", -1);
    let largest = info.opset < 11 || info.attr_int("largest", 1) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let k = match k_attr {
            Some(k) => k,
            None => single_int(input(ins, 1)?, "K")?,
        };
        let ax = axis_of(a, x, "TopK")?;
        let (outer, d, inner) = around(x.shape(), ax);
        let k = usize::try_from(k).ok().filter(|&k| k <= d)
            .ok_or_else(|| kernel_error(format!("k {k} is out of range [0, {d}] for axis {ax} of shape {:?}", x.shape())))?;
        let mut shape = x.shape().to_vec();
        shape[ax] = k;
        if x.dtype() == DType::Bool {
            return Err(kernel_error("TopK does not support bool"));
        }
        let (values, indices) = with_ordered_type!(x.dtype(), T => {
            let (v, i) = top_k_lines::<T>(elements(x)?, outer, d, inner, k, largest);
            (tensor(&shape, v)?, i)
        }, _ => return Err(kernel_error(format!("TopK does not support {}", x.dtype()))));
        Ok(vec![values, tensor(&shape, indices)?])
    })
}

/// The `k` best elements of each line of `d` elements of `x` (shape `[outer, d, inner]`,
/// lines along the middle axis), best first with equal values in index order, and their
/// positions in the line, laid out as `[outer, k, inner]`. Each line is partially selected
/// (linear time) and only its best `k` are sorted.
fn top_k_lines<T: Ordered>(x: &[T], outer: usize, d: usize, inner: usize, k: usize, largest: bool) -> (Vec<T>, Vec<i64>) {
    let n = outer * k * inner;
    let mut values = vec![T::zeroed(); n];
    let mut indices = vec![0i64; n];
    if k == 0 {
        return (values, indices);
    }
    let better = |p: &(T, usize), q: &(T, usize)| {
        let by_value = p.0.order(q.0);
        (if largest { by_value.reverse() } else { by_value }).then(p.1.cmp(&q.1))
    };
    let mut line: Vec<(T, usize)> = Vec::with_capacity(d);
    for o in 0..outer {
        for i in 0..inner {
            line.clear();
            line.extend((0..d).map(|j| (x[(o * d + j) * inner + i], j)));
            if k < d {
                line.select_nth_unstable_by(k - 1, better);
            }
            line[..k].sort_unstable_by(better);
            for (r, &(v, j)) in line[..k].iter().enumerate() {
                let at = (o * k + r) * inner + i;
                values[at] = v;
                indices[at] = j as i64;
            }
        }
    }
    (values, indices)
}

/// `NonZero` (opsets 9 and 13): the int64 coordinates `[rank, n]` of the `n` elements of `X`
/// that are not zero (false), in row-major order. A scalar counts as shape `[1]`.
fn non_zero(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let shape: &[usize] = if x.rank() == 0 { &[1] } else { x.shape() };
        let coords = with_ordered_type!(x.dtype(), T => nonzero_coordinates::<T>(elements(x)?, shape),
            _ => return Err(kernel_error(format!("NonZero does not support {}", x.dtype()))));
        let n = coords.len() / shape.len();
        Ok(vec![tensor(&[shape.len(), n], coords)?])
    })
}

/// The coordinates of the nonzero elements of `x` (of `shape`, rank 1 or more), laid out
/// `[rank, n]`: coordinate `d` of the `i`-th nonzero element at `d * n + i`.
fn nonzero_coordinates<T: Ordered>(x: &[T], shape: &[usize]) -> Vec<i64> {
    let n = x.iter().filter(|v| !v.is_zero()).count();
    let mut coords = vec![0i64; shape.len() * n];
    let mut at = vec![0usize; shape.len()];
    let mut found = 0;
    for v in x {
        if !v.is_zero() {
            for (d, &c) in at.iter().enumerate() {
                coords[d * n + found] = c as i64;
            }
            found += 1;
        }
        for d in (0..shape.len()).rev() {
            at[d] += 1;
            if at[d] < shape[d] {
                break;
            }
            at[d] = 0;
        }
    }
    coords
}

/// `Compress`: the slices of `input` along `axis` whose entry in the 1-D bool `condition` is
/// true, or, without `axis`, the elements of the flattened input. `condition` may be shorter
/// than the axis (the rest is not selected) or longer when the extra entries are false. Opset
/// 9 takes `axis` in `[0, rank)`, opset 11 also negative axes.
fn compress(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.node.attr_int("axis");
    if let Some(a) = a.filter(|&a| a < 0 && info.opset < 11) {
        return Err(info.error(format!("axis {a} is negative, which Compress allows from opset 11 only")));
    }
    kernel(move |ins| {
        let (x, cond) = (input(ins, 0)?, input(ins, 1)?);
        if cond.dtype() != DType::Bool || cond.rank() != 1 {
            return Err(kernel_error(format!("condition must be a 1-D bool tensor, got {} {:?}", cond.dtype(), cond.shape())));
        }
        let flags = elements::<u8>(cond)?;
        let (outer, d, inner, mut shape, ax) = match a {
            Some(a) => {
                let ax = axis_of(a, x, "Compress")?;
                let (outer, d, inner) = around(x.shape(), ax);
                (outer, d, inner, x.shape().to_vec(), Some(ax))
            }
            None => (1, x.len(), 1, vec![0], None),
        };
        if let Some(extra) = flags.iter().skip(d).position(|&f| f != 0) {
            return Err(kernel_error(format!("condition selects index {} but the {} has size {d}", d + extra, if a.is_some() { "axis" } else { "flattened input" })));
        }
        let picks: Vec<usize> = flags.iter().take(d).enumerate().filter(|&(_, &f)| f != 0).map(|(j, _)| j).collect();
        shape[ax.unwrap_or(0)] = picks.len();
        let picks = &picks;
        Ok(vec![gather_blocks(x, &shape, inner, (0..outer).flat_map(|o| picks.iter().map(move |&j| o * d + j)))?])
    })
}

/// `Unique` (opsets 11 and 28): the distinct elements of the flattened `X`, or with `axis` the
/// distinct slices along it, as `Y`, with int64 `indices` (first occurrence of each in `X`),
/// `inverse_indices` (the entry of `Y` each element or slice of `X` equals) and `counts`.
/// `sorted = 1` (default) orders `Y` ascending (slices lexicographically), `sorted = 0` by
/// first occurrence. Values compare as in [`Ordered`]: `-0.0` equals `0.0`, NaNs are equal.
fn unique(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.node.attr_int("axis");
    let sorted = info.attr_int("sorted", 1) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let (outer, d, inner, ax) = match a {
            Some(a) => {
                let ax = axis_of(a, x, "Unique")?;
                let (outer, d, inner) = around(x.shape(), ax);
                (outer, d, inner, Some(ax))
            }
            None => (1, x.len(), 1, None),
        };
        let groups = match x.strings() {
            Some(s) => unique_groups(outer, d, inner, sorted, |p, q| s[p].cmp(&s[q])),
            None => with_ordered_type!(x.dtype(), T => {
                let v = elements::<T>(x)?;
                unique_groups(outer, d, inner, sorted, |p, q| v[p].order(v[q]))
            }, _ => return Err(kernel_error(format!("Unique does not support {}", x.dtype())))),
        };
        let n = groups.first.len();
        let shape = match ax {
            Some(ax) => {
                let mut s = x.shape().to_vec();
                s[ax] = n;
                s
            }
            None => vec![n],
        };
        let first = &groups.first;
        let y = gather_blocks(x, &shape, inner, (0..outer).flat_map(|o| first.iter().map(move |&j| o * d + j)))?;
        let indices: Vec<i64> = first.iter().map(|&j| j as i64).collect();
        Ok(vec![y, tensor(&[n], indices)?, tensor(&[d], groups.inverse)?, tensor(&[n], groups.counts)?])
    })
}

/// The distinct items of a `Unique` input, in output order.
struct Groups {
    /// The position of each distinct item's first occurrence.
    first: Vec<usize>,
    /// The distinct item each item equals, by output position.
    inverse: Vec<i64>,
    /// How often each distinct item occurs.
    counts: Vec<i64>,
}

/// Groups the `d` items of a `[outer, d, inner]` layout (item `j` is the elements
/// `(o * d + j) * inner + i`, compared lexicographically in `(o, i)` order by `cmp` of two
/// element offsets) into equal ones, ordered ascending when `sorted`, else by first
/// occurrence. One sort of the items, `O(d log d)` comparisons.
fn unique_groups(outer: usize, d: usize, inner: usize, sorted: bool, cmp: impl Fn(usize, usize) -> Ordering) -> Groups {
    let item_cmp = |a: usize, b: usize| {
        (0..outer).flat_map(|o| (0..inner).map(move |i| o * d * inner + i))
            .map(|base| cmp(base + a * inner, base + b * inner))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    };
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_unstable_by(|&a, &b| item_cmp(a, b).then(a.cmp(&b)));
    let mut first = vec![];
    let mut counts = vec![];
    let mut group = vec![0usize; d];
    for (pos, &j) in order.iter().enumerate() {
        if pos == 0 || item_cmp(order[pos - 1], j).is_ne() {
            first.push(j);
            counts.push(0i64);
        }
        group[j] = first.len() - 1;
        *counts.last_mut().expect("a group was just opened") += 1;
    }
    let mut rank: Vec<usize> = (0..first.len()).collect();
    if !sorted {
        let mut by_first: Vec<usize> = (0..first.len()).collect();
        by_first.sort_unstable_by_key(|&g| first[g]);
        for (r, &g) in by_first.iter().enumerate() {
            rank[g] = r;
        }
        first = by_first.iter().map(|&g| first[g]).collect();
        counts = by_first.iter().map(|&g| counts[g]).collect();
    }
    let inverse = group.iter().map(|&g| rank[g] as i64).collect();
    Groups { first, inverse, counts }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_breaks_ties_by_index_and_ranks_nan_highest() {
        let x = [3.0f32, f32::NAN, 3.0, -1.0, 5.0];
        assert_eq!(top_k_lines(&x, 1, 5, 1, 3, true).1, vec![1, 4, 0]);
        assert_eq!(top_k_lines(&x, 1, 5, 1, 3, false).1, vec![3, 0, 2]);
        // Two lines along the first axis of a [3, 2] layout.
        let x = [1i64, 6, 5, 2, 5, 4];
        let (v, i) = top_k_lines(&x, 1, 3, 2, 2, true);
        assert_eq!((v, i), (vec![5, 6, 5, 4], vec![1, 0, 2, 2]));
    }

    #[test]
    fn nonzero_coordinates_are_row_major() {
        let x = [0u8, 1, 1, 0, 0, 1];
        assert_eq!(nonzero_coordinates(&x, &[2, 3]), vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(nonzero_coordinates(&[-0.0f32, 0.0], &[2]), Vec::<i64>::new());
    }

    #[test]
    fn unique_groups_in_sorted_and_first_occurrence_order() {
        let v = [2, 1, 1, 3, 4, 3];
        let g = unique_groups(1, 6, 1, true, |p, q| v[p].cmp(&v[q]));
        assert_eq!((g.first, g.inverse, g.counts), (vec![1, 0, 3, 4], vec![1, 0, 0, 2, 3, 2], vec![2, 1, 2, 1]));
        let g = unique_groups(1, 6, 1, false, |p, q| v[p].cmp(&v[q]));
        assert_eq!((g.first, g.inverse, g.counts), (vec![0, 1, 3, 4], vec![0, 1, 1, 2, 3, 2], vec![1, 2, 2, 1]));
    }
}
