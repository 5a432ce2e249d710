//! `qforge quantize` as a user runs it: a real model with sample-folder calibration data gives
//! a QDQ model that ONNX Runtime loads, a JSON report naming the reason of every float node,
//! the input model untouched; bad calibration data and bad arguments give errors that name the
//! sample, the input and the problem, and write nothing.

use std::path::Path;
use std::process::{Command, Output};

use qforge_ir::Tensor;
use qforge_testkit::{make_inputs, ort_run, real_models, RealModel, TempDir};

fn cls() -> RealModel {
    real_models().into_iter().find(|m| m.name == "ocr_cls").expect("ocr_cls in the test cache (run scripts/setup.sh)")
}

fn qforge(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge")).arg("quantize").args(args).output().expect("qforge runs")
}

/// Sample folders `<dir>/<i>/x.npy` from seeded inputs, with `edit` applied to each sample.
fn samples(dir: &Path, m: &RealModel, n: usize, edit: impl Fn(usize, &mut Vec<(String, Tensor)>)) {
    let g = qforge_onnx::load(&m.path).unwrap().graph;
    for i in 0..n {
        let mut s = make_inputs(&g, m, 100 + i as u64);
        edit(i, &mut s);
        let d = dir.join(format!("{i:03}"));
        std::fs::create_dir_all(&d).unwrap();
        for (name, t) in s {
            qforge_data::write_npy(&d.join(format!("{}.npy", qforge_data::sanitize(&name))), &t).unwrap();
        }
    }
}

/// `qforge quantize` of `m` on `calib` into `out`, with `extra` arguments.
fn quantize_with(m: &RealModel, calib: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<&std::ffi::OsStr> = vec![m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str()];
    args.extend(extra.iter().map(|f| std::ffi::OsStr::new(*f)));
    qforge(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn quantizes_a_real_model_and_reports_every_float_node() {
    let m = cls();
    let tmp = TempDir::new("qcli");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 6, |_, _| {});
    let before = std::fs::read(&m.path).unwrap();
    let out = tmp.path().join("q.onnx");
    let report = tmp.path().join("report.json");
    let o = qforge(&[m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--report".as_ref(), report.as_os_str()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("left in float"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&m.path).unwrap(), before, "the input model is untouched");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let nodes = r["nodes"].as_array().unwrap();
    assert!(nodes.iter().filter(|n| n["quantized"] == true).count() > 100);
    for n in nodes.iter().filter(|n| n["quantized"] == false) {
        assert!(n["reason"].as_str().is_some_and(|s| !s.is_empty()), "float node without a reason: {n}");
    }
    // ONNX Runtime runs it and agrees with the float model on the class.
    let g = qforge_onnx::load(&m.path).unwrap().graph;
    let inputs = make_inputs(&g, &m, 7);
    let (f, q) = (ort_run(&m.path, &inputs, 1), ort_run(&out, &inputs, 1));
    let (a, b) = (f[0].1.as_slice::<f32>().unwrap(), q[0].1.as_slice::<f32>().unwrap());
    assert_eq!(a.len(), b.len());
    // Deterministic: a second run writes the same bytes.
    let out2 = tmp.path().join("q2.onnx");
    let o = qforge(&[m.path.as_os_str(), "-o".as_ref(), out2.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&out2).unwrap());
}

fn expect_error(args: &[&std::ffi::OsStr], out: &Path, needles: &[&str]) {
    let o = qforge(args);
    let e = stderr(&o);
    assert!(!o.status.success(), "expected failure, got success: {e}");
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "'{n}' missing from: {e}");
    }
    assert!(!out.exists(), "nothing is written on error");
}

#[test]
fn bad_calibration_data_and_arguments_are_clear_errors() {
    let m = cls();
    let tmp = TempDir::new("qcli_bad");
    let out = tmp.path().join("q.onnx");
    let run = |calib: &Path, needles: &[&str]| {
        expect_error(&[m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str()], &out, needles)
    };
    // An empty set.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    run(&empty, &["empty"]);
    // A missing path.
    run(&tmp.path().join("nowhere"), &["nowhere"]);
    // NaN in one sample.
    let nan = tmp.path().join("nan");
    samples(&nan, &m, 3, |i, s| if i == 2 { s[0].1.as_slice_mut::<f32>().unwrap()[5] = f32::NAN });
    run(&nan, &["002", "'x'", "NaN"]);
    // A wrong shape and a wrong dtype.
    let shape = tmp.path().join("shape");
    samples(&shape, &m, 2, |i, s| if i == 1 { s[0].1 = Tensor::from_vec(&[1, 3, 10], vec![0f32; 30]).unwrap() });
    run(&shape, &["001", "'x'", "shape"]);
    let dtype = tmp.path().join("dtype");
    samples(&dtype, &m, 2, |_, s| s[0].1 = Tensor::from_vec(&[1, 3, 48, 192], vec![0f64; 3 * 48 * 192]).unwrap());
    run(&dtype, &["'x'", "float64"]);
    // A wrong input name.
    let names = tmp.path().join("names");
    samples(&names, &m, 2, |_, s| s[0].0 = "image".into());
    run(&names, &["image"]);
    // An unreadable file.
    let broken = tmp.path().join("broken");
    samples(&broken, &m, 1, |_, _| {});
    std::fs::write(broken.join("000").join("x.npy"), b"not an array").unwrap();
    run(&broken, &["x.npy"]);
    // Writing over the input model is refused.
    let good = tmp.path().join("good");
    samples(&good, &m, 1, |_, _| {});
    let copy = tmp.path().join("model.onnx");
    std::fs::copy(&m.path, &copy).unwrap();
    let o = qforge(&[copy.as_os_str(), "-o".as_ref(), copy.as_os_str(), "--calibration-data".as_ref(), good.as_os_str()]);
    assert!(!o.status.success() && stderr(&o).contains("is the input model"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&m.path).unwrap());
    // A model quantized already (here qforge's own output) is refused, naming its quantized ops.
    let quantized = tmp.path().join("quantized.onnx");
    let o = qforge(&[m.path.as_os_str(), "-o".as_ref(), quantized.as_os_str(), "--calibration-data".as_ref(), good.as_os_str()]);
    assert!(o.status.success(), "{}", stderr(&o));
    expect_error(&[quantized.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), good.as_os_str()], &out, &["already quantized", "QuantizeLinear", "float original"]);
    // An unknown backend names the built-in ones.
    expect_error(&[m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), good.as_os_str(), "--backend".as_ref(), "tpu".as_ref()], &out, &["'tpu'", "x86"]);
}

#[test]
fn bias_correction_weight_range_search_and_gptq_are_off_by_default_and_reported_when_on() {
    let m = cls();
    let tmp = TempDir::new("qcli_bc");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 4, |_, _| {});
    let run = |flags: &[&str]| -> serde_json::Value {
        let (out, report) = (tmp.path().join("q.onnx"), tmp.path().join("r.json"));
        let mut args: Vec<&std::ffi::OsStr> = vec![m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--report".as_ref(), report.as_os_str()];
        args.extend(flags.iter().map(|f| std::ffi::OsStr::new(*f)));
        let o = qforge(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap()
    };
    for flags in [&[][..], &["--no-bias-correction"], &["--bias-correction", "--no-bias-correction"]] {
        let r = run(flags);
        assert_eq!(r["bias_correction_enabled"], false, "{flags:?}");
        assert!(r["bias_correction"].as_array().unwrap().is_empty(), "{flags:?}");
        assert_eq!(r["weight_range_search"], false, "{flags:?}");
        assert!(r["weight_ranges"].as_array().unwrap().is_empty(), "{flags:?}");
        assert_eq!(r["gptq_enabled"], false, "{flags:?}");
        assert!(r["gptq"].as_array().unwrap().is_empty(), "{flags:?}");
    }
    let r = run(&["--weight-rounding", "gptq"]);
    assert_eq!(r["gptq_enabled"], true);
    let rounded = r["gptq"].as_array().unwrap();
    assert!(rounded.len() > 10, "ocr_cls has dozens of Conv");
    for n in rounded {
        let (near, gptq) = (n["nearest_error"].as_f64().unwrap(), n["gptq_error"].as_f64().unwrap());
        assert!(gptq.is_finite() && gptq <= near, "{n}");
    }
    let bad = qforge(&[m.path.as_os_str(), "-o".as_ref(), tmp.path().join("q.onnx").as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--weight-rounding".as_ref(), "adaround".as_ref()]);
    assert!(!bad.status.success() && stderr(&bad).contains("'adaround' is not a weight rounding"), "{}", stderr(&bad));
    let r = run(&["--weight-range", "mse"]);
    assert_eq!(r["weight_range_search"], true);
    for w in r["weight_ranges"].as_array().unwrap() {
        let f: Vec<f64> = w["factors"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert!(f.iter().all(|&x| (0.79..=1.0).contains(&x)), "{w}");
        assert_eq!(w["narrowed"].as_u64().unwrap() as usize, f.iter().filter(|&&x| x < 1.0).count(), "{w}");
    }
    let r = run(&["--bias-correction"]);
    assert_eq!(r["bias_correction_enabled"], true);
    let corrected = r["bias_correction"].as_array().unwrap();
    assert!(corrected.len() > 10, "ocr_cls has dozens of Conv with folded biases");
    for c in corrected {
        let shift = c["shift"].as_array().unwrap();
        assert!(!shift.is_empty() && shift.iter().all(|v| v.as_f64().is_some_and(f64::is_finite)), "{c}");
    }
}

#[test]
fn reduce_range_keeps_int8_weights_within_7_bits() {
    let m = cls();
    let tmp = TempDir::new("qcli_rr");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 4, |_, _| {});
    let widest = |flags: &[&str]| -> i64 {
        let out = tmp.path().join("q.onnx");
        let o = quantize_with(&m, &calib, &out, flags);
        assert!(o.status.success(), "{}", stderr(&o));
        let g = qforge_onnx::load(&out).unwrap().graph;
        let weights: Vec<i64> = g.values().filter_map(|(_, v)| v.initializer()).filter(|t| t.dtype() == qforge_ir::DType::I8)
            .flat_map(|t| t.to_i64_vec().unwrap()).collect();
        assert!(weights.len() > 10_000, "ocr_cls's int8 weights");
        weights.iter().map(|w| w.abs()).max().unwrap()
    };
    assert_eq!(widest(&[]), 127, "8-bit symmetric weights by default");
    assert_eq!(widest(&["--reduce-range"]), 64, "7-bit weights: ONNX Runtime's reduced int8 range");
    let bad = qforge(&[m.path.as_os_str(), "-o".as_ref(), tmp.path().join("h.onnx").as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--backend".as_ref(), "htp".as_ref(), "--reduce-range".as_ref()]);
    assert!(!bad.status.success() && stderr(&bad).contains("--reduce-range is not available with --backend htp"), "{}", stderr(&bad));
}

#[test]
fn calibration_samples_picks_samples_spread_evenly_over_the_set() {
    let m = cls();
    let tmp = TempDir::new("qcli_spread");
    let (all, picked) = (tmp.path().join("all"), tmp.path().join("picked"));
    samples(&all, &m, 12, |_, _| {});
    // 4 of 12, spread evenly: samples 0, 3, 6 and 9, copied alone into their own set.
    for i in [0, 3, 6, 9] {
        let (from, to) = (all.join(format!("{i:03}")), picked.join(format!("{i:03}")));
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(&from).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
        }
    }
    let quantize = |data: &Path, out: &str, extra: &[&str]| {
        let out = tmp.path().join(out);
        (quantize_with(&m, data, &out, extra), out)
    };
    let (o, spread) = quantize(&all, "spread.onnx", &["--calibration-samples", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("calibrating on 4 of the 12 samples"), "{}", stderr(&o));
    let (o, alone) = quantize(&picked, "alone.onnx", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(&spread).unwrap(), std::fs::read(&alone).unwrap(), "--calibration-samples 4 of 12 must calibrate on samples 0, 3, 6 and 9");
    let (o, whole) = quantize(&all, "whole.onnx", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(std::fs::read(&whole).unwrap(), std::fs::read(&alone).unwrap(), "the whole set calibrates differently from 4 of its samples");
    let (o, more) = quantize(&all, "more.onnx", &["--calibration-samples", "20"]);
    assert!(o.status.success() && stderr(&o).contains("holds 12 samples; calibrating on all of them"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&more).unwrap(), std::fs::read(&whole).unwrap(), "more samples than the set holds: all of them");
    let (o, _) = quantize(&all, "none.onnx", &["--calibration-samples", "0"]);
    assert!(!o.status.success() && stderr(&o).contains("--calibration-samples 0 calibrates on nothing"), "{}", stderr(&o));
}

#[test]
fn weight_dtype_u8_stores_symmetric_u8_weights_where_the_backend_takes_them() {
    let m = cls();
    let tmp = TempDir::new("qcli_u8w");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 4, |_, _| {});
    let out = tmp.path().join("q.onnx");
    let quantize = |extra: &[&str]| quantize_with(&m, &calib, &out, extra);
    let o = quantize(&["--weight-dtype", "u8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let g = qforge_onnx::load(&out).unwrap().graph;
    let (mut u8_weights, mut i8_weights) = (0, 0);
    let constant = |id: Option<qforge_ir::ValueId>| id.and_then(|v| g.value(v).ok()?.initializer());
    for (_, node) in g.nodes().filter(|(_, n)| n.op_type == "DequantizeLinear") {
        let Some(t) = constant(node.inputs[0]) else { continue };
        if t.shape().len() < 2 {
            continue;
        }
        match t.dtype() {
            qforge_ir::DType::U8 => {
                let zp = constant(node.inputs[2]).expect("a constant zero point").to_i64_vec().unwrap();
                assert!(zp.iter().all(|&z| z == 128), "symmetric u8 weights have zero point 128: {zp:?}");
                u8_weights += 1;
            }
            qforge_ir::DType::I8 => i8_weights += 1,
            other => panic!("weight of type {other:?}"),
        }
    }
    assert!(u8_weights > 50 && i8_weights == 0, "ocr_cls's conv weights are u8: {u8_weights} u8, {i8_weights} s8");
    let o = quantize(&["--weight-dtype", "u8", "--backend", "x86"]);
    assert!(!o.status.success() && stderr(&o).contains("backend 'x86' takes weights of s8 only"), "{}", stderr(&o));
    let o = quantize(&["--weight-dtype", "s4"]);
    assert!(!o.status.success() && stderr(&o).contains("--weight-dtype 's4' is not known"), "{}", stderr(&o));
    let o = quantize(&["--weight-dtype", "u8", "--backend", "htp"]);
    assert!(!o.status.success() && stderr(&o).contains("--weight-dtype is not available with --backend htp"), "{}", stderr(&o));
}

/// An `--exclude` entry that applies to no node is said, not silently dropped: a warning naming
/// it (with how names and regular expressions are matched), an error under `--strict`. An
/// entry that applies keeps its nodes float, and draws no warning.
#[test]
fn exclusions_that_match_no_node_are_named() {
    let m = cls();
    let tmp = TempDir::new("qcli_exclude");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 2, |_, _| {});
    let out = tmp.path().join("q.onnx");
    let report = tmp.path().join("report.json");
    // A regular expression written for node names (they are matched against scopes), a
    // misspelt name, and a scope regex that applies: ocr_cls's first Conv, with its
    // BatchNormalization folded in, writes batch_norm_0.tmp_2.
    let o = qforge(&[m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--report".as_ref(), report.as_os_str(),
        "--exclude".as_ref(), r"^Conv@0$".as_ref(), "--exclude".as_ref(), "Conv@00".as_ref(), "--exclude".as_ref(), r"^batch_norm_0$".as_ref()]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("warning: scope_regex '^Conv@0$'") && e.contains("warning: name 'Conv@00'"), "{e}");
    assert!(!e.contains("batch_norm_0$'"), "the matching entry is not warned about: {e}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let kept: Vec<&str> = r["nodes"].as_array().unwrap().iter().filter(|n| n["kind"] == "requested").map(|n| n["name"].as_str().unwrap()).collect();
    assert!(kept.contains(&"Conv@0") && !kept.iter().any(|n| n.starts_with("Conv@") && *n != "Conv@0"), "nodes the mapping keeps float: {kept:?}");
    std::fs::remove_file(&out).unwrap();
    expect_error(&[m.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--strict".as_ref(), "--exclude".as_ref(), "Conv@00".as_ref()],
        &out, &["--strict", "name 'Conv@00'", "matches a node's name or scope"]);
}

/// `[batch, 16]` BERT inputs: random token ids, an attention mask padding each sentence from
/// a random length of at least 8 on, token types 0 then 1.
fn bert_sample(rng: &mut qforge_testkit::Rng, batch: usize) -> Vec<(String, Tensor)> {
    let ids: Vec<i64> = (0..batch * 16).map(|_| rng.int(1, 1023)).collect();
    let mut mask = vec![1i64; batch * 16];
    for b in 0..batch {
        let len = rng.int(8, 16) as usize;
        mask[b * 16 + len..(b + 1) * 16].fill(0);
    }
    let types: Vec<i64> = (0..batch * 16).map(|i| (i % 16 >= 8) as i64).collect();
    vec![
        ("input_ids".into(), Tensor::from_vec(&[batch, 16], ids).unwrap()),
        ("attention_mask".into(), Tensor::from_vec(&[batch, 16], mask).unwrap()),
        ("token_type_ids".into(), Tensor::from_vec(&[batch, 16], types).unwrap()),
    ]
}

/// The BERT-class encoder fused by ONNX Runtime's transformer optimizer into its
/// `com.microsoft` operators (`scripts/optimize_bert.py`) calibrates in qforge's runtime and
/// quantizes: its MatMuls get Q/DQ, the contrib ops stay float with the reason, and ONNX
/// Runtime runs the result with sentence embeddings at cosine >= 0.99 against the float
/// model's.
#[test]
fn quantizes_models_fused_into_com_microsoft_transformer_ops() {
    let repo = qforge_testkit::repo();
    let tmp = TempDir::new("qcli-ortopt");
    let calib = tmp.path().join("calib");
    let mut rng = qforge_testkit::Rng::new(5);
    for i in 0..8 {
        let d = calib.join(format!("{i:03}"));
        std::fs::create_dir_all(&d).unwrap();
        for (name, t) in bert_sample(&mut rng, 2) {
            qforge_data::write_npy(&d.join(format!("{name}.npy")), &t).unwrap();
        }
    }
    let eval = [qforge_data::read_npz(&repo.join("models/bert_tiny_inputs.npz")).unwrap(), bert_sample(&mut rng, 4)];
    for (name, matmuls, ms_ops) in [("bert_tiny_ort_opt", 6, 9), ("bert_tiny_ort_opt_mha", 12, 9)] {
        let model = repo.join(format!("models/{name}.onnx"));
        let (out, report) = (tmp.path().join(format!("{name}.q.onnx")), tmp.path().join(format!("{name}.json")));
        let o = qforge(&[model.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--report".as_ref(), report.as_os_str()]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        let nodes = r["nodes"].as_array().unwrap();
        let quantized = nodes.iter().filter(|n| n["quantized"] == true && n["op"] == "MatMul").count();
        assert_eq!(quantized, matmuls, "{name}: quantized MatMuls");
        let contrib: Vec<_> = nodes.iter().filter(|n| n["op"].as_str().is_some_and(|op| op.starts_with("com.microsoft::"))).collect();
        assert_eq!(contrib.len(), ms_ops, "{name}: com.microsoft nodes in the report");
        for n in contrib {
            assert!(n["quantized"] == false && n["reason"].as_str().is_some_and(|s| !s.is_empty()), "{name}: {n}");
        }
        let q = qforge_onnx::load(&out).unwrap();
        assert!(q.graph.nodes().any(|(_, n)| n.op_type == "DequantizeLinear"), "{name}: no Q/DQ written");
        assert_eq!(q.graph.nodes().filter(|(_, n)| n.domain == qforge_ir::MS_DOMAIN).count(), ms_ops, "{name}: contrib ops kept");
        for inputs in &eval {
            let (f, qz) = (ort_run(&model, inputs, 1), ort_run(&out, inputs, 1));
            let get = |outs: &[(String, Tensor)]| outs.iter().find(|(n, _)| n == "sentence_embedding").unwrap().1.clone();
            let (a, b) = (get(&f), get(&qz));
            let dim = a.shape()[1];
            for (i, (x, y)) in a.as_slice::<f32>().unwrap().chunks(dim).zip(b.as_slice::<f32>().unwrap().chunks(dim)).enumerate() {
                let dot: f64 = x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum();
                let norm = |v: &[f32]| v.iter().map(|p| (*p as f64).powi(2)).sum::<f64>().sqrt();
                let cos = dot / (norm(x) * norm(y));
                println!("{name} quantized, sentence {i}: cosine {cos:.6} against float");
                assert!(cos >= 0.99, "{name} sentence {i}: cosine {cos}");
            }
        }
    }
}

/// Every run compares the written model's outputs with the float model's on 4 calibration
/// samples spread over the set: on ocr_cls the SQNR it reports equals the one ONNX Runtime's
/// outputs of both models give on those samples; a model whose quantized MatMul feeds a float
/// `Log` (small outputs rounded to zero) is flagged with a warning naming the output; and
/// `--check-samples 0` skips the check.
#[test]
fn the_written_model_is_checked_against_float_and_a_poor_output_is_a_warning() {
    let m = cls();
    let tmp = TempDir::new("qcli_check");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 6, |_, _| {});
    let (out, report) = (tmp.path().join("q.onnx"), tmp.path().join("r.json"));
    let o = quantize_with(&m, &calib, &out, &["--report", report.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let check = &r["output_check"];
    assert_eq!(check["samples"], 4);
    let reported = check["outputs"][0]["sqnr_db"].as_f64().unwrap();
    // Samples 0, 1, 3 and 4 of 6 (i * 6 / 4), run by ONNX Runtime.
    let (mut xx, mut ee) = (0f64, 0f64);
    let g = qforge_onnx::load(&m.path).unwrap().graph;
    for i in [0u64, 1, 3, 4] {
        let inputs = make_inputs(&g, &m, 100 + i);
        let (f, q) = (ort_run(&m.path, &inputs, 1), ort_run(&out, &inputs, 1));
        for (a, b) in f[0].1.as_slice::<f32>().unwrap().iter().zip(q[0].1.as_slice::<f32>().unwrap()) {
            xx += (*a as f64).powi(2);
            ee += (*a as f64 - *b as f64).powi(2);
        }
    }
    let ort_db = 10.0 * (xx / ee).log10();
    println!("ocr_cls check: qforge {reported:.3} dB, ONNX Runtime {ort_db:.3} dB");
    assert!((reported - ort_db).abs() < 0.1, "qforge reports {reported} dB, ONNX Runtime's outputs give {ort_db} dB");
    assert!(!stderr(&o).contains("is far from the float model's"), "{}", stderr(&o));

    // y = Log(x W): half the columns of W are 1000x smaller, their outputs fall below half a
    // step of the MatMul's 8-bit output and reach the Log as 0 (clipped to 1e-6).
    let mut g = qforge_ir::Graph::new("log");
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[1, 16]))).unwrap();
    let w: Vec<f32> = (0..16 * 8).map(|i| if i % 8 < 4 { 0.5 } else { 0.0005 }).collect();
    let w = g.add_initializer("w", Tensor::from_vec(&[16, 8], w).unwrap()).unwrap();
    let (lo, hi) = (g.add_initializer("lo", Tensor::scalar(1e-6f32)).unwrap(), g.add_initializer("hi", Tensor::scalar(1e6f32)).unwrap());
    let (mm, clipped, y) = (g.new_value("mm", None).unwrap(), g.new_value("clipped", None).unwrap(), g.new_value("y", None).unwrap());
    g.add_node(qforge_ir::Node::new("MatMul", "matmul").with_inputs([x, w]).with_outputs([mm])).unwrap();
    g.add_node(qforge_ir::Node::new("Clip", "clip").with_inputs([mm, lo, hi]).with_outputs([clipped])).unwrap();
    g.add_node(qforge_ir::Node::new("Log", "log").with_inputs([clipped]).with_outputs([y])).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = qforge_ir::Model { ir_version: 8, opset_imports: vec![qforge_ir::OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() };
    let path = tmp.path().join("log.onnx");
    qforge_onnx::save(&model, &path).unwrap();
    let data = tmp.path().join("log_calib");
    for i in 0..8u64 {
        let d = data.join(format!("{i:03}"));
        std::fs::create_dir_all(&d).unwrap();
        qforge_data::write_npy(&d.join("x.npy"), &Tensor::from_vec(&[1, 16], qforge_testkit::noise(i, 16, 0.5, 1.0)).unwrap()).unwrap();
    }
    let run = |extra: &[&str]| {
        let out = tmp.path().join("log_q.onnx");
        let mut args: Vec<&std::ffi::OsStr> = vec![path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), data.as_os_str()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        qforge(&args)
    };
    let o = run(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("warning: output 'y' is far from the float model's"), "{}", stderr(&o));
    let o = run(&["--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(j["output_check"]["outputs"][0]["sqnr_db"].as_f64().unwrap() < 10.0, "{j}");
    let o = run(&["--json", "--check-samples", "0"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(j["output_check"].is_null(), "{j}");
}

/// Histogram calibration gives the same bytes whether one worker sees every sample in order or
/// two take them as they come: orientation's feature maps are large enough to be sampled, and
/// each sample is half as large as the one before, so one worker counts every later sample on
/// the coarser grid of the first, where two count the first sample each takes on its own.
#[test]
fn histogram_calibration_gives_the_same_bytes_on_one_worker_and_on_two() {
    let m = real_models().into_iter().find(|m| m.name == "orientation").expect("orientation in the test cache (run scripts/setup.sh)");
    let tmp = TempDir::new("qcli_hist_workers");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 6, |i, s| {
        for (_, t) in s.iter_mut() {
            let scaled: Vec<f32> = t.as_slice::<f32>().unwrap().iter().map(|v| v * (32 >> i) as f32).collect();
            *t = Tensor::from_vec(t.shape(), scaled).unwrap();
        }
    });
    for method in ["percentile", "mse"] {
        let written: Vec<Vec<u8>> = ["1", "2"].iter().map(|threads| {
            let out = tmp.path().join(format!("{method}_{threads}.onnx"));
            let o = quantize_with(&m, &calib, &out, &["--method", method, "--threads", threads, "--check-samples", "0"]);
            assert!(o.status.success(), "{}", stderr(&o));
            std::fs::read(&out).unwrap()
        }).collect();
        assert!(written[0] == written[1], "--method {method}: one worker and two wrote different models");
    }
}

/// The output check measures what the activations of pair-fitted weights reach in the quantized
/// model, and convert fits those weights again where a channel went beyond its reach: the
/// measurement runs the integer plan on the check samples in parallel, and the bytes written
/// are still the same on one thread and on two.
#[test]
fn weights_refitted_to_the_quantized_reach_give_the_same_bytes_on_one_thread_and_on_two() {
    let m = real_models().into_iter().find(|m| m.name == "orientation").expect("orientation in the test cache (run scripts/setup.sh)");
    let tmp = TempDir::new("qcli_reach_threads");
    let calib = tmp.path().join("calib");
    samples(&calib, &m, 6, |_, _| {});
    let written: Vec<(Vec<u8>, u64)> = ["1", "2"].iter().map(|threads| {
        let out = tmp.path().join(format!("q_{threads}.onnx"));
        let o = quantize_with(&m, &calib, &out, &["--threads", threads, "--check-samples", "6", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (std::fs::read(&out).unwrap(), j["pair_sum_reach_raised"].as_u64().expect("pair_sum_reach_raised in --json"))
    }).collect();
    assert_eq!(written[0].1, written[1].1, "channels raised on one thread and on two");
    assert!(written[0].0 == written[1].0, "one thread and two wrote different models ({} channels raised)", written[0].1);
}
