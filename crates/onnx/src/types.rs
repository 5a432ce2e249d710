//! `TypeProto` <-> [`ValueType`].
//!
//! Not carried over: type and dimension denotations, and opaque types (read as unknown).

use qforge_ir::{DType, Dim, Shape, ValueType};

use crate::proto::{self, tensor_shape_proto::dimension, type_proto};

fn elem(code: Option<i32>) -> Option<DType> {
    code.and_then(DType::from_onnx)
}

fn shape(s: &Option<proto::TensorShapeProto>) -> Option<Shape> {
    s.as_ref().map(|s| {
        s.dim.iter().map(|d| match &d.value {
            Some(dimension::Value::DimValue(v)) => Dim::Known(*v),
            Some(dimension::Value::DimParam(p)) => Dim::Sym(p.clone()),
            None => Dim::Unknown,
        }).collect()
    })
}

/// The IR type of a `TypeProto`; `None` for an empty or opaque type.
pub fn from_proto(t: &proto::TypeProto) -> Option<ValueType> {
    Some(match t.value.as_ref()? {
        type_proto::Value::TensorType(t) => ValueType::Tensor { elem: elem(t.elem_type), shape: shape(&t.shape) },
        type_proto::Value::SparseTensorType(t) => ValueType::SparseTensor { elem: elem(t.elem_type), shape: shape(&t.shape) },
        type_proto::Value::SequenceType(s) => ValueType::Sequence(s.elem_type.as_deref().and_then(from_proto).map(Box::new)),
        type_proto::Value::OptionalType(o) => ValueType::Optional(o.elem_type.as_deref().and_then(from_proto).map(Box::new)),
        type_proto::Value::MapType(m) => ValueType::Map {
            key: elem(m.key_type),
            value: m.value_type.as_deref().and_then(from_proto).map(Box::new),
        },
        type_proto::Value::OpaqueType(_) => return None,
    })
}

fn shape_proto(s: &Option<Shape>) -> Option<proto::TensorShapeProto> {
    s.as_ref().map(|s| proto::TensorShapeProto {
        dim: s.iter().map(|d| proto::tensor_shape_proto::Dimension {
            denotation: None,
            value: match d {
                Dim::Known(v) => Some(dimension::Value::DimValue(*v)),
                Dim::Sym(p) => Some(dimension::Value::DimParam(p.clone())),
                Dim::Unknown => None,
            },
        }).collect(),
    })
}

/// Whether every tensor in `t` has a known element type. ONNX requires `elem_type` on tensor
/// types, and ONNX Runtime refuses a model whose value info lacks one ("Invalid tensor data type
/// 0"), so a value whose type is only partly known is written without a type.
pub fn is_complete(t: &ValueType) -> bool {
    match t {
        ValueType::Tensor { elem, .. } | ValueType::SparseTensor { elem, .. } => elem.is_some(),
        ValueType::Sequence(e) | ValueType::Optional(e) => e.as_deref().is_some_and(is_complete),
        ValueType::Map { key, value } => key.is_some() && value.as_deref().is_some_and(is_complete),
    }
}

/// The `TypeProto` of an IR type.
pub fn to_proto(t: &ValueType) -> proto::TypeProto {
    let code = |d: &Option<DType>| d.map(|d| d.onnx_code());
    let boxed = |t: &Option<Box<ValueType>>| t.as_deref().map(|t| Box::new(to_proto(t)));
    let value = match t {
        ValueType::Tensor { elem, shape } => type_proto::Value::TensorType(type_proto::Tensor { elem_type: code(elem), shape: shape_proto(shape) }),
        ValueType::SparseTensor { elem, shape } => type_proto::Value::SparseTensorType(type_proto::SparseTensor { elem_type: code(elem), shape: shape_proto(shape) }),
        ValueType::Sequence(e) => type_proto::Value::SequenceType(Box::new(type_proto::Sequence { elem_type: boxed(e) })),
        ValueType::Optional(e) => type_proto::Value::OptionalType(Box::new(type_proto::Optional { elem_type: boxed(e) })),
        ValueType::Map { key, value } => type_proto::Value::MapType(Box::new(type_proto::Map { key_type: code(key), value_type: boxed(value) })),
    };
    proto::TypeProto { denotation: None, value: Some(value) }
}
