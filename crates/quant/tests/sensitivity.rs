//! Sensitivity analysis and the accuracy budget on a model with one deliberately sensitive
//! activation: the first MatMul's output has one channel a thousand times larger than the
//! others, which the next MatMul ignores (zero weights), so quantizing that activation per
//! tensor wipes out the channels that matter while the float model is unaffected.

use qforge_ir::{Graph, Model, Node, OpsetImport, Tensor, ValueId};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{calibrate, convert, QuantizeOptions, SampleSource};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_quant::sensitivity::{analyze, keep_units_float, quantize_within_budget, Budget};
use qforge_testkit::{ort_run_with, TempDir};

fn noise(seed: u64, n: usize) -> Vec<f32> {
    qforge_testkit::noise(seed, n, -1.0, 1.0)
}

struct Seeded(usize);

impl SampleSource for Seeded {
    fn len(&self) -> usize {
        self.0
    }
    fn name(&self, i: usize) -> String {
        format!("#{i}")
    }
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String> {
        Ok(vec![("x".into(), Tensor::from_vec(&[8, 16], noise(100 + i as u64, 128)).unwrap())])
    }
}

fn matmul(g: &mut Graph, name: &str, x: ValueId, w: Vec<f32>, shape: &[usize]) -> ValueId {
    let w = g.add_initializer(format!("{name}.w"), Tensor::from_vec(shape, w).unwrap()).unwrap();
    let out = g.new_value(name, None).unwrap();
    g.add_node(Node::new("MatMul", format!("/{name}/MatMul")).with_inputs([x, w]).with_outputs([out])).unwrap();
    out
}

/// `x[8,16] -> MatMul -> wide -> MatMul -> mid -> Relu -> MatMul -> y`; `wide`'s channel 0 is
/// `outlier` times larger than it would be and the second weight's row 0 is zero.
fn outlier_model(outlier: f32) -> Model {
    let mut g = Graph::new("outlier");
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[8, 16]))).unwrap();
    let mut w1 = noise(1, 256);
    for r in 0..16 {
        w1[r * 16] *= outlier;
    }
    let wide = matmul(&mut g, "wide", x, w1, &[16, 16]);
    let mut w2 = noise(2, 256);
    w2[..16].fill(0.0);
    let mid = matmul(&mut g, "mid", wide, w2, &[16, 16]);
    let relu = g.new_value("mid_relu", None).unwrap();
    g.add_node(Node::new("Relu", "/relu/Relu").with_inputs([mid]).with_outputs([relu])).unwrap();
    let y = matmul(&mut g, "y", relu, noise(3, 64), &[16, 4]);
    g.set_outputs(vec![y]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

/// The SQNR of `q`'s first output against `model`'s, both run by ONNX Runtime on the four
/// [`Seeded`] samples, `q` as ONNX Runtime deploys it (its QDQ units fused into integer
/// kernels).
fn ort_sqnr_db(model: &Model, q: &Model) -> f64 {
    let tmp = TempDir::new("budget");
    let (fp, qp) = (tmp.path().join("f.onnx"), tmp.path().join("q.onnx"));
    qforge_onnx::save(model, &fp).unwrap();
    qforge_onnx::save(q, &qp).unwrap();
    let (mut xx, mut ee) = (0f64, 0f64);
    for i in 0..4 {
        let feed = Seeded(4).load(i).unwrap();
        let (f, g) = (ort_run_with(&fp, &feed, 1, false), ort_run_with(&qp, &feed, 1, true));
        for (a, b) in f[0].1.as_slice::<f32>().unwrap().iter().zip(g[0].1.as_slice::<f32>().unwrap()) {
            xx += (*a as f64).powi(2);
            ee += (*a as f64 - *b as f64).powi(2);
        }
    }
    10.0 * (xx / ee).log10()
}

fn quantizer() -> ConfigQuantizer {
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    ConfigQuantizer { backend, mapping }
}

#[test]
fn the_outlier_activation_ranks_first() {
    let c = calibrate(&outlier_model(1000.0), &quantizer(), &Seeded(4), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let s = analyze(&c, &Seeded(4), 1, &mut |_, _, _, _| {}).unwrap();
    for u in &s.ranking {
        println!("{:>10} #{:<2} {:?} only quantized {:.2} dB, only float {:.2} dB", u.unit.kind, u.unit.id, u.unit.values, u.only_quantized_sqnr_db, u.only_float_sqnr_db);
    }
    let top = &s.ranking[0];
    assert_eq!(top.unit.values, vec!["wide".to_string()], "the outlier activation should rank first");
    assert!(top.only_quantized_sqnr_db < s.ranking[1].only_quantized_sqnr_db - 10.0, "it should stand out by more than 10 dB");
    assert!(top.only_float_sqnr_db > s.all_quantized_sqnr_db + 10.0, "keeping it float should recover more than 10 dB");
    assert!(s.not_measured.is_empty(), "{:?}", s.not_measured);
}

/// The "only this unit float" SQNR of every unit equals, in ONNX Runtime, the SQNR of the
/// model converted with that unit in float: the trial's switches are what convert emits. Run
/// without the outlier, so that every unit moves the output.
#[test]
fn a_switched_off_unit_equals_the_model_converted_with_it_float() {
    let model = outlier_model(1.0);
    let c = calibrate(&model, &quantizer(), &Seeded(4), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let s = analyze(&c, &Seeded(4), 1, &mut |_, _, _, _| {}).unwrap();
    // Every unit quantized, as deployed: ONNX Runtime's figure for the converted model.
    let (all, _) = convert(c.clone()).unwrap();
    let (deployed, ort_deployed) = (s.all_quantized_as_deployed_sqnr_db.expect("the QDQ units lower"), ort_sqnr_db(&model, &all));
    assert!((deployed - ort_deployed).abs() < 0.01, "as deployed {deployed} dB, ONNX Runtime {ort_deployed} dB");
    let tmp = TempDir::new("sensitivity");
    let float_path = tmp.path().join("float.onnx");
    qforge_onnx::save(&model, &float_path).unwrap();
    let float: Vec<_> = (0..4).map(|i| ort_run_with(&float_path, &Seeded(4).load(i).unwrap(), 1, false)).collect();
    for u in &s.ranking {
        let mut one_float = c.clone();
        keep_units_float(&mut one_float, &[u.unit.id]);
        let (q, _) = convert(one_float).unwrap();
        let path = tmp.path().join(format!("unit{}.onnx", u.unit.id));
        qforge_onnx::save(&q, &path).unwrap();
        let (mut xx, mut ee) = (0f64, 0f64);
        for (i, f) in float.iter().enumerate() {
            let out = ort_run_with(&path, &Seeded(4).load(i).unwrap(), 1, false);
            for (a, b) in f[0].1.as_slice::<f32>().unwrap().iter().zip(out[0].1.as_slice::<f32>().unwrap()) {
                xx += (*a as f64).powi(2);
                ee += (*a as f64 - *b as f64).powi(2);
            }
        }
        let ort_db = 10.0 * (xx / ee).log10();
        println!("unit {} {:?}: trial {:.4} dB, ONNX Runtime {:.4} dB", u.unit.id, u.unit.values, u.only_float_sqnr_db, ort_db);
        assert!((ort_db - u.only_float_sqnr_db).abs() < 0.01, "unit {}: trial {} dB, ONNX Runtime {ort_db} dB", u.unit.id, u.only_float_sqnr_db);
    }
}

#[test]
fn the_budget_is_met_with_few_float_units() {
    let model = outlier_model(1000.0);
    let c = calibrate(&model, &quantizer(), &Seeded(4), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let s = analyze(&c, &Seeded(4), 1, &mut |_, _, _, _| {}).unwrap();
    let target_db = s.all_quantized_sqnr_db + 10.0;
    let opts = QuantizeOptions { check_samples: 2, ..QuantizeOptions::default() };
    let (q, report) = quantize_within_budget(&model, &quantizer(), &Seeded(4), &Seeded(4), &opts, &Budget::min_sqnr(target_db), &mut |_| {}).unwrap();
    let b = report.accuracy_budget.as_ref().unwrap();
    println!("budget {target_db:.2} dB: {} decisions, {} of {} units float, error {:.3e} -> {:.3e}", b.decisions.len(), b.units_float, b.units, b.error_all_quantized, b.error_final);
    assert!(b.met && b.error_final <= b.max_error);
    assert!(b.units_float >= 1 && b.units_float < b.units);
    // The budget is met by the converted model, run as the output check runs it (the written
    // model's integer plan) on the check's samples, so the check the report prints meets it.
    let last = b.rounds.last().expect("a round");
    assert_eq!(last.error_converted, b.error_final);
    let check = report.output_check.as_ref().expect("an output check");
    assert_eq!(check.samples, 2);
    for o in &check.outputs {
        assert!(o.metrics.sqnr_db >= target_db - 1e-3, "check of '{}': {} dB, budget {target_db} dB", o.name, o.metrics.sqnr_db);
    }
    let kept: Vec<&Vec<String>> = b.decisions.iter().filter(|d| d.kept_float).map(|d| &d.unit.values).collect();
    assert!(kept.contains(&&vec!["wide".to_string()]), "units kept float: {kept:?}");
    let budget_nodes: Vec<&str> = report.nodes.iter().filter(|n| n.kind == Some(qforge_quant::annotation::FloatKind::AccuracyBudget)).map(|n| n.name.as_str()).collect();
    assert!(budget_nodes.contains(&"/mid/MatMul"), "nodes reported float: {budget_nodes:?}");
    let wide = q.graph.value_by_name("wide").unwrap();
    assert!(q.graph.consumers(wide).iter().all(|&(n, _)| q.graph.node(n).unwrap().op_type != "QuantizeLinear"), "'wide' still has Q/DQ");
    let ort_db = ort_sqnr_db(&model, &q);
    assert!(ort_db >= target_db - 0.01, "ONNX Runtime gives {ort_db} dB for a budget of {target_db} dB");
}

/// A model with nothing to quantize (one Transpose, which stays float alone) meets any budget:
/// its output is the float model's, and the run writes it instead of failing.
#[test]
fn a_budget_over_a_model_with_nothing_quantized_is_met() {
    let mut g = Graph::new("transpose");
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[8, 16]))).unwrap();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("Transpose", "t").with_inputs([x]).with_outputs([y])).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() };
    let (q, report) = quantize_within_budget(&model, &quantizer(), &Seeded(2), &Seeded(2), &QuantizeOptions::default(), &Budget::min_sqnr(60.0), &mut |_| {}).unwrap();
    let b = report.accuracy_budget.as_ref().unwrap();
    assert!(b.met && b.units == 0 && b.error_final == 0.0);
    assert!(report.activations.is_empty());
    assert_eq!(q.graph.nodes().count(), 1);
}

/// `x[8,16] -> MatMul -> wide1 -> MatMul -> wide2 -> ... -> wide{layers} -> MatMul -> y`: every
/// `wide` has a channel 0 a thousand times larger than it would be, which the next weight
/// ignores (its row 0 is zero), so each one's quantization wipes out the signal on its own.
fn chain_model(layers: usize) -> Model {
    let mut g = Graph::new("chain");
    let mut h = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[8, 16]))).unwrap();
    for l in 0..=layers {
        let cols = if l == layers { 4 } else { 16 };
        let mut w = noise(10 + l as u64, 16 * cols);
        if l > 0 {
            w[..cols].fill(0.0);
        }
        if l < layers {
            for r in 0..16 {
                w[r * 16] *= 1000.0;
            }
        }
        let name = if l < layers { format!("wide{}", l + 1) } else { "y".to_string() };
        h = matmul(&mut g, &name, h, w, &[16, cols]);
    }
    g.set_outputs(vec![h]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

#[test]
fn errors_compounding_over_layers_are_met_by_returning_every_layer_that_needs_it_to_float() {
    // No single wide activation returned to float helps: the others still wipe the signal out.
    let model = chain_model(4);
    let c = calibrate(&model, &quantizer(), &Seeded(4), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let s = analyze(&c, &Seeded(4), 1, &mut |_, _, _, _| {}).unwrap();
    assert!(s.all_quantized_sqnr_db < 3.0, "{} dB", s.all_quantized_sqnr_db);
    for u in s.ranking.iter().filter(|u| u.unit.kind == "activation" && u.unit.values[0].starts_with("wide")) {
        assert!(u.only_float_sqnr_db < 3.0, "{:?} alone float: {} dB", u.unit.values, u.only_float_sqnr_db);
    }
    let (q, report) = quantize_within_budget(&model, &quantizer(), &Seeded(4), &Seeded(4), &QuantizeOptions::default(), &Budget::min_sqnr(25.0), &mut |_| {}).unwrap();
    let b = report.accuracy_budget.as_ref().unwrap();
    assert!(b.met && b.error_final <= b.max_error, "{} -> {}", b.error_all_quantized, b.error_final);
    let float: Vec<String> = b.decisions.iter().filter(|d| d.kept_float).map(|d| d.unit.values.join(",")).collect();
    let mut wides: Vec<&str> = float.iter().map(String::as_str).filter(|v| v.starts_with("wide")).collect();
    wides.sort();
    assert_eq!(wides, ["wide1", "wide2", "wide3", "wide4"], "units kept float: {float:?}");
    // The weights of the MatMuls reading those activations return to float with them: ONNX
    // Runtime would run each float activation with its 8-bit weight as MatMulNBits, quantizing
    // the activation, with its 1000x channel, to int8 at run time.
    let mut following: Vec<String> = b.weights_following.iter().map(|w| w.values.join(",")).collect();
    following.sort();
    assert_eq!(following, ["wide2.w", "wide3.w", "wide4.w", "y.w"]);
    assert_eq!(b.units_float, float.len() + following.len());
    assert!(b.units_float < b.units, "{} of {} float", b.units_float, b.units);
    // ONNX Runtime, its QDQ fusions on, runs the written model within the budget on the same
    // samples.
    let ort_db = ort_sqnr_db(&model, &q);
    assert!(ort_db >= 25.0 - 0.01, "ONNX Runtime: {ort_db} dB");
}
