//! Graph passes, one file each. Every pass returns what it changed and leaves a graph that
//! passes `Graph::check`.

mod fold_batch_norm;

pub use fold_batch_norm::fold_batch_norm;
