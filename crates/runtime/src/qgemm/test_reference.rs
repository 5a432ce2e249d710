//! A requantized 8-bit convolution written out element by element, the reference the NCHW
//! convolution kernels' tests compare against.

use std::mem::MaybeUninit;

use super::conv::{ConvInput, ConvRequant};
use super::{Int8, Scale, ZeroPoints};
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

/// The geometry of one axis as `(input, kernel, stride, dilation, pad_begin, pad_end)`.
pub(crate) type AxisSpec = (usize, usize, usize, usize, usize, usize);

/// Depthwise geometries `(channels, height axis, width axis)`: odd widths, strides 1 to 3,
/// dilations, asymmetric and large pads, a single position, kernels wider than the input.
pub(crate) const DEPTHWISE_CASES: [(usize, AxisSpec, AxisSpec); 13] = [
    (5, (12, 3, 1, 1, 1, 1), (80, 3, 1, 1, 1, 1)),
    (3, (9, 5, 2, 1, 2, 2), (41, 5, 2, 1, 2, 2)),
    (1, (30, 3, 1, 1, 1, 1), (300, 3, 1, 1, 1, 1)),
    (7, (6, 2, 1, 2, 0, 1), (19, 7, 3, 2, 3, 0)),
    (2, (1, 1, 1, 1, 0, 0), (1, 1, 1, 1, 0, 0)),
    (4, (8, 4, 3, 1, 0, 3), (17, 4, 1, 1, 3, 0)),
    (9, (5, 5, 1, 1, 2, 2), (16, 5, 1, 1, 2, 2)),
    (3, (3, 3, 1, 1, 2, 2), (2, 6, 1, 1, 5, 5)),
    (17, (7, 5, 1, 1, 2, 2), (7, 5, 1, 1, 2, 2)),
    (6, (14, 3, 2, 1, 1, 1), (28, 3, 2, 1, 0, 1)),
    (2, (20, 3, 1, 1, 1, 1), (33, 3, 1, 2, 2, 2)),
    (1, (2, 1, 1, 1, 0, 0), (3, 1, 1, 1, 0, 0)),
    (3, (11, 5, 1, 1, 2, 2), (13, 5, 1, 1, 2, 2)),
];

/// Checks a requantized depthwise kernel against [`naive_conv`]: for each case
/// `(channels, height axis, width axis)` and each signedness pair of input and weights, draws
/// random data from `seed` (per-channel weight zero points on even cases, some of them at the
/// value needing no window sums, input and output zero points anywhere, biases and scales,
/// an output table on every third case), and requires `run(input, weights, weight type, requantization)` (the output bytes) to equal
/// the naive convolution's on 1 and 2 threads.
pub(crate) fn check_depthwise(seed: u64, cases: &[(usize, AxisSpec, AxisSpec)], run: impl Fn(&ConvInput, &[u8], Int8, &ConvRequant) -> Vec<u8> + Sync) {
    let mut rng = qforge_testkit::Rng::new(seed);
    let pools: Vec<rayon::ThreadPool> = [1, 2].iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    for (ci, &(c, hx, wx)) in cases.iter().enumerate() {
        let h = axis(hx.0, hx.1, hx.2, hx.3, hx.4, hx.5);
        let wa = axis(wx.0, wx.1, wx.2, wx.3, wx.4, wx.5);
        for (xt, wt) in [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8), (Int8::I8, Int8::U8)] {
            let x: Vec<u8> = (0..c * h.input * wa.input).map(|_| rng.next() as u8).collect();
            let w: Vec<u8> = (0..c * h.kernel * wa.kernel).map(|_| rng.next() as u8).collect();
            let (base, shift) = if wt == Int8::I8 { (0, 128) } else { (128, 0) };
            let wz: Vec<i32> = (0..c).map(|j| if (ci + j) % 3 == 0 { base } else { rng.below(256) as i32 - shift }).collect();
            let per_channel = ci % 2 == 0;
            let wz: Vec<i32> = if per_channel { wz } else { vec![wz[0]; c] };
            let xz = rng.below(256) as i32 - if xt == Int8::I8 { 128 } else { 0 };
            let yz = rng.below(256) as i32 - if xt == Int8::I8 { 128 } else { 0 };
            let bias: Vec<i32> = (0..c).map(|_| rng.below(20001) as i32 - 10000).collect();
            let scale: Vec<f32> = (0..c).map(|_| [1.0 / 256.0, 1.0 / 1024.0, 0.0037, 0.00051][rng.below(4)]).collect();
            let table: Option<[u8; 256]> = (ci % 3 == 1).then(|| std::array::from_fn(|_| rng.next() as u8));
            let want: Vec<u8> = naive_conv(&x, xt, xz, &w, wt, &wz, c, c, c, h, wa, &bias, &scale, yz).into_iter().map(|b| table.map_or(b, |t| t[b as usize])).collect();
            let inp = ConvInput { x: &x, xt, x_zp: xz, channels: c, h, w: wa };
            let rq = ConvRequant {
                scale: Scale::Each(&scale),
                bias: Some(&bias),
                w_zp: if per_channel { ZeroPoints::Each(&wz) } else { ZeroPoints::Tensor(wz[0]) },
                y_zp: yz,
                table: table.as_ref(),
            };
            for pool in &pools {
                let got = pool.install(|| run(&inp, &w, wt, &rq));
                assert_eq!(got, want, "case {ci} x {xt:?} w {wt:?} per-channel {per_channel} table {} threads {}", table.is_some(), pool.current_num_threads());
            }
        }
    }
}

/// An output of `len` values of `xt`'s type filled by `fill_u8` or `fill_i8`, as bytes. The
/// storage starts as the byte `0xa5` in every element, so a value the kernel fails to write
/// shows up as a difference from the reference.
pub(crate) fn output_bytes(xt: Int8, len: usize, fill_u8: impl FnOnce(&mut [MaybeUninit<u8>]), fill_i8: impl FnOnce(&mut [MaybeUninit<i8>])) -> Vec<u8> {
    if xt == Int8::U8 {
        let mut o = vec![MaybeUninit::new(0xa5u8); len];
        fill_u8(&mut o);
        // SAFETY: every element was initialized when `o` was made.
        o.into_iter().map(|v| unsafe { v.assume_init() }).collect()
    } else {
        let mut o = vec![MaybeUninit::new(0xa5u8 as i8); len];
        fill_i8(&mut o);
        // SAFETY: as above.
        o.into_iter().map(|v| unsafe { v.assume_init() } as u8).collect()
    }
}
