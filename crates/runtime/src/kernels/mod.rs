//! Built-in kernels, grouped by family. Each family file has a `register` function listing
//! its ops, one registry line each.

mod attention;
mod attention_ms;
mod contrib_ms;
mod control;
pub(crate) mod conv;
mod detection;
mod einsum;
pub(crate) mod elementwise;
pub(crate) mod fused;
pub mod gemm;
pub(crate) mod math;
mod matmul;
mod norm;
mod pool;
mod qlinear;
pub(crate) mod qlinear_ms;
mod quantize;
mod reduce;
mod resize;
mod rnn;
mod sampling;
mod select;
pub mod sequence;
pub(crate) mod shape;
mod signal;
pub(crate) mod util;

/// Registers every built-in kernel.
pub fn register_all(r: &mut crate::Registry) {
    attention::register(r);
    attention_ms::register(r);
    contrib_ms::register(r);
    control::register(r);
    conv::register(r);
    detection::register(r);
    einsum::register(r);
    elementwise::register(r);
    matmul::register(r);
    norm::register(r);
    pool::register(r);
    qlinear::register(r);
    qlinear_ms::register(r);
    quantize::register(r);
    reduce::register(r);
    resize::register(r);
    rnn::register(r);
    sampling::register(r);
    select::register(r);
    sequence::register(r);
    shape::register(r);
    signal::register(r);
}
