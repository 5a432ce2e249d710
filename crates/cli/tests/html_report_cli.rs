//! `qforge quantize --report`: a path ending in `.html` writes the HTML report, and its data as
//! JSON beside it, through temporary files renamed into place; any other path still writes the
//! JSON report; a report that cannot be written is an error naming it.

use std::path::Path;
use std::process::{Command, Output};

use qforge_testkit::{oracle, TempDir};

mod common;
use common::example;

fn quantize(dir: &Path, report: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge"))
        .arg("quantize").arg(example("tiny_cnn.onnx")).arg("-o").arg(dir.join("q.onnx"))
        .arg("--calibration-data").arg(example("tiny_cnn_calib.npz")).arg("--report").arg(report)
        .output().expect("qforge runs")
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn html_report_and_its_json_are_written_in_place() {
    let tmp = TempDir::new("html-cli");
    let report = tmp.path().join("r.html");
    let o = quantize(tmp.path(), &report);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert_eq!(files(tmp.path()), ["q.onnx", "r.html", "r.json"], "no temporary file is left behind");
    assert!(stderr.contains("r.html") && stderr.contains("r.json"), "{stderr}");

    let html = std::fs::read_to_string(&report).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>") && html.ends_with("</html>\n"));
    let read = oracle("html_report.py", &[report.as_os_str()]);
    assert!(read.status.success(), "{}", String::from_utf8_lossy(&read.stderr));
    let page: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    assert_eq!(page["document_is_xml"], true);
    let svgs: Vec<&str> = page["svgs"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap()).collect();
    for id in ["sqnr-chart", "hist-0", "weight-0"] {
        assert!(svgs.contains(&id), "{id} in {svgs:?}");
    }

    let data: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path().join("r.json")).unwrap()).unwrap();
    assert_eq!(data["comparison"]["samples"], 8, "the eight small samples of the example are compared");
    assert_eq!(data["subject"]["json"], "r.json");
    let float_nodes = data["report"]["nodes"].as_array().unwrap().iter().filter(|n| n["quantized"] == false).count();
    assert_eq!(page["tables"]["float-nodes"].as_array().unwrap().len(), float_nodes + 1, "the page lists the JSON's float nodes");
    assert_eq!(data["histograms"].as_array().unwrap().len(), svgs.iter().filter(|s| s.starts_with("hist-")).count());
}

#[test]
fn a_json_path_still_writes_the_json_report() {
    let tmp = TempDir::new("html-cli-json");
    let report = tmp.path().join("r.json");
    let o = quantize(tmp.path(), &report);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(files(tmp.path()), ["q.onnx", "r.json"]);
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert!(doc["nodes"].is_array() && doc["activations"].is_array(), "the quantization report itself");
    assert!(doc.get("comparison").is_none(), "no comparison is run for a JSON report");
}

#[test]
fn an_unwritable_report_is_an_error_naming_it() {
    let tmp = TempDir::new("html-cli-missing");
    let report = tmp.path().join("missing").join("r.html");
    let o = quantize(tmp.path(), &report);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && stderr.contains("cannot write --report") && stderr.contains("r.json"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
