use std::fmt;

use crate::DType;

/// One dimension of a shape: a known size, a named symbolic size, or unknown.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dim {
    Known(i64),
    Sym(String),
    Unknown,
}

impl Dim {
    pub fn known(&self) -> Option<i64> {
        match self {
            Dim::Known(v) => Some(*v),
            _ => None,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Known(v) => write!(f, "{v}"),
            Dim::Sym(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A shape with possibly symbolic dimensions.
pub type Shape = Vec<Dim>;

/// The type of a value: ONNX `TypeProto`.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueType {
    /// A dense tensor; `None` element type or shape means unknown (unknown rank for the shape).
    Tensor { elem: Option<DType>, shape: Option<Shape> },
    SparseTensor { elem: Option<DType>, shape: Option<Shape> },
    Sequence(Option<Box<ValueType>>),
    Optional(Option<Box<ValueType>>),
    Map { key: Option<DType>, value: Option<Box<ValueType>> },
}

impl ValueType {
    pub fn tensor(elem: DType, shape: Shape) -> ValueType {
        ValueType::Tensor { elem: Some(elem), shape: Some(shape) }
    }

    pub fn tensor_of(elem: DType, dims: &[i64]) -> ValueType {
        Self::tensor(elem, dims.iter().map(|&d| Dim::Known(d)).collect())
    }

    /// The element type of a tensor type.
    pub fn elem(&self) -> Option<DType> {
        match self {
            ValueType::Tensor { elem, .. } | ValueType::SparseTensor { elem, .. } => *elem,
            _ => None,
        }
    }

    /// The shape of a tensor type, when its rank is known.
    pub fn shape(&self) -> Option<&Shape> {
        match self {
            ValueType::Tensor { shape, .. } | ValueType::SparseTensor { shape, .. } => shape.as_ref(),
            _ => None,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shape = |f: &mut fmt::Formatter<'_>, s: &Option<Shape>| match s {
            Some(s) => write!(f, "[{}]", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
            None => f.write_str("[..]"),
        };
        let elem = |e: &Option<DType>| e.map(|d| d.onnx_name()).unwrap_or("?");
        match self {
            ValueType::Tensor { elem: e, shape: s } => {
                f.write_str(elem(e))?;
                shape(f, s)
            }
            ValueType::SparseTensor { elem: e, shape: s } => {
                write!(f, "sparse {}", elem(e))?;
                shape(f, s)
            }
            ValueType::Sequence(t) => write!(f, "seq<{}>", t.as_deref().map(|t| t.to_string()).unwrap_or("?".into())),
            ValueType::Optional(t) => write!(f, "optional<{}>", t.as_deref().map(|t| t.to_string()).unwrap_or("?".into())),
            ValueType::Map { key, value } => write!(f, "map<{}, {}>", elem(key), value.as_deref().map(|t| t.to_string()).unwrap_or("?".into())),
        }
    }
}
