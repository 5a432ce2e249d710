//! qforge's execution engine.
//!
//! * [`Registry`]: kernels by (domain, op type, opset range), one line per op.
//! * [`Kernel`]: a planned operator instance.

mod error;
mod kernel;
pub mod kernels;

pub use error::{RuntimeError, RuntimeResult};
pub use kernel::{Kernel, KernelBuilder, NodeInfo, Registry, RunCtx, LATEST};
