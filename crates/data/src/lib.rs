//! Tensor files: NumPy `.npy` arrays and `.npz` archives, read into and written from
//! [`qforge_ir::Tensor`].

mod npy;
mod npz;

pub use npy::{read_npy, read_npy_bytes, write_npy, npy_bytes};
pub use npz::{read_npz, write_npz};

use std::path::PathBuf;

/// Errors reading or writing tensor files; each names the file (and archive member).
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a valid .npy array: {reason}")]
    BadNpy { path: PathBuf, reason: String },
    #[error("{path}: not a valid .npz archive: {reason}")]
    BadNpz { path: PathBuf, reason: String },
}

pub type DataResult<T> = Result<T, DataError>;
