use std::path::PathBuf;

/// Errors loading or saving a model. Each names the file and, where it applies, the graph
/// element, and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a readable ONNX model ({reason}); check that the file is a complete .onnx file")]
    Decode { path: PathBuf, reason: String },
    #[error("{path}: {what}")]
    Invalid { path: PathBuf, what: String },
    #[error("{path}: tensor '{tensor}': {reason}")]
    Tensor { path: PathBuf, tensor: String, reason: String },
    #[error("{path}: tensor '{tensor}' has external data at '{location}': {reason}")]
    ExternalData { path: PathBuf, tensor: String, location: String, reason: String },
    #[error("{path}: {source}")]
    Ir { path: PathBuf, source: qforge_ir::IrError },
}
