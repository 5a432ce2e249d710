//! `qforge sensitivity` and `qforge quantize --max-output-error` as a user runs them on the
//! example model: the JSON ranks every observation group and weight, its all-quantized figure
//! equals `qforge compare` on the model `qforge quantize` writes, and the budget's report lists
//! its decisions and meets the budget.

use std::process::Output;

use qforge_testkit::TempDir;
use serde_json::Value;

mod common;
use common::{example, qforge, text};

fn json(o: &Output) -> Value {
    assert!(o.status.success(), "{}", text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&o.stdout)))
}

fn db(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| v.as_str().and_then(|s| s.parse().ok()).unwrap_or(f64::NAN))
}

#[test]
fn json_ranks_every_group_and_matches_compare() {
    let (model, calib) = (example("tiny_cnn.onnx"), example("tiny_cnn_calib.npz"));
    let doc = json(&qforge(&["sensitivity".as_ref(), model.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--json".as_ref()]));
    let ranking = doc["ranking"].as_array().unwrap();
    let kinds: Vec<&str> = ranking.iter().map(|u| u["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "constant").count(), 3, "three weights (two Conv, one Gemm): {kinds:?}");
    assert!(kinds.iter().filter(|k| **k == "activation").count() >= 4, "{kinds:?}");
    let only_quantized: Vec<f64> = ranking.iter().map(|u| db(&u["only_quantized_sqnr_db"])).collect();
    assert!(only_quantized.windows(2).all(|w| w[0] <= w[1]), "not most sensitive first: {only_quantized:?}");
    for u in ranking {
        assert!(!u["values"].as_array().unwrap().is_empty() && !u["nodes"].as_array().unwrap().is_empty(), "{u}");
        assert_eq!(u["only_float"][0]["output"], "probs");
        assert!(db(&u["only_float_sqnr_db"]).is_finite() && u["only_quantized_cosine"].as_f64().unwrap() > 0.99, "{u}");
    }
    assert_eq!(doc["samples"], 8);

    let tmp = TempDir::new("senscli");
    let out = tmp.path().join("q.onnx");
    let o = qforge(&["quantize".as_ref(), model.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let cmp = json(&qforge(&["compare".as_ref(), model.as_os_str(), out.as_os_str(), "--data".as_ref(), calib.as_os_str(), "--json".as_ref()]));
    let (ours, theirs) = (db(&doc["all_quantized_sqnr_db"]), db(&cmp["outputs"][0]["sqnr_db"]));
    assert!((ours - theirs).abs() < 1e-6, "sensitivity says {ours} dB with every group quantized, compare says {theirs} dB");
    let (ours, theirs) = (db(&doc["all_quantized_as_deployed_sqnr_db"]), db(&cmp["outputs_as_run"][0]["sqnr_db"]));
    assert!((ours - theirs).abs() < 1e-6, "sensitivity says {ours} dB as deployed, compare says {theirs} dB");
}

#[test]
fn quantize_within_a_budget_reports_its_decisions() {
    let (model, calib) = (example("tiny_cnn.onnx"), example("tiny_cnn_calib.npz"));
    let tmp = TempDir::new("budgetcli");
    let (out, report) = (tmp.path().join("q.onnx"), tmp.path().join("report.json"));
    let o = qforge(&["quantize".as_ref(), model.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(),
        "--min-sqnr".as_ref(), "52".as_ref(), "--report".as_ref(), report.as_os_str(), "--json".as_ref()]);
    let summary = json(&o);
    let budget = &summary["accuracy_budget"];
    assert_eq!(budget["met"], true, "{budget}");
    assert!(budget["units_float"].as_u64().unwrap() < budget["units"].as_u64().unwrap(), "{budget}");
    let decisions = budget["decisions"].as_array().unwrap();
    assert!(!decisions.is_empty() && decisions.iter().all(|d| d["error_float"].is_number() && d["error_quantized"].is_number()), "{budget}");
    // A prefix the search measured met the budget of 52 dB.
    let prefix = budget["prefix_search"].as_array().unwrap();
    assert!(prefix.iter().any(|t| t["error"].as_f64().unwrap() <= 10f64.powf(-52.0 / 20.0)), "{budget}");
    // The last round's converted model is the one written, and it meets the budget.
    let rounds = budget["rounds"].as_array().unwrap();
    let last = rounds.last().expect("a round");
    assert_eq!(last["error_converted"], budget["error_final"], "{budget}");
    assert!(last["error_converted"].as_f64().unwrap() <= 10f64.powf(-52.0 / 20.0), "{budget}");
    let full: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let float_by_budget = full["nodes"].as_array().unwrap().iter().filter(|n| n["kind"] == "accuracy_budget").count();
    assert!(float_by_budget >= 1, "no node reported float by the accuracy budget");
    let cmp = json(&qforge(&["compare".as_ref(), model.as_os_str(), out.as_os_str(), "--data".as_ref(), calib.as_os_str(), "--json".as_ref()]));
    assert!(db(&cmp["outputs"][0]["sqnr_db"]) >= 52.0 - 1e-9, "compare: {}", cmp["outputs"][0]);

    let o = qforge(&["quantize".as_ref(), model.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--max-output-error=-1".as_ref()]);
    assert!(!o.status.success() && text(&o.stderr).contains("--max-output-error must be a positive number"), "{}", text(&o.stderr));
}
