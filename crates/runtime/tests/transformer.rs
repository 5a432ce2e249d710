//! The BERT-class encoder exported from PyTorch (`models/bert_tiny.onnx`) gives the same
//! sentence embeddings as ONNX Runtime: cosine >= 0.99999 per sentence, on the exported
//! sample inputs (one sentence padded by the attention mask) and on a different length. So do
//! its two variants fused by ONNX Runtime's transformer optimizer into ONNX Runtime's
//! `com.microsoft` operators (`scripts/optimize_bert.py`), which also match the unfused model.

use qforge_ir::Tensor;
use qforge_runtime::Session;
use qforge_testkit::{ort_run, repo};

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// The exported sample inputs, and three sentences of 40 tokens, the last padded from 20 on.
fn inputs() -> [Vec<(String, Tensor)>; 2] {
    let sample = qforge_data::read_npz(&repo().join("models/bert_tiny_inputs.npz")).unwrap();
    let longer: Vec<(String, Tensor)> = {
        let ids: Vec<i64> = (0..3 * 40).map(|i| (i * 37 % 1000 + 1) as i64).collect();
        let mut mask = vec![1i64; 120];
        mask[100..].fill(0);
        let types: Vec<i64> = (0..120).map(|i| ((i % 40) >= 20) as i64).collect();
        vec![
            ("input_ids".into(), Tensor::from_vec(&[3, 40], ids).unwrap()),
            ("attention_mask".into(), Tensor::from_vec(&[3, 40], mask).unwrap()),
            ("token_type_ids".into(), Tensor::from_vec(&[3, 40], types).unwrap()),
        ]
    };
    [sample, longer]
}

/// Asserts that the `sentence_embedding` outputs `a` and `b` agree per sentence (cosine at
/// least `min`), printing each cosine under `what`.
fn same_embeddings(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)], min: f64) {
    let get = |outs: &[(String, Tensor)]| outs.iter().find(|(n, _)| n == "sentence_embedding").map(|(_, t)| t.clone()).expect("a sentence_embedding output");
    let (x, y) = (get(a), get(b));
    let dim = x.shape()[1];
    for (i, (p, q)) in x.as_slice::<f32>().unwrap().chunks(dim).zip(y.as_slice::<f32>().unwrap().chunks(dim)).enumerate() {
        let c = cosine(p, q);
        println!("{what}, sentence {i}: cosine {c:.9}");
        assert!(c >= min, "{what}, sentence {i}: cosine {c}");
    }
}

#[test]
fn sentence_embeddings_match_onnxruntime() {
    let path = repo().join("models/bert_tiny.onnx");
    let model = qforge_onnx::load(&path).unwrap();
    let session = Session::new(&model).unwrap();
    for inputs in inputs() {
        let ours = session.run(inputs.clone()).unwrap();
        let reference = ort_run(&path, &inputs, 1);
        same_embeddings("bert_tiny", &ours, &reference, 0.99999);
    }
}

/// The optimized models hold the com.microsoft ops the optimizer fuses into (and no
/// attention, GELU or layer normalization left unfused); qforge runs them as ONNX Runtime
/// does, and both agree with the unfused model.
#[test]
fn models_fused_by_onnxruntime_transformer_optimizer_match_onnxruntime() {
    let original = repo().join("models/bert_tiny.onnx");
    let variants: [(&str, &[&str]); 2] = [
        ("bert_tiny_ort_opt", &["EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"]),
        ("bert_tiny_ort_opt_mha", &["MultiHeadAttention", "SkipLayerNormalization", "FastGelu"]),
    ];
    for (name, ops) in variants {
        let path = repo().join(format!("models/{name}.onnx"));
        let model = qforge_onnx::load(&path).unwrap();
        let ms_ops: Vec<&str> = model.graph.nodes().filter(|(_, n)| n.domain == qforge_ir::MS_DOMAIN).map(|(_, n)| n.op_type.as_str()).collect();
        for op in ops {
            assert!(ms_ops.contains(op), "{name} has no com.microsoft {op}: {ms_ops:?}");
        }
        for (_, n) in model.graph.nodes() {
            assert!(!["Softmax", "Erf", "LayerNormalization", "ReduceMean"].contains(&n.op_type.as_str()), "{name} still has an unfused {}", n.op_type);
        }
        let session = Session::new(&model).unwrap();
        for inputs in inputs() {
            let ours = session.run(inputs.clone()).unwrap();
            let reference = ort_run(&path, &inputs, 1);
            same_embeddings(&format!("{name} vs ONNX Runtime"), &ours, &reference, 0.99999);
            let (_, h) = ours.iter().find(|(n, _)| n == "last_hidden_state").unwrap();
            let (_, r) = reference.iter().find(|(n, _)| n == "last_hidden_state").unwrap();
            let (worst, ok) = qforge_testkit::compare(h, r, 1e-4, 1e-4);
            println!("{name}: last_hidden_state max |qforge - ORT| {worst:.3e}");
            assert!(ok, "{name}: last_hidden_state differs from ONNX Runtime by {worst}");
            same_embeddings(&format!("{name} vs unfused"), &ours, &ort_run(&original, &inputs, 1), 0.99999);
        }
    }
}
