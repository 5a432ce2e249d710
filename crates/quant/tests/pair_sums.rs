//! Weights that would saturate ONNX Runtime's 16-bit pair sums on x86 CPUs without VNNI:
//! every output channel's weights large and of one sign, inputs at the top of their range
//! (u8 255). Quantized for the `ort` backend, which declares `pair_sum_max = 128`, each
//! model's outputs in ONNX Runtime, with its fusions into integer kernels, equal qforge's
//! exact execution on every CPU. Quantized without the constraint, the same models differ on
//! a CPU where ONNX Runtime saturates (and agree where it does not), which shows the weights
//! do reach the saturation the constraint prevents.

use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, ValueId};
use qforge_quant::backend::BackendConfig;
use qforge_quant::convert::{convert_graph, group_qparams, ConvertOptions, WeightFits};
use qforge_quant::pipeline::{calibrate, quantize, InputStats, QuantizeOptions};
use qforge_quant::quantizer::Quantizer;
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_testkit::{compare, noise, ort_run_with, ort_u8s8_exact, TempDir};

/// A one-node model `op(x, W[, B]) -> y` with `W` of `w_shape`: every output channel's
/// weights in `[0.6, 1.0)`, negative on odd channels, so that all pairs share a sign.
fn model(op: &str, attrs: &[(&str, Attr)], x_shape: &[usize], w_shape: &[usize], channel_axis: usize, bias: bool) -> Model {
    let mut g = Graph::new("pairs");
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &x_shape.iter().map(|&d| d as i64).collect::<Vec<_>>()))).unwrap();
    let inner: usize = w_shape[channel_axis + 1..].iter().product();
    let channels = w_shape[channel_axis];
    let w: Vec<f32> = noise(11, w_shape.iter().product(), 0.6, 1.0).into_iter().enumerate()
        .map(|(i, v)| if (i / inner) % channels % 2 == 1 { -v } else { v }).collect();
    let mut inputs: Vec<ValueId> = vec![x, g.add_initializer("W", Tensor::from_vec(w_shape, w).unwrap()).unwrap()];
    if bias {
        inputs.push(g.add_initializer("B", Tensor::from_vec(&[channels], noise(12, channels, -0.5, 0.5)).unwrap()).unwrap());
    }
    let y = g.new_value("y", None).unwrap();
    let mut node = Node::new(op, "node").with_inputs(inputs).with_outputs([y]);
    for (name, value) in attrs {
        node = node.with_attr(name, value.clone());
    }
    g.add_node(node).unwrap();
    g.set_outputs(vec![y]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

/// The `ort` backend, with or without its `pair_sum_max`; every output quantized (no
/// `float_output`), so that differences are counted in output steps.
fn ort_backend(pair_sums: bool) -> BackendConfig {
    let mut b = BackendConfig::load("ort").unwrap();
    b.patterns.iter_mut().for_each(|p| p.float_output = false);
    let weight = b.dtype_configs.get_mut("weighted_int8").unwrap().weight.as_mut().unwrap();
    assert_eq!(weight.pair_sum_max, Some(128), "the ort backend declares ONNX Runtime's pair sums");
    if !pair_sums {
        weight.pair_sum_max = None;
    }
    b
}

/// The `x86` backend, with its 7-bit activations (`[0, 127]`) or at full u8 range.
fn x86_backend(seven_bits: bool) -> BackendConfig {
    let mut b = BackendConfig::load("x86").unwrap();
    for d in b.dtype_configs.values_mut() {
        for c in [d.input.as_mut(), d.output.as_mut()].into_iter().flatten().filter(|c| c.scale_exact_match.is_none()) {
            assert_eq!(c.quant_max_upper_bound, Some(127), "x86 activations take 7 bits");
            if !seven_bits {
                c.quant_max_upper_bound = None;
            }
        }
    }
    b
}

/// A quantized model saved where ONNX Runtime loads it, with qforge's session of it.
struct BothRuntimes {
    _dir: TempDir,
    path: std::path::PathBuf,
    ours: qforge_runtime::Session,
}

impl BothRuntimes {
    fn new(q: &Model, name: &str) -> BothRuntimes {
        let dir = TempDir::new(&format!("pair-sums-{name}"));
        let path = dir.path().join("q.onnx");
        qforge_onnx::save(q, &path).unwrap();
        BothRuntimes { _dir: dir, path, ours: qforge_runtime::Session::new(q).unwrap() }
    }

    /// The first output in ONNX Runtime (fusions on, one thread) and in qforge, compared with
    /// tolerance `tol` (relative and absolute): the largest difference, and whether it is within.
    fn compare_first(&self, input: &[(String, Tensor)], tol: f64) -> (f64, bool) {
        let ours = self.ours.run(input.to_vec()).unwrap();
        let theirs = ort_run_with(&self.path, input, 1, true);
        compare(&theirs[0].1, &ours[0].1, tol, tol)
    }
}

/// Quantizes `m` for `backend` (calibrated on inputs in `[0, 1]`, one sample all ones), runs it
/// on all-ones and on random input in ONNX Runtime (fusions on) and in qforge; returns the
/// largest difference of their outputs, in output quantization steps. `fitted` is how many
/// weights the backend's `pair_sum_max` must have fitted.
fn ort_minus_qforge(name: &str, m: &Model, x_shape: &[usize], backend: BackendConfig, fitted: usize) -> f64 {
    let n: usize = x_shape.iter().product();
    let feed = |v: Vec<f32>| vec![("x".to_string(), Tensor::from_vec(x_shape, v).unwrap())];
    let calibration: Vec<Vec<(String, Tensor)>> = vec![feed(vec![1.0; n]), feed(noise(1, n, 0.0, 1.0)), feed(noise(2, n, 0.0, 1.0))];
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let (q, report) = quantize(m, &ConfigQuantizer { backend, mapping }, &calibration, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    assert!(report.nodes.iter().all(|r| r.quantized), "{name}: {:?}", report.nodes);
    assert_eq!(report.pair_sums.len(), fitted, "{name}: {:?}", report.pair_sums);
    let both = BothRuntimes::new(&q, name);
    let step = report.activations.iter().find(|a| a.value == "y").map(|a| a.scale as f64).unwrap_or_else(|| panic!("{name}: y is quantized"));
    [feed(vec![1.0; n]), feed(noise(3, n, 0.0, 1.0))].iter().map(|input| both.compare_first(input, 0.0).0 / step).fold(0f64, f64::max)
}

#[test]
fn weights_fitted_to_pair_sums_run_exactly_in_onnx_runtime_on_every_cpu() {
    let cases: Vec<(&str, Model, Vec<usize>)> = vec![
        ("conv_3_inputs", model("Conv", &[("pads", Attr::Ints(vec![1; 4]))], &[1, 3, 8, 8], &[8, 3, 3, 3], 0, true), vec![1, 3, 8, 8]),
        ("conv_grouped", model("Conv", &[("group", Attr::Int(2))], &[1, 8, 6, 6], &[8, 4, 3, 3], 0, true), vec![1, 8, 6, 6]),
        ("conv_depthwise_x2", model("Conv", &[("group", Attr::Int(4))], &[1, 4, 6, 6], &[8, 1, 3, 3], 0, true), vec![1, 4, 6, 6]),
        ("conv_1d", model("Conv", &[], &[1, 6, 12], &[8, 6, 3], 0, false), vec![1, 6, 12]),
        ("gemm_transposed", model("Gemm", &[("transB", Attr::Int(1))], &[2, 16], &[8, 16], 0, true), vec![2, 16]),
        ("gemm", model("Gemm", &[], &[2, 16], &[16, 8], 1, true), vec![2, 16]),
        ("matmul", model("MatMul", &[], &[2, 3, 16], &[16, 8], 1, false), vec![2, 3, 16]),
    ];
    let exact = ort_u8s8_exact();
    for (name, m, x_shape) in &cases {
        let fitted = ort_minus_qforge(name, m, x_shape, ort_backend(true), 1);
        assert!(fitted < 1e-3, "{name}: ONNX Runtime is {fitted} output steps off qforge with pair sums fitted");
        let unfitted = ort_minus_qforge(name, m, x_shape, ort_backend(false), 0);
        if exact {
            assert!(unfitted < 1e-3, "{name}: this CPU has VNNI, yet ONNX Runtime is {unfitted} steps off");
        } else {
            assert!(unfitted >= 1.0, "{name}: without the fit ONNX Runtime should saturate here, yet it is only {unfitted} steps off");
        }
        println!("{name}: fitted 0 steps off ONNX Runtime; unfitted {unfitted:.0} steps off");
    }
}

/// The `x86` backend keeps activations within `[0, 127]`, as PyTorch's x86 qconfig does
/// (`reduce_range`), so its unfitted full-range s8 weights cannot saturate a pair sum for
/// inputs within the calibrated range (`2 · 127 · 128 < 32767`): ONNX Runtime runs the same
/// weights to qforge's outputs on every CPU. At full u8 range they saturate on a CPU without
/// VNNI.
#[test]
fn seven_bit_activations_keep_full_range_weights_exact_in_onnx_runtime_on_every_cpu() {
    let cases: Vec<(&str, Model, Vec<usize>)> = vec![
        ("conv_3_inputs", model("Conv", &[("pads", Attr::Ints(vec![1; 4]))], &[1, 3, 8, 8], &[8, 3, 3, 3], 0, true), vec![1, 3, 8, 8]),
        ("gemm_transposed", model("Gemm", &[("transB", Attr::Int(1))], &[2, 16], &[8, 16], 0, true), vec![2, 16]),
        ("matmul", model("MatMul", &[], &[2, 3, 16], &[16, 8], 1, false), vec![2, 3, 16]),
    ];
    let exact = ort_u8s8_exact();
    for (name, m, x_shape) in &cases {
        let seven = ort_minus_qforge(name, m, x_shape, x86_backend(true), 0);
        assert!(seven < 1e-3, "{name}: ONNX Runtime is {seven} output steps off qforge with 7-bit activations");
        let full = ort_minus_qforge(name, m, x_shape, x86_backend(false), 0);
        if exact {
            assert!(full < 1e-3, "{name}: this CPU has VNNI, yet ONNX Runtime is {full} steps off");
        } else {
            assert!(full >= 1.0, "{name}: at full u8 range ONNX Runtime should saturate here, yet it is only {full} steps off");
        }
        println!("{name}: 7-bit activations 0 steps off ONNX Runtime; 8-bit {full:.0} steps off");
    }
}

/// A grouped Conv whose input channels reach differently: the first group's two channels span
/// `[0, 1]`, the second group's stay within `[0, 0.05]`. The second group's output channels can
/// keep their weights at full range (their products stay small): half the channel scales rise
/// where all do when every input spans `[0, 1]`, and ONNX Runtime still computes qforge's exact
/// outputs on the calibration samples.
#[test]
fn weights_read_against_dim_channels_keep_their_range_and_stay_exact() {
    // 24 x 24 positions a channel, so two samples measure a reach (REACH_MIN_VALUES).
    let m = model("Conv", &[("pads", Attr::Ints(vec![1; 4])), ("group", Attr::Int(2))], &[1, 4, 24, 24], &[8, 2, 3, 3], 0, true);
    let hw = 24 * 24;
    let n = 4 * hw;
    let feed = |v: Vec<f32>| vec![("x".to_string(), Tensor::from_vec(&[1, 4, 24, 24], v).unwrap())];
    let dim = |v: Vec<f32>| v.into_iter().enumerate().map(|(i, x)| if i < 2 * hw { x } else { 0.05 * x }).collect::<Vec<f32>>();
    let bright: Vec<Vec<(String, Tensor)>> = vec![feed(vec![1.0; n]), feed(noise(1, n, 0.0, 1.0))];
    let dimmed: Vec<Vec<(String, Tensor)>> = vec![feed(dim(vec![1.0; n])), feed(dim(noise(1, n, 0.0, 1.0)))];
    let raised = |calibration: &Vec<Vec<(String, Tensor)>>| -> (usize, qforge_ir::Model) {
        let backend = ort_backend(true);
        let mapping = default_mapping(&backend, RangeName::Minmax, true);
        let (q, report) = quantize(&m, &ConfigQuantizer { backend, mapping }, calibration, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
        (report.pair_sums.first().map_or(0, |r| r.rescaled), q)
    };
    let (all, _) = raised(&bright);
    let (few, q) = raised(&dimmed);
    assert_eq!((all, few), (8, 4), "channel scales raised with bright inputs, with a dim group");
    let both = BothRuntimes::new(&q, "dim");
    for input in dimmed {
        let (diff, same) = both.compare_first(&input, 1e-6);
        assert!(same, "ONNX Runtime is {diff} off qforge on a calibration sample");
    }
}

/// A weight read by two MatMuls (an unrolled recurrence reads one per step) is fitted once and
/// stored once: both nodes are reported with the same fitting, and both read the one quantized
/// weight, whose integers ONNX Runtime (fusions on) runs to qforge's outputs (to float
/// rounding: the sum of the two products is float).
#[test]
fn a_weight_shared_by_two_nodes_is_fitted_and_stored_once() {
    let single = model("MatMul", &[], &[2, 16], &[16, 8], 1, false);
    let mut g = single.graph.clone();
    let (x, w, y) = (g.value_by_name("x").unwrap(), g.value_by_name("W").unwrap(), g.value_by_name("y").unwrap());
    let h = g.new_value("h", None).unwrap();
    g.add_node(Node::new("Relu", "relu").with_inputs([y]).with_outputs([h])).unwrap();
    let z = g.new_value("z", None).unwrap();
    g.add_node(Node::new("MatMul", "again").with_inputs([x, w]).with_outputs([z])).unwrap();
    let sum = g.new_value("sum", None).unwrap();
    g.add_node(Node::new("Add", "add").with_inputs([h, z]).with_outputs([sum])).unwrap();
    g.set_outputs(vec![sum]).unwrap();
    let m = Model { graph: g, ..single };
    let n = 32;
    let feed = |v: Vec<f32>| vec![("x".to_string(), Tensor::from_vec(&[2, 16], v).unwrap())];
    let calibration: Vec<Vec<(String, Tensor)>> = vec![feed(vec![1.0; n]), feed(noise(1, n, 0.0, 1.0))];
    let backend = ort_backend(true);
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let (q, report) = quantize(&m, &ConfigQuantizer { backend, mapping }, &calibration, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let fitted: Vec<_> = report.pair_sums.iter().map(|r| (r.node.as_str(), r.weight.as_str(), r.rescaled, r.channels, r.projected_pairs)).collect();
    assert_eq!(fitted.len(), 2, "{fitted:?}");
    assert_eq!((fitted[0].1, fitted[0].2, fitted[0].3, fitted[0].4), (fitted[1].1, fitted[1].2, fitted[1].3, fitted[1].4), "one fitting for both");
    assert!(fitted.iter().any(|f| f.0 == "node") && fitted.iter().any(|f| f.0 == "again"), "{fitted:?}");
    assert!(fitted[0].2 > 0, "the weight's pairs needed fitting: {fitted:?}");
    let stored: Vec<&str> = q.graph.values().filter(|(_, v)| v.initializer().is_some_and(|t| t.shape() == [16, 8])).map(|(_, v)| v.name.as_str()).collect();
    assert_eq!(stored.len(), 1, "the weight is stored once: {stored:?}");
    let (diff, ok) = BothRuntimes::new(&q, "shared").compare_first(&feed(noise(3, n, 0.0, 1.0)), 1e-5);
    assert!(ok, "ONNX Runtime and qforge differ by {diff}");
}

/// `x -> Conv a (Wa) -> Relu -> h -> Conv b (Wb, 3x3) -> y`, with `x` of shape `[1, 2, 24, 24]`,
/// and two calibration samples: the brightest input (channel 0 at 100, channel 1 at 0.2) and
/// noise below it. `Wa` maps `x`'s channel 0 to `h`'s channel 0 (up to 10) and channel 1 to
/// its channel 1 (up to 2).
fn reach_model() -> (Model, Vec<Vec<(String, Tensor)>>) {
    let mut g = Graph::new("reach");
    let shape = [1usize, 2, 24, 24];
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[1, 2, 24, 24]))).unwrap();
    let wa = g.add_initializer("Wa", Tensor::from_vec(&[2, 2, 1, 1], vec![0.1f32, 0.0, 0.0, 10.0]).unwrap()).unwrap();
    let wb = g.add_initializer("Wb", Tensor::from_vec(&[1, 2, 3, 3], [[0.74f32; 9], [1.0; 9]].concat()).unwrap()).unwrap();
    let a = g.new_value("a", None).unwrap();
    let h = g.new_value("h", None).unwrap();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("Conv", "a").with_inputs([x, wa]).with_outputs([a])).unwrap();
    g.add_node(Node::new("Relu", "relu").with_inputs([a]).with_outputs([h])).unwrap();
    g.add_node(Node::new("Conv", "b").with_inputs([h, wb]).with_outputs([y]).with_attr("pads", Attr::Ints(vec![1; 4]))).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let m = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() };
    let n = shape.iter().product::<usize>() / 2;
    let feed = |x0: Vec<f32>, x1: Vec<f32>| vec![("x".to_string(), Tensor::from_vec(&shape, [x0, x1].concat()).unwrap())];
    (m, vec![feed(vec![100.0; n], vec![0.2; n]), feed(noise(1, n, 0.0, 100.0), noise(2, n, 0.0, 0.2))])
}

/// A 1x1 Conv and a Relu, then a 3x3 Conv, `x -> h -> y`, where the quantized model's `h`
/// reaches further in one channel than the float model's: `x`'s two channels span `[0, 100]`
/// and `[0, 0.2]` and share one u8 scale (100/255), so `0.2` becomes `0.39`; `h = relu(0.1·x0,
/// 10·x1)` then reaches 3.9 in its second channel instead of 2.0, 100 of its u8 steps (scale
/// 10/255) where calibration saw 51. `y`'s taps pair `h`'s two channels with integers 94 and
/// 127, within ONNX Runtime's 16-bit pair sum for the float reach (67 with its headroom:
/// `255·94 + 67·127 <= 32640`) but not for the quantized one (`255·94 + 100·127 > 32767`). The
/// output check measures what the quantized `h` reaches and convert fits again, so ONNX
/// Runtime computes qforge's outputs on every CPU; without a check it does only on a CPU with
/// VNNI.
#[test]
fn weights_are_fitted_to_what_the_quantized_model_reaches_not_only_the_float_one() {
    let (m, calibration) = reach_model();
    let exact = ort_u8s8_exact();
    for check_samples in [2, 0] {
        let backend = ort_backend(true);
        let mapping = default_mapping(&backend, RangeName::Minmax, true);
        let opts = QuantizeOptions { check_samples, ..Default::default() };
        let (q, report) = quantize(&m, &ConfigQuantizer { backend, mapping }, &calibration, &opts, &mut |_, _| {}).unwrap();
        assert_eq!(report.pair_sum_reach_raised > 0, check_samples > 0, "channels raised with {check_samples} check samples: {}", report.pair_sum_reach_raised);
        let (diff, same) = BothRuntimes::new(&q, "quantized-reach").compare_first(&calibration[0], 1e-6);
        if check_samples > 0 {
            assert!(same, "fitted to the quantized reach, ONNX Runtime is {diff} off qforge");
        } else {
            assert_eq!(same, exact, "fitted to the float reach only, ONNX Runtime is {diff} off qforge (this CPU has VNNI: {exact})");
        }
    }
}

/// Convert refits a weight only when its reach changed ([`WeightFits`]): after raising one
/// channel of `h`, a convert that reuses the first convert's fits fits `Wb` alone and writes the
/// same integers and scales as a convert from scratch, and `Wb`'s differ from the first
/// convert's (so a fit reused without regard to the reach would show).
#[test]
fn a_refit_through_earlier_fits_equals_a_convert_from_scratch() {
    let (m, calibration) = reach_model();
    let quantizer = ConfigQuantizer { backend: ort_backend(true), mapping: default_mapping(&ort_backend(true), RangeName::Minmax, true) };
    let opts = QuantizeOptions { check_samples: 0, ..Default::default() };
    let c = calibrate(&m, &quantizer, &calibration, &opts, &mut |_, _| {}).unwrap();
    let params: Vec<_> = c.plan.groups.iter().map(group_qparams).collect();
    let options = ConvertOptions { contrib: false, weight_search: false, typed_outputs: quantizer.typed_outputs() };
    let convert = |stats: &InputStats, fits: &WeightFits| {
        let mut g = c.model.graph.clone();
        convert_graph(&mut g, &c.plan, 0, &params, stats, options, fits).unwrap();
        g
    };
    let fits = WeightFits::default();
    let first = convert(&c.stats, &fits);
    assert_eq!(fits.computed(), 2, "Wa and Wb");
    let mut raised = c.stats.clone();
    let maxima = raised.maxima.as_mut().expect("the ort backend collects channel maxima");
    let input = maxima.quantized_inputs(&first).into_iter().find(|i| first.node(i.node).unwrap().name == "b").expect("b reads a u8 activation");
    maxima.raise(&input, &[0, 255], &[1]);
    let reused = convert(&raised, &fits);
    assert_eq!(fits.computed(), 3, "only Wb is fitted again");
    let scratch = convert(&raised, &WeightFits::default());
    // The quantized constants: every initializer the convert wrote, by name.
    let constants = |g: &Graph| -> Vec<(String, Vec<u8>)> {
        let mut all: Vec<_> = g.values().filter_map(|(v, x)| Some((g.value_name(v).to_string(), x.initializer()?.raw_bytes()?.to_vec()))).collect();
        all.sort();
        all
    };
    assert_eq!(constants(&reused), constants(&scratch), "a refit through earlier fits writes what a convert from scratch writes");
    let named = |g: &Graph, prefix: &str| constants(g).into_iter().filter(|(n, _)| n.starts_with(prefix)).collect::<Vec<_>>();
    assert_ne!(named(&first, "Wb"), named(&reused, "Wb"), "Wb's fit follows the raised reach");
}

/// A weight reading a pooled feature (GlobalAveragePool's one value per channel per sample) is
/// fitted for full reach, whatever calibration saw: eight samples are too few draws to bound
/// what other inputs reach (`REACH_MIN_VALUES`). `V` reads the same channels at full resolution
/// (144 values per channel per sample) and is fitted to their measured reach: channel 1 stays within a tenth of
/// channel 0, so `V`'s pairs may go past `|q_a| + |q_b| = 128` and `W`'s may not. An input
/// that drives channel 1 ten times past calibration leaves ONNX Runtime on the exact integers
/// (which only a CPU without VNNI could break).
#[test]
fn weights_reading_pooled_features_assume_full_reach() {
    let mut g = Graph::new("pooled");
    let shape = [1usize, 2, 12, 12];
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[1, 2, 12, 12]))).unwrap();
    let weights = || Tensor::from_vec(&[4, 2, 1, 1], vec![0.787f32, 1.0, 0.5, 1.0, 0.3, 1.0, 0.7, 1.0]).unwrap();
    let w = g.add_initializer("W", weights()).unwrap();
    let v = g.add_initializer("V", weights()).unwrap();
    let p = g.new_value("p", None).unwrap();
    let y = g.new_value("y", None).unwrap();
    let z = g.new_value("z", None).unwrap();
    g.add_node(Node::new("GlobalAveragePool", "pool").with_inputs([x]).with_outputs([p])).unwrap();
    g.add_node(Node::new("Conv", "pooled").with_inputs([p, w]).with_outputs([y])).unwrap();
    g.add_node(Node::new("Conv", "spatial").with_inputs([x, v]).with_outputs([z])).unwrap();
    g.set_outputs(vec![y, z]).unwrap();
    let m = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() };
    let n = shape.iter().product::<usize>() / 2;
    let feed = |x0: Vec<f32>, x1: Vec<f32>| vec![("x".to_string(), Tensor::from_vec(&shape, [x0, x1].concat()).unwrap())];
    let calibration: Vec<_> = (0..8).map(|s| feed(noise(20 + s, n, 0.0, 1.0), noise(40 + s, n, 0.0, 0.1))).collect();
    let backend = ort_backend(true);
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let (q, report) = quantize(&m, &ConfigQuantizer { backend, mapping }, &calibration, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let pair_sums = |name: &str| -> Vec<i64> {
        let t = q.graph.values().find(|(id, _)| q.graph.value_name(*id) == format!("{name}_quantized")).and_then(|(_, x)| x.initializer().cloned()).unwrap();
        t.to_i64_vec().unwrap().chunks(2).map(|c| c[0].abs() + c[1].abs()).collect()
    };
    assert!(pair_sums("W").iter().all(|&s| s <= 128), "W reads a pooled feature: {:?}", pair_sums("W"));
    assert!(pair_sums("V").iter().any(|&s| s > 128), "V is fitted to its channels' measured reach: {:?}", pair_sums("V"));
    assert_eq!(report.pair_sum_reach_exceeded, 0);
    let full_reach = |node: &str| report.pair_sums.iter().find(|r| r.node == node).map(|r| r.full_reach);
    assert_eq!(full_reach("pooled"), Some(true), "the report says which weights took full reach: {:?}", report.pair_sums);
    let (diff, same) = BothRuntimes::new(&q, "pooled").compare_first(&feed(vec![1.0; n], vec![1.0; n]), 1e-6);
    assert!(same, "ONNX Runtime is {diff} off qforge on the pooled Conv");
}
