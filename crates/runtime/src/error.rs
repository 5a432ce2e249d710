/// Errors from planning or running a model. Each names the node or input involved.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("node '{node}' ({op}): {reason}")]
    Node { node: String, op: String, reason: String },
    #[error("node '{node}': operator {op} (opset {opset}) is not supported by the qforge runtime")]
    Unsupported { node: String, op: String, opset: i64 },
    #[error("input '{input}': {reason}")]
    Input { input: String, reason: String },
    /// A kernel's complaint about its inputs; the session adds the node.
    #[error("{0}")]
    Kernel(String),
    #[error(transparent)]
    Ir(#[from] qforge_ir::IrError),
}

pub type RuntimeResult<T> = Result<T, RuntimeError>;

/// A kernel error (the session names the node when it reports it).
pub fn kernel_error(reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Kernel(reason.into())
}
