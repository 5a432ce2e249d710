//! Observer numerics checked against PyTorch, with reference values recorded from torch by
//! `scripts/oracle/torch_observers.py` (torch is too large for the test venv).

use std::path::Path;

use qforge_quant::observer::search::{l2_search, UniformBins};
use qforge_quant::{Convention, QScheme, QType};
use serde_json::Value;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_observers.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn qtype(v: &Value) -> QType {
    serde_json::from_value(v.clone()).expect("a qtype name")
}

#[test]
fn qparams_match_minmax_observer() {
    let f = fixture();
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() > 100);
    for case in cases {
        let scheme = QScheme {
            reduce_range: case["reduce_range"].as_bool().unwrap(),
            quant_range: case["quant_range"].as_array().map(|r| (r[0].as_i64().unwrap(), r[1].as_i64().unwrap())),
            ..QScheme::new(qtype(&case["qtype"]), case["symmetric"].as_bool().unwrap(), Convention::PyTorch)
        };
        assert_eq!(scheme.qrange(), (case["qmin"].as_i64().unwrap(), case["qmax"].as_i64().unwrap()), "{case}");
        let p = scheme.qparams(case["min"].as_f64().unwrap() as f32, case["max"].as_f64().unwrap() as f32);
        assert_eq!(p.scale.to_bits() as u64, case["scale"].as_u64().unwrap(), "scale for {case}: ours {}", p.scale);
        assert_eq!(p.zero_point, case["zero_point"].as_i64().unwrap(), "zero point for {case}");
    }
}

#[test]
fn l2_search_matches_histogram_observer() {
    let f = fixture();
    let hists = f["histograms"].as_array().unwrap();
    assert!(hists.len() >= 10);
    for h in hists {
        let counts: Vec<f64> = h["counts"].as_array().unwrap().iter().map(|c| c.as_f64().unwrap()).collect();
        let (min, max) = (h["min"].as_f64().unwrap(), h["max"].as_f64().unwrap());
        let bins = UniformBins { counts: &counts, min, max };
        let (lo, hi) = l2_search(&bins, h["dst_nbins"].as_u64().unwrap() as usize);
        // torch reports the range in float32; one bin is (max - min) / 2048.
        let tol = (max - min) * 1e-6 + 1e-6;
        let (want_lo, want_hi) = (h["search_min"].as_f64().unwrap(), h["search_max"].as_f64().unwrap());
        assert!((lo - want_lo).abs() <= tol && (hi - want_hi).abs() <= tol,
            "{} {}: ours [{lo}, {hi}], torch [{want_lo}, {want_hi}]", h["name"], h["dtype"]);
    }
}
