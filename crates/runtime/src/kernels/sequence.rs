//! Sequences and optionals: the ops that build, read and take apart `seq(tensor)` values
//! ([`Sequence`]) and optionals ([`Value::Optional`]).

use qforge_ir::{Attr, DType, NodeId, Tensor, ValueType};

use super::control::run_subgraph;
use super::shape::{concat_tensors, split_tensor};
use super::util::{axis, ints, opt_tensor_input, single_int, tensor_input, value_input, values_fn};
use crate::plan::Plan;
use crate::{kernel_error, value_kernel, Kernel, KernelBuilder, NodeInfo, Registry, RunCtx, RuntimeResult, Sequence, Value, ValueKernel, LATEST};

/// The sequence and optional ops of the default domain, with the opset each starts at: the
/// ops that read or produce a sequence or an optional by definition.
pub const OPS: [(&str, i64, KernelBuilder); 12] = [
    ("SequenceEmpty", 11, sequence_empty),
    ("SequenceConstruct", 11, sequence_construct),
    ("SequenceInsert", 11, sequence_insert),
    ("SequenceErase", 11, sequence_erase),
    ("SequenceAt", 11, sequence_at),
    ("SequenceLength", 11, sequence_length),
    ("ConcatFromSequence", 11, concat_from_sequence),
    ("SplitToSequence", 11, split_to_sequence),
    ("SequenceMap", 17, sequence_map),
    ("Optional", 15, optional),
    ("OptionalHasElement", 15, optional_has_element),
    ("OptionalGetElement", 15, optional_get_element),
];

/// Registers the sequence and optional ops ([`OPS`]).
pub fn register(r: &mut Registry) {
    for (op, since, build) in OPS {
        r.add("", op, since, LATEST, build);
    }
}

/// Input `i` as a sequence.
fn sequence_input<'a>(ins: &[Option<&'a Value>], i: usize) -> RuntimeResult<&'a Sequence> {
    match value_input(ins, i)? {
        Value::Sequence(s) => Ok(s),
        v => Err(kernel_error(format!("input {i} must be a sequence, got {v}"))),
    }
}

/// Optional input `i` as one integer (a position), when given.
fn position_input(ins: &[Option<&Value>], i: usize) -> RuntimeResult<Option<i64>> {
    opt_tensor_input(ins, i, "position")?.map(|t| single_int(t, "position")).transpose()
}

/// `position` in `[-len, len - 1]` (or `[-len, len]` when `end_ok`, for inserting) as an index.
fn sequence_index(position: i64, len: usize, end_ok: bool) -> RuntimeResult<usize> {
    let n = len as i64;
    let hi = if end_ok { n } else { n - 1 };
    if position < -n || position > hi {
        return Err(kernel_error(format!("position {position} is out of range for a sequence of {len} tensors (allowed: {} to {hi})", -n)));
    }
    Ok(if position < 0 { (position + n) as usize } else { position as usize })
}

fn check_element(s: &Sequence, t: &Tensor) -> RuntimeResult<()> {
    if t.dtype() != s.dtype {
        return Err(kernel_error(format!("cannot put a {} tensor into a sequence of {} tensors", t.dtype(), s.dtype)));
    }
    Ok(())
}

/// The element type of a sequence type, when declared.
fn sequence_elem(ty: Option<&ValueType>) -> Option<DType> {
    match ty? {
        ValueType::Sequence(Some(t)) => t.elem(),
        _ => None,
    }
}

/// SequenceEmpty: an empty sequence of element type `dtype` (default float).
fn sequence_empty(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let code = info.attr_int("dtype", 1);
    let dtype = i32::try_from(code).ok().and_then(DType::from_onnx).ok_or_else(|| info.error(format!("'dtype' {code} is not a tensor element type")))?;
    values_fn(move |_| Ok(vec![Value::Sequence(Sequence { dtype, items: vec![] })]))
}

/// SequenceConstruct: the sequence of its inputs, tensors of one element type.
fn sequence_construct(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| {
        let items = (0..ins.len()).map(|i| tensor_input(ins, i, "element").cloned()).collect::<RuntimeResult<Vec<Tensor>>>()?;
        let dtype = items.first().ok_or_else(|| kernel_error("SequenceConstruct needs at least one tensor"))?.dtype();
        if let Some(t) = items.iter().find(|t| t.dtype() != dtype) {
            return Err(kernel_error(format!("the elements must share one type: {dtype} and {}", t.dtype())));
        }
        Ok(vec![Value::Sequence(Sequence { dtype, items })])
    })
}

/// SequenceInsert(sequence, tensor, position?): the sequence with the tensor inserted before
/// `position` (in `[-n, n]`; default: at the end).
fn sequence_insert(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| {
        let s = sequence_input(ins, 0)?;
        let t = tensor_input(ins, 1, "tensor")?;
        check_element(s, t)?;
        let at = match position_input(ins, 2)? {
            Some(p) => sequence_index(p, s.items.len(), true)?,
            None => s.items.len(),
        };
        let mut out = s.clone();
        out.items.insert(at, t.clone());
        Ok(vec![Value::Sequence(out)])
    })
}

/// SequenceErase(sequence, position?): the sequence without the tensor at `position` (in
/// `[-n, n - 1]`; default: the last).
fn sequence_erase(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| {
        let s = sequence_input(ins, 0)?;
        let at = sequence_index(position_input(ins, 1)?.unwrap_or(-1), s.items.len(), false)?;
        let mut out = s.clone();
        out.items.remove(at);
        Ok(vec![Value::Sequence(out)])
    })
}

/// SequenceAt(sequence, position): the tensor at `position`, in `[-n, n - 1]`.
fn sequence_at(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| {
        let s = sequence_input(ins, 0)?;
        let p = position_input(ins, 1)?.ok_or_else(|| kernel_error("position (input 1) is required"))?;
        Ok(vec![Value::Tensor(s.items[sequence_index(p, s.items.len(), false)?].clone())])
    })
}

/// SequenceLength: the number of tensors, as an int64 scalar.
fn sequence_length(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| Ok(vec![Value::Tensor(Tensor::scalar(sequence_input(ins, 0)?.items.len() as i64))]))
}

/// ConcatFromSequence(sequence; `axis`, `new_axis`): the tensors concatenated along `axis`
/// (in `[-r, r - 1]`), or with `new_axis = 1` stacked along a new axis `axis` (in
/// `[-r - 1, r]`). The sequence must not be empty, and its tensors must agree in type and in
/// every dimension but `axis`.
fn concat_from_sequence(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.node.attr_int("axis").ok_or_else(|| info.error("attribute 'axis' is required"))?;
    let new_axis = match info.attr_int("new_axis", 0) {
        0 => false,
        1 => true,
        v => return Err(info.error(format!("'new_axis' must be 0 or 1, got {v}"))),
    };
    values_fn(move |ins| {
        let s = sequence_input(ins, 0)?;
        let first = s.items.first().ok_or_else(|| kernel_error("cannot concatenate an empty sequence"))?;
        if let Some((i, t)) = s.items.iter().enumerate().find(|(_, t)| t.rank() != first.rank() || t.dtype() != first.dtype()) {
            return Err(kernel_error(format!("tensor {i} of the sequence ({} {:?}) does not match tensor 0 ({} {:?})", t.dtype(), t.shape(), first.dtype(), first.shape())));
        }
        let out = if new_axis {
            let ax = axis(a, first.rank() + 1)?;
            let lifted = s.items.iter().map(|t| {
                let mut shape = t.shape().to_vec();
                shape.insert(ax, 1);
                t.reshaped(&shape).map_err(|e| kernel_error(e.to_string()))
            }).collect::<RuntimeResult<Vec<Tensor>>>()?;
            concat_tensors(&lifted.iter().collect::<Vec<_>>(), ax)?
        } else {
            concat_tensors(&s.items.iter().collect::<Vec<_>>(), axis(a, first.rank())?)?
        };
        Ok(vec![Value::Tensor(out)])
    })
}

/// SplitToSequence(input, split?; `axis`, `keepdims`): the pieces of `input` along `axis`, as a
/// sequence. `split` is a scalar (pieces of that length, the last one shorter when it does not
/// divide the dimension) or a 1-D list of lengths adding up to the dimension; without it the
/// pieces have length 1 and lose the axis unless `keepdims` is 1.
fn split_to_sequence(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", 0);
    let keepdims = info.attr_int("keepdims", 1) != 0;
    values_fn(move |ins| {
        let x = tensor_input(ins, 0, "input")?;
        let ax = axis(a, x.rank())?;
        let d = x.shape()[ax];
        let split = opt_tensor_input(ins, 1, "split")?;
        let sizes: Vec<usize> = match split {
            Some(t) if t.rank() == 0 => {
                let n = single_int(t, "split")?;
                let n = usize::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| kernel_error(format!("split must be positive, got {n}")))?;
                (0..d.div_ceil(n)).map(|i| n.min(d - i * n)).collect()
            }
            Some(t) => ints(t, "split")?.into_iter()
                .map(|v| usize::try_from(v).map_err(|_| kernel_error(format!("split lengths must not be negative, got {v}"))))
                .collect::<RuntimeResult<_>>()?,
            None => vec![1; d],
        };
        let mut items = split_tensor(x, ax, &sizes)?;
        if split.is_none() && !keepdims {
            let mut shape = x.shape().to_vec();
            shape.remove(ax);
            items = items.iter().map(|t| t.reshaped(&shape).map_err(|e| kernel_error(e.to_string()))).collect::<RuntimeResult<_>>()?;
        }
        Ok(vec![Value::Sequence(Sequence { dtype: x.dtype(), items })])
    })
}

struct SequenceMap {
    id: NodeId,
    body: Plan,
    /// The element type of each output sequence, for outputs of an empty map.
    elems: Vec<DType>,
}

/// SequenceMap(sequence, more inputs...; `body`): runs the body once per position of the
/// sequences among the inputs (which must have one length), feeding each sequence's tensor at
/// that position and every tensor input whole; output `k` is the sequence of the body's output
/// `k` over the positions.
impl ValueKernel for SequenceMap {
    fn run_values(&self, ins: &[Option<&Value>], ctx: &RunCtx) -> RuntimeResult<Vec<Value>> {
        let len = sequence_input(ins, 0)?.items.len();
        for i in 0..ins.len() {
            match value_input(ins, i)? {
                Value::Sequence(s) if s.items.len() != len => {
                    return Err(kernel_error(format!("input {i} is a sequence of {} tensors, input 0 of {len}", s.items.len())));
                }
                Value::Sequence(_) | Value::Tensor(_) => {}
                v => return Err(kernel_error(format!("input {i} must be a sequence or a tensor, got {v}"))),
            }
        }
        let mut outs: Vec<Sequence> = self.elems.iter().map(|&dtype| Sequence { dtype, items: Vec::with_capacity(len) }).collect();
        for pos in 0..len {
            let feeds = ins.iter().map(|v| match v {
                Some(Value::Sequence(s)) => Some(Value::Tensor(s.items[pos].clone())),
                v => v.cloned(),
            }).collect();
            let results = run_subgraph(&self.body, feeds, ctx, self.id, "body")?;
            if results.len() != outs.len() {
                return Err(kernel_error(format!("the body returned {} outputs, the node declares {}", results.len(), outs.len())));
            }
            for (k, (out, v)) in outs.iter_mut().zip(results).enumerate() {
                let t = v.into_tensor().map_err(|v| kernel_error(format!("body output {k} is {v}; it must be a tensor")))?;
                if pos == 0 {
                    out.dtype = t.dtype();
                }
                check_element(out, &t)?;
                out.items.push(t);
            }
        }
        Ok(outs.into_iter().map(Value::Sequence).collect())
    }
}

fn sequence_map(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let Some(Attr::Graph(g)) = info.node.attr("body") else { return Err(info.error("attribute 'body' must be a graph")) };
    let body = Plan::build(g, info.opsets, Registry::builtin(), info.scope_consts).map_err(|e| info.error(format!("subgraph 'body': {e}")))?;
    if g.inputs().len() != info.node.inputs.len() || g.outputs().len() != info.node.outputs.len() {
        return Err(info.error(format!("the body takes {} inputs and gives {} outputs; the node has {} and {}", g.inputs().len(), g.outputs().len(), info.node.inputs.len(), info.node.outputs.len())));
    }
    let elems = info.node.outputs.iter().zip(g.outputs()).map(|(o, b)| {
        let declared = o.and_then(|o| info.graph.value(o).ok()).and_then(|v| sequence_elem(v.ty.as_ref()));
        declared.or_else(|| g.value(*b).ok().and_then(|v| v.ty.as_ref()).and_then(ValueType::elem)).unwrap_or(DType::F32)
    }).collect();
    value_kernel(SequenceMap { id: info.id, body, elems })
}

/// Optional(input?): an optional holding the input, or an empty one when no input is given
/// (its type is the `type` attribute's).
fn optional(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    if info.node.inputs.iter().flatten().next().is_none() && !matches!(info.node.attr("type"), Some(Attr::Type(_))) {
        return Err(info.error("an Optional without input needs the 'type' attribute"));
    }
    values_fn(|ins| Ok(vec![Value::Optional(ins.first().copied().flatten().map(|v| Box::new(v.clone())))]))
}

/// OptionalHasElement(input?): a bool scalar, true for a non-empty optional or (opset 18) a
/// tensor or sequence, false for an empty optional or no input.
fn optional_has_element(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| {
        let has = match ins.first().copied().flatten() {
            None | Some(Value::Optional(None)) => false,
            Some(_) => true,
        };
        Ok(vec![Value::Tensor(Tensor::from_bools(&[], &[has]).map_err(|e| kernel_error(e.to_string()))?)])
    })
}

/// OptionalGetElement(input): the optional's value (an error when it is empty); a tensor or
/// sequence input (opset 18) is passed on.
fn optional_get_element(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    values_fn(|ins| match value_input(ins, 0)? {
        Value::Optional(Some(v)) => Ok(vec![(**v).clone()]),
        Value::Optional(None) => Err(kernel_error("the optional input is empty")),
        v => Ok(vec![v.clone()]),
    })
}
