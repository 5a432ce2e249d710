//! Every ONNX backend node test that qforge's runtime passes (`conformance/allowlist.txt` of the
//! runtime crate) quantized with the default configuration, calibrated on the test's own inputs:
//! - quantize never panics, and refuses only models that are already quantized;
//! - tests whose inputs are sequences or optionals are left out (calibration samples are
//!   tensors); those with tensor inputs and sequence ops inside or sequence outputs are in;
//! - ONNX Runtime loads and runs every quantized model whose float original it runs (with its
//!   default optimizations, so with its fusions into integer kernels), its outputs have the
//!   float model's types and shapes and are within 5 % of the float output's largest magnitude.
//!
//! The node tests cover one operator each, with every attribute and type variation the ONNX
//! suite has, so this is the widest sweep of graph shapes quantize meets. The ONNX "light"
//! model zoo (IR version 3 models whose every weight is also a graph input) goes through the
//! same check on random inputs.

use std::path::{Path, PathBuf};

use qforge_ir::{Tensor, ValueType};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{quantize, QuantizeError, QuantizeOptions};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_testkit::{cache, light_models, make_inputs, oracle, repo, TempDir};

/// The default quantizer for the `ort` backend (its s8 weights fit ONNX Runtime's 16-bit pair
/// sums, so the check measures quantization error on every CPU, not the CPU's arithmetic).
fn ort_quantizer() -> ConfigQuantizer {
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    ConfigQuantizer { mapping, backend }
}

/// The samples of a node test: one per `test_data_set_*`, its `input_<i>.pb` files feeding the
/// graph inputs in order.
fn samples(dir: &Path, names: &[String]) -> Result<Vec<Vec<(String, Tensor)>>, String> {
    let mut sets: Vec<PathBuf> = std::fs::read_dir(dir).map_err(|e| e.to_string())?
        .map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    sets.sort();
    sets.iter().map(|set| {
        let mut feed = vec![];
        for (i, name) in names.iter().enumerate() {
            let f = set.join(format!("input_{i}.pb"));
            if f.exists() {
                let bytes = std::fs::read(&f).map_err(|e| e.to_string())?;
                feed.push((name.clone(), qforge_onnx::tensor_from_proto_bytes(&bytes).map_err(|e| e.to_string())?.1));
            }
        }
        Ok(feed)
    }).collect()
}

#[test]
fn every_runtime_node_test_quantizes_and_runs_in_onnx_runtime() {
    let node_tests = cache().join("node-tests");
    let allow: Vec<String> = std::fs::read_to_string(repo().join("crates/runtime/conformance/allowlist.txt")).unwrap()
        .lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    assert!(allow.len() >= 1000, "the runtime allowlist has {} tests", allow.len());
    let quantizer = ort_quantizer();
    let out = TempDir::new("node-quantize");
    let mut cases = vec![];
    let (mut refused, mut panics, mut errors, mut non_tensor_inputs) = (0, vec![], vec![], 0);
    for name in &allow {
        let dir = node_tests.join(name);
        let model = qforge_onnx::load(&dir.join("model.onnx")).unwrap_or_else(|e| panic!("{name}: {e}"));
        let non_tensor = |v: &qforge_ir::ValueId| model.graph.value(*v).is_ok_and(|x| matches!(x.ty, Some(ValueType::Sequence(_) | ValueType::Optional(_))));
        if model.graph.inputs().iter().any(non_tensor) {
            non_tensor_inputs += 1;
            continue;
        }
        let inputs: Vec<String> = model.graph.inputs().iter().map(|v| model.graph.value_name(*v)).collect();
        let feeds = samples(&dir, &inputs).unwrap_or_else(|e| panic!("{name}: {e}"));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            quantize(&model, &quantizer, &feeds, &QuantizeOptions::default(), &mut |_, _| {})
        }));
        match result {
            Err(_) => panics.push(name.clone()),
            Ok(Err(QuantizeError::AlreadyQuantized { .. })) => refused += 1,
            Ok(Err(e)) => errors.push(format!("{name}: {e}")),
            Ok(Ok((q, _))) => {
                let path = out.path().join(format!("{name}.onnx"));
                qforge_onnx::save(&q, &path).unwrap_or_else(|e| panic!("{name}: {e}"));
                cases.push(serde_json::json!({"name": name, "float": dir.join("model.onnx"), "quantized": path, "data": dir}));
            }
        }
    }
    println!("{} node tests quantized, {refused} refused as already quantized, {non_tensor_inputs} left out (sequence or optional inputs)", cases.len());
    assert!(panics.is_empty(), "quantize panicked on {} node tests: {}", panics.len(), panics.join(" "));
    assert!(errors.is_empty(), "quantize failed on {} node tests:\n{}", errors.len(), errors.join("\n"));
    assert!(refused >= 10, "only {refused} node tests were refused as already quantized (QuantizeLinear, QLinearConv, ...)");

    let manifest = out.path().join("cases.json");
    std::fs::write(&manifest, serde_json::to_vec(&cases).unwrap()).unwrap();
    let o = oracle("ort_quantized_cases.py", &[manifest.as_os_str()]);
    assert!(o.status.success(), "oracle failed: {}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let worst: Vec<(String, f64)> = r["worst"].as_array().unwrap().iter().map(|w| (w[0].as_str().unwrap().to_string(), w[1].as_f64().unwrap())).collect();
    println!("ONNX Runtime ran {} of them (it refuses {} float originals); largest errors relative to the float output's largest magnitude: {:?}",
        r["checked"], r["float_refused"].as_array().unwrap().len(), &worst[..worst.len().min(8)]);
    let failures = r["failures"].as_array().unwrap();
    assert!(failures.is_empty(), "{} quantized node tests fail in ONNX Runtime:\n{}", failures.len(),
        failures.iter().map(|f| format!("{}: {}", f[0], f[1])).collect::<Vec<_>>().join("\n"));
    // The one exception feeds 1000 into V where the mask hides it: min/max calibration keeps
    // that range, so the values that count round to zero (ONNX Runtime's quantizer does the same).
    let off: Vec<&(String, f64)> = worst.iter().filter(|(n, e)| *e > 0.05 && n != "test_attention_4d_softcap_neginf_mask_poison_expanded").collect();
    assert!(off.is_empty(), "quantized node tests whose outputs in ONNX Runtime are more than 5 % off float: {off:?}");
    let checked = r["checked"].as_u64().unwrap() as usize;
    assert!(checked * 10 >= cases.len() * 8, "ONNX Runtime ran only {checked} of the {} quantized node tests", cases.len());
}

#[test]
fn every_light_zoo_model_quantizes_and_runs_in_onnx_runtime() {
    let quantizer = ort_quantizer();
    let out = TempDir::new("light-quantize");
    let mut cases = vec![];
    for m in light_models() {
        let model = qforge_onnx::load(&m.path).unwrap();
        let samples: Vec<_> = (0..3).map(|seed| make_inputs(&model.graph, &m, seed)).collect();
        let (q, report) = quantize(&model, &quantizer, &samples, &QuantizeOptions::default(), &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert!(!report.constants.is_empty(), "{}: no weight stored quantized ({} initializers were inputs)", m.name, report.constant_inputs.len());
        let path = out.path().join(format!("{}.onnx", m.name));
        qforge_onnx::save(&q, &path).unwrap();
        let mut feed = serde_json::Map::new();
        for (i, (name, t)) in samples[0].iter().enumerate() {
            let f = out.path().join(format!("{}_{i}.npy", m.name));
            qforge_data::write_npy(&f, t).unwrap();
            feed.insert(name.clone(), serde_json::json!(f));
        }
        cases.push(serde_json::json!({"name": m.name, "float": m.path, "quantized": path, "feeds": [feed]}));
    }
    let manifest = out.path().join("cases.json");
    std::fs::write(&manifest, serde_json::to_vec(&cases).unwrap()).unwrap();
    let o = oracle("ort_quantized_cases.py", &[manifest.as_os_str()]);
    assert!(o.status.success(), "oracle failed: {}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let failures = r["failures"].as_array().unwrap();
    assert!(failures.is_empty(), "quantized light-zoo models fail in ONNX Runtime: {failures:?}");
    assert_eq!(r["checked"].as_u64().unwrap() as usize, cases.len(), "ONNX Runtime runs every float light-zoo model: {}", r["float_refused"]);
}
