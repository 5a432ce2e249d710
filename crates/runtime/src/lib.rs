//! qforge's execution engine.
//!
//! * [`Session`]: a model planned once (topological order, constant folding, kernels built,
//!   liveness), run many times with dynamic shapes, on its own thread pool.
//! * [`Hooks`]: see and replace every produced value (calibration, fake quantization).
//! * [`Registry`]: kernels by (domain, op type, opset range), one line per op.
//! * [`Kernel`]: a planned operator instance; [`ValueKernel`] for ops of sequences and
//!   optionals ([`Value`]).
//! * [`lower_qoperator`]: QDQ units rewritten into integer operators; sessions run QDQ models
//!   through it (after [`fold_constants`]), and `--format qoperator` writes its result.

mod error;
mod fold_constants;
mod fuse;
mod hooks;
mod kernel;
pub mod kernels;
mod lower_qoperator;
mod plan;
pub mod qgemm;
mod session;
mod value;

pub use error::{kernel_error, RuntimeError, RuntimeResult};
pub use fold_constants::fold_constants;
pub use hooks::{Hooks, NodeEvent, ValueEvent};
pub use lower_qoperator::{lower_qoperator, lower_qoperator_with, LowerError, LowerLog, LowerOptions, Lowered, NotLowered, Composed};
pub use kernel::{value_kernel, HookSink, Kernel, KernelBuilder, NodeInfo, Registry, RunCtx, ValueKernel, LATEST};
pub use plan::{opset_of, Folding, Plan, StepTime, NONDETERMINISTIC};
pub use session::{RunValues, Session, SessionOptions, Watch};
pub use value::{Sequence, Value};

/// The domain of operators that only sessions create, in the graphs they plan (never in
/// models qforge writes).
pub const RUNTIME_DOMAIN: &str = "ai.qforge.runtime";

/// The [`RUNTIME_DOMAIN`] operator mapping 8-bit integers through a 256-entry table, which
/// sessions run QDQ units of pointwise ops as (see [`LowerOptions`]).
pub const LOOKUP_TABLE: &str = "LookupTable";

/// The [`RUNTIME_DOMAIN`] operator sessions run a `QLinearConv` followed by a
/// [`LOOKUP_TABLE`] as: the `QLinearConv`'s inputs and attributes with the table as input 9
/// (256 uint8 or int8 elements); each requantized output byte `b` becomes `table[b]`, of the
/// table's type.
pub const QLINEAR_CONV_LOOKUP: &str = "QLinearConvLookup";
