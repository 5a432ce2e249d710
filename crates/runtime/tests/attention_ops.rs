//! Attention, RotaryEmbedding and SwiGLU beyond the ONNX node tests: bad inputs are errors naming
//! what is wrong (never panics), and masked rows and grouped heads give the right results.

mod common;

use common::{expect_err, f32s, i64s, run};
use qforge_ir::{Attr, Tensor};

fn zeros(shape: &[usize]) -> Option<Tensor> {
    f32s(shape, vec![0.0; shape.iter().product()])
}

#[test]
fn attention_softmax_weights_values_and_zeroes_fully_masked_rows() {
    // One head, two queries, two keys; query 1 may see no key.
    let q = f32s(&[1, 1, 2, 1], vec![1.0, 1.0]);
    let k = f32s(&[1, 1, 2, 1], vec![0.0, 2.0]);
    let v = f32s(&[1, 1, 2, 1], vec![10.0, 20.0]);
    let mask = Some(Tensor::from_bools(&[2, 2], &[true, true, false, false]).unwrap());
    let out = run("Attention", 23, &[("scale", Attr::Float(1.0))], vec![q, k, v, mask], 1).unwrap();
    let y = out[0].as_slice::<f32>().unwrap();
    let (p0, p1) = (1.0f32, 2.0f32.exp());
    let want = (10.0 * p0 + 20.0 * p1) / (p0 + p1);
    assert!((y[0] - want).abs() < 1e-4, "{y:?}");
    assert_eq!(y[1], 0.0);
}

#[test]
fn attention_shares_key_value_heads_across_query_head_groups() {
    // Four query heads over two key/value heads: heads 0-1 read kv head 0, 2-3 kv head 1.
    let q = f32s(&[1, 4, 1, 1], vec![1.0; 4]);
    let k = f32s(&[1, 2, 1, 1], vec![1.0, 1.0]);
    let v = f32s(&[1, 2, 1, 1], vec![3.0, 7.0]);
    let out = run("Attention", 23, &[], vec![q, k, v], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[3.0, 3.0, 7.0, 7.0]);
}

#[test]
fn attention_bad_inputs_are_errors() {
    let qkv = |q: &[usize], k: &[usize], v: &[usize]| vec![zeros(q), zeros(k), zeros(v)];
    expect_err(run("Attention", 23, &[], qkv(&[1, 2, 4], &[1, 2, 4], &[1, 2, 4]), 1), &["q_num_heads", "3-D"]);
    let heads = [("q_num_heads", Attr::Int(3)), ("kv_num_heads", Attr::Int(1))];
    expect_err(run("Attention", 23, &heads, qkv(&[1, 2, 4], &[1, 2, 4], &[1, 2, 4]), 1), &["hidden size 4", "q_num_heads 3"]);
    expect_err(run("Attention", 23, &[("q_num_heads", Attr::Int(0))], qkv(&[1, 2, 4], &[1, 2, 4], &[1, 2, 4]), 1), &["q_num_heads", "positive"]);
    expect_err(run("Attention", 23, &[], qkv(&[1, 3, 2, 4], &[1, 2, 2, 4], &[1, 2, 2, 4]), 1), &["3 query heads", "2 key/value heads"]);
    expect_err(run("Attention", 23, &[], qkv(&[1, 2, 2, 4], &[1, 2, 2, 8], &[1, 2, 2, 4]), 1), &["head size", "4", "8"]);
    expect_err(run("Attention", 23, &[], qkv(&[1, 2, 2, 4], &[1, 2, 3, 4], &[1, 2, 2, 4]), 1), &["sequence length", "3", "2"]);
    expect_err(run("Attention", 23, &[], qkv(&[1, 2, 2, 4], &[1, 2, 2], &[1, 2, 2, 4]), 1), &["one rank"]);
    expect_err(run("Attention", 25, &[("q_num_heads", Attr::Int(2))], qkv(&[1, 2, 2, 4], &[1, 2, 2, 4], &[1, 2, 2, 4]), 1), &["q_num_heads", "must not be set"]);
    expect_err(run("Attention", 23, &[("qk_matmul_output_mode", Attr::Int(4))], qkv(&[1, 1, 1, 1], &[1, 1, 1, 1], &[1, 1, 1, 1]), 1), &["qk_matmul_output_mode", "4"]);
    let mut ins = qkv(&[1, 1, 2, 4], &[1, 1, 2, 4], &[1, 1, 2, 4]);
    ins.extend([None, zeros(&[1, 1, 3, 4])]);
    expect_err(run("Attention", 23, &[], ins, 1), &["past_key and past_value", "together"]);
    let mut ins = qkv(&[1, 1, 2, 4], &[1, 1, 2, 4], &[1, 1, 2, 4]);
    ins.extend([None, zeros(&[1, 1, 3, 4]), zeros(&[1, 1, 2, 4])]);
    expect_err(run("Attention", 23, &[], ins, 3), &["past_key", "[1, 1, 3, 4]", "[1, 1, 2, 4]"]);
    let mut ins = qkv(&[1, 1, 2, 4], &[1, 1, 2, 4], &[1, 1, 2, 4]);
    ins.push(zeros(&[2, 3]));
    expect_err(run("Attention", 23, &[], ins, 1), &["attn_mask", "3 key columns", "2 keys"]);
    let mut ins = qkv(&[1, 1, 2, 4], &[1, 1, 2, 4], &[1, 1, 2, 4]);
    ins.push(zeros(&[3, 2]));
    expect_err(run("Attention", 23, &[], ins, 1), &["attn_mask", "[3, 2]", "broadcast"]);
    let mut ins = qkv(&[1, 1, 2, 4], &[1, 1, 2, 4], &[1, 1, 2, 4]);
    ins.extend([None, None, None, i64s(&[2], vec![1, 1])]);
    expect_err(run("Attention", 24, &[], ins, 1), &["nonpad_kv_seqlen", "[1]", "[2]"]);
    // Empty heads with long sequences: the score matrix alone would need 2^42 bytes.
    let long = 1 << 20;
    expect_err(run("Attention", 23, &[], qkv(&[1, 1, long, 0], &[1, 1, long, 0], &[1, 1, long, 0]), 1), &["attention scores"]);
}

#[test]
fn rotary_embedding_rotates_pairs_and_rejects_bad_inputs() {
    // One token, one head of 4 values, a quarter turn: (x1, x2) -> (-x2, x1) per pair.
    let x = f32s(&[1, 1, 1, 4], vec![1.0, 2.0, 3.0, 4.0]);
    let cache = |v: f32| f32s(&[1, 2], vec![v, v]);
    let pos = i64s(&[1, 1], vec![0]);
    let out = run("RotaryEmbedding", 23, &[], vec![x.clone(), cache(0.0), cache(1.0), pos.clone()], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[-3.0, -4.0, 1.0, 2.0]);
    let out = run("RotaryEmbedding", 23, &[("interleaved", Attr::Int(1))], vec![x.clone(), cache(0.0), cache(1.0), pos.clone()], 1).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[-2.0, 1.0, -4.0, 3.0]);
    expect_err(run("RotaryEmbedding", 23, &[], vec![x.clone(), cache(0.0), cache(1.0), i64s(&[1, 1], vec![5])], 1), &["position id 5", "[0, 1)"]);
    expect_err(run("RotaryEmbedding", 23, &[("rotary_embedding_dim", Attr::Int(3))], vec![x.clone(), cache(0.0), cache(1.0), pos.clone()], 1), &["rotary_embedding_dim 3", "even"]);
    expect_err(run("RotaryEmbedding", 23, &[], vec![zeros(&[1, 1, 4]), cache(0.0), cache(1.0), pos.clone()], 1), &["num_heads"]);
    expect_err(run("RotaryEmbedding", 23, &[], vec![x.clone(), f32s(&[1, 3], vec![0.0; 3]), f32s(&[1, 3], vec![0.0; 3]), pos], 1), &["last dimension 3", "2"]);
    expect_err(run("RotaryEmbedding", 23, &[], vec![x, cache(0.0), cache(1.0)], 1), &["without position_ids", "[1, 1, 2]"]);
}

#[test]
fn swiglu_gates_values_and_rejects_mismatched_inputs() {
    let out = run("SwiGLU", 28, &[], vec![f32s(&[2], vec![0.0, 2.0]), f32s(&[2], vec![5.0, 3.0])], 1).unwrap();
    let want = 2.0 / (1.0 + (-2.0f32).exp()) * 3.0;
    let y = out[0].as_slice::<f32>().unwrap();
    assert_eq!(y[0], 0.0);
    assert!((y[1] - want).abs() < 1e-5, "{y:?}");
    expect_err(run("SwiGLU", 28, &[], vec![zeros(&[2, 3]), zeros(&[3])], 1), &["[2, 3]", "[3]"]);
}
