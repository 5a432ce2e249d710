//! Shape and type inference on every real model agrees with ONNX's own inference (run on the
//! same model with value_info stripped): every element type ONNX infers matches ours, and
//! every dimension both sides know is equal. On the vision models qforge must know at least
//! as many dimensions as ONNX (it propagates shape arithmetic that ONNX cannot).

use std::collections::HashMap;

use qforge_ir::{infer, Dim};
use qforge_testkit::{committed_models, light_models, oracle, real_models};
use serde_json::Value;

#[test]
fn inference_agrees_with_onnx() {
    let mut summary = vec![];
    for m in real_models().into_iter().chain(light_models()).chain(committed_models()) {
        let mut model = qforge_onnx::load(&m.path).unwrap();
        let outputs: Vec<_> = model.graph.outputs().to_vec();
        let stripped: Vec<_> = model.graph.values().filter(|(id, v)| v.in_value_info && !outputs.contains(id)).map(|(id, _)| id).collect();
        for id in stripped {
            let v = model.graph.value_mut(id).unwrap();
            v.ty = None;
            v.in_value_info = false;
        }
        let report = infer::infer_model(&mut model);
        assert!(report.conflicts.is_empty(), "{}: conflicts with declared types: {:?}", m.name, report.conflicts);
        let out = oracle("onnx_shapes.py", &[m.path.as_os_str()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let reference: HashMap<String, Value> = serde_json::from_slice(&out.stdout).unwrap();
        let (mut ours_known, mut theirs_known, mut compared) = (0, 0, 0);
        for (name, want) in &reference {
            let Some(id) = model.graph.value_by_name(name) else { continue };
            let Some(ty) = model.graph.value(id).unwrap().ty.clone() else { continue };
            if let (Some(e), Some(w)) = (ty.elem(), want["elem"].as_str()) {
                assert_eq!(e.onnx_name(), w, "{}: element type of '{name}'", m.name);
            }
            let (Some(shape), Some(wshape)) = (ty.shape(), want["shape"].as_array()) else { continue };
            assert_eq!(shape.len(), wshape.len(), "{}: rank of '{name}': ours {shape:?}, onnx {wshape:?}", m.name);
            for (d, w) in shape.iter().zip(wshape) {
                if let (Dim::Known(a), Some(b)) = (d, w.as_i64()) {
                    assert_eq!(*a, b, "{}: '{name}': ours {shape:?}, onnx {wshape:?}", m.name);
                    compared += 1;
                }
                ours_known += d.known().is_some() as usize;
                theirs_known += w.as_i64().is_some() as usize;
            }
        }
        summary.push(format!("{:<26} dims known: qforge {ours_known:>5}, onnx {theirs_known:>5}, both {compared:>5}; ops without a rule: {}", m.name, report.unknown_ops.len()));
        if !m.name.starts_with("silero") && !m.name.starts_with("light") {
            assert!(ours_known >= theirs_known, "{}: qforge knows {ours_known} dims, onnx {theirs_known}", m.name);
        }
    }
    println!("{}", summary.join("\n"));
}
