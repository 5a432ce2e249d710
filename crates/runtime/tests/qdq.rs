//! `QuantizeLinear -> DequantizeLinear` chains match ONNX Runtime bit for bit: the quantized
//! integers exactly and the dequantized f32 values to the bit, for u8, i8, u16, i16, u4 and
//! i4, per-tensor, per-axis and blocked (opset 21), on data with exact .5 ties, values far
//! outside the range, infinities and negative zero, on tensors small and large enough to be
//! split across threads. Also int32 dequantization, the 2-bit node tests byte for byte, and a
//! clear refusal of float8.

use std::path::Path;

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueType};
use qforge_runtime::Session;
use qforge_testkit::{cache, ort_run, Rng, TempDir};

#[derive(Clone, Copy, Debug)]
enum Gran {
    Tensor,
    Axis(i64),
    Block(i64, usize),
}

fn range(d: DType) -> (i64, i64) {
    match d {
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::U16 => (0, 65535),
        DType::I16 => (-32768, 32767),
        DType::U4 => (0, 15),
        DType::I4 => (-8, 7),
        _ => unreachable!(),
    }
}

fn int_tensor(d: DType, shape: &[usize], v: &[i64]) -> Tensor {
    match d {
        DType::U8 => Tensor::from_vec(shape, v.iter().map(|&x| x as u8).collect::<Vec<_>>()),
        DType::I8 => Tensor::from_vec(shape, v.iter().map(|&x| x as i8).collect::<Vec<_>>()),
        DType::U16 => Tensor::from_vec(shape, v.iter().map(|&x| x as u16).collect::<Vec<_>>()),
        DType::I16 => Tensor::from_vec(shape, v.iter().map(|&x| x as i16).collect::<Vec<_>>()),
        DType::I32 => Tensor::from_vec(shape, v.iter().map(|&x| x as i32).collect::<Vec<_>>()),
        DType::U4 => Tensor::from_u4(shape, &v.iter().map(|&x| x as u8).collect::<Vec<_>>()),
        DType::I4 => Tensor::from_i4(shape, &v.iter().map(|&x| x as i8).collect::<Vec<_>>()),
        _ => unreachable!(),
    }
    .unwrap()
}

fn ints(t: &Tensor) -> Vec<i64> {
    t.to_i64_vec().unwrap()
}

fn dims(s: &[usize]) -> Vec<i64> {
    s.iter().map(|&d| d as i64).collect()
}

/// Scale shape for `x` of `shape` under a granularity.
fn scale_shape(shape: &[usize], g: Gran) -> Vec<usize> {
    let ax = |a: i64| if a < 0 { (a + shape.len() as i64) as usize } else { a as usize };
    match g {
        Gran::Tensor => vec![],
        Gran::Axis(a) => vec![shape[ax(a)]],
        Gran::Block(a, b) => {
            let mut s = shape.to_vec();
            s[ax(a)] = s[ax(a)].div_ceil(b);
            s
        }
    }
}

/// Scales (a mix of powers of two, which make exact ties, and awkward values) and zero
/// points spread over the type's range.
fn qparams(d: DType, n: usize, rng: &mut Rng) -> (Vec<f32>, Vec<i64>) {
    let (lo, hi) = range(d);
    let picks = [0.5f32, 0.25, 2.0, 0.1, 0.037, 3.3, 1.0 / 255.0, 0.0078125, 7.1e-4, 13.0];
    let s = (0..n).map(|i| picks[(i + rng.next() as usize % 3) % picks.len()]).collect();
    let z = (0..n).map(|i| match i % 3 {
        0 => (lo + hi + 1) / 2,
        1 => lo + (rng.next() % (hi - lo + 1) as u64) as i64,
        _ => if lo < 0 { 0 } else { lo + 1 },
    }).collect();
    (s, z)
}

/// Inputs whose quotient by the scale hits exact ties and the range edges: for each element
/// the scale it uses is `s`, and `x` is drawn from `(k + 0.5) * s`, `k * s`, +-0, values far
/// outside the range, infinities and plain noise. Without `huge`, values far outside stay
/// below `2^31 * s`: ONNX Runtime's blocked kernels, and its per-axis 4-bit kernels,
/// convert `x / s` to int32 before saturating, which overflows (so 1e30 quantizes to the minimum there, not the maximum the
/// spec asks for; qforge saturates, see `huge_values_saturate_as_the_spec_says`).
fn data(n: usize, scale_of: impl Fn(usize) -> (f32, i64), d: DType, huge: bool, rng: &mut Rng) -> Vec<f32> {
    let (lo, hi) = range(d);
    (0..n).map(|i| {
        let (s, z) = scale_of(i);
        let k = (lo - z - 3) as f32 + (rng.next() % ((hi - lo + 7) as u64)) as f32;
        match rng.next() % 12 {
            0..=2 => (k + 0.5) * s,
            3 => k * s,
            4 => -0.0,
            5 => 0.0,
            6 => (if rng.next().is_multiple_of(2) { 1.0 } else { -1.0 }) * if huge { 1e30 } else { 1e9 * s },
            7 => ((hi - z) as f32 + 0.5) * s * if rng.next().is_multiple_of(2) { 1.0 } else { -1.0 },
            8 if huge => if rng.next().is_multiple_of(2) { f32::INFINITY } else { f32::NEG_INFINITY },
            8 => -2e9 * s,
            9 => -(0.5 * s),
            _ => (rng.unit() * 2.0 - 1.0) * s * (hi - lo) as f32,
        }
    }).collect()
}

/// The scale index of each element of `x`.
fn param_index(shape: &[usize], g: Gran) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let ax = |a: i64| if a < 0 { (a + shape.len() as i64) as usize } else { a as usize };
    match g {
        Gran::Tensor => vec![0; n],
        Gran::Axis(a) => {
            let post: usize = shape[ax(a) + 1..].iter().product();
            (0..n).map(|i| i / post % shape[ax(a)]).collect()
        }
        Gran::Block(a, b) => {
            let a = ax(a);
            let ss = scale_shape(shape, Gran::Block(a as i64, b));
            (0..n).map(|i| {
                let mut rem = i;
                let mut idx = vec![0; shape.len()];
                for k in (0..shape.len()).rev() {
                    idx[k] = rem % shape[k];
                    rem /= shape[k];
                }
                idx[a] /= b;
                idx.iter().zip(&ss).fold(0, |acc, (&v, &s)| acc * s + v)
            }).collect()
        }
    }
}

struct Case {
    dtype: DType,
    gran: Gran,
    shape: Vec<usize>,
    opset: i64,
}

/// Builds `x -> QuantizeLinear -> q -> DequantizeLinear -> y`; for ONNX Runtime (which
/// cannot hand packed types to numpy) `q` is also cast to 8 bits.
fn model(c: &Case, scale: &Tensor, zp: &Tensor, for_ort: bool) -> Model {
    let mut g = Graph::new("qdq");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &dims(&c.shape)))).unwrap();
    let s = g.add_initializer("scale", scale.clone()).unwrap();
    let z = g.add_initializer("zp", zp.clone()).unwrap();
    let q = g.new_value("q", Some(ValueType::tensor_of(c.dtype, &dims(&c.shape)))).unwrap();
    let y = g.new_value("y", Some(ValueType::tensor_of(DType::F32, &dims(&c.shape)))).unwrap();
    let attrs = |mut n: Node| {
        match c.gran {
            Gran::Tensor => {}
            Gran::Axis(a) => n = n.with_attr("axis", Attr::Int(a)),
            Gran::Block(a, b) => n = n.with_attr("axis", Attr::Int(a)).with_attr("block_size", Attr::Int(b as i64)),
        }
        n
    };
    g.add_node(attrs(Node::new("QuantizeLinear", "q")).with_inputs([x, s, z]).with_outputs([q])).unwrap();
    g.add_node(attrs(Node::new("DequantizeLinear", "dq")).with_inputs([q, s, z]).with_outputs([y])).unwrap();
    let mut outs = vec![q, y];
    if for_ort && matches!(c.dtype, DType::U4 | DType::I4) {
        let to = if c.dtype == DType::U4 { DType::U8 } else { DType::I8 };
        let q8 = g.new_value("q8", Some(ValueType::tensor_of(to, &dims(&c.shape)))).unwrap();
        g.add_node(Node::new("Cast", "cast").with_attr("to", Attr::Int(to.onnx_code() as i64)).with_inputs([q]).with_outputs([q8])).unwrap();
        outs[0] = q8;
    }
    g.set_outputs(outs).unwrap();
    Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: c.opset }], graph: g, ..Default::default() }
}

fn run_qforge(m: &Model, inputs: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    Session::new(m).unwrap().run(inputs.to_vec()).unwrap()
}

fn check(c: &Case, seed: u64, dir: &Path) -> usize {
    let mut rng = Rng::new(seed);
    let ss = scale_shape(&c.shape, c.gran);
    let count: usize = ss.iter().product();
    let (s, z) = qparams(c.dtype, count, &mut rng);
    let idx = param_index(&c.shape, c.gran);
    let huge = match c.gran {
        Gran::Tensor => true,
        Gran::Axis(_) => !matches!(c.dtype, DType::U4 | DType::I4),
        Gran::Block(..) => false,
    };
    let x = data(idx.len(), |i| (s[idx[i]], z[idx[i]]), c.dtype, huge, &mut rng);
    let scale = Tensor::from_vec(&ss, s).unwrap();
    let zp = int_tensor(c.dtype, &ss, &z);
    let inputs = vec![("x".to_string(), Tensor::from_vec(&c.shape, x.clone()).unwrap())];
    let ours = run_qforge(&model(c, &scale, &zp, false), &inputs);
    let path = dir.join(format!("{seed}.onnx"));
    qforge_onnx::save(&model(c, &scale, &zp, true), &path).unwrap();
    let theirs = ort_run(&path, &inputs, 1);
    let what = format!("{:?} {:?} {:?} opset {}", c.dtype, c.gran, c.shape, c.opset);
    assert_eq!(ours[0].1.dtype(), c.dtype, "{what}");
    assert_eq!(ours[0].1.shape(), c.shape.as_slice(), "{what}");
    let (qa, qb) = (ints(&ours[0].1), ints(&theirs[0].1));
    let (ya, yb) = (ours[1].1.as_slice::<f32>().unwrap(), theirs[1].1.as_slice::<f32>().unwrap());
    assert_eq!(qa.len(), qb.len(), "{what}");
    assert_eq!(ya.len(), yb.len(), "{what}");
    for i in 0..qa.len() {
        assert_eq!(qa[i], qb[i], "{what}: q[{i}] of x = {:e} (bits {:#x})", x[i], x[i].to_bits());
        assert_eq!(ya[i].to_bits(), yb[i].to_bits(), "{what}: y[{i}] {} vs {}", ya[i], yb[i]);
    }
    let (lo, hi) = range(c.dtype);
    let saturated = qa.iter().filter(|&&v| v == lo || v == hi).count();
    assert!(saturated > 0 && saturated < qa.len(), "{what}: the data does not exercise both saturation and the interior");
    qa.len()
}

#[test]
fn qdq_chains_match_onnx_runtime_bit_for_bit() {
    let tmp = TempDir::new("qdq");
    let mut cases = vec![];
    for dtype in [DType::U8, DType::I8, DType::U16, DType::I16, DType::U4, DType::I4] {
        cases.push(Case { dtype, gran: Gran::Tensor, shape: vec![2, 3, 50], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Axis(1), shape: vec![2, 5, 7, 3], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Axis(-1), shape: vec![6, 9], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Block(1, 4), shape: vec![3, 10, 5], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Block(-1, 3), shape: vec![4, 11], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Block(0, 16), shape: vec![40, 3], opset: 21 });
    }
    for dtype in [DType::U8, DType::I8] {
        cases.push(Case { dtype, gran: Gran::Tensor, shape: vec![257], opset: 10 });
        cases.push(Case { dtype, gran: Gran::Axis(0), shape: vec![4, 33], opset: 13 });
    }
    for dtype in [DType::U8, DType::I4] {
        cases.push(Case { dtype, gran: Gran::Tensor, shape: vec![3, 50_001], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Axis(0), shape: vec![3, 50_001], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Axis(1), shape: vec![70_001, 2], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Block(1, 32), shape: vec![5, 40_000], opset: 21 });
        cases.push(Case { dtype, gran: Gran::Block(0, 32), shape: vec![40_000, 3], opset: 21 });
    }
    let mut total = 0;
    for (i, c) in cases.iter().enumerate() {
        total += check(c, i as u64 + 1, tmp.path());
    }
    println!("{} cases, {total} elements, bit-identical to ONNX Runtime", cases.len());
}

#[test]
fn huge_values_saturate_as_the_spec_says() {
    for (dtype, gran) in [DType::U8, DType::I8, DType::I16, DType::U4, DType::I4].into_iter().map(|d| (d, Gran::Block(1, 2)))
        .chain([(DType::U4, Gran::Axis(0)), (DType::I4, Gran::Axis(0))]) {
        let c = Case { dtype, gran, shape: vec![2, 4], opset: 21 };
        let (lo, hi) = range(dtype);
        let zero = if lo < 0 { -1 } else { 1 };
        let ss = scale_shape(&c.shape, gran);
        let scale = Tensor::from_vec(&ss, [0.5f32, 3.0, 1e-3, 7.0][..ss.iter().product::<usize>()].to_vec()).unwrap();
        let zp = int_tensor(dtype, &ss, &vec![zero; ss.iter().product()]);
        let x = vec![1e30f32, -1e30, f32::INFINITY, f32::NEG_INFINITY, 3e9, -3e9, f32::MAX, -f32::MAX];
        let out = run_qforge(&model(&c, &scale, &zp, false), &[("x".into(), Tensor::from_vec(&[2, 4], x).unwrap())]);
        assert_eq!(ints(&out[0].1), [hi, lo, hi, lo, hi, lo, hi, lo], "{dtype:?} {gran:?}");
    }
}

#[test]
fn int32_dequantization_matches_onnx_runtime() {
    let tmp = TempDir::new("dq32");
    let shape = [3usize, 4, 5];
    let mut rng = Rng::new(99);
    let x: Vec<i32> = (0..60).map(|i| match i % 4 {
        0 => rng.next() as i32,
        1 => i32::MAX - (rng.next() % 100) as i32,
        2 => i32::MIN + (rng.next() % 100) as i32,
        _ => (rng.next() % 20000) as i32 - 10000,
    }).collect();
    let mut g = Graph::new("dq32");
    let xi = g.add_input("x", Some(ValueType::tensor_of(DType::I32, &[3, 4, 5]))).unwrap();
    let s = g.add_initializer("scale", Tensor::from_vec(&[4], vec![0.037f32, 1e-5, 3.3, 2.0]).unwrap()).unwrap();
    let y = g.new_value("y", Some(ValueType::tensor_of(DType::F32, &[3, 4, 5]))).unwrap();
    g.add_node(Node::new("DequantizeLinear", "dq").with_attr("axis", Attr::Int(1)).with_inputs([xi, s]).with_outputs([y])).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let m = Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: 21 }], graph: g, ..Default::default() };
    let inputs = vec![("x".to_string(), Tensor::from_vec(&shape, x).unwrap())];
    let ours = run_qforge(&m, &inputs);
    let path = tmp.path().join("dq32.onnx");
    qforge_onnx::save(&m, &path).unwrap();
    let theirs = ort_run(&path, &inputs, 1);
    let (a, b) = (ours[0].1.as_slice::<f32>().unwrap(), theirs[0].1.as_slice::<f32>().unwrap());
    assert_eq!(a.len(), 60);
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        assert_eq!(p.to_bits(), q.to_bits(), "y[{i}]: {p} vs {q}");
    }
}

/// A node test's model, its first data set's inputs and its first expected output.
fn node_test(name: &str) -> (Model, Vec<(String, Tensor)>, Tensor) {
    let dir = cache().join("node-tests").join(name);
    let model = qforge_onnx::load(&dir.join("model.onnx")).unwrap();
    let read = |f: &str| qforge_onnx::tensor_from_proto_bytes(&std::fs::read(dir.join("test_data_set_0").join(f)).unwrap()).unwrap().1;
    let names: Vec<String> = model.graph.inputs().iter().map(|v| model.graph.value_name(*v)).collect();
    let inputs = names.iter().enumerate().map(|(i, n)| (n.clone(), read(&format!("input_{i}.pb")))).collect();
    (model, inputs, read("output_0.pb"))
}

/// The 2-bit QuantizeLinear node tests, compared byte for byte (the shared node-test runner
/// cannot widen 2-bit tensors).
#[test]
fn two_bit_node_tests_match_byte_for_byte() {
    for name in ["test_quantizelinear_int2", "test_quantizelinear_uint2"] {
        let (model, inputs, want) = node_test(name);
        let got = run_qforge(&model, &inputs);
        assert!(matches!(want.dtype(), DType::I2 | DType::U2), "{name}");
        assert_eq!((got[0].1.dtype(), got[0].1.shape()), (want.dtype(), want.shape()), "{name}");
        assert_eq!(got[0].1.raw_bytes(), want.raw_bytes(), "{name}");
    }
}

#[test]
fn float8_is_refused_clearly() {
    for name in ["test_quantizelinear_e4m3fn", "test_dequantizelinear_e5m2"] {
        let (model, inputs, _) = node_test(name);
        let err = Session::new(&model).and_then(|s| s.run(inputs)).unwrap_err().to_string();
        assert!(err.contains("float8") && err.contains("not supported"), "{name}: {err}");
    }
}
