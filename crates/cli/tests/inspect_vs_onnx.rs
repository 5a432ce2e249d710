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
