//! Scale/zero-point computation checked bit-exactly against the two references: ONNX
//! Runtime's `compute_scale_zp` (run live through the project venv) and PyTorch's
//! `MinMaxObserver.calculate_qparams` (values recorded by `scripts/oracle/torch_qparams.py`).

use std::path::{Path, PathBuf};
use std::process::Command;

use qforge_quant::{Convention, QScheme, QType};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    let cache = std::env::var_os("QFORGE_CACHE").map(PathBuf::from).unwrap_or_else(|| root().join(".cache"));
    let p = cache.join("venv/bin/python");
    assert!(p.exists(), "{} is missing; run scripts/setup.sh", p.display());
    p
}

fn qtype(s: &str) -> QType {
    match s {
        "u4" => QType::U4,
        "s4" => QType::S4,
        "u8" => QType::U8,
        "s8" => QType::S8,
        "u16" => QType::U16,
        "s16" => QType::S16,
        other => panic!("unknown qtype {other}"),
    }
}

/// Deterministic ranges covering the edge cases (zero width, one-sided, tiny, huge) and
/// random spreads.
fn ranges() -> Vec<(f32, f32)> {
    let mut r = vec![(0.0, 0.0), (0.0, 6.0), (-1.0, 1.0), (-3.5, 0.25), (-1e-9, 1e-9), (2.0, 3.0), (-7.0, -2.0),
        (-1e6, 3e5), (-1e-30, 1e-30), (-0.1, 12.0)];
    let mut s = 0x9e3779b97f4a7c15u64;
    for _ in 0..60 {
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let scale = 10f64.powf(next() * 8.0 - 4.0);
        let (a, b) = ((next() - 0.5) * scale, (next() - 0.3) * scale);
        r.push((a.min(b) as f32, a.max(b) as f32));
    }
    r
}

#[test]
fn ort_convention_matches_onnxruntime() {
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
    let dir = std::env::temp_dir().join(format!("qforge-qparams-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cases.json");
    std::fs::write(&file, serde_json::to_string(&cases).unwrap()).unwrap();
    let out = Command::new(python()).arg(root().join("scripts/oracle/ort_qparams.py")).arg(&file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let expected: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(expected.len(), cases.len());
    for (case, want) in cases.iter().zip(&expected) {
        let scheme = QScheme {
            reduce_range: case["reduce_range"].as_bool().unwrap(),
            ..QScheme::new(qtype(case["qtype"].as_str().unwrap()), case["symmetric"].as_bool().unwrap(), Convention::Ort)
        };
        let (qmin, qmax) = scheme.qrange();
        assert_eq!((qmin, qmax), (want["qmin"].as_i64().unwrap(), want["qmax"].as_i64().unwrap()), "{case}");
        let p = scheme.qparams(case["min"].as_f64().unwrap() as f32, case["max"].as_f64().unwrap() as f32);
        assert_eq!(p.scale.to_bits() as u64, want["scale"].as_u64().unwrap(), "scale for {case}: ours {}", p.scale);
        assert_eq!(p.zero_point, want["zero_point"].as_i64().unwrap(), "zero point for {case}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
