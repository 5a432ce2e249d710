//! qforge quantization.
//!
//! * [`qparams`]: integer types, schemes, scale/zero-point computation and the quantize
//!   primitive, following PyTorch's observers or ONNX Runtime's quantizer by choice.
//! * [`observer`]: streaming, mergeable calibration statistics.
//! * [`spec`] and [`annotation`]: what each node input and output is quantized to.
//! * [`pattern`]: graph patterns as data.
//! * [`backend`]: BackendConfig, what a deployment target supports, as data.
//! * [`qconfig`]: QConfig and QConfigMapping, what the user asks for per node.
//! * [`quantizer`]: quantizers (annotation front ends); [`prepare`]: observation groups and
//!   calibration hooks; [`convert`]: Q/DQ insertion; [`pipeline`]: the whole flow;
//!   [`report`]: what was done.
//! * [`bias_correction`]: per-channel bias correction of weight rounding, from input means
//!   measured during calibration.
//! * [`weight_rounding`]: GPTQ rounding of weights, from input second moments measured
//!   during calibration.
//! * [`passes`]: graph passes (one file each).
//! * [`htp`]: the HTP quantizer (rule registry, precisions, SoC generations as data).
//! * [`compare`]: per-tensor error of a quantized model against its float original.
//! * [`sensitivity`]: output error per observation group, and the accuracy budget.
//! * [`html`]: the HTML report with SVG plots (SQNR per layer, histograms, weight ranges).

pub mod annotation;
pub mod backend;
pub mod bias_correction;
pub mod compare;
pub mod convert;
pub mod htp;
pub mod html;
pub mod observer;
pub mod pair_sums;
pub mod passes;
pub mod pattern;
pub mod pipeline;
pub mod prepare;
pub mod qconfig;
pub mod qparams;
pub mod quantizer;
pub mod report;
pub mod sensitivity;
pub mod spec;
pub mod weight_rounding;

pub use qparams::{Convention, QParams, QScheme, QType};
