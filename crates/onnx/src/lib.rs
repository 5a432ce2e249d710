//! ONNX model loading and saving.
//!
//! * [`load`] / [`load_bytes`]: `ModelProto` to [`qforge_ir::Model`], with external data,
//!   and guards against hostile files (size checks before any allocation, bounded nesting,
//!   external data confined to the model's folder).
//! * [`save`] / [`to_bytes`]: the reverse, written atomically, deterministic, with external
//!   data when the model would exceed protobuf's 2 GB limit.
//! * [`fold_constant_nodes`]: `Constant` nodes to initializers.
//!
//! A load-save round trip keeps every field of the file: what the IR does not model (training
//! info, sparse initializers' original encoding, quantization annotations, value_info entries
//! for values that do not exist, device configurations) travels in the IR's `extra` bytes.
//! Tensors are always written as `raw_data` (or `string_data`), which changes the encoding
//! of tensors stored in typed fields but not their values.

mod error;
mod fold;
mod load;
mod save;
mod tensor;
mod types;

/// The protobuf types generated from `proto/onnx-ml.proto` and `proto/onnx-data.proto` (onnx
/// 1.23, IR version 14).
#[allow(clippy::all, missing_docs)]
pub mod proto {
    include!("generated/onnx.rs");
}

pub use error::OnnxError;
pub use fold::fold_constant_nodes;
pub use load::{load, load_bytes, load_with_options, LoadOptions};
pub use save::{save, save_with_options, to_bytes, SaveOptions};
pub use tensor::{tensor_from_proto, tensor_from_proto_bytes, tensor_to_proto};
