//! Values of a run: dense tensors, and ONNX's sequences and optionals.

use std::fmt;

use qforge_ir::{DType, Tensor};

/// A value a run computes or is fed: a dense tensor, a sequence of tensors, or an optional.
/// Most kernels see tensors only ([`crate::Kernel`]); the sequence and optional ops, Identity
/// and control flow see any value ([`crate::ValueKernel`]).
#[derive(Clone, PartialEq)]
pub enum Value {
    Tensor(Tensor),
    Sequence(Sequence),
    /// An optional holding a tensor or a sequence (`Some`), or empty (`None`).
    Optional(Option<Box<Value>>),
}

/// An ONNX `seq(tensor(T))`: tensors of one element type, in order, possibly of different
/// shapes. The element type is known even when the sequence is empty.
#[derive(Clone, PartialEq)]
pub struct Sequence {
    pub dtype: DType,
    pub items: Vec<Tensor>,
}

impl Value {
    /// The tensor, when the value is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The tensor, when the value is one; else the value back.
    pub fn into_tensor(self) -> Result<Tensor, Value> {
        match self {
            Value::Tensor(t) => Ok(t),
            v => Err(v),
        }
    }

    /// The sequence, when the value is one.
    pub fn as_sequence(&self) -> Option<&Sequence> {
        match self {
            Value::Sequence(s) => Some(s),
            _ => None,
        }
    }

    /// The tensors the value holds, named after `name` as files and reports write them: a
    /// tensor as `name`, a sequence's items as `name[0]`, `name[1]`, ..., an optional as what
    /// it holds; an empty optional and an empty sequence hold none.
    pub fn into_named_tensors(self, name: &str) -> Vec<(String, Tensor)> {
        match self {
            Value::Tensor(t) => vec![(name.to_string(), t)],
            Value::Sequence(s) => s.items.into_iter().enumerate().map(|(i, t)| (format!("{name}[{i}]"), t)).collect(),
            Value::Optional(None) => vec![],
            Value::Optional(Some(v)) => v.into_named_tensors(name),
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Value {
        Value::Tensor(t)
    }
}

/// What the value is, for messages: `a float tensor of shape [2, 3]`, `a sequence of 4
/// int64 tensors`, `an empty optional`, `an optional of ...`.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Tensor(t) => write!(f, "a {} tensor of shape {:?}", t.dtype(), t.shape()),
            Value::Sequence(s) => write!(f, "a {s:?}"),
            Value::Optional(None) => write!(f, "an empty optional"),
            Value::Optional(Some(v)) => write!(f, "an optional of {v}"),
        }
    }
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Debug for Sequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sequence of {} {} tensors", self.items.len(), self.dtype)
    }
}
