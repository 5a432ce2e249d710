//! A requantized 8-bit convolution written out element by element, the reference the NCHW
//! convolution kernels' tests compare against.

use super::Int8;
use crate::kernels::conv::Axis;

/// The geometry of one axis: `input` values, a `kernel` of taps `dilation` apart, `stride`,
/// padding; the output length follows ONNX's formula.
pub(crate) fn axis(input: usize, kernel: usize, stride: usize, dilation: usize, pad_begin: usize, pad_end: usize) -> Axis {
    let output = (input + pad_begin + pad_end - dilation * (kernel - 1) - 1) / stride + 1;
    Axis { input, kernel, stride, dilation, pad_begin, pad_end, output }
}

/// A direct grouped convolution of one `c`-channel NCHW image (bytes read as `xt`, zero point
/// `xz`) with `m` filters in `groups` groups (weights `[m, c / groups, kh, kw]` read as `wt`,
/// one zero point per filter), padding reading the zero point, an int32 `bias` per filter,
/// then `clamp(round_half_even(f32(acc) * scale[j]) + yz)` to `xt`'s range, as bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn naive_conv(x: &[u8], xt: Int8, xz: i32, w: &[u8], wt: Int8, wz: &[i32], c: usize, m: usize, groups: usize, h: Axis, wa: Axis, bias: &[i32], scale: &[f32], yz: i32) -> Vec<u8> {
    let val = |v: u8, t: Int8| if t == Int8::I8 { v as i8 as i32 } else { v as i32 };
    let (kh, kw, cg, mg) = (h.kernel, wa.kernel, c / groups, m / groups);
    let (lo, hi) = if xt == Int8::U8 { (0, 255) } else { (-128, 127) };
    let mut out = vec![];
    for j in 0..m {
        for oy in 0..h.output {
            for ox in 0..wa.output {
                let mut acc = bias[j];
                for ci in 0..cg {
                    let ch = j / mg * cg + ci;
                    for ki in 0..kh {
                        for kj in 0..kw {
                            let iy = (oy * h.stride + ki * h.dilation) as isize - h.pad_begin as isize;
                            let ix = (ox * wa.stride + kj * wa.dilation) as isize - wa.pad_begin as isize;
                            if iy < 0 || ix < 0 || iy >= h.input as isize || ix >= wa.input as isize {
                                continue;
                            }
                            let xv = val(x[(ch * h.input + iy as usize) * wa.input + ix as usize], xt) - xz;
                            acc += xv * (val(w[((j * cg + ci) * kh + ki) * kw + kj], wt) - wz[j]);
                        }
                    }
                }
                let v = (acc as f32 * scale[j]).round_ties_even() as i32 + yz;
                out.push(v.clamp(lo, hi) as u8);
            }
        }
    }
    out
}
