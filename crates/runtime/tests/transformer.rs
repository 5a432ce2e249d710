//! The BERT-class encoder exported from PyTorch (`models/bert_tiny.onnx`) gives the same
//! sentence embeddings as ONNX Runtime: cosine >= 0.99999 per sentence, on the exported
//! sample inputs (one sentence padded by the attention mask) and on a different length.

use qforge_ir::Tensor;
use qforge_runtime::Session;
use qforge_testkit::{ort_run, repo};

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn sentence_embeddings_match_onnxruntime() {
    let path = repo().join("models/bert_tiny.onnx");
    let model = qforge_onnx::load(&path).unwrap();
    let session = Session::new(&model).unwrap();
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
    for inputs in [sample, longer] {
        let ours = session.run(inputs.clone()).unwrap();
        let reference = ort_run(&path, &inputs, 1);
        let (a, b) = (ours[1].1.as_slice::<f32>().unwrap(), reference[1].1.as_slice::<f32>().unwrap());
        let dim = ours[1].1.shape()[1];
        for (i, (x, y)) in a.chunks(dim).zip(b.chunks(dim)).enumerate() {
            let c = cosine(x, y);
            println!("sentence {i}: cosine {c:.9}");
            assert!(c >= 0.99999, "sentence {i}: cosine {c}");
        }
    }
}
