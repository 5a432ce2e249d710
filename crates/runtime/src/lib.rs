//! qforge's execution engine.
//!
//! * [`Session`]: a model planned once (topological order, constant folding, kernels built,
//!   liveness), run many times with dynamic shapes, on its own thread pool.
//! * [`Hooks`]: see and replace every produced value (calibration, fake quantization).
//! * [`Registry`]: kernels by (domain, op type, opset range), one line per op.
//! * [`Kernel`]: a planned operator instance.

mod error;
mod fuse;
mod hooks;
mod kernel;
pub mod kernels;
mod plan;
pub mod qgemm;
mod session;

pub use error::{kernel_error, RuntimeError, RuntimeResult};
pub use hooks::{Hooks, NodeEvent, ValueEvent};
pub use kernel::{HookSink, Kernel, KernelBuilder, NodeInfo, Registry, RunCtx, LATEST};
pub use plan::{opset_of, Folding, Plan, StepTime, NONDETERMINISTIC};
pub use session::{RunValues, Session, SessionOptions};
