//! Inference rules, one per op type (see [`infer`]).

use super::Known;
use crate::{Attr, DType, Dim, Node, Shape, Tensor, ValueType};

fn ty(elem: Option<DType>, shape: Option<Shape>) -> Option<ValueType> {
    Some(ValueType::Tensor { elem, shape })
}

fn elem(k: &Known) -> Option<DType> {
    k.ty.as_ref().and_then(|t| t.elem())
}

fn shape(k: &Known) -> Option<Shape> {
    k.ty.as_ref().and_then(|t| t.shape()).cloned()
}

fn out(t: Option<ValueType>) -> Known {
    Known { ty: t, ..Default::default() }
}

/// The elements of a small rank-0/1 integer tensor as dimensions.
pub(crate) fn int_dims(t: &Tensor) -> Option<Vec<Dim>> {
    if t.rank() > 1 || t.len() > 64 || !matches!(t.dtype(), DType::I64 | DType::I32) {
        return None;
    }
    Some(t.to_i64_vec().ok()?.into_iter().map(Dim::Known).collect())
}

/// A fully known integer vector.
fn ints(k: &Known) -> Option<Vec<i64>> {
    k.value.as_ref()?.iter().map(|d| d.known()).collect()
}

fn norm_axis(a: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if a < 0 { a + r } else { a };
    (0..r).contains(&a).then_some(a as usize)
}

/// Numpy broadcast of symbolic shapes.
fn broadcast(shapes: &[Shape]) -> Shape {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    (0..rank).map(|i| {
        let mut d = Dim::Known(1);
        for s in shapes {
            let Some(x) = (i + s.len()).checked_sub(rank).map(|j| &s[j]) else { continue };
            d = match (&d, x) {
                (Dim::Known(1), x) => x.clone(),
                (_, Dim::Known(1)) => d.clone(),
                (Dim::Known(a), Dim::Known(b)) if a == b => d.clone(),
                (Dim::Known(_), Dim::Known(_)) => Dim::Unknown,
                (Dim::Known(_), _) => d.clone(),
                (_, Dim::Known(_)) => x.clone(),
                (Dim::Sym(a), Dim::Sym(b)) if a == b => d.clone(),
                _ => Dim::Unknown,
            };
        }
        d
    }).collect()
}

fn attr_ints(n: &Node, name: &str) -> Option<Vec<i64>> {
    n.attr_ints(name).map(|v| v.to_vec())
}

/// Output size of a sliding window along one axis, when the input size is known and the
/// window fits (positive kernel, stride and dilation; non-negative pads).
fn window(n: Dim, k: i64, s: i64, d: i64, pb: i64, pe: i64, auto: &str, ceil: bool) -> Dim {
    let Dim::Known(n) = n else { return Dim::Unknown };
    if k < 1 || s < 1 || d < 1 || pb < 0 || pe < 0 {
        return Dim::Unknown;
    }
    let Some(span) = (k - 1).checked_mul(d).and_then(|v| v.checked_add(1)) else { return Dim::Unknown };
    let (pb, pe) = match auto {
        "SAME_UPPER" | "SAME_LOWER" => return Dim::Known((n + s - 1) / s),
        "VALID" => (0, 0),
        _ => (pb, pe),
    };
    let Some(p) = n.checked_add(pb).and_then(|v| v.checked_add(pe)).map(|v| v - span).filter(|&p| p >= 0) else { return Dim::Unknown };
    let mut o = if ceil { (p + s - 1) / s + 1 } else { p / s + 1 };
    if ceil && (o - 1) * s >= n + pb {
        o -= 1;
    }
    Dim::Known(o)
}

/// Spatial output sizes of a sliding window with one `kernel` size per spatial axis of `x`
/// (`[N, C, D1, ...]`); unknown where `x` has no such axis.
fn windowed(node: &Node, x: &Shape, kernel: &[i64]) -> Shape {
    let r = kernel.len();
    let get = |name: &str, i: usize, d: i64| node.attr_ints(name).and_then(|v| v.get(i).copied()).unwrap_or(d);
    let auto = node.attr_str("auto_pad").unwrap_or("NOTSET");
    let ceil = node.attr_int("ceil_mode").unwrap_or(0) != 0;
    (0..r).map(|i| match x.get(2 + i) {
        Some(n) => window(n.clone(), kernel[i], get("strides", i, 1), get("dilations", i, 1), get("pads", i, 0), get("pads", i + r, 0), auto, ceil),
        None => Dim::Unknown,
    }).collect()
}

/// The output shape of Resize over input `xs` with constant `sizes` or `scales` (one per
/// resized axis: the `axes` attribute's, else every axis), honoring
/// `keep_aspect_ratio_policy`; resized axes are unknown when neither is known.
fn resized_shape(node: &Node, xs: &Shape, sizes: Option<Vec<i64>>, scales: Option<Vec<f64>>) -> Shape {
    let r = xs.len();
    let axes: Vec<usize> = match attr_ints(node, "axes") {
        Some(a) => match a.iter().map(|&v| norm_axis(v, r)).collect::<Option<Vec<_>>>() {
            Some(a) => a,
            None => return vec![Dim::Unknown; r],
        },
        None => (0..r).collect(),
    };
    let mut out = xs.clone();
    if let Some(sz) = sizes.filter(|v| v.len() == axes.len()) {
        let policy = node.attr_str("keep_aspect_ratio_policy").unwrap_or("stretch");
        if policy == "stretch" {
            for (&a, &n) in axes.iter().zip(&sz) {
                out[a] = Dim::Known(n);
            }
            return out;
        }
        let known: Option<Vec<i64>> = axes.iter().map(|&a| xs[a].known()).collect();
        let Some(inputs) = known.filter(|v| v.iter().all(|&n| n > 0)) else {
            axes.iter().for_each(|&a| out[a] = Dim::Unknown);
            return out;
        };
        let ratios = sz.iter().zip(&inputs).map(|(&o, &n)| o as f64 / n as f64);
        let scale = if policy == "not_larger" { ratios.fold(f64::INFINITY, f64::min) } else { ratios.fold(f64::NEG_INFINITY, f64::max) };
        for (&a, &n) in axes.iter().zip(&inputs) {
            out[a] = Dim::Known((scale * n as f64 + 0.5).floor() as i64);
        }
        return out;
    }
    match scales.filter(|v| v.len() == axes.len()) {
        Some(sc) => {
            for (&a, f) in axes.iter().zip(sc) {
                out[a] = match &xs[a] { Dim::Known(n) => Dim::Known((*n as f64 * f).floor() as i64), d if f == 1.0 => d.clone(), _ => Dim::Unknown };
            }
        }
        None => {
            // Without an `axes` attribute, batch and channels are taken to be kept.
            let first = if attr_ints(node, "axes").is_some() { 0 } else { 2 };
            axes.iter().filter(|&&a| a >= first).for_each(|&a| out[a] = Dim::Unknown);
        }
    }
    out
}

/// Output types (and small integer values) of a node, or `None` for an op without a rule.
pub(crate) fn infer(node: &Node, ins: &[Known], opset: i64) -> Option<Vec<Known>> {
    match node.domain.as_str() {
        "" | "ai.onnx" => infer_onnx(node, ins, opset),
        crate::MS_DOMAIN => infer_ms(node, ins, opset),
        _ => None,
    }
}

/// [`infer`] for the ops of ONNX Runtime's `com.microsoft` domain that have a rule: its
/// QuantizeLinear and DequantizeLinear (ONNX's contract), and the transformer ops its
/// optimizer emits whose output shapes follow plainly from their inputs. Other ops of the
/// domain are unknown, including those named like an ONNX op with another contract (its
/// Attention takes packed Q/K/V weights).
fn infer_ms(node: &Node, ins: &[Known], opset: i64) -> Option<Vec<Known>> {
    let x = ins.first().cloned().unwrap_or_default();
    let input_shape = |i: usize| ins.get(i).and_then(shape);
    Some(match node.op_type.as_str() {
        "QuantizeLinear" | "DequantizeLinear" => return infer_onnx(node, ins, opset),
        "Gelu" | "BiasGelu" | "FastGelu" | "QuickGelu" | "RotaryEmbedding" => vec![out(x.ty.clone())],
        "FusedMatMul" => {
            let flag = |name: &str| node.attr_int(name).unwrap_or(0) != 0;
            let arranged = |s: Shape, trans: bool, trans_batch: bool| -> Option<Shape> {
                let r = s.len();
                let mut s = s;
                if trans_batch {
                    if r < 3 {
                        return None;
                    }
                    let first = s.remove(0);
                    s.insert(r - 2, first);
                }
                if trans && r >= 2 {
                    s.swap(r - 2, r - 1);
                }
                Some(s)
            };
            let a = shape(&x).and_then(|s| arranged(s, flag("transA"), flag("transBatchA")));
            let b = input_shape(1).and_then(|s| arranged(s, flag("transB"), flag("transBatchB")));
            vec![out(ty(elem(&x), a.zip(b).and_then(|(a, b)| matmul_shape(a, b))))]
        }
        "SkipLayerNormalization" | "SkipSimplifiedLayerNormalization" => {
            let stat = shape(&x).filter(|s| !s.is_empty()).map(|mut s| {
                *s.last_mut().expect("not empty") = Dim::Known(1);
                s
            });
            vec![out(x.ty.clone()), out(ty(Some(DType::F32), stat.clone())), out(ty(Some(DType::F32), stat)), out(x.ty.clone())]
        }
        "EmbedLayerNormalization" => {
            let word = ins.get(2).cloned().unwrap_or_default();
            let ids = shape(&x).filter(|s| s.len() == 2);
            let y = ids.clone().zip(shape(&word).filter(|s| s.len() == 2)).map(|(ids, w)| vec![ids[0].clone(), ids[1].clone(), w[1].clone()]);
            let mask_index = ids.map(|s| vec![s[0].clone()]);
            vec![out(ty(elem(&word), y.clone())), out(ty(Some(DType::I32), mask_index)), out(ty(elem(&word), y))]
        }
        "Attention" => {
            let heads = node.attr_int("num_heads").filter(|&n| n > 0);
            let v_hidden = match attr_ints(node, "qkv_hidden_sizes") {
                Some(v) if v.len() == 3 => Some(Dim::Known(v[2])),
                Some(_) => None,
                None => input_shape(1).filter(|w| w.len() == 2).and_then(|w| w[1].known()).filter(|c| c % 3 == 0).map(|c| Dim::Known(c / 3)),
            };
            let y = shape(&x).filter(|s| s.len() == 3).zip(v_hidden.filter(|_| heads.is_some())).map(|(s, dv)| vec![s[0].clone(), s[1].clone(), dv]);
            vec![out(ty(elem(&x), y)), out(ty(elem(&x), None))]
        }
        "MultiHeadAttention" => {
            let heads = node.attr_int("num_heads").filter(|&n| n > 0);
            let y = match (shape(&x), input_shape(1), input_shape(2)) {
                (Some(q), _, _) if q.len() == 5 => Some(vec![q[0].clone(), q[1].clone(), heads.map_or(Dim::Unknown, |n| mul_dim(&q[4], n))]),
                (Some(q), Some(k), None) if q.len() == 3 && k.len() == 5 => Some(q),
                (Some(q), Some(_), Some(v)) if q.len() == 3 && v.len() == 3 => Some(vec![q[0].clone(), q[1].clone(), v[2].clone()]),
                (Some(q), Some(_), Some(v)) if q.len() == 3 && v.len() == 4 => Some(vec![q[0].clone(), q[1].clone(), v[1].known().map_or(Dim::Unknown, |n| mul_dim(&v[3], n))]),
                _ => None,
            };
            vec![out(ty(elem(&x), y)), out(ty(elem(&x), None)), out(ty(elem(&x), None))]
        }
        _ => return None,
    })
}

/// The shape of a layer normalization's per-row statistics: X's with 1s from `axis` (default
/// -1) on.
fn norm_stat_shape(node: &Node, x: &Known) -> Option<Shape> {
    let s = shape(x)?;
    let ax = norm_axis(node.attr_int("axis").unwrap_or(-1), s.len())?;
    Some(s.iter().enumerate().map(|(i, d)| if i < ax { d.clone() } else { Dim::Known(1) }).collect())
}

/// The numpy MatMul of shapes `a` and `b` (1-D operands promoted, batch dimensions
/// broadcast); `None` for a scalar.
fn matmul_shape(mut a: Shape, mut b: Shape) -> Option<Shape> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (a1, b1) = (a.len() == 1, b.len() == 1);
    if a1 { a.insert(0, Dim::Known(1)); }
    if b1 { b.push(Dim::Known(1)); }
    let mut o = broadcast(&[a[..a.len() - 2].to_vec(), b[..b.len() - 2].to_vec()]);
    if !a1 { o.push(a[a.len() - 2].clone()); }
    if !b1 { o.push(b[b.len() - 1].clone()); }
    Some(o)
}

/// [`infer`] for the default (ONNX) domain.
fn sequence_of(t: Option<ValueType>) -> Known {
    out(Some(ValueType::Sequence(t.map(Box::new))))
}

/// The element type of a sequence.
fn sequence_elem(k: &Known) -> Option<ValueType> {
    match k.ty.as_ref()? {
        ValueType::Sequence(t) => t.as_deref().cloned(),
        _ => None,
    }
}

/// One tensor type covering both: the common element type, and the shape where the two agree
/// (rank only where dimensions differ; unknown where ranks differ).
fn common_tensor(a: &ValueType, b: &ValueType) -> ValueType {
    let elem = a.elem().filter(|e| Some(*e) == b.elem()).or(a.elem()).or(b.elem());
    let shape = match (a.shape(), b.shape()) {
        (Some(p), Some(q)) if p.len() == q.len() => Some(p.iter().zip(q).map(|(x, y)| if x == y { x.clone() } else { Dim::Unknown }).collect()),
        _ => None,
    };
    ValueType::Tensor { elem, shape }
}

/// Sequences and optionals: the sequence types built, read and taken apart, and optional types.
fn infer_sequence(node: &Node, ins: &[Known]) -> Option<Vec<Known>> {
    let x = ins.first().cloned().unwrap_or_default();
    let input_ty = |i: usize| ins.get(i).and_then(|k| k.ty.clone());
    Some(match node.op_type.as_str() {
        "SequenceEmpty" => {
            let e = DType::from_onnx(node.attr_int("dtype").unwrap_or(1) as i32);
            vec![sequence_of(ty(e, None))]
        }
        "SequenceConstruct" => {
            let types: Vec<ValueType> = ins.iter().filter_map(|k| k.ty.clone()).collect();
            let all = (types.len() == ins.len()).then(|| types.iter().skip(1).fold(types.first().cloned(), |acc, t| acc.map(|a| common_tensor(&a, t)))).flatten();
            vec![sequence_of(all.or_else(|| ty(ins.iter().find_map(elem), None)))]
        }
        "SequenceInsert" => {
            let joined = match (sequence_elem(&x), input_ty(1)) {
                (Some(a), Some(b)) => Some(common_tensor(&a, &b)),
                (Some(a), None) => ty(a.elem(), None),
                (None, Some(b)) => ty(b.elem(), None),
                (None, None) => None,
            };
            vec![sequence_of(joined)]
        }
        "SequenceErase" => vec![out(x.ty.clone())],
        "SequenceAt" => vec![out(sequence_elem(&x))],
        "SequenceLength" => vec![out(ty(Some(DType::I64), Some(vec![])))],
        "ConcatFromSequence" => {
            let e = sequence_elem(&x);
            let new_axis = node.attr_int("new_axis").unwrap_or(0) == 1;
            let s = e.as_ref().and_then(|t| t.shape()).and_then(|s| {
                let r = s.len() + usize::from(new_axis);
                let a = norm_axis(node.attr_int("axis")?, r)?;
                let mut o = s.clone();
                if new_axis { o.insert(a, Dim::Unknown) } else { o[a] = Dim::Unknown }
                Some(o)
            });
            vec![out(ty(e.and_then(|t| t.elem()), s))]
        }
        "SplitToSequence" => {
            let keepdims = node.attr_int("keepdims").unwrap_or(1) != 0;
            let s = shape(&x).and_then(|s| {
                let a = norm_axis(node.attr_int("axis").unwrap_or(0), s.len())?;
                let mut o = s;
                match node.input(1) {
                    Some(_) => o[a] = Dim::Unknown,
                    None if keepdims => o[a] = Dim::Known(1),
                    None => { o.remove(a); }
                }
                Some(o)
            });
            vec![sequence_of(ty(elem(&x), s))]
        }
        "SequenceMap" => {
            let body = match node.attr("body") { Some(Attr::Graph(g)) => g, _ => return None };
            body.outputs().iter().map(|v| sequence_of(body.value(*v).ok().and_then(|v| v.ty.clone()))).collect()
        }
        "Optional" => {
            let inner = match node.input(0) {
                Some(_) => x.ty.clone(),
                None => match node.attr("type") { Some(Attr::Type(t)) => Some(t.clone()), _ => None },
            };
            vec![out(Some(ValueType::Optional(inner.map(Box::new))))]
        }
        "OptionalHasElement" => vec![out(ty(Some(DType::Bool), Some(vec![])))],
        "OptionalGetElement" => match &x.ty {
            Some(ValueType::Optional(t)) => vec![out(t.as_deref().cloned())],
            t => vec![out(t.clone())],
        },
        _ => return None,
    })
}

fn infer_onnx(node: &Node, ins: &[Known], opset: i64) -> Option<Vec<Known>> {
    let x = ins.first().cloned().unwrap_or_default();
    let same = || vec![out(x.ty.clone())];
    Some(match node.op_type.as_str() {
        "Relu" | "Sigmoid" | "Tanh" | "Sqrt" | "Exp" | "Log" | "Neg" | "Abs" | "Erf" | "Reciprocal" | "Floor" | "Ceil"
        | "Round" | "Sin" | "Cos" | "Softplus" | "Softsign" | "HardSigmoid" | "HardSwish" | "LeakyRelu" | "Elu" | "Selu"
        | "Celu" | "Gelu" | "Mish" | "Sign" | "Clip" | "Softmax" | "LogSoftmax" | "Hardmax" | "LRN" | "CumSum"
        | "InstanceNormalization" | "Not" | "PRelu" | "ThresholdedRelu" | "Tan" | "Sinh" | "Cosh" | "Asin" | "Acos"
        | "Atan" | "Asinh" | "Acosh" | "Atanh" | "Swish" | "BitwiseNot" | "GroupNormalization" | "RMSNormalization"
        | "LpNormalization" | "MeanVarianceNormalization" => same(),
        "BitwiseAnd" | "BitwiseOr" | "BitwiseXor" | "BitShift" => {
            let shapes: Option<Vec<Shape>> = ins.iter().map(shape).collect();
            vec![out(ty(elem(&x), shapes.map(|s| broadcast(&s))))]
        }
        "Det" => {
            let s = shape(&x).filter(|s| s.len() >= 2).map(|s| s[..s.len() - 2].to_vec());
            vec![out(ty(elem(&x), s))]
        }
        "Einsum" => {
            let shapes: Option<Vec<Shape>> = ins.iter().map(shape).collect();
            let s = node.attr_str("equation").zip(shapes).and_then(|(eq, shapes)| einsum_shape(eq, &shapes));
            vec![out(ty(elem(&x), s))]
        }
        "Attention" => {
            let shapes: Vec<Option<Shape>> = (0..5).map(|i| ins.get(i).and_then(shape)).collect();
            let [y, present_key, present_value, qk] = attention_shapes(node, &shapes);
            let v_elem = ins.get(2).and_then(elem);
            vec![out(ty(elem(&x), y)), out(ty(elem(&x), present_key)), out(ty(v_elem, present_value)), out(ty(elem(&x), qk))]
        }
        "RotaryEmbedding" | "SwiGLU" => same(),
        "Identity" => vec![x.clone()],
        "SequenceEmpty" | "SequenceConstruct" | "SequenceInsert" | "SequenceErase" | "SequenceAt" | "SequenceLength"
        | "ConcatFromSequence" | "SplitToSequence" | "SequenceMap" | "Optional" | "OptionalHasElement"
        | "OptionalGetElement" => infer_sequence(node, ins)?,
        "Dropout" => vec![out(x.ty.clone()), out(ty(Some(DType::Bool), shape(&x)))],
        "BatchNormalization" => same(),
        "SimplifiedLayerNormalization" => vec![out(x.ty.clone()), out(ty(Some(DType::F32), norm_stat_shape(node, &x)))],
        "LayerNormalization" => {
            let stat = norm_stat_shape(node, &x);
            vec![out(x.ty.clone()), out(ty(Some(DType::F32), stat.clone())), out(ty(Some(DType::F32), stat))]
        }
        "Cast" => {
            let to = node.attr_int("to").and_then(|c| DType::from_onnx(c as i32));
            vec![Known { ty: ty(to, shape(&x)), value: x.value.clone(), constant: None }]
        }
        "CastLike" => vec![out(ty(ins.get(1).and_then(elem), shape(&x)))],
        "IsNaN" | "IsInf" => vec![out(ty(Some(DType::Bool), shape(&x)))],
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Mod" | "Max" | "Min" | "Sum" | "Mean" => {
            let shapes: Option<Vec<Shape>> = ins.iter().map(shape).collect();
            let value = if ins.len() == 2 { arith(&node.op_type, &ins[0], &ins[1]) } else { None };
            vec![Known { ty: ty(elem(&x), shapes.map(|s| broadcast(&s))), value, constant: None }]
        }
        "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or" | "Xor" => {
            let shapes: Option<Vec<Shape>> = ins.iter().map(shape).collect();
            vec![out(ty(Some(DType::Bool), shapes.map(|s| broadcast(&s))))]
        }
        "Where" => {
            let shapes: Option<Vec<Shape>> = ins.iter().map(shape).collect();
            vec![out(ty(ins.get(1).and_then(elem), shapes.map(|s| broadcast(&s))))]
        }
        "Constant" => {
            let t = node.constant_tensor()?;
            vec![Known { ty: ty(Some(t.dtype()), Some(t.shape().iter().map(|&d| Dim::Known(d as i64)).collect())), value: int_dims(&t), constant: Some(t) }]
        }
        "Shape" => {
            let s = shape(&x);
            let r = s.as_ref().map(|s| s.len() as i64);
            let (start, end) = (node.attr_int("start").unwrap_or(0), node.attr_int("end"));
            let value = s.as_ref().map(|s| {
                let r = s.len() as i64;
                let c = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
                let (a, b) = (c(start), c(end.unwrap_or(r)));
                s[a..b.max(a)].to_vec()
            });
            let n = value.as_ref().map(|v| v.len() as i64).or(r.filter(|_| start == 0 && end.is_none()));
            vec![Known { ty: ty(Some(DType::I64), Some(vec![n.map(Dim::Known).unwrap_or(Dim::Unknown)])), value, constant: None }]
        }
        "Size" => vec![out(ty(Some(DType::I64), Some(vec![])))],
        "ConstantOfShape" => {
            let e = match node.attr("value") { Some(Attr::Tensor(t)) => Some(t.dtype()), _ => Some(DType::F32) };
            vec![out(ty(e, x.value.clone()))]
        }
        "Reshape" => {
            let target = ins.get(1).and_then(|k| k.value.clone());
            let allowzero = node.attr_int("allowzero").unwrap_or(0) != 0;
            let s = target.map(|t| reshape(shape(&x).as_ref(), &t, allowzero));
            vec![Known { ty: ty(elem(&x), s), value: x.value.clone(), constant: None }]
        }
        "Flatten" => {
            let s = shape(&x).map(|s| {
                let a = node.attr_int("axis").unwrap_or(1);
                let k = if a < 0 { (a + s.len() as i64).max(0) as usize } else { (a as usize).min(s.len()) };
                vec![product(&s[..k]), product(&s[k..])]
            });
            vec![out(ty(elem(&x), s))]
        }
        "Transpose" => {
            let s = shape(&x).map(|s| match attr_ints(node, "perm") {
                Some(p) => p.iter().map(|&i| s.get(i as usize).cloned().unwrap_or(Dim::Unknown)).collect(),
                None => s.iter().rev().cloned().collect(),
            });
            vec![out(ty(elem(&x), s))]
        }
        "Squeeze" | "Unsqueeze" => {
            let axes = if opset >= 13 { ins.get(1).and_then(ints) } else { attr_ints(node, "axes") };
            let s = shape(&x).and_then(|s| squeeze(&node.op_type, &s, axes));
            let value = x.value.clone();
            vec![Known { ty: ty(elem(&x), s), value, constant: None }]
        }
        "Concat" => {
            let shapes: Option<Vec<Shape>> = ins.iter().map(shape).collect();
            let a = node.attr_int("axis").unwrap_or(0);
            let s = shapes.and_then(|sh| {
                let first = sh.first()?.clone();
                let ax = norm_axis(a, first.len())?;
                let mut o = first.clone();
                o[ax] = sh.iter().map(|s| s.get(ax).cloned().unwrap_or(Dim::Unknown)).reduce(|p, q| add_dims(&p, &q)).unwrap_or(Dim::Unknown);
                Some(o)
            });
            let value = ins.iter().map(|k| k.value.clone()).collect::<Option<Vec<_>>>().map(|v| v.concat());
            vec![Known { ty: ty(elem(&x), s), value, constant: None }]
        }
        "Gather" => {
            let idx = ins.get(1).cloned().unwrap_or_default();
            let a = node.attr_int("axis").unwrap_or(0);
            let s = match (shape(&x), shape(&idx)) {
                (Some(d), Some(i)) => norm_axis(a, d.len()).map(|ax| [&d[..ax], &i[..], &d[ax + 1..]].concat()),
                _ => None,
            };
            let value = match (&x.value, ints(&idx)) {
                (Some(v), Some(i)) if a == 0 => i.iter().map(|&j| { let j = if j < 0 { j + v.len() as i64 } else { j }; v.get(j as usize).cloned() }).collect(),
                _ => None,
            };
            vec![Known { ty: ty(elem(&x), s), value, constant: None }]
        }
        "ScatterElements" | "Scatter" | "ScatterND" => same(),
        "OneHot" => {
            let depth = match ins.get(1).and_then(ints).as_deref() {
                Some(&[d]) => Dim::Known(d),
                _ => Dim::Unknown,
            };
            let a = node.attr_int("axis").unwrap_or(-1);
            let s = shape(&x).and_then(|sh| norm_axis(a, sh.len() + 1).map(|ax| [&sh[..ax], &[depth], &sh[ax..]].concat()));
            vec![out(ty(ins.get(2).and_then(elem), s))]
        }
        "Slice" => {
            let (starts, ends, axes, steps) = if opset < 10 {
                (attr_ints(node, "starts"), attr_ints(node, "ends"), attr_ints(node, "axes"), None)
            } else {
                (ins.get(1).and_then(ints), ins.get(2).and_then(ints), ins.get(3).and_then(ints), ins.get(4).and_then(ints))
            };
            let value = match (&x.value, &starts, &ends) {
                (Some(v), Some(s), Some(e)) if s.len() == 1 && steps.as_ref().is_none_or(|st| st == &[1]) => {
                    let n = v.len() as i64;
                    let c = |p: i64| (if p < 0 { p + n } else { p }).clamp(0, n) as usize;
                    let (a, b) = (c(s[0]), c(e[0]));
                    Some(v[a..b.max(a)].to_vec())
                }
                _ => None,
            };
            let s = match (shape(&x), starts, ends) {
                (Some(sh), Some(st), Some(en)) => Some(slice_shape(&sh, &st, &en, axes, steps)),
                (Some(sh), _, _) => Some(vec![Dim::Unknown; sh.len()]),
                _ => None,
            };
            vec![Known { ty: ty(elem(&x), s), value, constant: None }]
        }
        "Expand" => {
            let s = match (shape(&x), ins.get(1).and_then(|k| k.value.clone())) {
                (Some(a), Some(b)) => Some(broadcast(&[a, b])),
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "Tile" => {
            let s = match (shape(&x), ins.get(1).and_then(ints)) {
                (Some(a), Some(r)) => Some(a.iter().zip(&r).map(|(d, &k)| mul_dim(d, k)).collect()),
                (Some(a), None) => Some(vec![Dim::Unknown; a.len()]),
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "Range" => vec![out(ty(elem(&x), Some(vec![Dim::Unknown])))],
        "Pad" => {
            let pads = if opset < 11 { attr_ints(node, "pads") } else { ins.get(1).and_then(ints) };
            let s = match (shape(&x), pads) {
                (Some(sh), Some(p)) if p.len() == 2 * sh.len() => Some(sh.iter().enumerate().map(|(i, d)| match d { Dim::Known(k) => Dim::Known(k + p[i] + p[i + sh.len()]), _ if p[i] + p[i + sh.len()] == 0 => d.clone(), _ => Dim::Unknown }).collect()),
                (Some(sh), _) => Some(vec![Dim::Unknown; sh.len()]),
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "Split" => {
            let a = node.attr_int("axis").unwrap_or(0);
            let sizes = if opset >= 13 { ins.get(1).and_then(ints) } else { attr_ints(node, "split") };
            let n = node.outputs.len();
            (0..n).map(|i| {
                let s = shape(&x).and_then(|sh| {
                    let ax = norm_axis(a, sh.len())?;
                    let mut o = sh.clone();
                    o[ax] = match (&sizes, &sh[ax]) {
                        (Some(v), _) => Dim::Known(*v.get(i)?),
                        (None, Dim::Known(d)) if d % n as i64 == 0 => Dim::Known(d / n as i64),
                        _ => Dim::Unknown,
                    };
                    Some(o)
                });
                out(ty(elem(&x), s))
            }).collect()
        }
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1" | "ReduceL2" | "ReduceSumSquare" | "ReduceLogSumExp" | "ReduceLogSum" | "ArgMax" | "ArgMin" => {
            let arg = node.op_type.starts_with("Arg");
            let keep = node.attr_int("keepdims").unwrap_or(1) != 0;
            let from_input = !arg && ((node.op_type == "ReduceSum" && opset >= 13) || opset >= 18);
            let axes = if arg { Some(vec![node.attr_int("axis").unwrap_or(0)]) } else if from_input { ins.get(1).and_then(ints) } else { attr_ints(node, "axes") };
            let explicit_axes_input = from_input && ins.get(1).is_some_and(|k| k.ty.is_some());
            let s = shape(&x).and_then(|sh| {
                let axes: Vec<usize> = match axes {
                    Some(a) if !a.is_empty() => a.iter().map(|&v| norm_axis(v, sh.len())).collect::<Option<_>>()?,
                    _ if explicit_axes_input => return None,
                    _ if node.attr_int("noop_with_empty_axes").unwrap_or(0) != 0 => return Some(sh.clone()),
                    _ => (0..sh.len()).collect(),
                };
                Some(sh.iter().enumerate().filter_map(|(i, d)| if axes.contains(&i) { keep.then_some(Dim::Known(1)) } else { Some(d.clone()) }).collect())
            });
            vec![out(ty(if arg { Some(DType::I64) } else { elem(&x) }, s))]
        }
        "MatMul" => {
            let s = shape(&x).zip(ins.get(1).and_then(shape)).and_then(|(a, b)| matmul_shape(a, b));
            vec![out(ty(elem(&x), s))]
        }
        "Gemm" => {
            let (a, b) = (shape(&x), ins.get(1).and_then(shape));
            let ta = node.attr_int("transA").unwrap_or(0) != 0;
            let tb = node.attr_int("transB").unwrap_or(0) != 0;
            let s = match (a, b) {
                (Some(a), Some(b)) if a.len() == 2 && b.len() == 2 => Some(vec![a[if ta { 1 } else { 0 }].clone(), b[if tb { 0 } else { 1 }].clone()]),
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "Conv" => {
            let (xs, ws) = (shape(&x), ins.get(1).and_then(shape));
            let s = match (xs, ws) {
                (Some(xs), Some(ws)) if xs.len() >= 3 && ws.len() == xs.len() => {
                    let kernel: Option<Vec<i64>> = attr_ints(node, "kernel_shape").or_else(|| ws[2..].iter().map(|d| d.known()).collect());
                    kernel.map(|k| [vec![xs[0].clone(), ws[0].clone()], windowed(node, &xs, &k)].concat())
                }
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "ConvTranspose" => {
            let (xs, ws) = (shape(&x), ins.get(1).and_then(shape));
            let group = node.attr_int("group").unwrap_or(1);
            let s = match (xs, ws) {
                (Some(xs), Some(ws)) if xs.len() >= 3 && ws.len() == xs.len() => {
                    let r = xs.len() - 2;
                    let m = match &ws[1] { Dim::Known(k) => Dim::Known(k * group), _ => Dim::Unknown };
                    let sp: Vec<Dim> = (0..r).map(|i| {
                        if let Some(os) = attr_ints(node, "output_shape") { return os.len().checked_sub(r).and_then(|at| os.get(at + i)).map_or(Dim::Unknown, |&o| Dim::Known(o)); }
                        let get = |n: &str, j: usize, d: i64| node.attr_ints(n).and_then(|v| v.get(j).copied()).unwrap_or(d);
                        match (&xs[2 + i], &ws[2 + i]) {
                            (Dim::Known(n), Dim::Known(k)) => {
                                let (st, d) = (get("strides", i, 1), get("dilations", i, 1));
                                let total = st * (n - 1) + get("output_padding", i, 0) + (k - 1) * d + 1;
                                if node.attr_str("auto_pad").is_some_and(|a| a.starts_with("SAME")) { Dim::Known(n * st) } else { Dim::Known(total - get("pads", i, 0) - get("pads", i + r, 0)) }
                            }
                            _ => Dim::Unknown,
                        }
                    }).collect();
                    Some([vec![xs[0].clone(), m], sp].concat())
                }
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "MaxPool" | "AveragePool" | "LpPool" => {
            let s = shape(&x).and_then(|xs| {
                let k = attr_ints(node, "kernel_shape")?;
                (xs.len() == k.len() + 2).then(|| [xs[..2].to_vec(), windowed(node, &xs, &k)].concat())
            });
            let t = ty(elem(&x), s.clone());
            vec![out(t), out(ty(Some(DType::I64), s))]
        }
        "GlobalAveragePool" | "GlobalMaxPool" | "GlobalLpPool" => {
            let s = shape(&x).map(|xs| xs.iter().enumerate().map(|(i, d)| if i < 2 { d.clone() } else { Dim::Known(1) }).collect());
            vec![out(ty(elem(&x), s))]
        }
        "Resize" | "Upsample" => {
            let (scales_i, sizes_i) = if opset >= 11 && node.op_type == "Resize" { (2, Some(3)) } else { (1, None) };
            let s = shape(&x).map(|xs| resized_shape(node, &xs, sizes_i.and_then(|i| ins.get(i)).and_then(ints), ins.get(scales_i).and_then(|k| k.constant.as_ref()).and_then(|t| t.to_f64_vec().ok())));
            vec![out(ty(elem(&x), s))]
        }
        "MaxUnpool" => {
            let s = match ins.get(2).and_then(ints) {
                Some(os) => Some(os.into_iter().map(Dim::Known).collect()),
                None => shape(&x).and_then(|xs| {
                    let k = attr_ints(node, "kernel_shape")?;
                    let r = k.len();
                    (xs.len() == r + 2).then(|| {
                        let get = |n: &str, j: usize, d: i64| node.attr_ints(n).and_then(|v| v.get(j).copied()).unwrap_or(d);
                        let sp = (0..r).map(|i| match &xs[i + 2] {
                            Dim::Known(n) => Dim::Known((n - 1) * get("strides", i, 1) + k[i] - get("pads", i, 0) - get("pads", i + r, 0)),
                            _ => Dim::Unknown,
                        });
                        xs[..2].iter().cloned().chain(sp).collect()
                    })
                }),
            };
            vec![out(ty(elem(&x), s))]
        }
        "Col2Im" => {
            let (image, block) = (ins.get(1).and_then(ints), ins.get(2).and_then(ints));
            let s = shape(&x).filter(|xs| xs.len() == 3).and_then(|xs| {
                let image = image?;
                let taps: i64 = block?.iter().product();
                let c = match &xs[1] { Dim::Known(c) if taps > 0 => Dim::Known(c / taps), _ => Dim::Unknown };
                Some([vec![xs[0].clone(), c], image.into_iter().map(Dim::Known).collect()].concat())
            });
            vec![out(ty(elem(&x), s))]
        }
        "DeformConv" => {
            let (ws, os) = (ins.get(1).and_then(shape), ins.get(2).and_then(shape));
            let s = match (shape(&x), ws, os) {
                (Some(xs), Some(ws), Some(os)) if xs.len() >= 3 && !ws.is_empty() && os.len() == xs.len() => Some([vec![xs[0].clone(), ws[0].clone()], os[2..].to_vec()].concat()),
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "CenterCropPad" => {
            let s = match (shape(&x), ins.get(1).and_then(ints)) {
                (Some(mut xs), Some(target)) => {
                    let axes: Option<Vec<usize>> = match attr_ints(node, "axes") {
                        Some(a) => a.iter().map(|&a| norm_axis(a, xs.len())).collect(),
                        None => Some((0..xs.len()).collect()),
                    };
                    axes.filter(|a| a.len() == target.len() && target.iter().all(|&t| t >= 0)).map(|axes| {
                        for (a, t) in axes.into_iter().zip(target) {
                            xs[a] = Dim::Known(t);
                        }
                        xs
                    })
                }
                _ => None,
            };
            vec![out(ty(elem(&x), s))]
        }
        "RNN" | "LSTM" | "GRU" => {
            let dirs = if node.attr_str("direction") == Some("bidirectional") { 2 } else { 1 };
            let hidden = node.attr_int("hidden_size").map(Dim::Known).unwrap_or(Dim::Unknown);
            let layout = node.attr_int("layout").unwrap_or(0);
            let (y, st) = shape(&x).filter(|s| s.len() == 3).map(|s| {
                let (seq, batch) = if layout == 0 { (s[0].clone(), s[1].clone()) } else { (s[1].clone(), s[0].clone()) };
                let d = Dim::Known(dirs);
                if layout == 0 {
                    (vec![seq, d.clone(), batch.clone(), hidden.clone()], vec![d, batch, hidden.clone()])
                } else {
                    (vec![batch.clone(), seq, d.clone(), hidden.clone()], vec![batch, d, hidden.clone()])
                }
            }).unzip();
            let e = elem(&x);
            let mut outs = vec![out(ty(e, y)), out(ty(e, st.clone())), out(ty(e, st))];
            if node.op_type == "RNN" {
                outs.truncate(2);
            }
            outs
        }
        "QuantizeLinear" => {
            let zp = ins.get(2).and_then(elem);
            let to = node.attr_int("output_dtype").filter(|&d| d != 0).and_then(|c| DType::from_onnx(c as i32));
            vec![out(ty(zp.or(to).or(Some(DType::U8)), shape(&x)))]
        }
        "DequantizeLinear" => {
            let scale = ins.get(1).and_then(elem);
            let to = node.attr_int("output_dtype").filter(|&d| d != 0).and_then(|c| DType::from_onnx(c as i32));
            vec![out(ty(to.or(scale).or(Some(DType::F32)), shape(&x)))]
        }
        "CumProd" | "Trilu" | "ReverseSequence" => same(),
        "TopK" => {
            let k = if opset < 10 { node.attr_int("k") } else { ins.get(1).and_then(ints).and_then(|v| v.first().copied()) }.filter(|&k| k >= 0);
            let a = node.attr_int("axis").unwrap_or(-1);
            let s = shape(&x).and_then(|mut sh| {
                let ax = norm_axis(a, sh.len())?;
                *sh.get_mut(ax)? = k.map(Dim::Known).unwrap_or(Dim::Unknown);
                Some(sh)
            });
            vec![out(ty(elem(&x), s.clone())), out(ty(Some(DType::I64), s))]
        }
        "NonZero" => {
            let rank = shape(&x).map(|sh| Dim::Known(sh.len().max(1) as i64)).unwrap_or(Dim::Unknown);
            vec![out(ty(Some(DType::I64), Some(vec![rank, Dim::Unknown])))]
        }
        "NonMaxSuppression" => vec![out(ty(Some(DType::I64), Some(vec![Dim::Unknown, Dim::Known(3)])))],
        "EyeLike" => {
            let to = node.attr_int("dtype").and_then(|c| DType::from_onnx(c as i32));
            vec![out(ty(to.or(elem(&x)), shape(&x)))]
        }
        "Compress" | "Unique" => {
            let a = node.attr_int("axis");
            let s = match a {
                Some(a) => shape(&x).and_then(|mut sh| {
                    let ax = norm_axis(a, sh.len())?;
                    *sh.get_mut(ax)? = Dim::Unknown;
                    Some(sh)
                }),
                None => Some(vec![Dim::Unknown]),
            };
            let mut outs = vec![out(ty(elem(&x), s))];
            if node.op_type == "Unique" {
                let items = match (a, shape(&x)) {
                    (Some(a), Some(sh)) => norm_axis(a, sh.len()).and_then(|ax| sh.get(ax).cloned()).unwrap_or(Dim::Unknown),
                    (None, Some(sh)) => product(&sh),
                    _ => Dim::Unknown,
                };
                let index = |d: Dim| out(ty(Some(DType::I64), Some(vec![d])));
                outs.extend([index(Dim::Unknown), index(items), index(Dim::Unknown)]);
            }
            outs
        }
        "If" => {
            let branch = match node.attr("then_branch") { Some(Attr::Graph(g)) => g, _ => return None };
            branch.outputs().iter().map(|v| out(branch.value(*v).ok().and_then(|v| v.ty.clone()))).collect()
        }
        "GridSample" => {
            let s = shape(&x).zip(ins.get(1).and_then(shape)).filter(|(xs, gs)| xs.len() >= 3 && gs.len() == xs.len())
                .map(|(xs, gs)| [xs[..2].to_vec(), gs[1..gs.len() - 1].to_vec()].concat());
            vec![out(ty(elem(&x), s))]
        }
        "AffineGrid" => {
            let s = ins.get(1).and_then(|k| k.value.clone()).filter(|v| v.len() == 4 || v.len() == 5)
                .map(|v| [vec![v[0].clone()], v[2..].to_vec(), vec![Dim::Known(v.len() as i64 - 2)]].concat());
            vec![out(ty(elem(&x), s))]
        }
        "RoiAlign" => {
            let rois = ins.get(1).and_then(shape).and_then(|s| s.first().cloned()).unwrap_or(Dim::Unknown);
            let c = shape(&x).filter(|s| s.len() == 4).map(|s| s[1].clone()).unwrap_or(Dim::Unknown);
            let bins = |a: &str| Dim::Known(node.attr_int(a).unwrap_or(1));
            vec![out(ty(elem(&x), Some(vec![rois, c, bins("output_height"), bins("output_width")])))]
        }
        "DFT" => {
            let (inverse, onesided) = (node.attr_int("inverse").unwrap_or(0) != 0, node.attr_int("onesided").unwrap_or(0) != 0);
            let scalar = |i: usize| ins.get(i).and_then(ints).and_then(|v| v.first().copied());
            let axis = if opset < 20 { Some(node.attr_int("axis").unwrap_or(1)) } else if node.input(2).is_some() { scalar(2) } else { Some(-2) };
            let s = shape(&x).filter(|s| s.len() >= 2).map(|xs| {
                let r = xs.len();
                let mut o = xs.clone();
                o[r - 1] = Dim::Known(if inverse && onesided { 1 } else { 2 });
                match axis.and_then(|a| norm_axis(a, r)).filter(|&a| a < r - 1) {
                    Some(a) => {
                        let n = match node.input(1) {
                            Some(_) => scalar(1),
                            None if inverse && onesided => xs[a].known().map(|d| 2 * (d - 1)),
                            None => xs[a].known(),
                        };
                        o[a] = match n {
                            Some(n) if onesided && !inverse => Dim::Known(n / 2 + 1),
                            Some(n) => Dim::Known(n),
                            None if node.input(1).is_none() && !onesided => xs[a].clone(),
                            None => Dim::Unknown,
                        };
                    }
                    None => o[..r - 1].iter_mut().for_each(|d| *d = Dim::Unknown),
                }
                o
            });
            vec![out(ty(elem(&x), s))]
        }
        "STFT" => {
            let onesided = node.attr_int("onesided").unwrap_or(1) != 0;
            let xs = shape(&x).filter(|s| s.len() == 3);
            let step = ins.get(1).and_then(ints).and_then(|v| v.first().copied());
            let frame = ins.get(3).and_then(ints).and_then(|v| v.first().copied())
                .or_else(|| ins.get(2).and_then(shape).and_then(|s| s.first().and_then(|d| d.known())));
            let length = xs.as_ref().and_then(|s| s[1].known());
            let frames = match (length, frame, step) {
                (Some(l), Some(f), Some(st)) if st > 0 && f <= l => Dim::Known((l - f) / st + 1),
                _ => Dim::Unknown,
            };
            let bins = frame.map(|f| Dim::Known(if onesided { f / 2 + 1 } else { f })).unwrap_or(Dim::Unknown);
            let batch = xs.map(|s| s[0].clone()).unwrap_or(Dim::Unknown);
            vec![out(ty(elem(&x), Some(vec![batch, frames, bins, Dim::Known(2)])))]
        }
        "HannWindow" | "HammingWindow" | "BlackmanWindow" => {
            let to = DType::from_onnx(node.attr_int("output_datatype").unwrap_or(1) as i32);
            let size = ints(&x).and_then(|v| v.first().copied()).map(Dim::Known).unwrap_or(Dim::Unknown);
            vec![out(ty(to, Some(vec![size])))]
        }
        "MelWeightMatrix" => {
            let to = DType::from_onnx(node.attr_int("output_datatype").unwrap_or(1) as i32);
            let scalar = |i: usize| ins.get(i).and_then(ints).and_then(|v| v.first().copied());
            let spectrum = scalar(1).map(|n| Dim::Known(n / 2 + 1)).unwrap_or(Dim::Unknown);
            let mels = scalar(0).map(Dim::Known).unwrap_or(Dim::Unknown);
            vec![out(ty(to, Some(vec![spectrum, mels])))]
        }
        "Scan" => {
            let body = match node.attr("body") { Some(Attr::Graph(g)) => g, _ => return None };
            let m = node.attr_int("num_scan_inputs").and_then(|m| usize::try_from(m).ok())?;
            let batched = opset < 9;
            let given = &ins[usize::from(batched).min(ins.len())..];
            let n = given.len().checked_sub(m)?;
            let first_scan = given.get(n).and_then(shape);
            let seq = first_scan.as_ref().and_then(|s| {
                let a = if batched { 1 } else { node.attr_ints("scan_input_axes").and_then(|v| v.first().copied()).unwrap_or(0) };
                norm_axis(a, s.len()).and_then(|a| s.get(a).cloned())
            }).unwrap_or(Dim::Unknown);
            let batch = first_scan.as_ref().and_then(|s| s.first().cloned()).unwrap_or(Dim::Unknown);
            let out_axes = attr_ints(node, "scan_output_axes").unwrap_or_default();
            body.outputs().iter().enumerate().map(|(i, v)| {
                let t = body.value(*v).ok().and_then(|v| v.ty.clone());
                let e = t.as_ref().and_then(|t| t.elem());
                let s = t.as_ref().and_then(|t| t.shape()).cloned();
                let s = match (i < n, batched) {
                    (true, false) => s,
                    (true, true) => s.map(|s| [vec![batch.clone()], s].concat()),
                    (false, true) => s.map(|s| [vec![batch.clone(), seq.clone()], s].concat()),
                    (false, false) => s.and_then(|s| {
                        let a = norm_axis(out_axes.get(i - n).copied().unwrap_or(0), s.len() + 1)?;
                        let mut s = s;
                        s.insert(a, seq.clone());
                        Some(s)
                    }),
                };
                out(ty(e, s))
            }).collect()
        }
        _ => return None,
    })
}

/// The output shape of an einsum `equation` on inputs of `shapes`: each letter's size from
/// the inputs (a size other than 1 wins over 1), ellipses broadcast; `None` when the
/// equation does not fit the shapes.
fn einsum_shape(equation: &str, shapes: &[Shape]) -> Option<Shape> {
    let eq: String = equation.chars().filter(|c| *c != ' ').collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != shapes.len() {
        return None;
    }
    let mut sizes: std::collections::HashMap<char, Dim> = Default::default();
    let mut ellipses = vec![];
    for (term, s) in terms.iter().zip(shapes) {
        let (head, tail) = term.split_once("...").unwrap_or((term, ""));
        let letters = head.len() + tail.len();
        if s.len() < letters || (!term.contains("...") && s.len() != letters) {
            return None;
        }
        let dims = head.chars().zip(&s[..head.len()]).chain(tail.chars().zip(&s[s.len() - tail.len()..]));
        for (c, d) in dims {
            let e = sizes.entry(c).or_insert_with(|| d.clone());
            if *e == Dim::Known(1) {
                *e = d.clone();
            }
        }
        if term.contains("...") {
            ellipses.push(s[head.len()..s.len() - tail.len()].to_vec());
        }
    }
    let ellipsis = broadcast(&ellipses);
    let out_term: String = match rhs {
        Some(r) => r.to_string(),
        None => {
            let mut once: Vec<char> = sizes.keys().copied().filter(|&c| lhs.matches(c).count() == 1).collect();
            once.sort_unstable();
            let letters: String = once.into_iter().collect();
            if ellipses.is_empty() { letters } else { format!("...{letters}") }
        }
    };
    let (head, tail) = out_term.split_once("...").unwrap_or((&out_term, ""));
    let mut out: Shape = head.chars().map(|c| sizes.get(&c).cloned()).collect::<Option<_>>()?;
    if out_term.contains("...") {
        out.extend(ellipsis);
    }
    out.extend(tail.chars().map(|c| sizes.get(&c).cloned()).collect::<Option<Vec<_>>>()?);
    Some(out)
}

/// The output shapes of Attention (Y, present_key, present_value, qk_matmul_output) from the
/// shapes of Q, K, V, attn_mask and past_key, where they are known; 3-D inputs take their head
/// counts from `q_num_heads`/`kv_num_heads`.
fn attention_shapes(node: &Node, shapes: &[Option<Shape>]) -> [Option<Shape>; 4] {
    let (Some(q), Some(k), Some(v)) = (&shapes[0], &shapes[1], &shapes[2]) else { return [None, None, None, None] };
    let heads = |name: &str| node.attr_int(name).filter(|&h| h > 0);
    let split = |d: &Dim, h: Option<i64>| match (d, h) {
        (Dim::Known(n), Some(h)) if n % h == 0 => Dim::Known(n / h),
        _ => Dim::Unknown,
    };
    // (batch, q heads, q seq, kv heads, kv seq, k head size, v head size)
    let dims = match (q.len(), k.len(), v.len()) {
        (4, 4, 4) => (q[0].clone(), q[1].clone(), q[2].clone(), k[1].clone(), k[2].clone(), k[3].clone(), v[3].clone()),
        (3, 3, 3) => {
            let (hq, hkv) = (heads("q_num_heads"), heads("kv_num_heads"));
            let known = |h: Option<i64>| h.map_or(Dim::Unknown, Dim::Known);
            (q[0].clone(), known(hq), q[1].clone(), known(hkv), k[1].clone(), split(&k[2], hkv), split(&v[2], hkv))
        }
        _ => return [None, None, None, None],
    };
    let (batch, q_heads, q_seq, kv_heads, kv_seq, head_size, v_head_size) = dims;
    let keys = if node.inputs.get(4).is_some_and(|i| i.is_some()) {
        shapes[4].as_ref().filter(|p| p.len() == 4).map_or(Dim::Unknown, |p| add_dims(&p[2], &kv_seq))
    } else {
        kv_seq
    };
    let y = if q.len() == 3 {
        let hidden = match (&q_heads, &v_head_size) {
            (Dim::Known(h), d) => mul_dim(d, *h),
            _ => Dim::Unknown,
        };
        vec![batch.clone(), q_seq.clone(), hidden]
    } else {
        vec![batch.clone(), q_heads.clone(), q_seq.clone(), v_head_size.clone()]
    };
    [
        Some(y),
        Some(vec![batch.clone(), kv_heads.clone(), keys.clone(), head_size]),
        Some(vec![batch.clone(), kv_heads, keys.clone(), v_head_size]),
        Some(vec![batch, q_heads, q_seq, keys]),
    ]
}

fn product(dims: &[Dim]) -> Dim {
    dims.iter().try_fold(1i64, |acc, d| d.known().map(|k| acc * k)).map(Dim::Known).unwrap_or_else(|| {
        let unknown: Vec<&Dim> = dims.iter().filter(|d| d.known() != Some(1)).collect();
        if unknown.len() == 1 { unknown[0].clone() } else { Dim::Unknown }
    })
}

fn add_dims(a: &Dim, b: &Dim) -> Dim {
    match (a, b) {
        (Dim::Known(x), Dim::Known(y)) => Dim::Known(x + y),
        _ => Dim::Unknown,
    }
}

fn mul_dim(d: &Dim, k: i64) -> Dim {
    match d {
        Dim::Known(x) => Dim::Known(x * k),
        _ if k == 1 => d.clone(),
        _ => Dim::Unknown,
    }
}

/// Shape arithmetic on values: elementwise ops on small integer vectors.
fn arith(op: &str, a: &Known, b: &Known) -> Option<Vec<Dim>> {
    let (x, y) = (a.value.as_ref()?, b.value.as_ref()?);
    let n = x.len().max(y.len());
    if !(x.len() == n || x.len() == 1) || !(y.len() == n || y.len() == 1) {
        return None;
    }
    (0..n).map(|i| {
        let (p, q) = (&x[if x.len() == 1 { 0 } else { i }], &y[if y.len() == 1 { 0 } else { i }]);
        Some(match (p.known(), q.known()) {
            (Some(u), Some(v)) => Dim::Known(match op {
                "Add" => u + v,
                "Sub" => u - v,
                "Mul" => u * v,
                "Div" if v != 0 => u.div_euclid(v),
                "Max" => u.max(v),
                "Min" => u.min(v),
                _ => return None,
            }),
            (_, Some(1)) if op == "Mul" || op == "Div" => p.clone(),
            (_, Some(0)) if op == "Add" || op == "Sub" => p.clone(),
            _ => Dim::Unknown,
        })
    }).collect()
}

fn reshape(from: Option<&Shape>, target: &[Dim], allowzero: bool) -> Shape {
    let mut out: Shape = target.iter().enumerate().map(|(i, d)| match d {
        Dim::Known(0) if !allowzero => from.and_then(|f| f.get(i).cloned()).unwrap_or(Dim::Unknown),
        d => d.clone(),
    }).collect();
    if let Some(pos) = out.iter().position(|d| *d == Dim::Known(-1)) {
        let total = from.and_then(|f| f.iter().try_fold(1i64, |a, d| d.known().map(|k| a * k)));
        let rest = out.iter().enumerate().filter(|(i, _)| *i != pos).try_fold(1i64, |a, (_, d)| d.known().map(|k| a * k));
        out[pos] = match (total, rest) {
            (Some(t), Some(r)) if r != 0 => Dim::Known(t / r),
            _ => {
                // A symbol that is the only unknown factor on both sides carries over.
                let syms_from: Vec<&Dim> = from.map(|f| f.iter().filter(|d| d.known().is_none()).collect()).unwrap_or_default();
                let same_known = from.map(|f| f.iter().filter_map(|d| d.known()).product::<i64>()) == rest;
                if syms_from.len() == 1 && same_known { syms_from[0].clone() } else { Dim::Unknown }
            }
        };
    }
    out
}

fn squeeze(op: &str, s: &Shape, axes: Option<Vec<i64>>) -> Option<Shape> {
    if op == "Squeeze" {
        return Some(match axes {
            Some(a) => {
                let ax: Vec<usize> = a.iter().map(|&v| norm_axis(v, s.len())).collect::<Option<_>>()?;
                s.iter().enumerate().filter(|(i, _)| !ax.contains(i)).map(|(_, d)| d.clone()).collect()
            }
            None if s.iter().all(|d| d.known().is_some()) => s.iter().filter(|d| d.known() != Some(1)).cloned().collect(),
            None => return None,
        });
    }
    let a = axes?;
    let r = s.len() + a.len();
    let mut ax: Vec<usize> = a.iter().map(|&v| norm_axis(v, r)).collect::<Option<_>>()?;
    ax.sort();
    let mut o = s.clone();
    for i in ax {
        o.insert(i.min(o.len()), Dim::Known(1));
    }
    Some(o)
}

fn slice_shape(s: &Shape, starts: &[i64], ends: &[i64], axes: Option<Vec<i64>>, steps: Option<Vec<i64>>) -> Shape {
    let mut o = s.clone();
    let axes: Vec<i64> = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    for (k, &a) in axes.iter().enumerate() {
        let Some(ax) = norm_axis(a, s.len()) else { return vec![Dim::Unknown; s.len()] };
        let step = steps.as_ref().and_then(|v| v.get(k).copied()).unwrap_or(1);
        o[ax] = match s[ax] {
            Dim::Known(d) if step != 0 => {
                let norm = |v: i64| if v < 0 { v + d } else { v };
                let (b, e) = if step > 0 { (norm(starts[k]).clamp(0, d), norm(ends[k]).clamp(0, d)) } else { (norm(starts[k]).clamp(-1, d - 1), norm(ends[k]).clamp(-1, d - 1)) };
                let n = if step > 0 { (e - b + step - 1).div_euclid(step) } else { (b - e - step - 1).div_euclid(-step) };
                Dim::Known(n.max(0))
            }
            _ if starts[k] == 0 && ends[k] >= i32::MAX as i64 && step == 1 => s[ax].clone(),
            _ => Dim::Unknown,
        };
    }
    o
}
