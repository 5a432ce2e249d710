//! `qforge quantize --backend htp` as a user runs it (on examples/tiny_cnn.onnx, whose 3 to 16
//! input channels need `--block-size 2` for block-wise weights): a generation too old for the precision
//! gives per-node violations (node, op, rule, fix) on stderr and in the JSON report while the
//! model is still written; `--strict` turns them into an error and writes nothing; overrides
//! from `--config` reach the nodes they name; bad HTP arguments are refused with the accepted
//! values.

use std::path::Path;
use std::process::{Command, Output};

use qforge_testkit::{repo, TempDir};

fn qforge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge")).arg("quantize").args(args).output().expect("qforge runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `quantize examples/tiny_cnn.onnx -o OUT --calibration-data examples/tiny_cnn_calib.npz --backend htp` plus `extra`.
fn tiny(out: &Path, extra: &[&str]) -> Output {
    let model = repo().join("examples/tiny_cnn.onnx");
    let calib = repo().join("examples/tiny_cnn_calib.npz");
    let mut args = vec![model.to_str().unwrap(), "-o", out.to_str().unwrap(), "--calibration-data", calib.to_str().unwrap(), "--backend", "htp"];
    args.extend_from_slice(extra);
    qforge(&args)
}

const WEIGHTED: [(&str, &str); 3] = [("/features/conv1/Conv", "Conv"), ("/features/conv2/Conv", "Conv"), ("/head/fc/Gemm", "Gemm")];

#[test]
fn an_old_soc_reports_violations_node_by_node() {
    let tmp = TempDir::new("htpcli");
    let out = tmp.path().join("q.onnx");
    let report = tmp.path().join("report.json");
    let o = tiny(&out, &["--precision", "16a4w-block", "--block-size", "2", "--soc", "v68", "--report", report.to_str().unwrap()]);
    let e = stderr(&o);
    assert!(o.status.success(), "violations are warnings without --strict: {e}");
    assert!(out.exists(), "the model is written");
    for (node, op) in WEIGHTED {
        let line = e.lines().find(|l| l.contains(&format!("node '{node}'"))).unwrap_or_else(|| panic!("no line for {node}: {e}"));
        assert!(line.contains(op) && line.contains("16a4w-block") && line.contains("v68") && line.contains("--precision 16a4w or --soc v69"), "{line}");
    }
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let v = r["violations"].as_array().unwrap();
    let nodes: Vec<(&str, &str)> = v.iter().map(|x| (x["node"].as_str().unwrap(), x["op"].as_str().unwrap())).collect();
    assert_eq!(nodes, WEIGHTED.to_vec());
    assert!(v.iter().all(|x| x["rule"].as_str().is_some_and(|s| !s.is_empty()) && x["fix"].as_str().is_some_and(|s| s.contains("--soc v69"))), "{v:?}");
    // A generation that runs block-wise 4-bit weights has nothing to say.
    let o = tiny(&out, &["--precision", "16a4w-block", "--block-size", "2", "--soc", "SM8450", "--report", report.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["violations"].as_array().unwrap().len(), 0, "{}", stderr(&o));
}

#[test]
fn strict_turns_violations_into_an_error() {
    let tmp = TempDir::new("htpcli-strict");
    let out = tmp.path().join("q.onnx");
    let o = tiny(&out, &["--precision", "16a16w", "--soc", "v69", "--strict"]);
    let e = stderr(&o);
    assert!(!o.status.success(), "--strict fails: {e}");
    assert!(!e.contains("panicked"), "{e}");
    assert!(e.contains("3 node(s)") && WEIGHTED.iter().all(|(n, _)| e.contains(n)) && e.contains("--soc v73"), "{e}");
    assert!(!out.exists(), "nothing is written on error");
    let o = tiny(&out, &["--precision", "16a16w", "--soc", "v73", "--strict"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn config_overrides_reach_their_nodes() {
    let tmp = TempDir::new("htpcli-config");
    let out = tmp.path().join("q.onnx");
    let report = tmp.path().join("report.json");
    let config = tmp.path().join("htp.toml");
    std::fs::write(&config, "[[name]]\nname = \"/features/conv2/Conv\"\nprecision = \"16a8w\"\n\n[[op_type]]\nop = \"Softmax\"\nprecision = \"float\"\n").unwrap();
    let o = tiny(&out, &["--config", config.to_str().unwrap(), "--report", report.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let node = |name: &str| r["nodes"].as_array().unwrap().iter().find(|n| n["name"] == name).unwrap_or_else(|| panic!("no node {name}")).clone();
    assert!(node("/features/conv2/Conv")["rule"].as_str().unwrap().contains("[16a8w]"));
    assert!(node("/features/conv1/Conv")["rule"].as_str().unwrap().contains("[8a8w]"), "--precision defaults to 8a8w");
    let softmax = node("/head/Softmax");
    assert_eq!(softmax["quantized"], false);
    assert!(softmax["reason"].as_str().unwrap().contains("float"), "{softmax}");
}

#[test]
fn bad_htp_arguments_are_refused() {
    let tmp = TempDir::new("htpcli-bad");
    let out = tmp.path().join("q.onnx");
    let cases: [(&[&str], &[&str]); 4] = [
        (&["--soc", "v42"], &["v42", "v68", "v79", "SM8550"]),
        (&["--precision", "4a4w"], &["4a4w", "16a4w-block"]),
        (&["--per-tensor"], &["--per-tensor", "htp"]),
        (&["--block-size", "0", "--precision", "16a4w-block"], &["block size"]),
    ];
    for (args, needles) in cases {
        let o = tiny(&out, args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} should fail: {e}");
        for n in needles {
            assert!(e.contains(n), "{args:?}: '{n}' missing from: {e}");
        }
        assert!(!out.exists());
    }
    let model = repo().join("examples/tiny_cnn.onnx");
    let calib = repo().join("examples/tiny_cnn_calib.npz");
    let o = qforge(&[model.to_str().unwrap(), "-o", out.to_str().unwrap(), "--calibration-data", calib.to_str().unwrap(), "--precision", "16a8w"]);
    assert!(!o.status.success() && stderr(&o).contains("--backend htp"), "{}", stderr(&o));
}
