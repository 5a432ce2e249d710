//! qforge quantization.
//!
//! * [`qparams`]: integer types, schemes, scale/zero-point computation and the quantize
//!   primitive, following PyTorch's observers or ONNX Runtime's quantizer by choice.
//! * [`observer`]: streaming, mergeable calibration statistics.

pub mod observer;
pub mod qparams;

pub use qparams::{Convention, QParams, QScheme, QType};
