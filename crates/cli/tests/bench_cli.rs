//! `qforge bench`: latency statistics and the per-node profile, on the float example model and
//! on its QDQ form (which runs as integer operators).

mod common;

use std::collections::HashSet;

use common::{example, qforge, text};
use qforge_testkit::TempDir;
use serde_json::Value;

/// `qforge bench MODEL --runs 5 --profile --json`, parsed.
fn bench_json(model: &std::path::Path) -> Value {
    let out = qforge(&["bench".as_ref(), model.as_os_str(), "--runs".as_ref(), "5".as_ref(), "--profile".as_ref(), "--json".as_ref()]);
    assert!(out.status.success(), "qforge bench failed: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON object")
}

/// Checks the latency order statistics and that the per-op profile is the per-node profile
/// summed by op type, both slowest first.
fn check_profile(r: &Value, node_names: &HashSet<String>) {
    let (p10, median, p90) = (r["p10_ms"].as_f64().unwrap(), r["median_ms"].as_f64().unwrap(), r["p90_ms"].as_f64().unwrap());
    assert!(0.0 < p10 && p10 <= median && median <= p90, "p10 {p10}, median {median}, p90 {p90}");
    let nodes = r["profile_ms_by_node"].as_array().expect("profile_ms_by_node");
    let ops = r["profile_ms_by_op"].as_array().expect("profile_ms_by_op");
    assert!(!nodes.is_empty());
    let ms = |v: &Value| v["ms"].as_f64().unwrap();
    assert!(nodes.windows(2).all(|w| ms(&w[0]) >= ms(&w[1])), "nodes are listed slowest first");
    assert!(ops.windows(2).all(|w| ms(&w[0]) >= ms(&w[1])), "op types are listed slowest first");
    let mut seen = HashSet::new();
    for n in nodes {
        let name = n["node"].as_str().unwrap();
        assert!(seen.insert(name), "node '{name}' is listed twice");
        assert!(ms(n) >= 0.0);
    }
    assert!(seen.iter().all(|n| node_names.contains(*n)), "profiled nodes {seen:?} are not all nodes of the model {node_names:?}");
    for op in ops {
        let name = op["op"].as_str().unwrap();
        let sum: f64 = nodes.iter().filter(|n| n["op"] == name).map(ms).sum();
        assert!((sum - ms(op)).abs() <= 1e-9 * sum.max(1.0), "op {name}: {} ms, its nodes sum to {sum} ms", ms(op));
    }
    let listed: HashSet<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert!(nodes.iter().all(|n| listed.contains(n["op"].as_str().unwrap())), "every node's op type has a total");
}

fn node_names(model: &std::path::Path) -> HashSet<String> {
    let m = qforge_onnx::load(model).unwrap();
    m.graph.nodes().map(|(_, n)| n.name.clone()).collect()
}

#[test]
fn bench_profiles_every_node_of_a_float_model() {
    let model = example("tiny_cnn.onnx");
    let r = bench_json(&model);
    assert!(r["qdq_lowering"].is_null(), "a float model has no QDQ units");
    check_profile(&r, &node_names(&model));
}

#[test]
fn bench_runs_a_qdq_model_as_integer_operators_and_profiles_them() {
    let dir = TempDir::new("bench-cli");
    let q = dir.0.join("tiny_cnn.qdq.onnx");
    let out = qforge(&["quantize".as_ref(), example("tiny_cnn.onnx").as_os_str(), "-o".as_ref(), q.as_os_str(), "--calibration-data".as_ref(), example("tiny_cnn_calib.npz").as_os_str()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r = bench_json(&q);
    assert!(r["qdq_lowering"]["lowered"].as_u64().unwrap() > 0, "{}", r["qdq_lowering"]);
    let ops: Vec<&str> = r["profile_ms_by_op"].as_array().unwrap().iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert!(ops.contains(&"QLinearConv"), "the quantized convolutions run as QLinearConv: {ops:?}");
    // Lowered nodes keep the names of the nodes they replace.
    check_profile(&r, &node_names(&q));
}

#[test]
fn bench_refuses_zero_runs() {
    let out = qforge(&["bench".as_ref(), example("tiny_cnn.onnx").as_os_str(), "--runs".as_ref(), "0".as_ref()]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--runs must be at least 1"), "{}", text(&out.stderr));
}
