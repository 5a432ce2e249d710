//! Elementwise operators: unary math, binary arithmetic and comparisons with numpy
//! broadcasting, logic, `Where`, `Cast`, `Clip`, and the variadic `Sum`/`Max`/`Min`/`Mean`.

use half::{bf16, f16};
use qforge_ir::{DType, Tensor};

use super::util::{binary, input, kernel, map_into, min_items, opt_input, par_chunks_mut, slice, tensor, ternary, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Float ops of one input computed element by element: each output element depends only on
/// the input element at its position and on the node's attributes.
const UNARY_FLOAT: &[&str] = &["Relu", "Sigmoid", "Tanh", "Sqrt", "Exp", "Log", "Erf", "Reciprocal", "Floor", "Ceil", "Round", "Sin", "Cos",
    "Softplus", "Softsign", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Gelu", "Mish", "Shrink",
    "Tan", "Sinh", "Cosh", "Asin", "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Swish"];

/// Ops of one input computed element by element on signed and float types, with the first
/// opset of each.
const UNARY_SIGNED: &[(&str, i64)] = &[("Neg", 1), ("Abs", 1), ("Sign", 9)];

/// Registers the elementwise operators.
pub fn register(r: &mut Registry) {
    for op in UNARY_FLOAT {
        r.add("", op, 1, LATEST, unary_float);
    }
    for &(op, since) in UNARY_SIGNED {
        r.add("", op, since, LATEST, unary_signed);
    }
    r.add("", "IsNaN", 9, LATEST, is_class);
    r.add("", "IsInf", 10, LATEST, is_class);
    for op in ["Add", "Sub", "Mul", "Div"] {
        r.add("", op, 1, LATEST, arithmetic);
    }
    r.add("", "Pow", 1, LATEST, pow);
    r.add("", "Mod", 10, LATEST, modulo);
    r.add("", "PRelu", 1, LATEST, prelu);
    for op in ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"] {
        r.add("", op, 1, LATEST, compare);
    }
    for op in ["And", "Or", "Xor"] {
        r.add("", op, 1, LATEST, logic);
    }
    r.add("", "Not", 1, LATEST, not);
    for op in ["BitwiseAnd", "BitwiseOr", "BitwiseXor"] {
        r.add("", op, 18, LATEST, bitwise);
    }
    r.add("", "BitwiseNot", 18, LATEST, bitwise_not);
    r.add("", "BitShift", 11, LATEST, bit_shift);
    r.add("", "Where", 9, LATEST, where_);
    r.add("", "Cast", 1, LATEST, cast);
    r.add("", "CastLike", 15, LATEST, cast_like);
    r.add("", "Clip", 1, LATEST, clip);
    for op in ["Sum", "Max", "Min", "Mean"] {
        r.add("", op, 1, LATEST, variadic);
    }
}

/// Whether the default-domain op `op` maps each element of its first input to one output
/// element by a function fixed by its attributes and its other inputs when those are
/// constant: the single-input elementwise ops, and `Clip` (bounds as inputs).
pub(crate) fn is_pointwise(op: &str) -> bool {
    op == "Clip" || UNARY_FLOAT.contains(&op) || UNARY_SIGNED.iter().any(|&(o, _)| o == op)
}

/// Converts a float tensor of any float type to f32 values.
pub fn to_f32(t: &Tensor) -> RuntimeResult<std::borrow::Cow<'_, [f32]>> {
    Ok(match t.dtype() {
        DType::F32 => std::borrow::Cow::Borrowed(t.as_slice::<f32>().unwrap()),
        DType::F16 => std::borrow::Cow::Owned(t.as_slice::<f16>().unwrap().iter().map(|v| v.to_f32()).collect()),
        DType::BF16 => std::borrow::Cow::Owned(t.as_slice::<bf16>().unwrap().iter().map(|v| v.to_f32()).collect()),
        DType::F64 => std::borrow::Cow::Owned(t.as_slice::<f64>().unwrap().iter().map(|&v| v as f32).collect()),
        d => return Err(kernel_error(format!("expected a float tensor, got {d}"))),
    })
}

/// A float tensor of `dtype` from f32 values.
pub fn from_f32(dtype: DType, shape: &[usize], v: Vec<f32>) -> RuntimeResult<Tensor> {
    match dtype {
        DType::F32 => tensor(shape, v),
        DType::F16 => tensor(shape, v.into_iter().map(f16::from_f32).collect::<Vec<_>>()),
        DType::BF16 => tensor(shape, v.into_iter().map(bf16::from_f32).collect::<Vec<_>>()),
        DType::F64 => tensor(shape, v.into_iter().map(|x| x as f64).collect::<Vec<_>>()),
        d => Err(kernel_error(format!("expected a float type, got {d}"))),
    }
}

/// [`to_f32`], also taking 8-bit integer tensors, which f32 holds exactly: for ops that only
/// select or copy elements (MaxPool, nearest Resize), which then give the same integers.
pub fn values_f32(t: &Tensor) -> RuntimeResult<std::borrow::Cow<'_, [f32]>> {
    match t.dtype() {
        DType::U8 => Ok(t.as_slice::<u8>().unwrap().iter().map(|&v| v as f32).collect::<Vec<_>>().into()),
        DType::I8 => Ok(t.as_slice::<i8>().unwrap().iter().map(|&v| v as f32).collect::<Vec<_>>().into()),
        _ => to_f32(t),
    }
}

/// [`from_f32`], also making 8-bit integer tensors from values [`values_f32`] selected.
pub fn values_from_f32(dtype: DType, shape: &[usize], v: Vec<f32>) -> RuntimeResult<Tensor> {
    match dtype {
        DType::U8 => tensor(shape, v.into_iter().map(|x| x as u8).collect::<Vec<_>>()),
        DType::I8 => tensor(shape, v.into_iter().map(|x| x as i8).collect::<Vec<_>>()),
        d => from_f32(d, shape, v),
    }
}

/// The logistic function, as the Sigmoid kernel computes it (vectorizable).
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + super::math::exp(-x))
}

/// GELU with the exact error function: `0.5 x (1 + erf(x / sqrt 2))`.
#[inline(always)]
pub(super) fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + super::math::erf(x / std::f32::consts::SQRT_2))
}

/// GELU's tanh approximation: `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
#[inline(always)]
pub(super) fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + super::math::tanh((2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x)))
}

/// A unary float kernel: `f` is monomorphized into the loop (so it vectorizes) and applied
/// in parallel chunks for large tensors.
pub(super) fn unary(f: impl Fn(f32) -> f32 + Copy + Send + Sync + 'static) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(move |ins| {
        const CHUNK: usize = 1 << 14;
        let x = input(ins, 0)?;
        let src = to_f32(x)?;
        let mut v = vec![0f32; src.len()];
        par_chunks_mut(&mut v, CHUNK, min_items(CHUNK * ELEMENT_WORK), || (), |_, i, d| map_into(d, &src[i * CHUNK..i * CHUNK + d.len()], f));
        Ok(vec![from_f32(x.dtype(), x.shape(), v)?])
    })
}

/// The ops of [`UNARY_FLOAT`] on f16, bf16, f32 and f64 (computed in f32), with their
/// attributes' defaults; the trigonometric and hyperbolic ones (Tan, Sinh, Cosh, Asin, Acos,
/// Atan from opset 7, Asinh, Acosh, Atanh from opset 9) give NaN outside their domain;
/// Swish (opset 24) is `x * sigmoid(alpha * x)`, `alpha` 1 by default.
fn unary_float(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let alpha = |d| info.attr_float("alpha", d);
    match info.node.op_type.as_str() {
        "Relu" => unary(|x: f32| x.max(0.0)),
        "Sigmoid" => unary(sigmoid),
        "Tanh" => unary(super::math::tanh),
        "Sqrt" => unary(f32::sqrt),
        "Exp" => unary(super::math::exp),
        "Log" => unary(f32::ln),
        "Erf" => unary(super::math::erf),
        "Reciprocal" => unary(|x: f32| 1.0 / x),
        "Floor" => unary(f32::floor),
        "Ceil" => unary(f32::ceil),
        "Round" => unary(f32::round_ties_even),
        "Sin" => unary(f32::sin),
        "Cos" => unary(f32::cos),
        "Tan" => unary(f32::tan),
        "Sinh" => unary(f32::sinh),
        "Cosh" => unary(f32::cosh),
        "Asin" => unary(f32::asin),
        "Acos" => unary(f32::acos),
        "Atan" => unary(f32::atan),
        "Asinh" => unary(f32::asinh),
        "Acosh" => unary(f32::acosh),
        "Atanh" => unary(f32::atanh),
        "Swish" => {
            let a = alpha(1.0);
            unary(move |x: f32| x * sigmoid(a * x))
        }
        "Softplus" => unary(|x: f32| if x > 20.0 { x } else { x.exp().ln_1p() }),
        "Softsign" => unary(|x: f32| x / (1.0 + x.abs())),
        "HardSigmoid" => {
            let (a, b) = (alpha(0.2), info.attr_float("beta", 0.5));
            unary(move |x: f32| (a * x + b).clamp(0.0, 1.0))
        }
        "HardSwish" => unary(|x: f32| super::fused::Unary::HardSwish.apply(x)),
        "LeakyRelu" => {
            let a = alpha(0.01);
            unary(move |x: f32| if x < 0.0 { a * x } else { x })
        }
        "Elu" => {
            let a = alpha(1.0);
            unary(move |x: f32| if x < 0.0 { a * (x.exp() - 1.0) } else { x })
        }
        "Selu" => {
            let (a, g) = (alpha(1.673_263_2), info.attr_float("gamma", 1.050_701));
            unary(move |x: f32| if x <= 0.0 { g * (a * x.exp() - a) } else { g * x })
        }
        "Celu" => {
            let a = alpha(1.0);
            unary(move |x: f32| x.max(0.0) + (a * ((x / a).exp() - 1.0)).min(0.0))
        }
        "ThresholdedRelu" => {
            let a = alpha(1.0);
            unary(move |x: f32| if x > a { x } else { 0.0 })
        }
        "Gelu" if info.attr_str("approximate", "none") == "tanh" => unary(gelu_tanh),
        "Gelu" => unary(gelu_erf),
        "Mish" => unary(|x: f32| x * super::math::tanh(if x > 20.0 { x } else { x.exp().ln_1p() })),
        "Shrink" => {
            let (lambd, bias) = (info.attr_float("lambd", 0.5), info.attr_float("bias", 0.0));
            unary(move |x: f32| if x < -lambd { x + bias } else if x > lambd { x - bias } else { 0.0 })
        }
        other => Err(info.error(format!("{other} is not a unary float op"))),
    }
}

fn unary_signed(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    kernel(move |ins| {
        let x = input(ins, 0)?;
        macro_rules! go {
            ($T:ty, $zero:expr, $one:expr) => {{
                let v: Vec<$T> = slice::<$T>(x, "X")?.iter().map(|&v| match op.as_str() {
                    "Neg" => $zero - v,
                    "Abs" => if v < $zero { $zero - v } else { v },
                    _ => if v > $zero { $one } else if v < $zero { $zero - $one } else { $zero },
                }).collect();
                tensor(x.shape(), v)?
            }};
        }
        let out = match x.dtype() {
            DType::F32 => go!(f32, 0.0, 1.0),
            DType::F64 => go!(f64, 0.0, 1.0),
            DType::I64 => go!(i64, 0, 1),
            DType::I32 => go!(i32, 0, 1),
            DType::I16 => go!(i16, 0, 1),
            DType::I8 => go!(i8, 0, 1),
            DType::F16 | DType::BF16 => {
                let v: Vec<f32> = to_f32(x)?.iter().map(|&v| match op.as_str() { "Neg" => -v, "Abs" => v.abs(), _ => if v > 0.0 { 1.0 } else if v < 0.0 { -1.0 } else { 0.0 } }).collect();
                from_f32(x.dtype(), x.shape(), v)?
            }
            d => return Err(kernel_error(format!("{op} does not support {d}"))),
        };
        Ok(vec![out])
    })
}

fn is_class(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    let (pos, neg) = (info.attr_int("detect_positive", 1) != 0, info.attr_int("detect_negative", 1) != 0);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let v: Vec<bool> = to_f32(x)?.iter().map(|&v| if op == "IsNaN" { v.is_nan() } else { v.is_infinite() && ((v > 0.0 && pos) || (v < 0.0 && neg)) }).collect();
        Ok(vec![Tensor::from_bools(x.shape(), &v).map_err(|e| kernel_error(e.to_string()))?])
    })
}

/// `a op b` for two tensors of the same numeric type.
fn arith(op: &str, a: &Tensor, b: &Tensor) -> RuntimeResult<Tensor> {
    if a.dtype() != b.dtype() {
        return Err(kernel_error(format!("{op} needs inputs of one type, got {} and {}", a.dtype(), b.dtype())));
    }
    macro_rules! go {
        ($T:ty, $div:expr) => {{
            let (x, y) = (slice::<$T>(a, "A")?, slice::<$T>(b, "B")?);
            let (v, s) = match op {
                "Add" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p + q)?,
                "Sub" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p - q)?,
                "Mul" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p * q)?,
                _ => binary(x, a.shape(), y, b.shape(), $div)?,
            };
            tensor(&s, v)?
        }};
    }
    macro_rules! int {
        ($T:ty) => {{
            let (x, y) = (slice::<$T>(a, "A")?, slice::<$T>(b, "B")?);
            if op == "Div" && y.iter().any(|&q| q == 0) {
                return Err(kernel_error("integer division by zero"));
            }
            let (v, s) = match op {
                "Add" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p.wrapping_add(q))?,
                "Sub" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p.wrapping_sub(q))?,
                "Mul" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p.wrapping_mul(q))?,
                _ => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p.wrapping_div(q))?,
            };
            tensor(&s, v)?
        }};
    }
    Ok(match a.dtype() {
        DType::F32 => go!(f32, |p: f32, q: f32| p / q),
        DType::F64 => go!(f64, |p: f64, q: f64| p / q),
        DType::I64 => int!(i64),
        DType::I32 => int!(i32),
        DType::I16 => int!(i16),
        DType::I8 => int!(i8),
        DType::U8 => int!(u8),
        DType::U16 => int!(u16),
        DType::U32 => int!(u32),
        DType::U64 => int!(u64),
        DType::F16 | DType::BF16 => {
            let (x, y) = (to_f32(a)?, to_f32(b)?);
            let f = match op { "Add" => |p: f32, q: f32| p + q, "Sub" => |p, q| p - q, "Mul" => |p, q| p * q, _ => |p, q| p / q };
            let (v, s) = binary(&x, a.shape(), &y, b.shape(), f)?;
            from_f32(a.dtype(), &s, v)?
        }
        d => return Err(kernel_error(format!("{op} does not support {d}"))),
    })
}

/// `b` laid against `a`'s dimensions from `axis` on (legacy broadcasting, opsets before 7):
/// its shape padded with 1s before and after, so numpy broadcasting then applies.
fn legacy_broadcast(a: &Tensor, b: &Tensor, axis: i64) -> RuntimeResult<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    let at = super::util::axis(axis, ra)?;
    if at + rb > ra {
        return Err(kernel_error(format!("B of shape {:?} does not fit A of shape {:?} from axis {axis}", b.shape(), a.shape())));
    }
    let shape: Vec<usize> = (0..ra).map(|d| if (at..at + rb).contains(&d) { b.shape()[d - at] } else { 1 }).collect();
    b.reshaped(&shape).map_err(|e| kernel_error(e.to_string()))
}

/// Add, Sub, Mul, Div (opsets 1 on): numpy broadcasting; before opset 7 with `broadcast` set
/// and an `axis`, B's dimensions align with A's from that axis.
fn arithmetic(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    let legacy_axis = if info.opset < 7 && info.attr_int("broadcast", 0) != 0 { info.node.attr_int("axis") } else { None };
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        match legacy_axis {
            Some(ax) => Ok(vec![arith(&op, a, &legacy_broadcast(a, b, ax)?)?]),
            None => Ok(vec![arith(&op, a, b)?]),
        }
    })
}

fn pow(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        if a.dtype().is_float() {
            let (x, y) = (to_f32(a)?, to_f32(b).or_else(|_| b.to_f64_vec().map(|v| v.into_iter().map(|x| x as f32).collect::<Vec<_>>().into()).map_err(|e| kernel_error(e.to_string())))?);
            let (v, s) = binary(&x, a.shape(), &y, b.shape(), |p: f32, q: f32| if q == 2.0 { p * p } else if q == 0.5 { p.sqrt() } else { p.powf(q) })?;
            return Ok(vec![from_f32(a.dtype(), &s, v)?]);
        }
        let x = a.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?;
        let y = b.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?;
        let (v, s) = binary(&x, a.shape(), &y, b.shape(), |p: i64, q: f64| (p as f64).powf(q) as i64)?;
        let t = tensor(&s, v)?;
        Ok(vec![super::shape::cast_tensor(&t, a.dtype())?])
    })
}

fn modulo(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let fmod = info.attr_int("fmod", 0) != 0;
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        if a.dtype().is_float() {
            let (x, y) = (to_f32(a)?, to_f32(b)?);
            let (v, s) = binary(&x, a.shape(), &y, b.shape(), |p: f32, q: f32| {
                let r = p % q;
                if fmod || r == 0.0 || (r < 0.0) == (q < 0.0) { r } else { r + q }
            })?;
            return Ok(vec![from_f32(a.dtype(), &s, v)?]);
        }
        let (x, y) = (a.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?, b.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?);
        if y.contains(&0) {
            return Err(kernel_error("integer modulo by zero"));
        }
        let (v, s) = binary(&x, a.shape(), &y, b.shape(), |p: i64, q: i64| if fmod { p % q } else { ((p % q) + q) % q })?;
        Ok(vec![super::shape::cast_tensor(&tensor(&s, v)?, a.dtype())?])
    })
}

/// PRelu: `x < 0 ? slope * x : x`. From opset 7 the slope broadcasts numpy-style; before,
/// a 1-D slope of one value per channel applies along axis 1.
fn prelu(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let per_channel = info.opset < 7;
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        let channel_slope;
        let b = if per_channel && a.rank() >= 2 && b.rank() == 1 && b.len() == a.shape()[1] && b.len() != 1 {
            channel_slope = legacy_broadcast(a, b, 1)?;
            &channel_slope
        } else {
            b
        };
        let (x, y) = (to_f32(a)?, to_f32(b)?);
        let (v, s) = binary(&x, a.shape(), &y, b.shape(), |p: f32, q: f32| if p < 0.0 { p * q } else { p })?;
        Ok(vec![from_f32(a.dtype(), &s, v)?])
    })
}

fn compare(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        let cmp = |p: f64, q: f64| match op.as_str() {
            "Equal" => p == q,
            "Less" => p < q,
            "Greater" => p > q,
            "LessOrEqual" => p <= q,
            _ => p >= q,
        };
        let (v, s) = if a.dtype() == DType::F32 && b.dtype() == DType::F32 {
            binary(a.as_slice::<f32>().unwrap(), a.shape(), b.as_slice::<f32>().unwrap(), b.shape(), |p, q| cmp(p as f64, q as f64))?
        } else if a.dtype() == DType::I64 && b.dtype() == DType::I64 {
            binary(a.as_slice::<i64>().unwrap(), a.shape(), b.as_slice::<i64>().unwrap(), b.shape(), |p, q| match op.as_str() {
                "Equal" => p == q, "Less" => p < q, "Greater" => p > q, "LessOrEqual" => p <= q, _ => p >= q,
            })?
        } else if let (Some(x), Some(y)) = (a.strings(), b.strings()) {
            let (ix, iy): (Vec<usize>, Vec<usize>) = ((0..x.len()).collect(), (0..y.len()).collect());
            binary(&ix, a.shape(), &iy, b.shape(), |p, q| x[p] == y[q])?
        } else {
            let (x, y) = (a.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?, b.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?);
            binary(&x, a.shape(), &y, b.shape(), cmp)?
        };
        Ok(vec![Tensor::from_bools(&s, &v).map_err(|e| kernel_error(e.to_string()))?])
    })
}

fn bools(t: &Tensor) -> RuntimeResult<Vec<bool>> {
    t.bools().map_err(|_| kernel_error(format!("expected a bool tensor, got {}", t.dtype())))
}

fn logic(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        let (x, y) = (bools(a)?, bools(b)?);
        let (v, s) = binary(&x, a.shape(), &y, b.shape(), |p, q| match op.as_str() { "And" => p && q, "Or" => p || q, _ => p != q })?;
        Ok(vec![Tensor::from_bools(&s, &v).map_err(|e| kernel_error(e.to_string()))?])
    })
}

fn not(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let v: Vec<bool> = bools(x)?.into_iter().map(|b| !b).collect();
        Ok(vec![Tensor::from_bools(x.shape(), &v).map_err(|e| kernel_error(e.to_string()))?])
    })
}

/// Calls `$go!(T)` with the Rust type of an integer dtype, or returns an error naming `$op`.
macro_rules! with_integer_type {
    ($dtype:expr, $op:expr, $go:ident) => {
        match $dtype {
            DType::U8 => $go!(u8),
            DType::U16 => $go!(u16),
            DType::U32 => $go!(u32),
            DType::U64 => $go!(u64),
            DType::I8 => $go!(i8),
            DType::I16 => $go!(i16),
            DType::I32 => $go!(i32),
            DType::I64 => $go!(i64),
            d => return Err(kernel_error(format!("{} needs an integer type, got {d}", $op))),
        }
    };
}

/// Two inputs of one type, for the binary bitwise ops.
fn same_type_pair<'a>(op: &str, ins: &[Option<&'a Tensor>]) -> RuntimeResult<(&'a Tensor, &'a Tensor)> {
    let (a, b) = (input(ins, 0)?, input(ins, 1)?);
    if a.dtype() != b.dtype() {
        return Err(kernel_error(format!("{op} needs inputs of one type, got {} and {}", a.dtype(), b.dtype())));
    }
    Ok((a, b))
}

/// BitwiseAnd, BitwiseOr, BitwiseXor (opset 18): the bitwise operation on two integer
/// tensors of one type, with numpy broadcasting.
fn bitwise(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    kernel(move |ins| {
        let (a, b) = same_type_pair(&op, ins)?;
        macro_rules! go {
            ($T:ty) => {{
                let (x, y) = (slice::<$T>(a, "A")?, slice::<$T>(b, "B")?);
                let (v, s) = match op.as_str() {
                    "BitwiseAnd" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p & q)?,
                    "BitwiseOr" => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p | q)?,
                    _ => binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| p ^ q)?,
                };
                tensor(&s, v)?
            }};
        }
        Ok(vec![with_integer_type!(a.dtype(), op, go)])
    })
}

/// BitwiseNot (opset 18): the bitwise complement of an integer tensor.
fn bitwise_not(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        macro_rules! go {
            ($T:ty) => {
                tensor(x.shape(), slice::<$T>(x, "X")?.iter().map(|&v| !v).collect::<Vec<$T>>())?
            };
        }
        Ok(vec![with_integer_type!(x.dtype(), "BitwiseNot", go)])
    })
}

/// BitShift (opset 11 for unsigned types, opset 28 adds signed ones): `X` shifted by `Y`
/// bits (numpy broadcasting) toward `direction` "LEFT" or "RIGHT". Left shifts drop the bits
/// shifted out; right shifts of signed values are arithmetic. A shift that is negative or at
/// least the type's width gives -1 for a right shift of a negative value, else 0.
fn bit_shift(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let right = match info.node.attr_str("direction") {
        Some("RIGHT") => true,
        Some("LEFT") => false,
        Some(other) => return Err(info.error(format!("direction must be \"LEFT\" or \"RIGHT\", got \"{other}\""))),
        None => return Err(info.error("the 'direction' attribute is required")),
    };
    kernel(move |ins| {
        let (a, b) = same_type_pair("BitShift", ins)?;
        macro_rules! go {
            ($T:ty) => {{
                let (x, y) = (slice::<$T>(a, "X")?, slice::<$T>(b, "Y")?);
                let (v, s) = binary(x, a.shape(), y, b.shape(), |p: $T, q: $T| {
                    let shift = q as i128;
                    if shift < 0 || shift >= <$T>::BITS as i128 {
                        if right && (p as i128) < 0 { !0 } else { 0 }
                    } else if right {
                        p >> shift as u32
                    } else {
                        p.wrapping_shl(shift as u32)
                    }
                })?;
                tensor(&s, v)?
            }};
        }
        Ok(vec![with_integer_type!(a.dtype(), "BitShift", go)])
    })
}

fn where_(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let (c, a, b) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        if a.dtype() != b.dtype() {
            return Err(kernel_error(format!("Where needs X and Y of one type, got {} and {}", a.dtype(), b.dtype())));
        }
        let cond = bools(c)?;
        let (ia, ib): (Vec<usize>, Vec<usize>) = ((0..a.len()).collect(), (0..b.len()).collect());
        let (pick, shape) = ternary((&cond, c.shape()), (&ia, a.shape()), (&ib, b.shape()), |c, x, y| if c { (true, x) } else { (false, y) })?;
        let n = pick.len();
        let out = if a.dtype() == DType::F32 {
            let (x, y) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
            tensor(&shape, pick.iter().map(|&(s, i)| if s { x[i] } else { y[i] }).collect::<Vec<f32>>())?
        } else {
            let width = a.dtype().bits() / 8;
            let (x, y) = (a.raw_bytes().ok_or_else(|| kernel_error("Where on strings is not supported"))?, b.raw_bytes().unwrap());
            let mut raw = Vec::with_capacity(n * width);
            for &(s, i) in &pick {
                raw.extend_from_slice(if s { &x[i * width..(i + 1) * width] } else { &y[i * width..(i + 1) * width] });
            }
            Tensor::from_raw(a.dtype(), &shape, &raw).map_err(|e| kernel_error(e.to_string()))?
        };
        Ok(vec![out])
    })
}

fn cast(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let to = info.attr_int("to", 0);
    let to = DType::from_onnx(to as i32).ok_or_else(|| info.error(format!("'to' = {to} is not a known type")))?;
    kernel(move |ins| Ok(vec![super::shape::cast_tensor(input(ins, 0)?, to)?]))
}

fn cast_like(_: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| Ok(vec![super::shape::cast_tensor(input(ins, 0)?, input(ins, 1)?.dtype())?]))
}

fn clip(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let attrs = (info.opset < 11).then(|| (info.attr_float("min", f32::MIN), info.attr_float("max", f32::MAX)));
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let bound = |i: usize, default: f64| -> RuntimeResult<f64> {
            match opt_input(ins, i) {
                Some(t) => t.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?.first().copied().ok_or_else(|| kernel_error("Clip bound is empty")),
                None => Ok(default),
            }
        };
        let (lo, hi) = match attrs {
            Some((lo, hi)) => (lo as f64, hi as f64),
            None => (bound(1, f64::NEG_INFINITY)?, bound(2, f64::INFINITY)?),
        };
        if x.dtype().is_float() {
            let (lo, hi) = (lo as f32, hi as f32);
            let v: Vec<f32> = to_f32(x)?.iter().map(|&v| v.max(lo).min(hi)).collect();
            return Ok(vec![from_f32(x.dtype(), x.shape(), v)?]);
        }
        let v: Vec<i64> = x.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?.into_iter()
            .map(|v| (v as f64).max(lo).min(hi) as i64).collect();
        Ok(vec![super::shape::cast_tensor(&tensor(x.shape(), v)?, x.dtype())?])
    })
}

fn variadic(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let op = info.node.op_type.clone();
    kernel(move |ins| {
        let present: Vec<&Tensor> = ins.iter().flatten().copied().collect();
        let first = *present.first().ok_or_else(|| kernel_error(format!("{op} needs at least one input")))?;
        let mut acc = first.clone();
        for t in &present[1..] {
            acc = match op.as_str() {
                "Sum" | "Mean" => arith("Add", &acc, t)?,
                _ => {
                    if acc.dtype().is_float() {
                        let (x, y) = (to_f32(&acc)?, to_f32(t)?);
                        let (v, s) = if op == "Max" {
                            binary(&x, acc.shape(), &y, t.shape(), |p: f32, q: f32| if p.is_nan() || q.is_nan() { f32::NAN } else { p.max(q) })?
                        } else {
                            binary(&x, acc.shape(), &y, t.shape(), |p: f32, q: f32| if p.is_nan() || q.is_nan() { f32::NAN } else { p.min(q) })?
                        };
                        from_f32(acc.dtype(), &s, v)?
                    } else {
                        let (x, y) = (acc.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?, t.to_i64_vec().map_err(|e| kernel_error(e.to_string()))?);
                        let (v, s) = binary(&x, acc.shape(), &y, t.shape(), |p: i64, q: i64| if op == "Max" { p.max(q) } else { p.min(q) })?;
                        super::shape::cast_tensor(&tensor(&s, v)?, acc.dtype())?
                    }
                }
            };
        }
        if op == "Mean" {
            let n = present.len() as f32;
            let v: Vec<f32> = to_f32(&acc)?.iter().map(|&v| v / n).collect();
            acc = from_f32(acc.dtype(), acc.shape(), v)?;
        }
        Ok(vec![acc])
    })
}
