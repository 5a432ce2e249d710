//! RNN, CenterCropPad, MaxUnpool, Col2Im and DeformConv beyond the ONNX node tests: bad
//! inputs are errors naming what is wrong (never panics), and small cases give the values
//! the spec defines.

mod common;

use common::{expect_err, f32s, i64s, run};
use qforge_ir::{Attr};

fn strings(v: &[&str]) -> Attr {
    Attr::Strings(v.iter().map(|s| s.as_bytes().to_vec()).collect())
}

#[test]
fn rnn_rejects_bad_shapes_and_lengths() {
    let x = || f32s(&[2, 1, 3], vec![0.5; 6]);
    let w = || f32s(&[1, 4, 3], vec![0.1; 12]);
    let r = || f32s(&[1, 4, 4], vec![0.1; 16]);
    expect_err(run("RNN", 14, &[], vec![f32s(&[2, 3], vec![0.0; 6]), w(), r()], 2), &["X must be 3-D", "[2, 3]"]);
    expect_err(run("RNN", 14, &[], vec![x(), f32s(&[1, 4, 2], vec![0.0; 8]), r()], 2), &["W [1, 4, 2]", "input size 3"]);
    expect_err(run("RNN", 14, &[("hidden_size", Attr::Int(5))], vec![x(), w(), r()], 2), &["hidden size 5"]);
    expect_err(run("RNN", 14, &[], vec![x(), w(), r(), f32s(&[1, 4], vec![0.0; 4])], 2), &["B has shape [1, 4]", "[1, 8]"]);
    expect_err(run("RNN", 14, &[], vec![x(), w(), r(), None, i64s(&[1], vec![3])], 2), &["sequence length 3", "0..=2"]);
    expect_err(run("RNN", 14, &[], vec![x(), w(), r(), None, i64s(&[2], vec![1, 1])], 2), &["2 values", "batch size is 1"]);
    expect_err(run("RNN", 14, &[], vec![x(), w(), r(), None, None, f32s(&[1, 2, 4], vec![0.0; 8])], 2), &["initial_h", "[1, 1, 4]"]);
    expect_err(run("RNN", 14, &[("activations", strings(&["Gelu"]))], vec![x(), w(), r()], 2), &["Gelu"]);
    expect_err(run("RNN", 14, &[("direction", Attr::String(b"bidirectional".to_vec()))], vec![x(), w(), r()], 2), &["W [1, 4, 3]", "2 direction"]);
    expect_err(run("RNN", 14, &[("layout", Attr::Int(2))], vec![x(), w(), r()], 2), &["layout is 2"]);
}

#[test]
fn rnn_reverse_runs_each_item_from_its_own_last_step() {
    // Input size 1, hidden 1, W = 1, R = 0, Affine activation (identity): H_t = X_t.
    let acts = ("activations", strings(&["Affine"]));
    let out = run("RNN", 14, &[acts, ("direction", Attr::String(b"reverse".to_vec()))], vec![f32s(&[3, 2, 1], vec![1.0, 10.0, 2.0, 20.0, 3.0, 30.0]), f32s(&[1, 1, 1], vec![1.0]), f32s(&[1, 1, 1], vec![0.0]), None, i64s(&[2], vec![2, 3])], 2).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[1.0, 10.0, 2.0, 20.0, 0.0, 30.0]);
    assert_eq!(out[1].as_slice::<f32>().unwrap(), &[1.0, 10.0]);
}

#[test]
fn center_crop_pad_rejects_bad_shape_and_axes() {
    let x = || f32s(&[2, 3], vec![1.0; 6]);
    expect_err(run("CenterCropPad", 18, &[], vec![x(), i64s(&[1], vec![2])], 1), &["1 values", "2 axes"]);
    expect_err(run("CenterCropPad", 18, &[], vec![x(), i64s(&[2], vec![2, -1])], 1), &["target size -1"]);
    expect_err(run("CenterCropPad", 18, &[("axes", Attr::Ints(vec![0, -2]))], vec![x(), i64s(&[2], vec![2, 2])], 1), &["more than once"]);
    expect_err(run("CenterCropPad", 18, &[("axes", Attr::Ints(vec![2]))], vec![x(), i64s(&[1], vec![2])], 1), &["axis 2", "rank 2"]);
    expect_err(run("CenterCropPad", 18, &[], vec![x(), i64s(&[2], vec![1 << 40, 1 << 40])], 1), &["CenterCropPad output"]);
    let out = run("CenterCropPad", 18, &[], vec![f32s(&[3], vec![1.0, 2.0, 3.0]), i64s(&[1], vec![0])], 1).unwrap();
    assert_eq!(out[0].shape(), &[0]);
}

#[test]
fn max_unpool_rejects_bad_indices_and_shapes() {
    let k = ("kernel_shape", Attr::Ints(vec![2, 2]));
    let s = ("strides", Attr::Ints(vec![2, 2]));
    let x = || f32s(&[1, 1, 1, 1], vec![5.0]);
    expect_err(run("MaxUnpool", 11, &[k.clone(), s.clone()], vec![x(), i64s(&[1, 1, 1, 1], vec![4])], 1), &["index 4", "4 elements"]);
    expect_err(run("MaxUnpool", 11, &[k.clone(), s.clone()], vec![x(), i64s(&[1, 1, 1, 1], vec![-1])], 1), &["index -1"]);
    expect_err(run("MaxUnpool", 11, &[k.clone(), s.clone()], vec![x(), i64s(&[1, 1, 1], vec![0])], 1), &["indices have shape [1, 1, 1]"]);
    expect_err(run("MaxUnpool", 11, &[k.clone(), s.clone()], vec![f32s(&[1, 1], vec![1.0]), i64s(&[1, 1], vec![0])], 1), &["needs rank 4"]);
    expect_err(run("MaxUnpool", 11, &[k.clone(), s.clone()], vec![x(), i64s(&[1, 1, 1, 1], vec![0]), i64s(&[4], vec![1, 1, 1, 1])], 1), &["output_shape [1, 1, 1, 1]"]);
    expect_err(run("MaxUnpool", 11, &[k.clone(), ("pads", Attr::Ints(vec![3, 3, 3, 3]))], vec![x(), i64s(&[1, 1, 1, 1], vec![0])], 1), &["no valid output size"]);
    expect_err(run("MaxUnpool", 11, &[], vec![x(), i64s(&[1, 1, 1, 1], vec![0])], 1), &["'kernel_shape' is required"]);
    let out = run("MaxUnpool", 11, &[k, s], vec![x(), i64s(&[1, 1, 1, 1], vec![3]), i64s(&[4], vec![1, 1, 3, 3])], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn col2im_rejects_bad_shapes() {
    let x = || f32s(&[1, 4, 4], vec![1.0; 16]);
    expect_err(run("Col2Im", 18, &[], vec![x(), i64s(&[2], vec![3, 3]), i64s(&[1], vec![2])], 1), &["one size per spatial axis"]);
    expect_err(run("Col2Im", 18, &[], vec![x(), i64s(&[2], vec![3, 0]), i64s(&[2], vec![2, 2])], 1), &["holds 0"]);
    expect_err(run("Col2Im", 18, &[], vec![x(), i64s(&[2], vec![4, 4]), i64s(&[2], vec![2, 2])], 1), &["[N, C * 4, 9]"]);
    expect_err(run("Col2Im", 18, &[], vec![x(), i64s(&[2], vec![1, 1]), i64s(&[2], vec![2, 2])], 1), &["larger than the padded input"]);
    expect_err(run("Col2Im", 18, &[("strides", Attr::Ints(vec![0, 1]))], vec![x(), i64s(&[2], vec![3, 3]), i64s(&[2], vec![2, 2])], 1), &["stride 0"]);
    let out = run("Col2Im", 18, &[], vec![x(), i64s(&[2], vec![3, 3]), i64s(&[2], vec![2, 2])], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[1.0, 2.0, 1.0, 2.0, 4.0, 2.0, 1.0, 2.0, 1.0]);
}

#[test]
fn deform_conv_rejects_bad_shapes() {
    let x = || f32s(&[1, 1, 3, 3], vec![1.0; 9]);
    let w = || f32s(&[1, 1, 2, 2], vec![1.0; 4]);
    let offset = || f32s(&[1, 8, 2, 2], vec![0.0; 32]);
    expect_err(run("DeformConv", 19, &[], vec![x(), w(), f32s(&[1, 8, 3, 3], vec![0.0; 72])], 1), &["offset has shape [1, 8, 3, 3]", "[1, 8, 2, 2]"]);
    expect_err(run("DeformConv", 19, &[], vec![x(), f32s(&[1, 2, 2, 2], vec![1.0; 8]), offset()], 1), &["do not fit group 1"]);
    expect_err(run("DeformConv", 19, &[], vec![x(), w(), offset(), f32s(&[2], vec![0.0; 2])], 1), &["B has shape [2]"]);
    expect_err(run("DeformConv", 19, &[], vec![x(), w(), offset(), None, f32s(&[1, 4, 2, 1], vec![0.0; 8])], 1), &["mask has shape"]);
    expect_err(run("DeformConv", 19, &[("group", Attr::Int(0))], vec![x(), w(), offset()], 1), &["group 0"]);
    expect_err(run("DeformConv", 19, &[], vec![f32s(&[1, 1, 3], vec![1.0; 3]), w(), offset()], 1), &["must all be 4-D"]);
    // Zero offsets: an ordinary 2x2 convolution of ones, plus bias.
    let out = run("DeformConv", 19, &[], vec![x(), w(), offset(), f32s(&[1], vec![0.5])], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[4.5; 4]);
}
