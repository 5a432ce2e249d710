//! The qforge graph IR.
//!
//! * [`Tensor`]: a dense n-dimensional array of any ONNX element type, including packed
//!   4-bit integers, with 8-byte-aligned shared storage.
//! * [`Graph`], [`Node`], [`Value`]: an SSA dataflow graph. Values are edges; every value has
//!   at most one producer. Subgraphs (If/Loop/Scan bodies) live in node attributes and refer to
//!   values of enclosing graphs through [`ValueKind::Outer`] values.
//! * [`Patch`]: the only way passes edit a graph besides appending. A rewrite builds a patch
//!   and [`Graph::apply`] commits it atomically.
//! * [`Graph::check`]: structural consistency (dangling values, cycles, duplicate names,
//!   declared types versus constant data).
//! * [`Model`]: a graph plus the model-level metadata of an ONNX file.
//! * [`infer`]: shape and type inference with symbolic dimensions.

mod attr;
mod check;
mod dtype;
mod error;
mod graph;
pub mod infer;
mod model;
mod patch;
mod scope;
mod tensor;
mod types;

pub use attr::{Attr, Attribute};
pub use dtype::DType;
pub use error::{IrError, IrResult};
pub use graph::{Graph, GraphPath, Node, NodeId, Value, ValueId, ValueKind, CAPTURE_USE};
pub use model::{Function, Model, OpsetImport};

/// ONNX Runtime's contrib-op domain (e.g. its 16- and 4-bit `QuantizeLinear` below opset 21).
pub const MS_DOMAIN: &str = "com.microsoft";
pub use patch::Patch;
pub use scope::node_scope;
pub use tensor::{Elem, Tensor};
pub use types::{Dim, Shape, ValueType};
