use crate::DType;

/// Errors raised by IR operations. Every variant names the node, value or tensor involved.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum IrError {
    #[error("tensor '{tensor}': {reason}")]
    BadTensor { tensor: String, reason: String },
    #[error("tensor '{tensor}' holds {actual} elements, but the requested view is {requested}")]
    DTypeMismatch { tensor: String, actual: DType, requested: DType },
    #[error("tensor of shape {shape:?} and type {dtype} needs {needed} bytes, which exceeds the limit of {limit} bytes")]
    TooLarge { shape: Vec<usize>, dtype: DType, needed: u128, limit: u64 },
    #[error("graph '{graph}': value '{value}' is defined more than once")]
    DuplicateValue { graph: String, value: String },
    #[error("graph '{graph}': node '{node}' ({op}) reads value #{value}, which does not exist")]
    DanglingValue { graph: String, node: String, op: String, value: u32 },
    #[error("graph '{graph}': {what}")]
    Invalid { graph: String, what: String },
    #[error("graph '{graph}': the nodes {nodes:?} form a cycle")]
    Cycle { graph: String, nodes: Vec<String> },
    #[error("graph '{graph}': value '{value}' is declared {declared} but {actual}")]
    TypeMismatch { graph: String, value: String, declared: String, actual: String },
    #[error("patch rejected on graph '{graph}': {reason}")]
    Patch { graph: String, reason: String },
}

pub type IrResult<T> = Result<T, IrError>;
