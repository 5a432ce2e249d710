//! Folding BatchNormalization into the preceding Conv/ConvTranspose/Gemm keeps the model's
//! outputs, checked with ONNX Runtime on the original (with ORT's own fusions off, so its
//! BatchNormalization runs as written) and the folded model (rtol 1e-4, atol 1e-5), on real
//! models with BatchNormalization after Conv and ConvTranspose.

use qforge_quant::passes::fold_batch_norm;
use qforge_testkit::{compare, make_inputs, ort_run_with, real_models, TempDir};

fn count(g: &qforge_ir::Graph, op: &str) -> usize {
    g.nodes().filter(|(_, n)| n.op_type == op).count()
}

#[test]
fn folded_models_match_the_originals() {
    let tmp = TempDir::new("foldbn");
    let mut total = 0;
    for m in real_models().into_iter().filter(|m| ["ocr_cls", "ocr_det", "orientation"].contains(&m.name.as_str())) {
        let original = qforge_onnx::load(&m.path).unwrap();
        let mut model = original.clone();
        qforge_onnx::fold_constant_nodes(&mut model);
        let before = count(&model.graph, "BatchNormalization");
        let folded = fold_batch_norm(&mut model.graph).unwrap();
        model.graph.check().unwrap();
        assert!(folded > 0, "{}: nothing folded", m.name);
        assert_eq!(count(&model.graph, "BatchNormalization"), before - folded, "{}", m.name);
        let path = tmp.path().join(format!("{}.onnx", m.name));
        qforge_onnx::save(&model, &path).unwrap();
        let inputs = make_inputs(&original.graph, &m, 3);
        let (a, b) = (ort_run_with(&m.path, &inputs, 1, false), ort_run_with(&path, &inputs, 1, false));
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            let (worst, ok) = compare(y, x, 1e-4, 1e-5);
            println!("{:<12} folded {folded:>2} of {before:>2} BN; '{name}' max |diff| {worst:.2e}", m.name);
            assert!(ok, "{} output '{name}': max |diff| {worst}", m.name);
        }
        total += folded;
    }
    assert!(total >= 40, "only {total} BatchNormalization nodes folded");
}
