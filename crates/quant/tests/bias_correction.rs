//! Bias correction against an independent computation: for every corrected Conv and Gemm, the
//! quantized model's bias must equal the float bias plus the mean over the calibration samples
//! and output positions of `(W − Ŵ)·x` (x: the node's float input), computed here with a naive
//! convolution in f64, to within half a step of the int32 bias.

use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, ValueId};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{quantize, QuantizeOptions};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_quant::report::Report;
use qforge_testkit::noise;

struct ConvAttrs {
    group: usize,
    stride: usize,
    pad: usize,
}

/// `y[n, o, h, w] = b[o] + Σ w[o, c', i, j] · x[n, g·C' + c', h·s + i − p, w·s + j − p]`, in f64.
fn conv(x: &[f64], xs: [usize; 4], w: &[f64], ws: [usize; 4], b: &[f64], a: &ConvAttrs) -> (Vec<f64>, [usize; 4]) {
    let [n, c, h, wd] = xs;
    let [m, cg, kh, kw] = ws;
    let oh = (h + 2 * a.pad - kh) / a.stride + 1;
    let ow = (wd + 2 * a.pad - kw) / a.stride + 1;
    let mut y = vec![0f64; n * m * oh * ow];
    for b_ in 0..n {
        for o in 0..m {
            let g = o / (m / a.group);
            for r in 0..oh {
                for q in 0..ow {
                    let mut s = b[o];
                    for ci in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let (rr, qq) = ((r * a.stride + i) as i64 - a.pad as i64, (q * a.stride + j) as i64 - a.pad as i64);
                                if rr >= 0 && qq >= 0 && (rr as usize) < h && (qq as usize) < wd {
                                    s += w[((o * cg + ci) * kh + i) * kw + j] * x[((b_ * c + g * cg + ci) * h + rr as usize) * wd + qq as usize];
                                }
                            }
                        }
                    }
                    y[((b_ * m + o) * oh + r) * ow + q] = s;
                }
            }
        }
    }
    (y, [n, m, oh, ow])
}

fn channel_means(y: &[f64], s: [usize; 4]) -> Vec<f64> {
    let per = s[2] * s[3];
    (0..s[1]).map(|o| (0..s[0]).map(|n| y[(n * s[1] + o) * per..][..per].iter().sum::<f64>()).sum::<f64>() / (s[0] * per) as f64).collect()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.as_slice::<f32>().unwrap().iter().map(|&v| v as f64).collect()
}

/// The real values behind the DequantizeLinear that input `i` of node `node` reads, and the
/// scale of each element's channel along axis 0.
fn dequantized(m: &Model, node: &str, i: usize) -> (Vec<f64>, Vec<f64>) {
    let g = &m.graph;
    let (_, n) = g.nodes().find(|(_, n)| n.name == node).unwrap();
    let (dq, _) = g.producer(n.input(i).unwrap()).unwrap();
    let dq = g.node(dq).unwrap();
    assert_eq!(dq.op_type, "DequantizeLinear");
    let init = |k: usize| g.value(dq.input(k).unwrap()).unwrap().initializer().unwrap().clone();
    let (q, s) = (init(0), init(1));
    let scales = s.as_slice::<f32>().unwrap().to_vec();
    let qv: Vec<f64> = match q.dtype() {
        qforge_ir::DType::I8 => q.as_slice::<i8>().unwrap().iter().map(|&v| v as f64).collect(),
        qforge_ir::DType::I32 => q.as_slice::<i32>().unwrap().iter().map(|&v| v as f64).collect(),
        d => panic!("unexpected {d}"),
    };
    let per = qv.len() / scales.len();
    let scale: Vec<f64> = (0..qv.len()).map(|k| scales[if scales.len() == 1 { 0 } else if i == 2 { k } else { k / per }] as f64).collect();
    (qv.iter().zip(&scale).map(|(q, s)| q * s).collect(), scale)
}

/// x [1,4,9,9] -> conv (3x3, stride 2, pad 1, bias) -> depthwise conv (3x3, pad 1, bias) ->
/// conv without bias; z [3,6] -> Gemm (transB, bias [5]).
fn model() -> Model {
    let mut g = Graph::new("g");
    let x = g.add_input("x", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[1, 4, 9, 9]))).unwrap();
    let z = g.add_input("z", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, &[3, 6]))).unwrap();
    let init = |g: &mut Graph, name: &str, shape: &[usize], seed: u64, lo: f32, hi: f32| g.add_initializer(name, Tensor::from_vec(shape, noise(seed, shape.iter().product(), lo, hi)).unwrap()).unwrap();
    let w1 = init(&mut g, "w1", &[6, 4, 3, 3], 11, -0.6, 0.6);
    let b1 = init(&mut g, "b1", &[6], 12, -0.2, 0.2);
    let w2 = init(&mut g, "w2", &[6, 1, 3, 3], 13, -0.9, 0.9);
    let b2 = init(&mut g, "b2", &[6], 14, -0.2, 0.2);
    let w3 = init(&mut g, "w3", &[2, 6, 1, 1], 15, -0.5, 0.5);
    let wg = init(&mut g, "wg", &[5, 6], 16, -0.7, 0.7);
    let bg = init(&mut g, "bg", &[5], 17, -0.1, 0.1);
    let node = |g: &mut Graph, n: Node, out: &str| -> ValueId {
        let v = g.new_value(out, None).unwrap();
        g.add_node(n.with_outputs([v])).unwrap();
        v
    };
    let pads = Attr::Ints(vec![1, 1, 1, 1]);
    let y1 = node(&mut g, Node::new("Conv", "conv1").with_inputs([x, w1, b1]).with_attr("strides", Attr::Ints(vec![2, 2])).with_attr("pads", pads.clone()), "y1");
    let y2 = node(&mut g, Node::new("Conv", "dw").with_inputs([y1, w2, b2]).with_attr("group", Attr::Int(6)).with_attr("pads", pads), "y2");
    let y3 = node(&mut g, Node::new("Conv", "nobias").with_inputs([y2, w3]), "y3");
    let yg = node(&mut g, Node::new("Gemm", "gemm").with_inputs([z, wg, bg]).with_attr("transB", Attr::Int(1)), "yg");
    g.set_outputs(vec![y3, yg]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

/// Inputs with a mean far from zero, so weight rounding shifts the outputs' means.
fn samples() -> Vec<Vec<(String, Tensor)>> {
    (0..6).map(|s| vec![
        ("x".to_string(), Tensor::from_vec(&[1, 4, 9, 9], noise(100 + s, 324, 0.5, 2.5)).unwrap()),
        ("z".to_string(), Tensor::from_vec(&[3, 6], noise(200 + s, 18, 1.0, 3.0)).unwrap()),
    ]).collect()
}

fn run(m: &Model, bias_correction: bool) -> (Model, Report) {
    let backend = BackendConfig::load("ort").unwrap();
    let q = ConfigQuantizer { mapping: default_mapping(&backend, RangeName::Minmax, true), backend };
    quantize(m, &q, &samples(), &QuantizeOptions { bias_correction, threads: 2, ..Default::default() }, &mut |_, _| {}).unwrap()
}

fn init_f64(m: &Model, name: &str) -> Vec<f64> {
    f64s(m.graph.value(m.graph.value_by_name(name).unwrap()).unwrap().initializer().unwrap())
}

/// For each output channel: the corrected bias (float bias + mean of `(W − Ŵ)·x`) minus the
/// model's bias, over half the bias step.
fn conv_bias_errors(float: &Model, q: &Model, node: &str, w: &str, b: &str, ws: [usize; 4], a: &ConvAttrs, inputs: &[(Vec<f64>, [usize; 4])]) -> Vec<f64> {
    let (w_hat, _) = dequantized(q, node, 1);
    let (b_hat, b_step) = dequantized(q, node, 2);
    let delta: Vec<f64> = init_f64(float, w).iter().zip(&w_hat).map(|(w, h)| w - h).collect();
    let zero = vec![0.0; ws[0]];
    let mut sum = vec![0.0; ws[0]];
    for (x, xs) in inputs {
        let (y, s) = conv(x, *xs, &delta, ws, &zero, a);
        for (acc, m) in sum.iter_mut().zip(channel_means(&y, s)) {
            *acc += m / inputs.len() as f64;
        }
    }
    let b = init_f64(float, b);
    (0..ws[0]).map(|o| (b[o] + sum[o] - b_hat[o]).abs() / (b_step[o] / 2.0)).collect()
}

#[test]
fn corrected_biases_cancel_the_mean_shift_of_weight_rounding() {
    let m = model();
    let (q, report) = run(&m, true);
    let (plain, plain_report) = run(&m, false);
    assert!(plain_report.bias_correction.is_empty() && !plain_report.bias_correction_enabled);
    let corrected: Vec<&str> = report.bias_correction.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(corrected, ["conv1", "dw", "gemm"]);
    assert_eq!(report.bias_uncorrected.iter().map(|r| (r.1.as_str(), r.3.as_str())).collect::<Vec<_>>(), [("nobias", "no bias input")]);

    let xs: Vec<(Vec<f64>, [usize; 4])> = samples().iter().map(|s| (f64s(&s[0].1), [1, 4, 9, 9])).collect();
    let c1 = ConvAttrs { group: 1, stride: 2, pad: 1 };
    let y1: Vec<(Vec<f64>, [usize; 4])> = xs.iter().map(|(x, s)| conv(x, *s, &init_f64(&m, "w1"), [6, 4, 3, 3], &init_f64(&m, "b1"), &c1)).collect();
    let dw = ConvAttrs { group: 6, stride: 1, pad: 1 };
    let mut worst_plain: f64 = 0.0;
    for (node, w, b, ws, a, inputs) in [("conv1", "w1", "b1", [6, 4, 3, 3], &c1, &xs), ("dw", "w2", "b2", [6, 1, 3, 3], &dw, &y1)] {
        for (o, e) in conv_bias_errors(&m, &q, node, w, b, ws, a, inputs).iter().enumerate() {
            assert!(*e <= 1.0 + 1e-3, "{node} channel {o}: corrected bias off by {e} half-steps");
        }
        worst_plain = conv_bias_errors(&m, &plain, node, w, b, ws, a, inputs).into_iter().fold(worst_plain, f64::max);
    }
    assert!(worst_plain > 4.0, "without correction the bias must miss the shift (worst {worst_plain} half-steps), or this test checks nothing");

    // Gemm: C + mean_rows(z) · (W − Ŵ)ᵀ.
    let (w_hat, _) = dequantized(&q, "gemm", 1);
    let (c_hat, c_step) = dequantized(&q, "gemm", 2);
    let wg = init_f64(&m, "wg");
    let bg = init_f64(&m, "bg");
    let zs: Vec<Vec<f64>> = samples().iter().map(|s| f64s(&s[1].1)).collect();
    for o in 0..5 {
        let shift: f64 = zs.iter().map(|z| (0..3).map(|r| (0..6).map(|k| (wg[o * 6 + k] - w_hat[o * 6 + k]) * z[r * 6 + k]).sum::<f64>()).sum::<f64>() / 3.0).sum::<f64>() / zs.len() as f64;
        let e = (bg[o] + shift - c_hat[o]).abs() / (c_step[o] / 2.0);
        assert!(e <= 1.0 + 1e-3, "gemm column {o}: corrected bias off by {e} half-steps");
    }
    let shifts = &report.bias_correction.iter().find(|r| r.node == "gemm").unwrap().shift;
    assert_eq!(shifts.len(), 5);
}

#[test]
fn bias_correction_is_deterministic_across_calibration_workers() {
    let m = model();
    let bytes = |q: &Model| qforge_onnx::to_bytes(q).unwrap();
    let first = bytes(&run(&m, true).0);
    for _ in 0..3 {
        assert_eq!(bytes(&run(&m, true).0), first);
    }
}
