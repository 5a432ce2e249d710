//! Graph passes, one file each. Every pass returns what it changed and leaves a graph that
//! passes `Graph::check`.

mod fold_batch_norm;
mod fold_constants;
mod upgrade_opset;

pub use fold_batch_norm::fold_batch_norm;
pub use fold_constants::fold_constants;
pub use upgrade_opset::{upgrade_opset, Rewrite, UpgradeError, MAX_OPSET};
