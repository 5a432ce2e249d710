//! qforge quantization.
//!
//! * [`qparams`]: integer types, schemes, scale/zero-point computation and the quantize
//!   primitive, following PyTorch's observers or ONNX Runtime's quantizer by choice.

pub mod qparams;

pub use qparams::{Convention, QParams, QScheme, QType};
