//! TopK, NonZero, Trilu, NonMaxSuppression, Compress, CumProd, EyeLike, ReverseSequence and
//! Unique beyond the ONNX node tests: bad inputs are errors naming what is wrong (never
//! panics), and edge cases (empty tensors, large k, long lines) give the right results.

mod common;

use common::{expect_err, f32s, i64s, run};
use qforge_ir::{Attr, DType, Tensor};

#[test]
fn top_k_matches_a_full_sort_on_long_lines() {
    // 3 lines of 1000 pseudo-random values with many ties, along axis 0 of [1000, 3].
    let mut seed = 7u64;
    let v: Vec<f32> = (0..3000).map(|_| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 40) % 97) as f32
    }).collect();
    for (k, largest) in [(1, 1), (10, 1), (10, 0), (1000, 1)] {
        let out = run("TopK", 11, &[("axis", Attr::Int(-2)), ("largest", Attr::Int(largest))], vec![f32s(&[1000, 3], v.clone()), i64s(&[1], vec![k])], 2).unwrap();
        assert_eq!(out[0].shape(), &[k as usize, 3]);
        let (values, indices) = (out[0].as_slice::<f32>().unwrap(), out[1].as_slice::<i64>().unwrap());
        for line in 0..3 {
            let mut want: Vec<(f32, i64)> = (0..1000).map(|j| (v[j * 3 + line], j as i64)).collect();
            want.sort_by(|p, q| if largest == 1 { q.0.total_cmp(&p.0) } else { p.0.total_cmp(&q.0) }.then(p.1.cmp(&q.1)));
            for r in 0..k as usize {
                assert_eq!((values[r * 3 + line], indices[r * 3 + line]), want[r], "k {k} line {line} rank {r}");
            }
        }
    }
}

#[test]
fn top_k_rejects_bad_k_and_axes() {
    let x = || f32s(&[2, 3], vec![1.0; 6]);
    expect_err(run("TopK", 11, &[], vec![x(), i64s(&[1], vec![4])], 2), &["'node'", "k 4", "[0, 3]"]);
    expect_err(run("TopK", 11, &[], vec![x(), i64s(&[1], vec![-1])], 2), &["k -1"]);
    expect_err(run("TopK", 11, &[], vec![x(), i64s(&[2], vec![1, 1])], 2), &["K must hold one integer"]);
    expect_err(run("TopK", 11, &[("axis", Attr::Int(2))], vec![x(), i64s(&[1], vec![1])], 2), &["axis 2", "rank 2"]);
    expect_err(run("TopK", 11, &[], vec![f32s(&[], vec![1.0]), i64s(&[1], vec![1])], 2), &["scalar"]);
    expect_err(run("TopK", 1, &[], vec![x()], 2), &["'k' is required"]);
    let out = run("TopK", 1, &[("k", Attr::Int(2))], vec![x()], 2).unwrap();
    assert_eq!(out[1].shape(), &[2, 2]);
    let out = run("TopK", 11, &[], vec![f32s(&[2, 0], vec![]), i64s(&[1], vec![0])], 2).unwrap();
    assert_eq!((out[0].shape(), out[1].dtype()), (&[2usize, 0][..], DType::I64));
}

#[test]
fn non_zero_of_empty_and_scalar_inputs() {
    let out = run("NonZero", 13, &[], vec![f32s(&[2, 0, 3], vec![])], 1).unwrap();
    assert_eq!(out[0].shape(), &[3, 0]);
    let out = run("NonZero", 13, &[], vec![f32s(&[], vec![2.0])], 1).unwrap();
    assert_eq!((out[0].shape(), out[0].as_slice::<i64>().unwrap()), (&[1usize, 1][..], &[0i64][..]));
    expect_err(run("NonZero", 13, &[], vec![Some(Tensor::from_strings(&[1], vec![b"a".to_vec()]).unwrap())], 1), &["does not support"]);
}

#[test]
fn trilu_needs_a_matrix_and_takes_any_k() {
    expect_err(run("Trilu", 14, &[], vec![f32s(&[3], vec![1.0; 3])], 1), &["rank 2 or more", "[3]"]);
    expect_err(run("Trilu", 14, &[], vec![f32s(&[2, 2], vec![1.0; 4]), i64s(&[2], vec![0, 1])], 1), &["k must hold one integer"]);
    let out = run("Trilu", 14, &[("upper", Attr::Int(0))], vec![f32s(&[2, 2], vec![1.0; 4]), i64s(&[], vec![i64::MIN])], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[0.0; 4]);
    let bools = Tensor::from_bools(&[2, 2], &[true; 4]).unwrap();
    let out = run("Trilu", 14, &[], vec![Some(bools), None], 1).unwrap();
    assert_eq!(out[0].bools().unwrap(), vec![true, true, false, true]);
}

#[test]
fn non_max_suppression_validates_its_inputs() {
    let boxes = || f32s(&[1, 2, 4], vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.9]);
    let scores = || f32s(&[1, 1, 2], vec![0.9, 0.8]);
    let max = || i64s(&[1], vec![5]);
    let out = run("NonMaxSuppression", 11, &[], vec![boxes(), scores(), max(), f32s(&[1], vec![0.5]), None], 1).unwrap();
    assert_eq!(out[0].as_slice::<i64>().unwrap(), &[0, 0, 0]);
    let out = run("NonMaxSuppression", 11, &[], vec![boxes(), scores()], 1).unwrap();
    assert_eq!(out[0].shape(), &[0, 3]);
    expect_err(run("NonMaxSuppression", 11, &[], vec![boxes(), f32s(&[1, 1, 3], vec![0.0; 3]), max()], 1), &["disagree"]);
    expect_err(run("NonMaxSuppression", 11, &[], vec![f32s(&[1, 2, 3], vec![0.0; 6]), scores(), max()], 1), &["[batches, boxes, 4]"]);
    expect_err(run("NonMaxSuppression", 11, &[], vec![boxes(), scores(), max(), f32s(&[1], vec![1.5])], 1), &["iou_threshold 1.5"]);
    expect_err(run("NonMaxSuppression", 10, &[("center_point_box", Attr::Int(2))], vec![boxes(), scores()], 1), &["center_point_box"]);
}

#[test]
fn compress_rejects_selections_past_the_axis() {
    let x = || f32s(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let cond = |v: &[bool]| Some(Tensor::from_bools(&[v.len()], v).unwrap());
    expect_err(run("Compress", 11, &[("axis", Attr::Int(0))], vec![x(), cond(&[true, false, true])], 1), &["index 2", "size 2"]);
    let out = run("Compress", 11, &[("axis", Attr::Int(-1))], vec![x(), cond(&[false, true, false])], 1).unwrap();
    assert_eq!((out[0].shape(), out[0].as_slice::<f32>().unwrap()), (&[2usize, 1][..], &[2.0f32, 4.0][..]));
    expect_err(run("Compress", 9, &[("axis", Attr::Int(-1))], vec![x(), cond(&[true])], 1), &["negative"]);
    expect_err(run("Compress", 11, &[], vec![x(), f32s(&[1], vec![1.0])], 1), &["1-D bool"]);
    let strings = Tensor::from_strings(&[3], vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]).unwrap();
    let out = run("Compress", 11, &[], vec![Some(strings), cond(&[false, true, true])], 1).unwrap();
    assert_eq!(out[0].strings().unwrap(), &[b"b".to_vec(), b"c".to_vec()]);
}

#[test]
fn cum_prod_checks_its_axis() {
    expect_err(run("CumProd", 26, &[], vec![f32s(&[2], vec![1.0; 2]), i64s(&[], vec![1])], 1), &["axis 1"]);
    expect_err(run("CumProd", 26, &[], vec![f32s(&[], vec![1.0]), i64s(&[], vec![0])], 1), &["scalar"]);
    let out = run("CumProd", 26, &[], vec![i64s(&[2], vec![i64::MAX, 3]), i64s(&[], vec![0])], 1).unwrap();
    assert_eq!(out[0].as_slice::<i64>().unwrap(), &[i64::MAX, i64::MAX.wrapping_mul(3)]);
}

#[test]
fn eye_like_and_reverse_sequence_reject_bad_shapes() {
    expect_err(run("EyeLike", 22, &[], vec![f32s(&[1, 2, 2], vec![0.0; 4])], 1), &["2-D", "[1, 2, 2]"]);
    expect_err(run("EyeLike", 22, &[("dtype", Attr::Int(8))], vec![f32s(&[2, 2], vec![0.0; 4])], 1), &["does not support"]);
    let out = run("EyeLike", 22, &[("dtype", Attr::Int(9)), ("k", Attr::Int(-1))], vec![f32s(&[3, 2], vec![0.0; 6])], 1).unwrap();
    assert_eq!(out[0].bools().unwrap(), vec![false, false, true, false, false, true]);
    let x = || f32s(&[3, 2], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    expect_err(run("ReverseSequence", 10, &[], vec![x(), i64s(&[2], vec![4, 1])], 1), &["sequence_lens[0] = 4", "[0, 3]"]);
    expect_err(run("ReverseSequence", 10, &[], vec![x(), i64s(&[3], vec![1, 1, 1])], 1), &["3 entries", "batch of 2"]);
    expect_err(run("ReverseSequence", 10, &[("batch_axis", Attr::Int(0))], vec![x(), i64s(&[3], vec![1, 1, 1])], 1), &["batch_axis 0", "time_axis 0"]);
    let out = run("ReverseSequence", 10, &[], vec![x(), i64s(&[2], vec![3, 0])], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[4.0, 1.0, 2.0, 3.0, 0.0, 5.0]);
}

#[test]
fn unique_of_strings_empty_inputs_and_bad_axes() {
    let s = Tensor::from_strings(&[4], [b"b", b"a", b"b", b"c"].iter().map(|v| v.to_vec()).collect()).unwrap();
    let out = run("Unique", 11, &[("sorted", Attr::Int(0))], vec![Some(s)], 4).unwrap();
    assert_eq!(out[0].strings().unwrap(), &[b"b".to_vec(), b"a".to_vec(), b"c".to_vec()]);
    assert_eq!(out[2].as_slice::<i64>().unwrap(), &[0, 1, 0, 2]);
    let out = run("Unique", 11, &[("axis", Attr::Int(1))], vec![f32s(&[2, 0], vec![])], 4).unwrap();
    assert_eq!((out[0].shape(), out[3].shape()), (&[2usize, 0][..], &[0usize][..]));
    expect_err(run("Unique", 11, &[("axis", Attr::Int(-3))], vec![f32s(&[2, 2], vec![0.0; 4])], 4), &["axis -3", "rank 2"]);
}
