//! Graph passes, one file each. Every pass returns what it changed and leaves a graph that
//! passes `Graph::check`. The lowering to integer operators lives in the runtime, whose
//! sessions apply it to QDQ models, and is re-exported here.

mod fold_affine;
mod fold_constant_scales;
mod fold_constants;
mod upgrade_opset;

pub use fold_affine::fold_affine;
pub use fold_constant_scales::fold_constant_scales;
pub use fold_constants::fold_constants;
pub use qforge_runtime::{lower_qoperator, LowerError, LowerLog, Lowered, NotLowered};
pub use upgrade_opset::{upgrade_opset, Rewrite, UpgradeError, MAX_OPSET};
