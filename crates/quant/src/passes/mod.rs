//! Graph passes, one file each. Every pass returns what it changed and leaves a graph that
//! passes `Graph::check`. Constant folding and the lowering to integer operators live in the
//! runtime, whose sessions apply them to QDQ models, and are re-exported here.

mod constant_input_defaults;
mod fold_affine;
mod fold_constant_scales;
mod localize_captured_weights;
mod matmul_add_to_gemm;
mod upcast_half;
mod upgrade_opset;

pub use constant_input_defaults::constant_input_defaults;
pub use fold_affine::fold_affine;
pub use fold_constant_scales::fold_constant_scales;
pub use localize_captured_weights::localize_captured_weights;
pub use matmul_add_to_gemm::matmul_add_to_gemm;
pub use qforge_runtime::{fold_constants, lower_qoperator, LowerError, LowerLog, Lowered, NotLowered};
pub use upcast_half::{upcast_half, Upcast};
pub use upgrade_opset::{upgrade_opset, Rewrite, UpgradeError, MAX_OPSET};
