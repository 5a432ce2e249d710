//! Shape and data-movement operators, and type conversion. These work on any element type.

use half::{bf16, f16};
use qforge_ir::{DType, Tensor};

use super::select::gather_blocks;
use super::util::{axis, broadcast_shape, broadcast_to, check_output_size, gather_elements, input, ints, kernel, opt_input, single_int, tensor, value_input, values_fn};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the shape and data-movement operators.
pub fn register(r: &mut Registry) {
    r.add("", "Identity", 1, LATEST, identity);
    r.add("", "Dropout", 1, LATEST, dropout);
    r.add("", "Shape", 1, LATEST, shape);
    r.add("", "Size", 1, LATEST, size);
    r.add("", "Reshape", 5, LATEST, reshape);
    r.add("", "Flatten", 1, LATEST, flatten);
    r.add("", "Transpose", 1, LATEST, transpose);
    r.add("", "Squeeze", 1, LATEST, squeeze);
    r.add("", "Unsqueeze", 1, LATEST, unsqueeze);
    r.add("", "Concat", 1, LATEST, concat);
    r.add("", "Split", 2, LATEST, split);
    r.add("", "Slice", 1, LATEST, slice_op);
    r.add("", "Gather", 1, LATEST, gather);
    r.add("", "GatherElements", 11, LATEST, gather_elements_op);
    r.add("", "Scatter", 9, 10, scatter_elements);
    r.add("", "ScatterElements", 11, LATEST, scatter_elements);
    r.add("", "ScatterND", 11, LATEST, scatter_nd);
    r.add("", "GatherND", 11, LATEST, gather_nd);
    r.add("", "OneHot", 9, LATEST, one_hot);
    r.add("", "Expand", 8, LATEST, expand);
    r.add("", "Tile", 6, LATEST, tile);
    r.add("", "Pad", 2, LATEST, pad);
    r.add("", "CenterCropPad", 18, LATEST, center_crop_pad);
    r.add("", "Constant", 1, LATEST, constant);
    r.add("", "ConstantOfShape", 9, LATEST, constant_of_shape);
    r.add("", "Range", 11, LATEST, range);
    r.add("", "DepthToSpace", 1, LATEST, depth_to_space);
    r.add("", "SpaceToDepth", 1, LATEST, space_to_depth);
    r.add("", "Trilu", 14, LATEST, trilu);
    r.add("", "EyeLike", 9, LATEST, eye_like);
    r.add("", "ReverseSequence", 10, LATEST, reverse_sequence);
}

fn err(e: qforge_ir::IrError) -> crate::RuntimeError {
    kernel_error(e.to_string())
}

/// Converts a tensor to another element type (numeric and bool; float to integer truncates
/// toward zero and saturates, float to bool is `!= 0`).
pub fn cast_tensor(t: &Tensor, to: DType) -> RuntimeResult<Tensor> {
    if t.dtype() == to {
        return Ok(t.clone());
    }
    let shape = t.shape();
    if t.dtype().is_float() {
        let v: Vec<f64> = t.to_f64_vec().map_err(err)?;
        return Ok(match to {
            DType::F32 => tensor(shape, v.iter().map(|&x| x as f32).collect::<Vec<_>>())?,
            DType::F64 => tensor(shape, v)?,
            DType::F16 => tensor(shape, v.iter().map(|&x| f16::from_f64(x)).collect::<Vec<_>>())?,
            DType::BF16 => tensor(shape, v.iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>())?,
            DType::Bool => Tensor::from_bools(shape, &v.iter().map(|&x| x != 0.0).collect::<Vec<_>>()).map_err(err)?,
            _ => from_i64(to, shape, v.iter().map(|&x| if x.is_nan() { 0 } else { x as i64 }).collect())?,
        });
    }
    let v = t.to_i64_vec().map_err(|_| kernel_error(format!("cannot cast {} to {to}", t.dtype())))?;
    Ok(match to {
        DType::F32 => tensor(shape, v.iter().map(|&x| x as f32).collect::<Vec<_>>())?,
        DType::F64 => tensor(shape, v.iter().map(|&x| x as f64).collect::<Vec<_>>())?,
        DType::F16 => tensor(shape, v.iter().map(|&x| f16::from_f64(x as f64)).collect::<Vec<_>>())?,
        DType::BF16 => tensor(shape, v.iter().map(|&x| bf16::from_f64(x as f64)).collect::<Vec<_>>())?,
        DType::Bool => Tensor::from_bools(shape, &v.iter().map(|&x| x != 0).collect::<Vec<_>>()).map_err(err)?,
        _ => from_i64(to, shape, v)?,
    })
}

fn from_i64(to: DType, shape: &[usize], v: Vec<i64>) -> RuntimeResult<Tensor> {
    Ok(match to {
        DType::I64 => tensor(shape, v)?,
        DType::I32 => tensor(shape, v.into_iter().map(|x| x as i32).collect::<Vec<_>>())?,
        DType::I16 => tensor(shape, v.into_iter().map(|x| x as i16).collect::<Vec<_>>())?,
        DType::I8 => tensor(shape, v.into_iter().map(|x| x as i8).collect::<Vec<_>>())?,
        DType::U8 => tensor(shape, v.into_iter().map(|x| x as u8).collect::<Vec<_>>())?,
        DType::U16 => tensor(shape, v.into_iter().map(|x| x as u16).collect::<Vec<_>>())?,
        DType::U32 => tensor(shape, v.into_iter().map(|x| x as u32).collect::<Vec<_>>())?,
        DType::U64 => tensor(shape, v.into_iter().map(|x| x as u64).collect::<Vec<_>>())?,
        DType::I4 | DType::U4 | DType::I2 | DType::U2 => Tensor::from_packed(to, shape, v.into_iter()).map_err(err)?,
        d => return Err(kernel_error(format!("cannot cast to {d}"))),
    })
}

/// Identity: passes any value on (tensor, sequence or optional).
fn identity(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| Ok(vec![value_input(ins, 0)?.clone()]))
}

fn dropout(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let mask = Tensor::from_bools(x.shape(), &vec![true; x.len()]).map_err(err)?;
        Ok(vec![x.clone(), mask])
    })
}

fn shape(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (start, end) = (info.attr_int("start", 0), info.node.attr_int("end"));
    kernel(move |ins| {
        let s = input(ins, 0)?.shape();
        let r = s.len() as i64;
        let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
        let (a, b) = (clampi(start), clampi(end.unwrap_or(r)));
        let dims: Vec<i64> = s[a..b.max(a)].iter().map(|&d| d as i64).collect();
        Ok(vec![tensor(&[dims.len()], dims)?])
    })
}

fn size(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| Ok(vec![Tensor::scalar(input(ins, 0)?.len() as i64)]))
}

/// ONNX `Reshape` target shape: 0 copies the input dimension (unless `allowzero`), -1 is inferred.
pub fn reshape_target(from: &[usize], spec: &[i64], allowzero: bool) -> RuntimeResult<Vec<usize>> {
    let n: usize = from.iter().product();
    let mut out = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &d) in spec.iter().enumerate() {
        match d {
            -1 if infer.is_none() => { infer = Some(i); out.push(1) }
            0 if !allowzero => out.push(*from.get(i).ok_or_else(|| kernel_error(format!("shape {spec:?}: dimension {i} copies an input dimension that does not exist")))?),
            d if d >= 0 => out.push(d as usize),
            _ => return Err(kernel_error(format!("invalid target shape {spec:?}"))),
        }
    }
    let known: usize = out.iter().product();
    if let Some(i) = infer {
        if known == 0 || !n.is_multiple_of(known) {
            return Err(kernel_error(format!("cannot reshape {from:?} to {spec:?}")));
        }
        out[i] = n / known;
    } else if known != n {
        return Err(kernel_error(format!("cannot reshape {from:?} ({n} elements) to {spec:?}")));
    }
    Ok(out)
}

fn reshape(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let allowzero = info.attr_int("allowzero", 0) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let spec = ints(input(ins, 1)?, "shape")?;
        Ok(vec![x.reshaped(&reshape_target(x.shape(), &spec, allowzero)?).map_err(err)?])
    })
}

fn flatten(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", 1);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let r = x.rank();
        let k = if a < 0 { (a + r as i64).max(0) as usize } else { (a as usize).min(r) };
        let outer: usize = x.shape()[..k].iter().product();
        Ok(vec![x.reshaped(&[outer, x.len() / outer.max(1)]).map_err(err)?])
    })
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// A tensor of `shape` whose element at index `i` (row-major) is element
/// `offset + sum_d i_d * st[d]` of `x`, for any element type: whole runs are copied when the
/// innermost dimension is contiguous in `x`. The caller keeps every addressed element in
/// bounds.
pub fn strided_copy(x: &Tensor, shape: &[usize], offset: usize, st: &[isize]) -> RuntimeResult<Tensor> {
    let n: usize = shape.iter().product();
    let width = x.dtype().bits() / 8;
    if x.strings().is_some() || !x.dtype().bits().is_multiple_of(8) || width == 0 || n == 0 {
        let index = StridedIndex::new(shape, offset, st);
        return gather_elements(x, shape, index.take(n));
    }
    // Output dimensions in order with size-1 ones dropped and neighbours that step through
    // `x` as one dimension merged.
    let mut dims: Vec<(usize, isize)> = vec![];
    for (&d, &s) in shape.iter().zip(st) {
        if d == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(last) if last.1 == s * d as isize => *last = (last.0 * d, s),
            _ => dims.push((d, s)),
        }
    }
    if dims.is_empty() {
        dims.push((1, 1));
    }
    let mut out = Tensor::zeros(x.dtype(), shape).map_err(|e| kernel_error(e.to_string()))?;
    let (src, dst) = (x.raw_bytes().unwrap(), out.raw_bytes_mut().unwrap());
    match width {
        1 => copy_runs::<u8>(src, dst, &dims, offset),
        2 => copy_runs::<u16>(bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst), &dims, offset),
        4 => copy_runs::<u32>(bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst), &dims, offset),
        8 => copy_runs::<u64>(bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst), &dims, offset),
        _ => {
            let index = StridedIndex::new(shape, offset, st);
            return gather_elements(x, shape, index.take(n));
        }
    }
    Ok(out)
}

/// Fills `dst` run by run along the last of `dims` (size, stride in `src`), the outer
/// dimensions stepped as an odometer from `offset`. When the innermost dimension is strided
/// and the one outside it is contiguous in `src` (a transpose of the last two axes), runs are
/// filled [`TILE`] at a time, so each read of `src` takes neighbouring elements.
fn copy_runs<T: Copy>(src: &[T], dst: &mut [T], dims: &[(usize, isize)], offset: usize) {
    let (inner, ist) = dims[dims.len() - 1];
    let tiled = ist != 1 && dims.len() >= 2 && dims[dims.len() - 2].1 == 1 && dims[dims.len() - 2].0 >= TILE;
    let (outer, step) = if tiled {
        let (rows, _) = dims[dims.len() - 2];
        let mut o = dims[..dims.len() - 2].to_vec();
        o.push((rows.div_ceil(TILE), TILE as isize));
        (o, TILE)
    } else {
        (dims[..dims.len() - 1].to_vec(), 1)
    };
    let rows = if tiled { dims[dims.len() - 2].0 } else { 1 };
    let mut idx = vec![0usize; outer.len()];
    let mut at = offset as isize;
    let mut out = 0;
    while out < dst.len() {
        let block = if tiled { step.min(rows - idx[outer.len() - 1] * TILE) } else { 1 };
        let chunk = &mut dst[out..out + block * inner];
        if ist == 1 {
            chunk.copy_from_slice(&src[at as usize..][..inner]);
        } else {
            for k in 0..inner {
                let from = &src[(at + k as isize * ist) as usize..][..block];
                for (j, &v) in from.iter().enumerate() {
                    chunk[j * inner + k] = v;
                }
            }
        }
        out += block * inner;
        for d in (0..outer.len()).rev() {
            idx[d] += 1;
            at += outer[d].1;
            if idx[d] < outer[d].0 {
                break;
            }
            at -= outer[d].1 * outer[d].0 as isize;
            idx[d] = 0;
        }
    }
}

/// Runs [`copy_runs`] fills together when transposing the last two axes.
const TILE: usize = 16;

/// The flat indices of a strided view, row-major (for element types without a fixed
/// byte width).
struct StridedIndex<'a> {
    shape: &'a [usize],
    st: &'a [isize],
    idx: Vec<usize>,
    cur: isize,
}

impl<'a> StridedIndex<'a> {
    fn new(shape: &'a [usize], offset: usize, st: &'a [isize]) -> Self {
        StridedIndex { shape, st, idx: vec![0; shape.len()], cur: offset as isize }
    }
}

impl Iterator for StridedIndex<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        let here = self.cur as usize;
        for d in (0..self.shape.len()).rev() {
            self.idx[d] += 1;
            self.cur += self.st[d];
            if self.idx[d] < self.shape[d] {
                break;
            }
            self.cur -= self.st[d] * self.shape[d] as isize;
            self.idx[d] = 0;
        }
        Some(here)
    }
}

/// Transposes `x` by `perm`.
pub fn transpose_tensor(x: &Tensor, perm: &[usize]) -> RuntimeResult<Tensor> {
    let s = x.shape();
    let st = strides(s);
    let out_shape: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    let out_st: Vec<isize> = perm.iter().map(|&p| st[p] as isize).collect();
    strided_copy(x, &out_shape, 0, &out_st)
}

fn transpose(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let perm = info.attr_ints("perm");
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let r = x.rank();
        let p: Vec<usize> = match &perm {
            Some(p) => p.iter().map(|&a| axis(a, r)).collect::<RuntimeResult<_>>()?,
            None => (0..r).rev().collect(),
        };
        let mut seen = p.clone();
        seen.sort();
        if seen != (0..r).collect::<Vec<_>>() {
            return Err(kernel_error(format!("perm {p:?} is not a permutation of rank {r}")));
        }
        Ok(vec![transpose_tensor(x, &p)?])
    })
}

fn axes_of(info_axes: &Option<Vec<i64>>, ins: &[Option<&Tensor>], i: usize) -> RuntimeResult<Option<Vec<i64>>> {
    Ok(match opt_input(ins, i) {
        Some(t) => Some(ints(t, "axes")?),
        None => info_axes.clone(),
    })
}

fn squeeze(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let attr = info.attr_ints("axes");
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let r = x.rank();
        let out: Vec<usize> = match axes_of(&attr, ins, 1)? {
            Some(a) => {
                let a: Vec<usize> = a.iter().map(|&v| axis(v, r)).collect::<RuntimeResult<_>>()?;
                for &i in &a {
                    if x.shape()[i] != 1 {
                        return Err(kernel_error(format!("cannot squeeze axis {i} of shape {:?}", x.shape())));
                    }
                }
                x.shape().iter().enumerate().filter(|(i, _)| !a.contains(i)).map(|(_, &d)| d).collect()
            }
            None => x.shape().iter().copied().filter(|&d| d != 1).collect(),
        };
        Ok(vec![x.reshaped(&out).map_err(err)?])
    })
}

fn unsqueeze(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let attr = info.attr_ints("axes");
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let a = axes_of(&attr, ins, 1)?.ok_or_else(|| kernel_error("Unsqueeze needs axes"))?;
        let r = x.rank() + a.len();
        let mut a: Vec<usize> = a.iter().map(|&v| axis(v, r)).collect::<RuntimeResult<_>>()?;
        a.sort();
        let mut out = x.shape().to_vec();
        for i in a {
            out.insert(i, 1);
        }
        Ok(vec![x.reshaped(&out).map_err(err)?])
    })
}

fn concat(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", if info.opset < 4 { 1 } else { i64::MIN });
    if a == i64::MIN {
        return Err(info.error("attribute 'axis' is required"));
    }
    kernel(move |ins| {
        let parts: Vec<&Tensor> = ins.iter().flatten().copied().collect();
        let first = *parts.first().ok_or_else(|| kernel_error("Concat needs inputs"))?;
        Ok(vec![concat_tensors(&parts, axis(a, first.rank())?)?])
    })
}

/// Concatenates tensors of one type and rank along axis `ax`; the other dimensions must agree.
pub(crate) fn concat_tensors(parts: &[&Tensor], ax: usize) -> RuntimeResult<Tensor> {
    let first = *parts.first().ok_or_else(|| kernel_error("nothing to concatenate"))?;
    let r = first.rank();
    let mut out_shape = first.shape().to_vec();
    out_shape[ax] = 0;
    for p in parts {
        if p.rank() != r || p.dtype() != first.dtype() || p.shape().iter().enumerate().any(|(i, &d)| i != ax && d != first.shape()[i]) {
            return Err(kernel_error(format!("cannot concatenate {} {:?} with {} {:?} on axis {ax}", first.dtype(), first.shape(), p.dtype(), p.shape())));
        }
        out_shape[ax] += p.shape()[ax];
    }
    let outer: usize = out_shape[..ax].iter().product();
    if first.strings().is_some() {
        let mut idx = vec![];
        let flat: Vec<Vec<u8>> = parts.iter().flat_map(|p| p.strings().unwrap().to_vec()).collect();
        let mut base = vec![0usize];
        for p in parts {
            base.push(base.last().unwrap() + p.len());
        }
        for o in 0..outer {
            for (k, p) in parts.iter().enumerate() {
                let block = p.len() / outer.max(1);
                idx.extend((0..block).map(|i| base[k] + o * block + i));
            }
        }
        return Tensor::from_strings(&out_shape, idx.into_iter().map(|i| flat[i].clone()).collect()).map_err(err);
    }
    if first.dtype().bits() % 8 != 0 {
        return Err(kernel_error(format!("cannot concatenate {} tensors: their elements are packed below a byte", first.dtype())));
    }
    let width = first.dtype().bits() / 8;
    let mut out = Tensor::zeros(first.dtype(), &out_shape).map_err(err)?;
    let raw = out.raw_bytes_mut().expect("a fresh numeric tensor is not shared");
    let mut at = 0;
    for o in 0..outer {
        for p in parts {
            let block = p.len() / outer.max(1) * width;
            raw[at..at + block].copy_from_slice(&p.raw_bytes().unwrap()[o * block..(o + 1) * block]);
            at += block;
        }
    }
    Ok(out)
}

/// Splits `x` along `ax` into pieces of the given sizes.
pub fn split_tensor(x: &Tensor, ax: usize, sizes: &[usize]) -> RuntimeResult<Vec<Tensor>> {
    let s = x.shape();
    if sizes.iter().sum::<usize>() != s[ax] {
        return Err(kernel_error(format!("split sizes {sizes:?} do not add up to dimension {} of {s:?}", s[ax])));
    }
    let outer: usize = s[..ax].iter().product();
    let inner: usize = s[ax + 1..].iter().product();
    let mut start = 0;
    sizes.iter().map(|&len| {
        let mut shape = s.to_vec();
        shape[ax] = len;
        let piece = strided_copy(x, &[outer, len * inner], start * inner, &[(s[ax] * inner) as isize, 1])?;
        start += len;
        piece.reshaped(&shape).map_err(err)
    }).collect()
}

fn split(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", 0);
    let attr_split = info.attr_ints("split");
    let n_out = info.node.outputs.len();
    let num_outputs = info.node.attr_int("num_outputs");
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let ax = axis(a, x.rank())?;
        let d = x.shape()[ax];
        let sizes: Vec<usize> = match (opt_input(ins, 1), &attr_split) {
            (Some(t), _) => ints(t, "split")?.into_iter().map(|v| v as usize).collect(),
            (None, Some(s)) => s.iter().map(|&v| v as usize).collect(),
            (None, None) => {
                let n = num_outputs.map(|n| n as usize).unwrap_or(n_out).max(1);
                let chunk = d.div_ceil(n);
                (0..n).map(|i| chunk.min(d.saturating_sub(i * chunk))).collect()
            }
        };
        split_tensor(x, ax, &sizes)
    })
}

fn slice_op(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let attrs = (info.opset < 10).then(|| (info.attr_ints("starts"), info.attr_ints("ends"), info.attr_ints("axes")));
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let (starts, ends, axes, steps) = match &attrs {
            Some((s, e, a)) => (s.clone().unwrap_or_default(), e.clone().unwrap_or_default(), a.clone(), None),
            None => (
                ints(input(ins, 1)?, "starts")?,
                ints(input(ins, 2)?, "ends")?,
                opt_input(ins, 3).map(|t| ints(t, "axes")).transpose()?,
                opt_input(ins, 4).map(|t| ints(t, "steps")).transpose()?,
            ),
        };
        let r = x.rank();
        let axes: Vec<usize> = match axes {
            Some(a) => a.iter().map(|&v| axis(v, r)).collect::<RuntimeResult<_>>()?,
            None => (0..starts.len()).collect(),
        };
        if starts.len() != axes.len() || ends.len() != axes.len() {
            return Err(kernel_error("starts, ends and axes must have the same length"));
        }
        let s = x.shape();
        let mut begin: Vec<i64> = vec![0; r];
        let mut step: Vec<i64> = vec![1; r];
        let mut count: Vec<usize> = s.to_vec();
        for (k, &ax) in axes.iter().enumerate() {
            let d = s[ax] as i64;
            let st = steps.as_ref().map(|v| v[k]).unwrap_or(1);
            if st == 0 {
                return Err(kernel_error("slice step cannot be 0"));
            }
            let norm = |v: i64| if v < 0 { v + d } else { v };
            let (b, e) = if st > 0 {
                (norm(starts[k]).clamp(0, d), norm(ends[k]).clamp(0, d))
            } else {
                (norm(starts[k]).clamp(-1, d - 1), norm(ends[k]).clamp(-1, d - 1))
            };
            let n = if st > 0 { (e - b + st - 1).div_euclid(st) } else { (b - e + (-st) - 1).div_euclid(-st) };
            begin[ax] = b;
            step[ax] = st;
            count[ax] = n.max(0) as usize;
        }
        let st = strides(s);
        let offset: i64 = (0..r).map(|i| if count[i] > 0 { begin[i] * st[i] as i64 } else { 0 }).sum();
        let vstrides: Vec<isize> = (0..r).map(|i| (step[i] * st[i] as i64) as isize).collect();
        Ok(vec![strided_copy(x, &count, offset as usize, &vstrides)?])
    })
}

fn gather(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", 0);
    kernel(move |ins| {
        let (x, idx) = (input(ins, 0)?, input(ins, 1)?);
        let ax = axis(a, x.rank())?;
        let s = x.shape();
        let d = s[ax] as i64;
        let indices = ints(idx, "indices")?;
        let mut resolved = Vec::with_capacity(indices.len());
        for &i in &indices {
            let j = if i < 0 { i + d } else { i };
            if j < 0 || j >= d {
                return Err(kernel_error(format!("index {i} is out of range for dimension {ax} of size {d}")));
            }
            resolved.push(j as usize);
        }
        let outer: usize = s[..ax].iter().product();
        let inner: usize = s[ax + 1..].iter().product();
        let mut shape = s[..ax].to_vec();
        shape.extend_from_slice(idx.shape());
        shape.extend_from_slice(&s[ax + 1..]);
        if inner > 1 && x.raw_bytes().is_some() && x.dtype().bits() % 8 == 0 {
            // Whole runs of `inner` elements: one byte copy each.
            let row = inner * x.dtype().bits() / 8;
            let src = x.raw_bytes().unwrap();
            let mut out = Tensor::zeros(x.dtype(), &shape).map_err(err)?;
            let rows = (0..outer).flat_map(|o| resolved.iter().map(move |&j| o * s[ax] + j));
            for (dst, r) in out.raw_bytes_mut().unwrap().chunks_exact_mut(row).zip(rows) {
                dst.copy_from_slice(&src[r * row..(r + 1) * row]);
            }
            return Ok(vec![out]);
        }
        let src = (0..outer).flat_map(|o| resolved.iter().flat_map(move |&j| (0..inner).map(move |i| (o * s[ax] + j) * inner + i)));
        Ok(vec![gather_elements(x, &shape, src)?])
    })
}

/// The flat offsets into a tensor of shape `x` that `GatherElements`/`ScatterElements`
/// address: for each element of an index tensor of shape `idx` (row-major, values
/// `indices`), its own coordinates with the one along `ax` replaced by the index (negative
/// indices count from the end of the axis). Index shapes must have `x`'s rank.
fn element_offsets(x: &[usize], idx: &[usize], ax: usize, indices: &[i64]) -> RuntimeResult<Vec<usize>> {
    if x.is_empty() || idx.len() != x.len() {
        return Err(kernel_error(format!("indices of shape {idx:?} and data of shape {x:?} must have one rank, at least 1")));
    }
    let (xs, is) = (strides(x), strides(idx));
    let d = x[ax] as i64;
    let mut offsets = Vec::with_capacity(indices.len());
    for (flat, &i) in indices.iter().enumerate() {
        let j = if i < 0 { i + d } else { i };
        if j < 0 || j >= d {
            return Err(kernel_error(format!("index {i} is out of range for dimension {ax} of size {d}")));
        }
        let mut off = 0;
        for k in 0..idx.len() {
            let c = (flat / is[k]) % idx[k];
            off += if k == ax { j as usize } else { c } * xs[k];
        }
        offsets.push(off);
    }
    Ok(offsets)
}

fn gather_elements_op(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", 0);
    kernel(move |ins| {
        let (x, idx) = (input(ins, 0)?, input(ins, 1)?);
        let ax = axis(a, x.rank())?;
        let src = element_offsets(x.shape(), idx.shape(), ax, &ints(idx, "indices")?)?;
        Ok(vec![gather_elements(x, idx.shape(), src.into_iter())?])
    })
}

/// `GatherND` (opsets 11-13): with `b = batch_dims` (default 0), the first `b` dimensions of
/// `indices` and `data` match, and each index tuple along the last axis of `indices` (int64,
/// `k` coordinates, negative counts from the end of each axis; out of range is an error)
/// selects the slice `data[batch..., i_1, ..., i_k, ...]` of its batch. The output has shape
/// `indices.shape[..-1] ++ data.shape[b + k..]`, any element type.
fn gather_nd(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let b = usize::try_from(info.attr_int("batch_dims", 0)).map_err(|_| info.error("batch_dims must not be negative"))?;
    kernel(move |ins| {
        let (data, idx) = (input(ins, 0)?, input(ins, 1)?);
        let (ds, is) = (data.shape(), idx.shape());
        let k = is.last().copied().unwrap_or(0);
        if k == 0 || is.len() <= b || ds.len() < b + k || ds[..b] != is[..b] {
            return Err(kernel_error(format!("indices of shape {is:?} do not fit data of shape {ds:?} with batch_dims {b}")));
        }
        let st = strides(ds);
        let slice: usize = ds[b + k..].iter().product();
        let batches: usize = ds[..b].iter().product();
        let batch_stride = if b == 0 { 0 } else { st[b - 1] };
        let indices = ints(idx, "indices")?;
        let per_batch = if batches == 0 { 0 } else { indices.len() / batches };
        let mut src = Vec::with_capacity(indices.len() / k * slice);
        for (n, tuple) in indices.chunks(k).enumerate() {
            let base = if per_batch == 0 { 0 } else { n * k / per_batch * batch_stride };
            let base = base + tuple_offset(tuple, ds, &st, b)?;
            src.extend(base..base + slice);
        }
        let shape: Vec<usize> = is[..is.len() - 1].iter().chain(&ds[b + k..]).copied().collect();
        Ok(vec![gather_elements(data, &shape, src.into_iter())?])
    })
}

/// The flat offset (with strides `st` of shape `ds`) of the index tuple `tuple` addressing
/// dimensions `first..first + tuple.len()`; negative indices count from the end of their axis,
/// and an index out of range is an error (`GatherND`, `ScatterND`).
fn tuple_offset(tuple: &[i64], ds: &[usize], st: &[usize], first: usize) -> RuntimeResult<usize> {
    let mut base = 0;
    for (d, &i) in (first..).zip(tuple) {
        let size = ds[d] as i64;
        let j = if i < 0 { i + size } else { i };
        if j < 0 || j >= size {
            return Err(kernel_error(format!("index {i} is out of range for dimension {d} of size {size}")));
        }
        base += j as usize * st[d];
    }
    Ok(base)
}

/// How `ScatterElements` combines an update with the element it lands on.
#[derive(Clone, Copy, PartialEq)]
enum Reduction {
    None,
    Add,
    Mul,
    Max,
    Min,
}

/// `ScatterElements` (opsets 11-18) and `Scatter` (9-10): a copy of `data` (any type) where
/// each element of `updates` lands at its own coordinates with the one along `axis` (default
/// 0, negative counts from the back) replaced by the matching element of `indices` (int32 or
/// int64, negative counts from the end of the axis; out of range is an error). `indices` and
/// `updates` have one shape, of `data`'s rank and no larger than `data` along the other axes.
/// `reduction` (16+; `max`, `min` 18+) combines each update with the element already there,
/// in row-major order of `updates`, so duplicate indices accumulate (integers wrap); with
/// `none` (default) the last update wins.
fn scatter_elements(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", 0);
    let name = info.attr_str("reduction", "none");
    let reduction = reduction_named(info, &name)?;
    kernel(move |ins| {
        let (data, idx, updates) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        if updates.shape() != idx.shape() {
            return Err(kernel_error(format!("updates of shape {:?} do not match indices of shape {:?}", updates.shape(), idx.shape())));
        }
        let ax = axis(a, data.rank())?;
        if let Some(k) = (0..idx.rank().min(data.rank())).find(|&k| k != ax && idx.shape()[k] > data.shape()[k]) {
            return Err(kernel_error(format!("indices of shape {:?} exceed data of shape {:?} along axis {k}", idx.shape(), data.shape())));
        }
        let targets = element_offsets(data.shape(), idx.shape(), ax, &ints(idx, "indices")?)?;
        scatter(data, &targets, updates, reduction, &name).map(|t| vec![t])
    })
}

/// `ScatterND` (opsets 11-18): a copy of `data` (any type) where each index tuple along the last
/// axis of `indices` (int64, `k` coordinates, negative counts from the end of each axis; out of
/// range is an error) addresses the slice `data[i_1, ..., i_k, ...]` and the matching slice of
/// `updates` (shape `indices.shape[..-1] ++ data.shape[k..]`) lands there. `reduction` (16+;
/// `max`, `min` 18+) combines as in [`scatter_elements`], tuple by tuple in row-major order.
fn scatter_nd(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let name = info.attr_str("reduction", "none");
    let reduction = reduction_named(info, &name)?;
    kernel(move |ins| {
        let (data, idx, updates) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let (ds, is) = (data.shape(), idx.shape());
        let k = is.last().copied().unwrap_or(0);
        if is.is_empty() || k == 0 || k > ds.len() {
            return Err(kernel_error(format!("indices of shape {is:?} must end in a dimension of 1 to {} (data's rank)", ds.len())));
        }
        let want: Vec<usize> = is[..is.len() - 1].iter().chain(&ds[k..]).copied().collect();
        if updates.shape() != want.as_slice() {
            return Err(kernel_error(format!("updates of shape {:?} do not match {want:?} (indices {is:?}, data {ds:?})", updates.shape())));
        }
        let st = strides(ds);
        let slice: usize = ds[k..].iter().product();
        let mut targets = Vec::with_capacity(updates.len());
        for tuple in ints(idx, "indices")?.chunks(k) {
            let base = tuple_offset(tuple, ds, &st, 0)?;
            targets.extend(base..base + slice);
        }
        scatter(data, &targets, updates, reduction, &name).map(|t| vec![t])
    })
}

/// The [`Reduction`] of a `reduction` attribute value, or an error naming the node.
fn reduction_named(info: &NodeInfo, name: &str) -> RuntimeResult<Reduction> {
    Ok(match name {
        "none" => Reduction::None,
        "add" => Reduction::Add,
        "mul" => Reduction::Mul,
        "max" => Reduction::Max,
        "min" => Reduction::Min,
        other => return Err(info.error(format!("reduction '{other}' is not one of none, add, mul, max, min"))),
    })
}

/// A copy of `data` with element `i` of `updates` combined into element `targets[i]`, in order:
/// written over it (`Reduction::None`), or reduced with it (integers wrap).
fn scatter(data: &Tensor, targets: &[usize], updates: &Tensor, reduction: Reduction, name: &str) -> RuntimeResult<Tensor> {
    if updates.dtype() != data.dtype() {
        return Err(kernel_error(format!("updates must have data's type {}, got {}", data.dtype(), updates.dtype())));
    }
    let mut out = data.clone();
    if reduction == Reduction::None {
        scatter_copy(&mut out, targets, updates)?;
        return Ok(out);
    }
    macro_rules! go {
        ($T:ty, $add:expr, $mul:expr) => {
            match reduction {
                Reduction::Add => scatter_reduce::<$T>(&mut out, targets, updates, $add),
                Reduction::Mul => scatter_reduce::<$T>(&mut out, targets, updates, $mul),
                Reduction::Max => scatter_reduce::<$T>(&mut out, targets, updates, |x, y| if y > x { y } else { x }),
                Reduction::Min => scatter_reduce::<$T>(&mut out, targets, updates, |x, y| if y < x { y } else { x }),
                Reduction::None => unreachable!("handled above"),
            }
        };
    }
    match data.dtype() {
        DType::F32 => go!(f32, |x, y| x + y, |x, y| x * y),
        DType::F64 => go!(f64, |x, y| x + y, |x, y| x * y),
        DType::F16 => go!(f16, |x, y| x + y, |x, y| x * y),
        DType::BF16 => go!(bf16, |x, y| x + y, |x, y| x * y),
        DType::I64 => go!(i64, i64::wrapping_add, i64::wrapping_mul),
        DType::I32 => go!(i32, i32::wrapping_add, i32::wrapping_mul),
        DType::I16 => go!(i16, i16::wrapping_add, i16::wrapping_mul),
        DType::I8 => go!(i8, i8::wrapping_add, i8::wrapping_mul),
        DType::U64 => go!(u64, u64::wrapping_add, u64::wrapping_mul),
        DType::U32 => go!(u32, u32::wrapping_add, u32::wrapping_mul),
        DType::U16 => go!(u16, u16::wrapping_add, u16::wrapping_mul),
        DType::U8 => go!(u8, u8::wrapping_add, u8::wrapping_mul),
        d => return Err(kernel_error(format!("reduction '{name}' does not support {d}"))),
    }?;
    Ok(out)
}

/// Writes element `i` of `updates` over element `targets[i]` of `out`, in order.
fn scatter_copy(out: &mut Tensor, targets: &[usize], updates: &Tensor) -> RuntimeResult<()> {
    if let Some(u) = updates.strings() {
        let mut v = out.strings().expect("data and updates have one type").to_vec();
        for (&t, s) in targets.iter().zip(u) {
            v[t] = s.clone();
        }
        *out = Tensor::from_strings(out.shape(), v).map_err(err)?;
        return Ok(());
    }
    let bits = out.dtype().bits();
    if bits == 0 || !bits.is_multiple_of(8) {
        return Err(kernel_error(format!("{} tensors are not supported here", out.dtype())));
    }
    let w = bits / 8;
    let src = updates.raw_bytes().expect("non-string tensors have bytes");
    let dst = out.raw_bytes_mut().expect("non-string tensors have bytes");
    for (i, &t) in targets.iter().enumerate() {
        dst[t * w..(t + 1) * w].copy_from_slice(&src[i * w..(i + 1) * w]);
    }
    Ok(())
}

/// `out[targets[i]] = f(out[targets[i]], updates[i])`, in order.
fn scatter_reduce<T: qforge_ir::Elem>(out: &mut Tensor, targets: &[usize], updates: &Tensor, f: impl Fn(T, T) -> T) -> RuntimeResult<()> {
    let u = updates.as_slice::<T>().map_err(err)?;
    let o = out.as_slice_mut::<T>().map_err(err)?;
    for (&t, &v) in targets.iter().zip(u) {
        o[t] = f(o[t], v);
    }
    Ok(())
}

/// `OneHot` (opsets 9-28): `indices` (any numeric type; floats truncated toward zero, as ONNX
/// Runtime reads them) with a dimension of `depth` inserted at `axis` (default -1, in
/// `[-r-1, r]` for indices of rank r), `values[1]` where the coordinate along it equals the
/// index and `values[0]` elsewhere; the output has `values`' type (any, strings included).
/// From opset 11 an index in `[-depth, 0)` counts from the end; any other index outside
/// `[0, depth)` gives a row of `values[0]` alone. `depth` is a one-element tensor of any
/// numeric type (truncated, not negative), `values` a two-element tensor `[off, on]`.
fn one_hot(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", -1);
    let wrap = info.opset >= 11;
    kernel(move |ins| {
        let (idx, depth, values) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let ax = axis(a, idx.rank() + 1)?;
        let depth = match cast_tensor(depth, DType::I64)?.as_slice::<i64>().map_err(err)? {
            &[d] => usize::try_from(d).map_err(|_| kernel_error(format!("depth {d} is negative")))?,
            d => return Err(kernel_error(format!("depth must have one element, got {}", d.len()))),
        };
        if values.len() != 2 {
            return Err(kernel_error(format!("values must have two elements [off, on], got {}", values.len())));
        }
        let mut shape = idx.shape().to_vec();
        shape.insert(ax, depth);
        check_output_size("OneHot output", values.dtype(), &shape)?;
        let d = depth as i64;
        let hot: Vec<Option<usize>> = cast_tensor(idx, DType::I64)?.as_slice::<i64>().map_err(err)?.iter()
            .map(|&i| if wrap && i < 0 { i + d } else { i })
            .map(|j| (0..d).contains(&j).then_some(j as usize))
            .collect();
        let hot = &hot;
        let inner: usize = idx.shape()[ax..].iter().product();
        let outer: usize = idx.shape()[..ax].iter().product();
        let src = (0..outer).flat_map(move |o| (0..depth).flat_map(move |k| (0..inner).map(move |i| usize::from(hot[o * inner + i] == Some(k)))));
        Ok(vec![gather_elements(values, &shape, src)?])
    })
}

fn expand(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let target: Vec<usize> = ints(input(ins, 1)?, "shape")?.into_iter().map(|v| v.max(0) as usize).collect();
        let out = broadcast_shape(x.shape(), &target)?;
        if x.dtype() == DType::F32 {
            return Ok(vec![tensor(&out, broadcast_to(x.as_slice::<f32>().unwrap(), x.shape(), &out))?]);
        }
        let idx: Vec<usize> = (0..x.len()).collect();
        Ok(vec![gather_elements(x, &out, broadcast_to(&idx, x.shape(), &out).into_iter())?])
    })
}

fn tile(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let reps = ints(input(ins, 1)?, "repeats")?;
        if reps.len() != x.rank() || reps.iter().any(|&r| r < 0) {
            return Err(kernel_error(format!("repeats {reps:?} do not fit rank {}", x.rank())));
        }
        let s = x.shape();
        let out: Vec<usize> = s.iter().zip(&reps).map(|(&d, &r)| d * r as usize).collect();
        let (xs, os) = (strides(s), strides(&out));
        let n: usize = out.iter().product();
        let src = (0..n).map(|flat| (0..s.len()).map(|k| ((flat / os[k]) % out[k] % s[k]) * xs[k]).sum());
        Ok(vec![gather_elements(x, &out, src)?])
    })
}

fn pad(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let mode = info.attr_str("mode", "constant");
    let attrs = (info.opset < 11).then(|| (info.attr_ints("pads").or_else(|| info.attr_ints("paddings")), info.attr_float("value", 0.0)));
    if !["constant", "reflect", "edge", "wrap"].contains(&mode.as_str()) {
        return Err(info.error(format!("unknown pad mode '{mode}'")));
    }
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let r = x.rank();
        let (pads, value) = match &attrs {
            Some((p, v)) => (p.clone().ok_or_else(|| kernel_error("pads are required"))?, Tensor::scalar(*v)),
            None => (
                ints(input(ins, 1)?, "pads")?,
                match opt_input(ins, 2) { Some(v) => v.clone(), None => cast_tensor(&Tensor::scalar(0f32), x.dtype())? },
            ),
        };
        let axes: Vec<usize> = match opt_input(ins, 3) {
            Some(t) => ints(t, "axes")?.iter().map(|&a| axis(a, r)).collect::<RuntimeResult<_>>()?,
            None => (0..r).collect(),
        };
        if pads.len() != 2 * axes.len() {
            return Err(kernel_error(format!("{} pads do not fit {} axes", pads.len(), axes.len())));
        }
        let mut before = vec![0i64; r];
        let mut after = vec![0i64; r];
        for (k, &a) in axes.iter().enumerate() {
            before[a] = pads[k];
            after[a] = pads[k + axes.len()];
        }
        let s = x.shape();
        let out: Vec<usize> = (0..r).map(|i| (s[i] as i64 + before[i] + after[i]).max(0) as usize).collect();
        // Source index for every output element, or None for the constant value, built axis
        // by axis (outermost first) from each axis' map of output to input coordinates.
        let xs = strides(s);
        let mut src: Vec<Option<usize>> = vec![Some(0)];
        for k in 0..r {
            let (map, stride) = (pad_axis_map(&mode, s[k], before[k], out[k]), xs[k]);
            src = src.iter().flat_map(|&p| map.iter().map(move |&c| Some(p? + c? * stride))).collect();
        }
        let value = cast_tensor(&value, x.dtype())?;
        let joined = concat_with_value(x, &value)?;
        let fill = x.len();
        Ok(vec![gather_elements(&joined, &out, src.into_iter().map(|s| s.unwrap_or(fill)))?])
    })
}

/// Plans a CenterCropPad node (opset 18): input `x` and int64 `shape` with one target size
/// per axis of the `axes` attribute (default: all axes; negative axes count from the end,
/// no axis twice). Along each such axis a larger input is cropped to the target around its
/// center (the extra element of an odd difference comes off the end) and a smaller one is
/// zero-padded around it (the extra element of an odd difference goes at the end); other
/// axes are kept.
fn center_crop_pad(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let axes_attr = info.attr_ints("axes");
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let r = x.rank();
        let target = ints(input(ins, 1)?, "CenterCropPad shape")?;
        let axes: Vec<usize> = match &axes_attr {
            Some(a) => a.iter().map(|&a| axis(a, r)).collect::<RuntimeResult<_>>()?,
            None => (0..r).collect(),
        };
        if target.len() != axes.len() {
            return Err(kernel_error(format!("CenterCropPad: shape has {} values {target:?}; {} axes {axes:?} need one each", target.len(), axes.len())));
        }
        let s = x.shape();
        let mut out = s.to_vec();
        let mut before = vec![0i64; r];
        let mut seen = vec![false; r];
        for (&a, &size) in axes.iter().zip(&target) {
            if std::mem::replace(&mut seen[a], true) {
                return Err(kernel_error(format!("CenterCropPad: axis {a} appears more than once in axes {axes:?}")));
            }
            let size = usize::try_from(size).map_err(|_| kernel_error(format!("CenterCropPad: target size {size} for axis {a} is negative")))?;
            before[a] = if size >= s[a] { ((size - s[a]) / 2) as i64 } else { -(((s[a] - size) / 2) as i64) };
            out[a] = size;
        }
        check_output_size("CenterCropPad output", x.dtype(), &out)?;
        let xs = strides(s);
        let mut src: Vec<Option<usize>> = vec![Some(0)];
        for k in 0..r {
            let (map, stride) = (pad_axis_map("constant", s[k], before[k], out[k]), xs[k]);
            src = src.iter().flat_map(|&p| map.iter().map(move |&c| Some(p? + c? * stride))).collect();
        }
        let zero = cast_tensor(&Tensor::scalar(0f32), x.dtype())?;
        let joined = concat_with_value(x, &zero)?;
        let fill = x.len();
        Ok(vec![gather_elements(&joined, &out, src.into_iter().map(|s| s.unwrap_or(fill)))?])
    })
}

/// For each of the `len` output coordinates along an axis of input length `d` padded by
/// `before` in front, the input coordinate Pad `mode` reads, or `None` where the constant
/// value goes (constant mode outside the input, or an empty input axis).
fn pad_axis_map(mode: &str, d: usize, before: i64, len: usize) -> Vec<Option<usize>> {
    let d = d as i64;
    (0..len as i64).map(|o| {
        let c = o - before;
        if (0..d).contains(&c) {
            return Some(c as usize);
        }
        let c = match mode {
            _ if d == 0 => return None,
            "edge" => c.clamp(0, d - 1),
            "wrap" => c.rem_euclid(d),
            "reflect" if d > 1 => {
                let p = 2 * (d - 1);
                let m = c.rem_euclid(p);
                if m >= d { p - m } else { m }
            }
            "reflect" => 0,
            _ => return None,
        };
        Some(c as usize)
    }).collect()
}

/// `x` flattened with one extra element (the pad value) appended.
pub(crate) fn concat_with_value(x: &Tensor, value: &Tensor) -> RuntimeResult<Tensor> {
    let mut raw = x.raw_bytes().ok_or_else(|| kernel_error("padding tensors of strings is not supported"))?.to_vec();
    let v = value.raw_bytes().unwrap();
    raw.extend_from_slice(&v[..x.dtype().bits() / 8]);
    Tensor::from_raw(x.dtype(), &[x.len() + 1], &raw).map_err(err)
}

fn constant(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let t = info.node.constant_tensor().ok_or_else(|| info.error("Constant needs exactly one dense value attribute"))?;
    kernel(move |_| Ok(vec![t.clone()]))
}

fn constant_of_shape(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let value = match info.node.attr("value") {
        Some(qforge_ir::Attr::Tensor(t)) if t.len() == 1 => t.clone(),
        Some(_) => return Err(info.error("'value' must be a one-element tensor")),
        None => Tensor::scalar(0f32),
    };
    kernel(move |ins| {
        let shape: Vec<usize> = ints(input(ins, 0)?, "shape")?.iter().map(|&d| usize::try_from(d).map_err(|_| kernel_error(format!("negative dimension {d}")))).collect::<RuntimeResult<_>>()?;
        check_output_size("ConstantOfShape output", value.dtype(), &shape)?;
        let n: usize = shape.iter().product();
        Ok(vec![gather_elements(&value.reshaped(&[1]).map_err(err)?, &shape, std::iter::repeat_n(0, n))?])
    })
}

fn range(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let (s, l, d) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let f = |t: &Tensor| t.to_f64_vec().map_err(err).and_then(|v| v.first().copied().ok_or_else(|| kernel_error("Range bounds must be scalars")));
        let (start, limit, delta) = (f(s)?, f(l)?, f(d)?);
        if delta == 0.0 {
            return Err(kernel_error("Range delta cannot be 0"));
        }
        let n = ((limit - start) / delta).ceil().max(0.0) as usize;
        if s.dtype().is_float() {
            let v: Vec<f64> = (0..n).map(|i| start + i as f64 * delta).collect();
            return Ok(vec![cast_tensor(&tensor(&[n], v)?, s.dtype())?]);
        }
        let (a, b) = (start as i64, delta as i64);
        let v: Vec<i64> = (0..n as i64).map(|i| a + i * b).collect();
        Ok(vec![cast_tensor(&tensor(&[n], v)?, s.dtype())?])
    })
}

/// Whether a DepthToSpace/SpaceToDepth node orders the moved channels column-row-depth
/// (`mode = "CRD"`) rather than depth-column-row (`"DCR"`, the default).
fn crd_mode(info: &NodeInfo) -> RuntimeResult<bool> {
    match info.attr_str("mode", "DCR").as_str() {
        "DCR" => Ok(false),
        "CRD" => Ok(true),
        other => Err(info.error(format!("mode must be DCR or CRD, got {other:?}"))),
    }
}

fn depth_to_space(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let b = info.attr_int("blocksize", 0).max(1) as usize;
    let crd = crd_mode(info)?;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let [n, c, h, w] = *x.shape() else { return Err(kernel_error("DepthToSpace needs a 4-D input")) };
        let c2 = c / (b * b);
        let (shape6, perm) = if crd { ([n, c2, b, b, h, w], [0, 1, 4, 2, 5, 3]) } else { ([n, b, b, c2, h, w], [0, 3, 4, 1, 5, 2]) };
        let t = transpose_tensor(&x.reshaped(&shape6).map_err(err)?, &perm)?;
        Ok(vec![t.reshaped(&[n, c2, h * b, w * b]).map_err(err)?])
    })
}

/// SpaceToDepth: blocks of `blocksize x blocksize` pixels become channels, ordered
/// `(row, column, channel)` in DCR mode and `(channel, row, column)` in CRD mode (opset 28).
fn space_to_depth(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let b = info.attr_int("blocksize", 0).max(1) as usize;
    let perm = if crd_mode(info)? { [0, 1, 3, 5, 2, 4] } else { [0, 3, 5, 1, 2, 4] };
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let [n, c, h, w] = *x.shape() else { return Err(kernel_error("SpaceToDepth needs a 4-D input")) };
        if h % b != 0 || w % b != 0 {
            return Err(kernel_error(format!("SpaceToDepth input {:?} is not divisible into {b}x{b} blocks", x.shape())));
        }
        let t = transpose_tensor(&x.reshaped(&[n, c, h / b, b, w / b, b]).map_err(err)?, &perm)?;
        Ok(vec![t.reshaped(&[n, c * b * b, h / b, w / b]).map_err(err)?])
    })
}

/// Bytes per element of `t`, for element types of whole bytes (not strings or packed types).
fn element_bytes(t: &Tensor, op: &str) -> RuntimeResult<usize> {
    let bits = t.dtype().bits();
    if t.strings().is_some() || bits == 0 || !bits.is_multiple_of(8) {
        return Err(kernel_error(format!("{op} does not support {}", t.dtype())));
    }
    Ok(bits / 8)
}

/// The columns `[start, end)` of row `row` of a `cols`-wide matrix that `Trilu` zeroes: left
/// of diagonal `k` (`j - row < k`) for the upper triangle, right of it (`j - row > k`) for the
/// lower.
fn trilu_zeroed_columns(row: usize, cols: usize, k: i64, upper: bool) -> (usize, usize) {
    let clamp = |c: i128| c.clamp(0, cols as i128) as usize;
    let diagonal = row as i128 + k as i128;
    if upper { (0, clamp(diagonal)) } else { (clamp(diagonal + 1), cols) }
}

/// `Trilu` (opset 14): the upper (`upper = 1`, default) or lower triangle of each matrix in
/// the last two axes of `input`, from diagonal `k` (optional int64 scalar input, default 0;
/// positive above the main diagonal) on, with the other elements zero. Any element type of
/// whole bytes.
fn trilu(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let upper = info.attr_int("upper", 1) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let &[.., rows, cols] = x.shape() else {
            return Err(kernel_error(format!("Trilu needs an input of rank 2 or more, got shape {:?}", x.shape())));
        };
        let k = opt_input(ins, 1).map(|t| single_int(t, "k")).transpose()?.unwrap_or(0);
        let width = element_bytes(x, "Trilu")?;
        let mut out = x.clone();
        if out.is_empty() {
            return Ok(vec![out]);
        }
        let bytes = out.raw_bytes_mut().ok_or_else(|| kernel_error(format!("Trilu does not support {}", x.dtype())))?;
        for matrix in bytes.chunks_exact_mut(rows * cols * width) {
            for (r, row) in matrix.chunks_exact_mut(cols * width).enumerate() {
                let (start, end) = trilu_zeroed_columns(r, cols, k, upper);
                row[start * width..end * width].fill(0);
            }
        }
        Ok(vec![out])
    })
}

/// `EyeLike` (opsets 9 and 22): a 2-D tensor of the shape of `input` with ones on diagonal
/// `k` (attribute, default 0; positive above the main diagonal) and zeros elsewhere, of
/// element type `dtype` (attribute) or else that of `input`. Numeric and bool types.
fn eye_like(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let dtype = match info.node.attr_int("dtype") {
        Some(code) => Some(i32::try_from(code).ok().and_then(DType::from_onnx).ok_or_else(|| info.error(format!("dtype {code} is not an element type")))?),
        None => None,
    };
    let k = info.attr_int("k", 0);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let &[rows, cols] = x.shape() else {
            return Err(kernel_error(format!("EyeLike needs a 2-D input, got shape {:?}", x.shape())));
        };
        let dtype = dtype.unwrap_or(x.dtype());
        let one = cast_tensor(&Tensor::scalar(1i64), dtype).map_err(|_| kernel_error(format!("EyeLike does not support {dtype}")))?;
        let width = element_bytes(&one, "EyeLike")?;
        let one = one.raw_bytes().ok_or_else(|| kernel_error(format!("EyeLike does not support {dtype}")))?;
        let mut out = Tensor::zeros(dtype, &[rows, cols]).map_err(err)?;
        let bytes = out.raw_bytes_mut().ok_or_else(|| kernel_error(format!("EyeLike does not support {dtype}")))?;
        for r in 0..rows {
            let c = r as i128 + k as i128;
            if (0..cols as i128).contains(&c) {
                let at = (r * cols + c as usize) * width;
                bytes[at..at + width].copy_from_slice(one);
            }
        }
        Ok(vec![out])
    })
}

/// `ReverseSequence` (opsets 10 and 28): for each batch entry `b` (along `batch_axis`,
/// default 1), the first `sequence_lens[b]` steps along `time_axis` (default 0) reversed and
/// the rest copied. The two axes are 0 and 1 in either order; `sequence_lens` is int64
/// `[batch]`, each in `[0, time]`. Any element type.
fn reverse_sequence(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (batch_axis, time_axis) = (info.attr_int("batch_axis", 1), info.attr_int("time_axis", 0));
    if !matches!((batch_axis, time_axis), (0, 1) | (1, 0)) {
        return Err(info.error(format!("batch_axis {batch_axis} and time_axis {time_axis} must be 0 and 1 in either order")));
    }
    let batch_first = batch_axis == 0;
    kernel(move |ins| {
        let (x, lens) = (input(ins, 0)?, input(ins, 1)?);
        let s = x.shape();
        if s.len() < 2 {
            return Err(kernel_error(format!("ReverseSequence needs an input of rank 2 or more, got shape {s:?}")));
        }
        let (batch, time) = if batch_first { (s[0], s[1]) } else { (s[1], s[0]) };
        let lens = ints(lens, "sequence_lens")?;
        if lens.len() != batch {
            return Err(kernel_error(format!("sequence_lens has {} entries for a batch of {batch} (input shape {s:?})", lens.len())));
        }
        let lens: Vec<usize> = lens.iter().enumerate().map(|(b, &l)| {
            usize::try_from(l).ok().filter(|&l| l <= time)
                .ok_or_else(|| kernel_error(format!("sequence_lens[{b}] = {l} is outside [0, {time}]")))
        }).collect::<RuntimeResult<_>>()?;
        let inner: usize = s[2..].iter().product();
        let lens = &lens;
        let sources = (0..s[0]).flat_map(|i| (0..s[1]).map(move |j| {
            let (b, t) = if batch_first { (i, j) } else { (j, i) };
            let from = if t < lens[b] { lens[b] - 1 - t } else { t };
            if batch_first { b * time + from } else { from * batch + b }
        }));
        Ok(vec![gather_blocks(x, s, inner, sources)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element `i` (row-major over `shape`) of a strided view, computed one index at a time.
    fn naive(x: &[f32], shape: &[usize], offset: usize, st: &[isize]) -> Vec<f32> {
        let n: usize = shape.iter().product();
        (0..n).map(|mut i| {
            let mut at = offset as isize;
            for (&d, &s) in shape.iter().zip(st).rev() {
                at += (i % d) as isize * s;
                i /= d;
            }
            x[at as usize]
        }).collect()
    }

    #[test]
    fn trilu_zeroes_the_columns_past_the_diagonal() {
        assert_eq!(trilu_zeroed_columns(0, 5, 0, true), (0, 0));
        assert_eq!(trilu_zeroed_columns(2, 5, 1, true), (0, 3));
        assert_eq!(trilu_zeroed_columns(2, 5, -4, true), (0, 0));
        assert_eq!(trilu_zeroed_columns(2, 5, 0, false), (3, 5));
        assert_eq!(trilu_zeroed_columns(2, 5, -3, false), (0, 5));
        assert_eq!(trilu_zeroed_columns(1, 5, i64::MAX, true), (0, 5));
        assert_eq!(trilu_zeroed_columns(1, 5, i64::MAX, false), (5, 5));
        assert_eq!(trilu_zeroed_columns(1, 5, i64::MIN, false), (0, 5));
    }

    #[test]
    fn strided_copies_equal_element_by_element_indexing() {
        let x: Vec<f32> = (0..3 * 37 * 21).map(|i| i as f32).collect();
        let t = Tensor::from_vec(&[3, 37, 21], x.clone()).unwrap();
        // Transposes of the last two axes (tiled, with a partial last tile), of all axes, a
        // reversed slice (negative stride), and a contiguous copy.
        let cases: [(&[usize], usize, &[isize]); 5] = [
            (&[3, 21, 37], 0, &[777, 1, 21]),
            (&[21, 37, 3], 0, &[1, 21, 777]),
            (&[37, 3, 21], 0, &[21, 777, 1]),
            (&[3, 37, 21], 20, &[777, 21, -1]),
            (&[2, 17, 21], 777, &[777, 21, 1]),
        ];
        for (shape, offset, st) in cases {
            let got = strided_copy(&t, shape, offset, st).unwrap();
            assert_eq!(got.as_slice::<f32>().unwrap(), naive(&x, shape, offset, st), "{shape:?} {st:?}");
        }
    }
}
