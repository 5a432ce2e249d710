//! Built-in kernels, grouped by family. Each family file has a `register` function listing
//! its ops, one registry line each.

/// Registers every built-in kernel.
pub fn register_all(_r: &mut crate::Registry) {}
