//! Observer numerics checked against ONNX Runtime's quantizer, run live through the project
//! venv: `compute_scale_zp` and the entropy (KL) calibration threshold search.

use std::path::{Path, PathBuf};
use std::process::Command;

use qforge_quant::observer::search::{entropy_search, symmetric_bins};
use qforge_quant::observer::Histogram;
use qforge_quant::{Convention, QScheme, QType};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs an oracle script on a JSON file of cases and returns its JSON answer.
fn oracle(script: &str, cases: &Value) -> Value {
    let cache = std::env::var_os("QFORGE_CACHE").map(PathBuf::from).unwrap_or_else(|| root().join(".cache"));
    let python = cache.join("venv/bin/python");
    assert!(python.exists(), "{} is missing; run scripts/setup.sh", python.display());
    let dir = std::env::temp_dir().join(format!("qforge-oracle-{}-{script}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cases.json");
    std::fs::write(&file, serde_json::to_string(cases).unwrap()).unwrap();
    let out = Command::new(python).arg(root().join("scripts/oracle").join(script)).arg(&file).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn qtype(v: &Value) -> QType {
    serde_json::from_value(v.clone()).expect("a qtype name")
}

/// A deterministic xorshift stream of uniforms in [0, 1).
fn uniforms(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Ranges covering the edge cases (zero width, one-sided, tiny, huge) and random spreads.
fn ranges() -> Vec<(f32, f32)> {
    let mut r = vec![(0.0, 0.0), (0.0, 6.0), (-1.0, 1.0), (-3.5, 0.25), (-1e-9, 1e-9), (2.0, 3.0), (-7.0, -2.0),
        (-1e6, 3e5), (-1e-30, 1e-30), (-0.1, 12.0)];
    let mut next = uniforms(0x9e3779b97f4a7c15);
    for _ in 0..60 {
        let scale = 10f64.powf(next() * 8.0 - 4.0);
        let (a, b) = ((next() - 0.5) * scale, (next() - 0.3) * scale);
        r.push((a.min(b) as f32, a.max(b) as f32));
    }
    r
}

#[test]
fn ort_convention_matches_compute_scale_zp() {
    let mut cases = vec![];
    for (lo, hi) in ranges() {
        for q in ["u8", "s8", "u16", "s16", "u4", "s4"] {
            for symmetric in [false, true] {
                for reduce_range in [false, true] {
                    cases.push(json!({"qtype": q, "symmetric": symmetric, "reduce_range": reduce_range, "min": lo, "max": hi}));
                }
            }
        }
    }
    let expected = oracle("ort_qparams.py", &json!(cases));
    let expected = expected.as_array().unwrap();
    assert_eq!(expected.len(), cases.len());
    for (case, want) in cases.iter().zip(expected) {
        let scheme = QScheme {
            reduce_range: case["reduce_range"].as_bool().unwrap(),
            ..QScheme::new(qtype(&case["qtype"]), case["symmetric"].as_bool().unwrap(), Convention::Ort)
        };
        assert_eq!(scheme.qrange(), (want["qmin"].as_i64().unwrap(), want["qmax"].as_i64().unwrap()), "{case}");
        let p = scheme.qparams(case["min"].as_f64().unwrap() as f32, case["max"].as_f64().unwrap() as f32);
        assert_eq!(p.scale.to_bits() as u64, want["scale"].as_u64().unwrap(), "scale for {case}: ours {}", p.scale);
        assert_eq!(p.zero_point, want["zero_point"].as_i64().unwrap(), "zero point for {case}");
    }
}

#[test]
fn entropy_search_matches_ort() {
    let mut next = uniforms(42);
    let mut gauss = move || {
        let (u, v) = (next().max(1e-12), next());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    };
    let mut cases = vec![];
    let mut ours = vec![];
    for (k, shape) in ["normal", "relu", "heavy_tail", "shifted"].iter().enumerate() {
        for bins in [512usize, 2048] {
            let data: Vec<f32> = (0..30000).map(|i| {
                let g = gauss();
                (match *shape {
                    "normal" => g,
                    "relu" => g.max(0.0) * 2.0,
                    "heavy_tail" => if i % 500 == 0 { g * 25.0 } else { g },
                    _ => g * 0.5 + 1.5 + k as f64,
                }) as f32
            }).collect();
            let mut h = Histogram::new(bins);
            h.observe(&data);
            let (counts, t) = symmetric_bins(&h);
            ours.push(entropy_search(&counts, t, h.min as f64, h.max as f64, 128));
            cases.push(json!({"counts": counts, "threshold": t, "min": h.min, "max": h.max, "num_quantized_bins": 128}));
        }
    }
    let expected = oracle("ort_entropy.py", &json!(cases));
    let clipped = cases.iter().zip(&ours).filter(|(c, r)| r.1 < c["max"].as_f64().unwrap() * 0.9).count();
    assert!(clipped >= 4, "the cases should exercise clipping, {clipped} do");
    for ((case, want), (lo, hi)) in cases.iter().zip(expected.as_array().unwrap()).zip(ours) {
        let t = case["threshold"].as_f64().unwrap();
        let tol = t * 1e-6;
        let (wlo, whi) = (want[0].as_f64().unwrap(), want[1].as_f64().unwrap());
        assert!((lo - wlo).abs() <= tol && (hi - whi).abs() <= tol,
            "{} bins: ours [{lo}, {hi}], ORT [{wlo}, {whi}]", case["counts"].as_array().unwrap().len());
    }
}
