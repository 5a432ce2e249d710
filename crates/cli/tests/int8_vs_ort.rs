//! qforge's int8 runtime against ONNX Runtime on the real benchmark models: every integer
//! tensor a node produces (quantized activations, int32 accumulators) is exposed as a graph
//! output, both engines run the model on the same inputs, and the integers must be identical.
//! Three forms of each model are checked:
//! * qforge's lowering to integer operators (`quantize --format qoperator`), run by ONNX
//!   Runtime with graph optimizations off, so it runs the nodes as written;
//! * qforge's QDQ model (`quantize`), run by ONNX Runtime with all optimizations, so it fuses
//!   the QDQ units into integer kernels at session build, as qforge's session does;
//! * ONNX Runtime's own QDQ model (its static quantizer), likewise.
//!
//! The QDQ forms' final outputs, with nothing exposed (so qforge's session fuses lookup tables
//! into the convolutions before them), must agree with ONNX Runtime's too.
//!
//! qforge's s8 weights keep ONNX Runtime exact on every CPU: on x86 without VNNI its u8 x s8
//! kernels add pairs of products into saturating 16-bit sums, and the `ort` backend's
//! `pair_sum_max` keeps every such pair within them for activations within the calibrated
//! reach of their channels (`qforge_quant::pair_sums`; these runs feed a calibration sample),
//! so these comparisons at full weight range prove the pairing right on such a CPU. ONNX Runtime's own
//! quantizer has no such constraint; there (see `ort_u8s8_exact`) its models are quantized with
//! weights in the reduced range `[-64, 64]`, where its arithmetic is exact.

mod common;

use std::ffi::OsStr;
use std::path::Path;

use common::{qforge, text};
use qforge_testkit::{make_inputs, oracle, ort_u8s8_exact, real_models, RealModel, TempDir};

/// Writes `count` seeded samples of `m` as sample folders under `dir`; returns the feeds'
/// `--input NAME=FILE` arguments of the first one.
fn samples(dir: &Path, m: &RealModel, count: usize) -> Vec<String> {
    let g = qforge_onnx::load(&m.path).unwrap().graph;
    let mut first = vec![];
    for i in 0..count {
        let d = dir.join(format!("{i:03}"));
        std::fs::create_dir_all(&d).unwrap();
        for (name, t) in make_inputs(&g, m, 200 + i as u64) {
            let file = d.join(format!("{}.npy", qforge_data::sanitize(&name)));
            qforge_data::write_npy(&file, &t).unwrap();
            if i == 0 {
                first.push(format!("{name}={}", file.display()));
            }
        }
    }
    first
}

/// Who quantizes the model under test, and in which format.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Form {
    QforgeQOperator,
    QforgeQdq,
    /// qforge's QDQ model with u8 weights (`--weight-dtype u8`), never in the reduced range:
    /// ONNX Runtime's u8 x u8 kernels are exact on every CPU.
    QforgeQdqU8Weights,
    OrtQdq,
}

/// Quantizes `name` in `form` and compares every integer tensor of one run in qforge and in
/// ONNX Runtime, then (QDQ forms) the final outputs of the model as written
/// ([`outputs_match`]); returns how many integer tensors were compared.
fn integers_match(name: &str, form: Form) -> usize {
    let m = real_models().into_iter().find(|m| m.name == name).unwrap_or_else(|| panic!("{name} in the test cache (run scripts/setup.sh)"));
    let tmp = TempDir::new(&format!("int8-vs-ort-{name}-{form:?}"));
    let calib = tmp.path().join("calib");
    let feeds = samples(&calib, &m, 4);
    let lowered = tmp.path().join("quantized.onnx");
    let reduce_range = !ort_u8s8_exact() && form == Form::OrtQdq;
    let out = match form {
        Form::OrtQdq => {
            let mut args = vec![m.path.as_os_str(), calib.as_os_str(), lowered.as_os_str()];
            if reduce_range {
                args.push(OsStr::new("--reduce-range"));
            }
            oracle("ort_quantize.py", &args)
        }
        _ => {
            let format = if form == Form::QforgeQOperator { "qoperator" } else { "qdq" };
            let mut args = vec![OsStr::new("quantize"), m.path.as_os_str(), OsStr::new("-o"), lowered.as_os_str(), OsStr::new("--calibration-data"), calib.as_os_str(), OsStr::new("--format"), OsStr::new(format)];
            if form == Form::QforgeQdqU8Weights {
                args.extend([OsStr::new("--weight-dtype"), OsStr::new("u8")]);
            }
            qforge(&args)
        }
    };
    assert!(out.status.success(), "{name}: quantizing ({form:?}) failed: {}", text(&out.stderr));
    let exposed_model = tmp.path().join("exposed.onnx");
    let o = oracle("expose_integers.py", &[lowered.as_os_str(), exposed_model.as_os_str()]);
    assert!(o.status.success(), "{name}: {}", text(&o.stderr));
    let exposed: Vec<String> = serde_json::from_slice(&o.stdout).unwrap();
    let inputs: Vec<String> = feeds.iter().flat_map(|f| ["--input".to_string(), f.clone()]).collect();
    let (theirs, ours) = run_both(name, &exposed_model, &inputs, form == Form::QforgeQOperator, &tmp.path().join("exposed"));
    let mut compared = 0;
    for value in &exposed {
        let a = &theirs.iter().find(|(n, _)| n == value).unwrap_or_else(|| panic!("{name}: ORT gave no '{value}'")).1;
        let b = &ours.iter().find(|(n, _)| n == value).unwrap_or_else(|| panic!("{name}: qforge gave no '{value}'")).1;
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}: '{value}' type or shape");
        assert_eq!(a.raw_bytes().unwrap(), b.raw_bytes().unwrap(), "{name}: integer tensor '{value}' differs from ONNX Runtime's");
        compared += 1;
    }
    if form != Form::QforgeQOperator {
        outputs_match(name, &lowered, &inputs, &tmp.path().join("final"));
    }
    compared
}

/// The outputs of `model` run by ONNX Runtime (its graph optimizations off with `no_opt`) and
/// by `qforge run` on the same `--input` arguments, by name; their files are written next to
/// `stem`.
fn run_both(name: &str, model: &Path, inputs: &[String], no_opt: bool, stem: &Path) -> (Vec<(String, qforge_ir::Tensor)>, Vec<(String, qforge_ir::Tensor)>) {
    let (ort_out, qf_out) = (stem.with_extension("ort.npz"), stem.with_extension("qforge.npz"));
    let mut args: Vec<&OsStr> = vec![model.as_os_str(), OsStr::new("-o"), ort_out.as_os_str()];
    if no_opt {
        args.push(OsStr::new("--no-opt"));
    }
    args.extend(inputs.iter().map(OsStr::new));
    let o = oracle("ort_run.py", &args);
    assert!(o.status.success(), "{name}: ONNX Runtime failed: {}", text(&o.stderr));
    let mut args: Vec<&OsStr> = vec![OsStr::new("run"), model.as_os_str(), OsStr::new("-o"), qf_out.as_os_str()];
    args.extend(inputs.iter().map(OsStr::new));
    let o = qforge(&args);
    assert!(o.status.success(), "{name}: qforge run failed: {}", text(&o.stderr));
    (qforge_data::read_npz(&ort_out).unwrap(), qforge_data::read_npz(&qf_out).unwrap())
}

/// Runs the quantized model as it is (no value exposed, so a session fuses what it can: lookup
/// tables into the convolutions before them, elementwise chains into one table) in qforge and
/// in ONNX Runtime, and requires the model's outputs to agree: integer outputs exactly, float
/// outputs (computed in float from identical integers) within `1e-5` relative plus `1e-6`.
fn outputs_match(name: &str, model: &Path, inputs: &[String], stem: &Path) {
    let (theirs, ours) = run_both(name, model, inputs, false, stem);
    assert_eq!(theirs.len(), ours.len(), "{name}: output count");
    for (value, a) in &theirs {
        let b = &ours.iter().find(|(n, _)| n == value).unwrap_or_else(|| panic!("{name}: qforge gave no '{value}'")).1;
        assert_eq!(a.dtype(), b.dtype(), "{name}: output '{value}' type");
        let tolerance = if a.dtype().is_float() { (1e-5, 1e-6) } else { (0.0, 0.0) };
        let (worst, ok) = qforge_testkit::compare(b, a, tolerance.0, tolerance.1);
        assert!(ok, "{name}: output '{value}' differs from ONNX Runtime's by up to {worst}");
    }
}

/// The benchmark models and how many integer tensors each must at least compare.
const MODELS: [(&str, usize); 4] = [("ocr_cls", 50), ("orientation", 50), ("ocr_det", 100), ("silero_vad_16k_op15", 5)];

/// [`integers_match`] on each of `models` in `form`, each comparing at least its count.
fn all_match(form: Form, models: &[(&str, usize)]) {
    if !ort_u8s8_exact() && form == Form::OrtQdq {
        println!("this CPU has no VNNI: ONNX Runtime's u8 x s8 products saturate, so its quantizer's weights use the reduced range [-64, 64]");
    }
    for &(name, at_least) in models {
        let n = integers_match(name, form);
        println!("{name} ({form:?}): {n} integer tensors identical to ONNX Runtime's");
        assert!(n >= at_least, "{name} ({form:?}): only {n} integer tensors compared; expected at least {at_least}");
    }
}

#[test]
fn every_integer_tensor_of_the_lowered_benchmark_models_matches_onnx_runtime() {
    all_match(Form::QforgeQOperator, &MODELS);
}

#[test]
fn qdq_benchmark_models_run_as_integer_kernels_like_onnx_runtime() {
    all_match(Form::QforgeQdq, &MODELS);
}

#[test]
fn u8_weight_models_run_exactly_in_onnx_runtime_on_every_cpu() {
    all_match(Form::QforgeQdqU8Weights, &[MODELS[0], MODELS[1], MODELS[3]]);
}

#[test]
fn onnx_runtime_quantized_models_run_as_in_onnx_runtime() {
    // ocr_det is left out: ONNX Runtime's quantizer takes about half a minute on it.
    all_match(Form::OrtQdq, &[MODELS[0], MODELS[1], MODELS[3]]);
}

/// `qforge inspect --json`'s count of the u8 x s8 weights whose 16-bit pair sums can saturate
/// in ONNX Runtime without VNNI, on orientation quantized three ways: by ONNX Runtime at full
/// range (flagged; on such a CPU its outputs then differ from the exact ones qforge computes,
/// on a VNNI CPU they agree), by ONNX Runtime with `--reduce-range` (7-bit weights cannot
/// saturate) and by qforge (fitted to its calibrated activations: exact on every CPU).
#[test]
fn inspect_flags_weights_whose_pair_sums_onnx_runtime_saturates() {
    let m = real_models().into_iter().find(|m| m.name == "orientation").expect("orientation in the test cache (run scripts/setup.sh)");
    let tmp = TempDir::new("inspect-pair-sums");
    let calib = tmp.path().join("calib");
    let feeds = samples(&calib, &m, 4);
    let inputs: Vec<String> = feeds.iter().flat_map(|f| ["--input".to_string(), f.clone()]).collect();
    let saturating = |model: &Path| -> (u64, usize) {
        let o = qforge(&[OsStr::new("inspect"), OsStr::new("--json"), model.as_os_str()]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (j["u8s8_pair_sums"]["weights"].as_u64().unwrap(), j["u8s8_pair_sums"]["saturating"].as_array().unwrap().len())
    };
    let ort_full = tmp.path().join("ort_full.onnx");
    let o = oracle("ort_quantize.py", &[m.path.as_os_str(), calib.as_os_str(), ort_full.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (weights, flagged) = saturating(&ort_full);
    assert!(weights >= 15 && flagged > weights as usize / 2, "ONNX Runtime's full-range orientation: {flagged} of {weights} weights flagged");
    let (theirs, ours) = run_both("orientation", &ort_full, &inputs, false, &tmp.path().join("ort_full"));
    let (worst, same) = qforge_testkit::compare(&ours[0].1, &theirs[0].1, 1e-5, 1e-6);
    assert_eq!(same, ort_u8s8_exact(), "ONNX Runtime against qforge's exact integers on the flagged model: off by up to {worst}");

    let ort_reduced = tmp.path().join("ort_reduced.onnx");
    let o = oracle("ort_quantize.py", &[m.path.as_os_str(), calib.as_os_str(), ort_reduced.as_os_str(), OsStr::new("--reduce-range")]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(saturating(&ort_reduced), (weights, 0), "7-bit weights");

    // qforge fits its weights to the reach of each input channel, not to 255 everywhere:
    // `inspect`, which cannot know the reach, flags fewer of them than of ONNX Runtime's, and
    // ONNX Runtime computes the exact integers on a calibration sample on every CPU.
    let ours_path = tmp.path().join("qforge.onnx");
    let o = qforge(&[OsStr::new("quantize"), m.path.as_os_str(), OsStr::new("-o"), ours_path.as_os_str(), OsStr::new("--calibration-data"), calib.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (ours_weights, ours_flagged) = saturating(&ours_path);
    assert!(ours_weights == weights && ours_flagged < flagged, "qforge's orientation: {ours_flagged} of {ours_weights} weights flagged, ONNX Runtime's {flagged}");
    let (theirs, ours) = run_both("orientation", &ours_path, &inputs, false, &tmp.path().join("qforge"));
    let (worst, same) = qforge_testkit::compare(&ours[0].1, &theirs[0].1, 1e-5, 1e-6);
    assert!(same, "ONNX Runtime against qforge's exact integers on qforge's model: off by up to {worst}");

    // `inspect --data` runs the model on the samples and bounds each pair by how far its two
    // input channels reach there. qforge's weights were fitted to what its quantized
    // activations reach on its check samples (all four here), so none is flagged; ONNX
    // Runtime's full-range model, which it runs off the exact integers on the first sample on
    // this CPU, keeps flagged weights.
    let measured = |model: &Path| -> usize {
        let o = qforge(&[OsStr::new("inspect"), OsStr::new("--json"), model.as_os_str(), OsStr::new("--data"), calib.as_os_str()]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["u8s8_pair_sums"]["reach"]["samples"], 4, "{}", j["u8s8_pair_sums"]);
        j["u8s8_pair_sums"]["saturating"].as_array().unwrap().len()
    };
    assert_eq!(measured(&ours_path), 0, "qforge's orientation, on the samples it was checked on");
    if !ort_u8s8_exact() {
        assert!(measured(&ort_full) > 0, "ONNX Runtime saturates on these samples, yet no weight is flagged for them");
    }
    let absent = tmp.path().join("no_such_folder");
    let o = qforge(&[OsStr::new("inspect"), ours_path.as_os_str(), OsStr::new("--data"), absent.as_os_str()]);
    assert!(!o.status.success(), "a missing --data folder is an error");
    assert!(text(&o.stderr).contains(&absent.display().to_string()), "the error names the folder: {}", text(&o.stderr));
}
