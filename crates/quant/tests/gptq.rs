//! GPTQ weight rounding end to end: quantize a model with 4-bit weights with nearest and with
//! GPTQ rounding, then measure here, with a naive f64 convolution and matrix product, each
//! layer's output error `Σ ((W − Ŵ)·x)²` over every calibration sample and output position
//! (x: the layer's float input). GPTQ must lower it on every rounded layer, keep the scales,
//! stay in the 4-bit range, and give the same bytes every run.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{quantize, QuantizeOptions};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_quant::report::Report;
use qforge_quant::weight_rounding::WeightRounding;
use qforge_testkit::noise;

/// Convolution attributes of the test model (square kernels, symmetric pads).
#[derive(Clone, Copy)]
struct ConvAttrs {
    group: usize,
    stride: usize,
    pad: usize,
}

/// `y[n, o, h, w] = Σ w[o, c', i, j] · x[n, g·C' + c', h·s + i − p, w·s + j − p]`, in f64.
fn conv(x: &[f64], xs: [usize; 4], w: &[f64], ws: [usize; 4], a: ConvAttrs) -> (Vec<f64>, [usize; 4]) {
    let [n, c, h, wd] = xs;
    let [m, cg, kh, kw] = ws;
    let oh = (h + 2 * a.pad - kh) / a.stride + 1;
    let ow = (wd + 2 * a.pad - kw) / a.stride + 1;
    let mut y = vec![0f64; n * m * oh * ow];
    for b in 0..n {
        for o in 0..m {
            let g = o / (m / a.group);
            for r in 0..oh {
                for q in 0..ow {
                    let mut s = 0.0;
                    for ci in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let (rr, qq) = ((r * a.stride + i) as i64 - a.pad as i64, (q * a.stride + j) as i64 - a.pad as i64);
                                if rr >= 0 && qq >= 0 && (rr as usize) < h && (qq as usize) < wd {
                                    s += w[((o * cg + ci) * kh + i) * kw + j] * x[((b * c + g * cg + ci) * h + rr as usize) * wd + qq as usize];
                                }
                            }
                        }
                    }
                    y[((b * m + o) * oh + r) * ow + q] = s;
                }
            }
        }
    }
    (y, [n, m, oh, ow])
}

/// `y[n, o, Y, X] = Σ x[n, c, i, j] · w[c, o, Y − i·s, X − j·s]` (one group, no pads), in f64.
fn conv_transpose(x: &[f64], [n, c, h, wd]: [usize; 4], w: &[f64], [_, m, kh, kw]: [usize; 4], s: usize) -> Vec<f64> {
    let (oh, ow) = ((h - 1) * s + kh, (wd - 1) * s + kw);
    let mut y = vec![0f64; n * m * oh * ow];
    for b in 0..n {
        for ci in 0..c {
            for i in 0..h {
                for j in 0..wd {
                    for o in 0..m {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                y[((b * m + o) * oh + i * s + ky) * ow + j * s + kx] += x[((b * c + ci) * h + i) * wd + j] * w[((ci * m + o) * kh + ky) * kw + kx];
                            }
                        }
                    }
                }
            }
        }
    }
    y
}

fn add_bias(y: &mut [f64], s: [usize; 4], b: &[f64]) {
    let per = s[2] * s[3];
    for (e, v) in y.iter_mut().enumerate() {
        *v += b[(e / per) % s[1]];
    }
}

/// x [1,8,10,10] -> conv1 (3x3, stride 2, pad 1, bias) -> dw (depthwise 3x3, pad 1) -> pw (1x1)
/// and -> up (ConvTranspose 2x2, stride 2); z [6,12] -> gemm (transB, bias) and -> mm (MatMul [12,5]).
/// The inputs have correlated channels, as real activations do.
fn model() -> Model {
    let mut g = Graph::new("g");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[1, 8, 10, 10]))).unwrap();
    let z = g.add_input("z", Some(ValueType::tensor_of(DType::F32, &[6, 12]))).unwrap();
    let init = |g: &mut Graph, name: &str, shape: &[usize], seed: u64, lo: f32, hi: f32| g.add_initializer(name, Tensor::from_vec(shape, noise(seed, shape.iter().product(), lo, hi)).unwrap()).unwrap();
    let w1 = init(&mut g, "w1", &[8, 8, 3, 3], 11, -0.6, 0.6);
    let b1 = init(&mut g, "b1", &[8], 12, -0.2, 0.2);
    let w2 = init(&mut g, "w2", &[8, 1, 3, 3], 13, -0.9, 0.9);
    let w3 = init(&mut g, "w3", &[4, 8, 1, 1], 15, -0.5, 0.5);
    let wt = init(&mut g, "wt", &[8, 2, 2, 2], 18, -0.5, 0.5);
    let wg = init(&mut g, "wg", &[7, 12], 16, -0.7, 0.7);
    let bg = init(&mut g, "bg", &[7], 17, -0.1, 0.1);
    let wm = init(&mut g, "wm", &[12, 5], 19, -0.7, 0.7);
    let node = |g: &mut Graph, n: Node, out: &str| -> ValueId {
        let v = g.new_value(out, None).unwrap();
        g.add_node(n.with_outputs([v])).unwrap();
        v
    };
    let pads = Attr::Ints(vec![1, 1, 1, 1]);
    let y1 = node(&mut g, Node::new("Conv", "conv1").with_inputs([x, w1, b1]).with_attr("strides", Attr::Ints(vec![2, 2])).with_attr("pads", pads.clone()), "y1");
    let y2 = node(&mut g, Node::new("Conv", "dw").with_inputs([y1, w2]).with_attr("group", Attr::Int(8)).with_attr("pads", pads), "y2");
    let y3 = node(&mut g, Node::new("Conv", "pw").with_inputs([y2, w3]), "y3");
    let yt = node(&mut g, Node::new("ConvTranspose", "up").with_inputs([y1, wt]).with_attr("strides", Attr::Ints(vec![2, 2])), "yt");
    let yg = node(&mut g, Node::new("Gemm", "gemm").with_inputs([z, wg, bg]).with_attr("transB", Attr::Int(1)), "yg");
    let ym = node(&mut g, Node::new("MatMul", "mm").with_inputs([z, wm]), "ym");
    g.set_outputs(vec![y3, yt, yg, ym]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

/// Each channel (column) mixes three shared factors plus its own noise.
fn correlated(seed: u64, vectors: usize, width: usize, channel_major: bool) -> Vec<f32> {
    let f = noise(seed, vectors * 3, -1.0, 1.0);
    let mix = noise(seed + 1, 3 * width, -1.0, 1.0);
    let own = noise(seed + 2, vectors * width, -0.25, 0.25);
    let mut out = vec![0f32; vectors * width];
    for v in 0..vectors {
        for c in 0..width {
            let value = (0..3).map(|k| f[v * 3 + k] * mix[k * width + c]).sum::<f32>() + own[v * width + c] + 0.3;
            out[if channel_major { c * vectors + v } else { v * width + c }] = value;
        }
    }
    out
}

fn samples() -> Vec<Vec<(String, Tensor)>> {
    (0..8).map(|s| vec![
        ("x".to_string(), Tensor::from_vec(&[1, 8, 10, 10], correlated(100 + 10 * s, 100, 8, true)).unwrap()),
        ("z".to_string(), Tensor::from_vec(&[6, 12], correlated(300 + 10 * s, 6, 12, false)).unwrap()),
    ]).collect()
}

/// The `ort` backend with 4-bit symmetric weights.
fn backend() -> BackendConfig {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../backends/ort.toml")).unwrap();
    let text = text.replace("weight = { dtype = \"s8\"", "weight = { dtype = \"s4\"").replace("name = \"ort\"", "name = \"ort_w4\"");
    assert!(text.contains("\"s4\""));
    BackendConfig::from_toml(&text, "ort_w4").unwrap()
}

fn run(m: &Model, rounding: WeightRounding) -> (Model, Report) {
    run_on(m, rounding, 2)
}

/// Quantizes `m` with 4-bit weights on `threads` threads (1: one calibration worker).
fn run_on(m: &Model, rounding: WeightRounding, threads: usize) -> (Model, Report) {
    run_with(m, rounding, threads, backend())
}

fn run_with(m: &Model, rounding: WeightRounding, threads: usize, backend: BackendConfig) -> (Model, Report) {
    let q = ConfigQuantizer { mapping: default_mapping(&backend, RangeName::Minmax, true), backend };
    quantize(m, &q, &samples(), &QuantizeOptions { weight_rounding: rounding, threads, ..Default::default() }, &mut |_, _| {}).unwrap()
}

fn init_f64(m: &Model, name: &str) -> Vec<f64> {
    m.graph.value(m.graph.value_by_name(name).unwrap()).unwrap().initializer().unwrap().to_f64_vec().unwrap()
}

/// The integers and scales behind the DequantizeLinear read by input 1 of `node`.
fn weight(m: &Model, node: &str) -> (Vec<f64>, Vec<f64>) {
    let g = &m.graph;
    let (_, n) = g.nodes().find(|(_, n)| n.name == node).unwrap();
    let (dq, _) = g.producer(n.input(1).unwrap()).unwrap();
    let dq = g.node(dq).unwrap();
    assert_eq!(dq.op_type, "DequantizeLinear", "{node}");
    let init = |k: usize| g.value(dq.input(k).unwrap()).unwrap().initializer().unwrap().to_f64_vec().unwrap();
    (init(0), init(1))
}

/// `W − Ŵ` of `node` in `q` (scales per output channel along `axis` of the weight `shape`).
fn weight_error(float: &Model, q: &Model, node: &str, w: &str, shape: &[usize], axis: usize) -> Vec<f64> {
    let (ints, scales) = weight(q, node);
    let inner: usize = shape[axis + 1..].iter().product();
    init_f64(float, w).iter().enumerate().map(|(e, &v)| v - ints[e] * scales[if scales.len() == 1 { 0 } else { (e / inner) % shape[axis] }]).collect()
}

/// `Σ ((W − Ŵ)·x)²` of every layer over the calibration samples.
fn layer_errors(float: &Model, q: &Model) -> Vec<(&'static str, f64)> {
    let (c1, dw, pw) = (ConvAttrs { group: 1, stride: 2, pad: 1 }, ConvAttrs { group: 8, stride: 1, pad: 1 }, ConvAttrs { group: 1, stride: 1, pad: 0 });
    let mut errors = vec![("conv1", 0.0), ("dw", 0.0), ("pw", 0.0), ("gemm", 0.0), ("mm", 0.0), ("up", 0.0)];
    let sq = |v: Vec<f64>| v.iter().map(|e| e * e).sum::<f64>();
    for s in samples() {
        let x = s[0].1.to_f64_vec().unwrap();
        let (mut y1, s1) = conv(&x, [1, 8, 10, 10], &init_f64(float, "w1"), [8, 8, 3, 3], c1);
        add_bias(&mut y1, s1, &init_f64(float, "b1"));
        let (y2, s2) = conv(&y1, s1, &init_f64(float, "w2"), [8, 1, 3, 3], dw);
        errors[0].1 += sq(conv(&x, [1, 8, 10, 10], &weight_error(float, q, "conv1", "w1", &[8, 8, 3, 3], 0), [8, 8, 3, 3], c1).0);
        errors[1].1 += sq(conv(&y1, s1, &weight_error(float, q, "dw", "w2", &[8, 1, 3, 3], 0), [8, 1, 3, 3], dw).0);
        errors[2].1 += sq(conv(&y2, s2, &weight_error(float, q, "pw", "w3", &[4, 8, 1, 1], 0), [4, 8, 1, 1], pw).0);
        errors[5].1 += sq(conv_transpose(&y1, s1, &weight_error(float, q, "up", "wt", &[8, 2, 2, 2], 1), [8, 2, 2, 2], 2));
        let z = s[1].1.to_f64_vec().unwrap();
        let (dg, dm) = (weight_error(float, q, "gemm", "wg", &[7, 12], 0), weight_error(float, q, "mm", "wm", &[12, 5], 1));
        for r in 0..6 {
            errors[3].1 += (0..7).map(|o| (0..12).map(|k| dg[o * 12 + k] * z[r * 12 + k]).sum::<f64>().powi(2)).sum::<f64>();
            errors[4].1 += (0..5).map(|o| (0..12).map(|k| dm[k * 5 + o] * z[r * 12 + k]).sum::<f64>().powi(2)).sum::<f64>();
        }
    }
    errors
}

#[test]
fn gptq_lowers_every_layers_output_error_on_the_same_scales() {
    let m = model();
    let (nearest, nearest_report) = run(&m, WeightRounding::Nearest);
    let (gptq, report) = run(&m, WeightRounding::Gptq);
    assert!(!nearest_report.gptq_enabled && nearest_report.gptq.is_empty());
    assert!(report.gptq_enabled);
    let mut rounded: Vec<&str> = report.gptq.iter().map(|r| r.node.as_str()).collect();
    rounded.sort();
    assert_eq!(rounded, ["conv1", "dw", "gemm", "mm", "pw", "up"]);
    assert!(report.gptq_skipped.is_empty(), "{:?}", report.gptq_skipped);
    for r in &report.gptq {
        assert!(r.gptq_error < r.nearest_error, "{}: reported proxy {} against nearest {}", r.node, r.gptq_error, r.nearest_error);
    }

    let (before, after) = (layer_errors(&m, &nearest), layer_errors(&m, &gptq));
    let mut total = (0.0, 0.0);
    for ((node, e0), (_, e1)) in before.iter().zip(&after) {
        assert!(e1 < e0, "{node}: GPTQ output error {e1} against nearest {e0}");
        total = (total.0 + e0, total.1 + e1);
        let ((i0, s0), (i1, s1)) = (weight(&nearest, node), weight(&gptq, node));
        assert_eq!(s0, s1, "{node}: GPTQ keeps the scales");
        assert!(i1.iter().all(|&v| (-8.0..=7.0).contains(&v)), "{node}: 4-bit range");
        assert!(i0 != i1, "{node}: GPTQ changed no integer");
    }
    assert!(total.1 < 0.7 * total.0, "GPTQ total output error {} against nearest {}", total.1, total.0);
}

#[test]
fn gptq_is_deterministic_across_calibration_workers() {
    let m = model();
    let bytes = |q: &Model| qforge_onnx::to_bytes(q).unwrap();
    let first = bytes(&run_on(&m, WeightRounding::Gptq, 1).0);
    for _ in 0..3 {
        assert_eq!(bytes(&run(&m, WeightRounding::Gptq).0), first, "two workers give the bytes of one");
    }
}

#[test]
fn auto_rounding_is_gptq_for_4_bit_weights_and_nearest_for_8_bit_ones() {
    let m = model();
    let bytes = |q: &Model| qforge_onnx::to_bytes(q).unwrap();
    let (auto4, report) = run(&m, WeightRounding::Auto);
    assert!(report.gptq_enabled && report.gptq.len() == 6);
    assert_eq!(bytes(&auto4), bytes(&run(&m, WeightRounding::Gptq).0));
    assert_ne!(bytes(&auto4), bytes(&run(&m, WeightRounding::Nearest).0));
    let ort = || BackendConfig::load("ort").unwrap();
    let (auto8, report) = run_with(&m, WeightRounding::Auto, 2, ort());
    assert!(!report.gptq_enabled && report.gptq.is_empty() && report.gptq_skipped.is_empty());
    assert_eq!(bytes(&auto8), bytes(&run_with(&m, WeightRounding::Nearest, 2, ort()).0));
    assert_ne!(bytes(&auto8), bytes(&run_with(&m, WeightRounding::Gptq, 2, ort()).0));
}
