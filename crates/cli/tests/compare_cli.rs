//! `qforge compare` as a user runs it: the example model quantized with `qforge quantize` and
//! compared on its calibration data gives JSON naming every tensor of the float model and its
//! weights, and a table; bad data and mismatched models give errors naming the path or input.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Output;

use qforge_testkit::TempDir;

mod common;
use common::{example, qforge, text};

/// The example model quantized by `qforge quantize` into `dir`.
fn quantized_example(dir: &Path) -> PathBuf {
    let out = dir.join("tiny_cnn.qdq.onnx");
    let o = qforge(&["quantize".as_ref(), example("tiny_cnn.onnx").as_os_str(), "-o".as_ref(), out.as_os_str(),
        "--calibration-data".as_ref(), example("tiny_cnn_calib.npz").as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    out
}

fn compare(float: &Path, quant: &Path, data: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<&OsStr> = vec!["compare".as_ref(), float.as_os_str(), quant.as_os_str(), "--data".as_ref(), data.as_os_str()];
    args.extend(extra.iter().map(|a| OsStr::new(*a)));
    qforge(&args)
}

#[test]
fn json_names_every_tensor_and_weight_of_the_example() {
    let tmp = TempDir::new("cmpcli");
    let quant = quantized_example(tmp.path());
    let (float, data) = (example("tiny_cnn.onnx"), example("tiny_cnn_calib.npz"));
    let o = compare(&float, &quant, &data, &["--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&o.stdout)));
    assert_eq!(doc["samples"], 8, "tiny_cnn_calib.npz stacks 8 samples");

    let model = qforge_onnx::load(&float).unwrap();
    let g = &model.graph;
    let mut expected: Vec<String> = g.inputs().iter().map(|&v| g.value_name(v)).collect();
    for id in g.topo_order().unwrap() {
        expected.extend(g.node(id).unwrap().outputs.iter().flatten().map(|&v| g.value_name(v)));
    }
    let activations = doc["activations"].as_array().unwrap();
    let names: Vec<&str> = activations.iter().map(|a| a["name"].as_str().unwrap()).collect();
    assert_eq!(names, expected, "every value of the float model, in graph order");
    for a in activations {
        let sqnr = a["sqnr_db"].as_f64().unwrap_or_else(|| panic!("quantization error expected everywhere: {a}"));
        assert!(sqnr > 10.0 && sqnr < 100.0, "{a}");
        assert!(a["cosine"].as_f64().unwrap() > 0.99, "{a}");
        assert_eq!(a["count"].as_u64().unwrap() % 8, 0, "elements of 8 samples: {a}");
    }
    assert!(activations.iter().any(|a| a["name"] == "x" && a["fake_quantized"] == true && a["op"] == "input"));
    assert_eq!(doc["outputs"].as_array().unwrap().iter().map(|o| o["name"].as_str().unwrap()).collect::<Vec<_>>(), vec!["probs"]);
    let weights = doc["weights"].as_array().unwrap();
    for w in ["c1.w", "c2.w", "fc.w"] {
        let found = weights.iter().find(|x| x["name"] == w).unwrap_or_else(|| panic!("{w} missing from {weights:?}"));
        assert!(!found["channel_sqnr_db"].as_array().unwrap().is_empty(), "{w}: per-channel figures");
        assert!(found["min_channel_sqnr_db"].as_f64().unwrap() <= found["median_channel_sqnr_db"].as_f64().unwrap());
    }

    let o = compare(&float, &quant, &data, &["--limit", "3"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let table = text(&o.stdout);
    assert!(table.contains("on 3 sample(s)") && table.contains("worst 10 by SQNR") && table.contains("c1.w"), "{table}");
    for name in &expected {
        assert!(table.lines().any(|l| l.split_whitespace().next() == Some(name.as_str())), "{name} missing from the table:\n{table}");
    }
    assert!(text(&o.stderr).contains("comparing: 3/3 samples"), "{}", text(&o.stderr));
}

#[test]
fn bad_data_and_mismatched_models_are_named() {
    let tmp = TempDir::new("cmpclierr");
    let quant = quantized_example(tmp.path());
    let float = example("tiny_cnn.onnx");

    let missing = tmp.path().join("no_such_data.npz");
    let o = compare(&float, &quant, &missing, &[]);
    let e = text(&o.stderr);
    assert!(!o.status.success() && !e.contains("panicked"), "{e}");
    assert!(e.contains(&missing.display().to_string()) && e.contains("does not exist"), "{e}");

    let wrong_input = tmp.path().join("wrong.npz");
    let t = qforge_ir::Tensor::from_vec(&[2, 1, 3, 32, 32], vec![0.5f32; 2 * 3 * 32 * 32]).unwrap();
    qforge_data::write_npz(&wrong_input, &[("image".to_string(), t)]).unwrap();
    let o = compare(&float, &quant, &wrong_input, &[]);
    let e = text(&o.stderr);
    assert!(!o.status.success() && e.contains(&wrong_input.display().to_string()) && e.contains("'x'"), "{e}");

    let o = compare(&float, &example("tiny_cnn_calib.npz"), &example("tiny_cnn_calib.npz"), &[]);
    let e = text(&o.stderr);
    assert!(!o.status.success() && !e.contains("panicked") && e.contains("tiny_cnn_calib.npz"), "a non-model names the file: {e}");
}
