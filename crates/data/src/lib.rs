//! Tensor files: NumPy `.npy` arrays and `.npz` archives, read into and written from
//! [`qforge_ir::Tensor`], and calibration data sets built from them or from images with a
//! preprocessing spec ([`CalibrationSet`]).

mod calib;
pub mod images;
mod npy;
mod npz;

pub use npy::{read_npy, read_npy_bytes, write_npy, npy_bytes};
pub use npz::{read_npz, write_npz};
pub use calib::{sanitize, CalibrationSet, ModelInput};

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
    /// A calibration data set that cannot be used; `reason` says what is wrong and what to do.
    #[error("{path}: calibration data{}: {reason}", location(.sample, .input))]
    Calibration { path: PathBuf, sample: Option<String>, input: Option<String>, reason: String },
}

fn location(sample: &Option<String>, input: &Option<String>) -> String {
    let s = sample.as_ref().map(|s| format!(", sample '{s}'")).unwrap_or_default();
    s + &input.as_ref().map(|i| format!(", input '{i}'")).unwrap_or_default()
}

pub type DataResult<T> = Result<T, DataError>;
