//! `qforge inspect --json` agrees with the `onnx` Python package on every real model of the
//! test cache: op histogram (subgraphs included), node and parameter counts, inputs, outputs
//! and opsets.

use std::path::PathBuf;
use std::process::Command;

use qforge_testkit::{committed_models, light_models, python, real_models, repo};

fn models() -> Vec<PathBuf> {
    real_models().into_iter().chain(light_models()).chain(committed_models()).map(|m| m.path).collect()
}

fn json_of(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().expect("command runs");
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

#[test]
fn inspect_matches_onnx_package() {
    let oracle = repo().join("scripts/oracle/onnx_inspect.py");
    for model in models() {
        let ours = json_of(Command::new(env!("CARGO_BIN_EXE_qforge")).arg("inspect").arg("--json").arg(&model));
        let reference = json_of(Command::new(python()).arg(&oracle).arg(&model));
        for key in ["ops", "nodes", "parameters", "inputs", "outputs", "opsets"] {
            assert_eq!(ours[key], reference[key], "{}: '{key}' differs", model.display());
        }
    }
}

#[test]
fn inspect_reports_unreadable_files_cleanly() {
    let dir = qforge_testkit::TempDir::new("inspect");
    let bad = dir.path().join("garbage.onnx");
    std::fs::write(&bad, b"\x08\x07this is not a protobuf model\xff\xff").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_qforge")).arg("inspect").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("garbage.onnx"), "the error names the file: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `x[8,16]` read by a MatMul and a Gemm with 8-bit dequantized weights, by a MatMul through
/// Q/DQ with one, by one whose output is quantized, and `c[1,16,4,4]` by a Conv with one.
fn weight_only_cases() -> qforge_ir::Model {
    use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueType};
    let mut g = Graph::new("weight_only");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[8, 16]))).unwrap();
    let c = g.add_input("c", Some(ValueType::tensor_of(DType::F32, &[1, 16, 4, 4]))).unwrap();
    let node = |g: &mut Graph, op: &str, name: &str, inputs: Vec<qforge_ir::ValueId>, attrs: Vec<(&str, Attr)>| {
        let out = g.new_value(format!("{name}_out"), None).unwrap();
        let mut n = Node::new(op, name).with_inputs(inputs).with_outputs([out]);
        for (k, v) in attrs {
            n = n.with_attr(k, v);
        }
        g.add_node(n).unwrap();
        out
    };
    // Each weight has scales of its own: ONNX Runtime merges equal initializers, and a scale
    // shared by two nodes keeps both from fusing.
    let mut seed = 0.0f32;
    let mut weight = |g: &mut Graph, name: &str, shape: &[usize], axis: i64| {
        seed += 1.0;
        let n: usize = shape.iter().product();
        let q = g.add_initializer(&format!("{name}_q"), Tensor::from_vec(shape, (0..n).map(|i| ((i * 37) % 255) as i8 - 127).collect::<Vec<i8>>()).unwrap()).unwrap();
        let channels = shape[axis as usize];
        let s = g.add_initializer(&format!("{name}_scale"), Tensor::from_vec(&[channels], (0..channels).map(|c| 0.01 * seed + 0.001 * c as f32).collect::<Vec<f32>>()).unwrap()).unwrap();
        let z = g.add_initializer(&format!("{name}_zero_point"), Tensor::from_vec(&[channels], vec![0i8; channels]).unwrap()).unwrap();
        (q, s, z, axis)
    };
    let mut outputs = vec![];
    for (name, op) in [("weight_only_matmul", "MatMul"), ("weight_only_gemm", "Gemm"), ("qdq_matmul", "MatMul"), ("weight_only_matmul_to_q", "MatMul")] {
        let (q, s, z, axis) = weight(&mut g, name, &[16, 8], 1);
        let w = node(&mut g, "DequantizeLinear", &format!("{name}_dq"), vec![q, s, z], vec![("axis", Attr::Int(axis))]);
        let a = if name == "qdq_matmul" {
            let (s, z) = (g.add_initializer("x_scale", Tensor::scalar(0.02f32)).unwrap(), g.add_initializer("x_zero_point", Tensor::scalar(128u8)).unwrap());
            let xq = node(&mut g, "QuantizeLinear", "x_q", vec![x, s, z], vec![]);
            node(&mut g, "DequantizeLinear", "x_dq", vec![xq, s, z], vec![])
        } else {
            x
        };
        let mut y = node(&mut g, op, name, vec![a, w], vec![]);
        if name == "weight_only_matmul_to_q" {
            let (s, z) = (g.add_initializer("y_scale", Tensor::scalar(0.05f32)).unwrap(), g.add_initializer("y_zero_point", Tensor::scalar(128u8)).unwrap());
            let yq = node(&mut g, "QuantizeLinear", "y_q", vec![y, s, z], vec![]);
            y = node(&mut g, "DequantizeLinear", "y_dq", vec![yq, s, z], vec![]);
        }
        outputs.push(y);
    }
    let (q, s, z, axis) = weight(&mut g, "weight_only_conv", &[8, 16, 1, 1], 0);
    let w = node(&mut g, "DequantizeLinear", "weight_only_conv_dq", vec![q, s, z], vec![("axis", Attr::Int(axis))]);
    outputs.push(node(&mut g, "Conv", "weight_only_conv", vec![c, w], vec![]));
    g.set_outputs(outputs).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

/// `weight_only_matmuls` lists exactly the nodes ONNX Runtime fuses into MatMulNBits.
#[test]
fn weight_only_matmuls_are_those_onnx_runtime_runs_as_matmulnbits() {
    let dir = qforge_testkit::TempDir::new("weightonly");
    let path = dir.path().join("cases.onnx");
    qforge_onnx::save(&weight_only_cases(), &path).unwrap();
    let ours = json_of(Command::new(env!("CARGO_BIN_EXE_qforge")).arg("inspect").arg("--json").arg(&path));
    let mut flagged: Vec<&str> = ours["weight_only_matmuls"].as_array().unwrap().iter().map(|w| w["node"].as_str().unwrap()).collect();
    flagged.sort();
    let ort = json_of(Command::new(python()).arg(repo().join("scripts/oracle/ort_fused_ops.py")).arg(&path));
    let mut nbits: Vec<&str> = ort.as_object().unwrap().iter().filter(|(_, op)| *op == "com.microsoft::MatMulNBits").map(|(n, _)| n.as_str()).collect();
    nbits.sort();
    assert_eq!(flagged, nbits, "ONNX Runtime's optimized graph: {ort}");
    assert_eq!(flagged, ["weight_only_gemm", "weight_only_matmul"]);
}
