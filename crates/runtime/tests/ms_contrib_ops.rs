//! ONNX Runtime's contrib operators that its transformer optimizer emits (`com.microsoft`
//! Gelu, BiasGelu, FastGelu, QuickGelu, FusedMatMul, SkipLayerNormalization,
//! SkipSimplifiedLayerNormalization, EmbedLayerNormalization, Attention, MultiHeadAttention,
//! RotaryEmbedding; ONNX Runtime's SimplifiedLayerNormalization and pre-17 LayerNormalization
//! of the default domain) agree with ONNX Runtime's CPU kernels within [`RTOL`] relative and
//! [`ATOL`] absolute on random inputs covering their attributes, optional inputs and
//! optional outputs; the packed MultiHeadAttention forms, which ONNX Runtime's CPU kernel
//! refuses, agree with ONNX Runtime on the unpacked equivalent. Bad inputs are errors naming
//! what is wrong, never panics.

mod common;

use common::{expect_err, f32s, run, run_ms};
use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, ValueType, MS_DOMAIN};
use qforge_runtime::Session;
use qforge_testkit::{compare, noise, ort_run_with, TempDir};

/// Relative tolerance against ONNX Runtime.
const RTOL: f64 = 1e-4;
/// Absolute tolerance against ONNX Runtime (for values near zero).
const ATOL: f64 = 1e-5;

/// Uniform random f32 values in `[lo, hi)` of `shape`.
fn rand(shape: &[usize], seed: u64, lo: f32, hi: f32) -> Tensor {
    Tensor::from_vec(shape, noise(seed, shape.iter().product(), lo, hi)).unwrap()
}

fn i32s(shape: &[usize], v: &[i32]) -> Tensor {
    Tensor::from_vec(shape, v.to_vec()).unwrap()
}

fn i64t(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::from_vec(shape, v.to_vec()).unwrap()
}

/// One node: op type, domain, inputs (`None` omits one) and attributes.
#[derive(Clone)]
struct Op {
    op: &'static str,
    domain: &'static str,
    inputs: Vec<Option<Tensor>>,
    attrs: Vec<(&'static str, Attr)>,
}

fn ms(op: &'static str, inputs: Vec<Option<Tensor>>, attrs: Vec<(&'static str, Attr)>) -> Op {
    Op { op, domain: MS_DOMAIN, inputs, attrs }
}

fn onnx(op: &'static str, inputs: Vec<Option<Tensor>>, attrs: Vec<(&'static str, Attr)>) -> Op {
    Op { op, domain: "", inputs, attrs }
}

/// One model's graph and its feeds.
struct Side {
    g: Graph,
    feeds: Vec<(String, Tensor)>,
}

impl Side {
    fn new() -> Side {
        Side { g: Graph::new("g"), feeds: vec![] }
    }
    /// Adds `op` as case `case`, its outputs named `c{case}_y{k}` where `wanted[k]`.
    fn add(&mut self, case: usize, op: Op, wanted: &[bool]) {
        let mut inputs = vec![];
        for (i, t) in op.inputs.into_iter().enumerate() {
            inputs.push(t.map(|t| {
                let name = format!("c{case}_x{i}");
                let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
                let v = self.g.add_input(&name, Some(ValueType::tensor_of(t.dtype(), &dims))).unwrap();
                self.feeds.push((name, t));
                v
            }));
        }
        let outs: Vec<_> = wanted.iter().enumerate().map(|(k, &w)| w.then(|| self.g.new_value(format!("c{case}_y{k}"), None).unwrap())).collect();
        let mut node = Node::new(op.op, format!("node{case}"));
        node.domain = op.domain.to_string();
        node.inputs = inputs;
        node.outputs = outs.clone();
        for (k, v) in op.attrs {
            node = node.with_attr(k, v);
        }
        self.g.add_node(node).unwrap();
        let mut all: Vec<_> = self.g.outputs().to_vec();
        all.extend(outs.into_iter().flatten());
        self.g.set_outputs(all).unwrap();
    }
    fn model(self, opset: i64) -> (Model, Vec<(String, Tensor)>) {
        let opsets = vec![OpsetImport { domain: String::new(), version: opset }, OpsetImport { domain: MS_DOMAIN.into(), version: 1 }];
        (Model { ir_version: 8, opset_imports: opsets, graph: self.g, ..Default::default() }, self.feeds)
    }
}

/// Single-node cases run side by side: qforge runs its model, ONNX Runtime (CPU, graph
/// optimizations off) its own, whose nodes are the same except where a `pair` gives
/// ONNX Runtime an equivalent form.
struct Suite {
    name: &'static str,
    opset: i64,
    ours: Side,
    theirs: Side,
    labels: Vec<String>,
}

impl Suite {
    fn new(name: &'static str, opset: i64) -> Suite {
        Suite { name, opset, ours: Side::new(), theirs: Side::new(), labels: vec![] }
    }
    fn case(&mut self, label: &str, op: Op, wanted: &[bool]) {
        self.pair(label, op.clone(), op, wanted);
    }
    fn pair(&mut self, label: &str, ours: Op, theirs: Op, wanted: &[bool]) {
        let case = self.labels.len();
        self.ours.add(case, ours, wanted);
        self.theirs.add(case, theirs, wanted);
        self.labels.push(label.to_string());
    }
    /// Runs both models and asserts every output agrees; prints the largest difference of
    /// each case.
    fn check(self) {
        let (ours_model, ours_feeds) = self.ours.model(self.opset);
        let (theirs_model, theirs_feeds) = self.theirs.model(self.opset);
        let session = Session::new(&ours_model).unwrap_or_else(|e| panic!("{}: {e}", self.name));
        let ours = session.run(ours_feeds).unwrap_or_else(|e| panic!("{}: {e}", self.name));
        let dir = TempDir::new(self.name);
        let path = dir.path().join("m.onnx");
        qforge_onnx::save(&theirs_model, &path).unwrap();
        let theirs = ort_run_with(&path, &theirs_feeds, 1, false);
        let mut worst_all = 0f64;
        for (name, t) in &ours {
            let case: usize = name[1..name.find('_').unwrap()].parse().unwrap();
            let label = format!("{} [{}] {}", self.name, self.labels[case], &name[name.find('_').unwrap() + 1..]);
            let (_, o) = theirs.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("{label}: ONNX Runtime gave no {name}"));
            assert_eq!(t.dtype(), o.dtype(), "{label}: dtype");
            assert_eq!(t.shape(), o.shape(), "{label}: shape");
            let (worst, ok) = compare(t, o, RTOL, ATOL);
            let scale = o.to_f64_vec().unwrap().iter().fold(0f64, |m, v| m.max(v.abs()));
            println!("{label}: max |qforge - ORT| = {worst:.3e} (max |ORT| {scale:.3})");
            assert!(ok, "{label}: differs from ONNX Runtime by up to {worst:e}");
            worst_all = worst_all.max(worst);
        }
        println!("{}: {} outputs of {} cases agree, max |diff| {worst_all:.3e}", self.name, ours.len(), self.labels.len());
    }
}

#[test]
fn gelu_activations_match_onnx_runtime() {
    let mut s = Suite::new("gelu", 17);
    let x = |seed| Some(rand(&[2, 5, 48], seed, -5.0, 5.0));
    let bias = |seed| Some(rand(&[48], seed, -1.0, 1.0));
    s.case("Gelu", ms("Gelu", vec![x(1)], vec![]), &[true]);
    s.case("BiasGelu", ms("BiasGelu", vec![x(2), bias(3)], vec![]), &[true]);
    s.case("FastGelu", ms("FastGelu", vec![x(4)], vec![]), &[true]);
    s.case("FastGelu bias", ms("FastGelu", vec![x(5), bias(6)], vec![]), &[true]);
    s.case("FastGelu 1-D", ms("FastGelu", vec![Some(rand(&[37], 7, -6.0, 6.0)), Some(rand(&[37], 8, -1.0, 1.0))], vec![]), &[true]);
    s.case("QuickGelu", ms("QuickGelu", vec![x(9)], vec![]), &[true]);
    s.case("QuickGelu alpha", ms("QuickGelu", vec![x(10)], vec![("alpha", Attr::Float(1.25))]), &[true]);
    s.case("QuickGelu negative alpha", ms("QuickGelu", vec![x(11)], vec![("alpha", Attr::Float(-0.5))]), &[true]);
    s.check();
}

#[test]
fn fused_matmul_matches_onnx_runtime() {
    let mut s = Suite::new("fused_matmul", 17);
    // (A's shape, B's shape, [transA, transB, transBatchA, transBatchB], alpha)
    type Case = (&'static [usize], &'static [usize], [i64; 4], f32);
    let cases: [Case; 10] = [
        (&[2, 3, 4], &[2, 4, 5], [0, 0, 0, 0], 1.0),
        (&[2, 4, 3], &[2, 4, 5], [1, 0, 0, 0], 0.5),
        (&[2, 3, 4], &[2, 5, 4], [0, 1, 0, 0], 0.125),
        (&[2, 4, 3], &[2, 5, 4], [1, 1, 0, 0], -2.0),
        (&[3, 2, 4], &[2, 4, 5], [0, 0, 1, 0], 1.0),
        (&[3, 2, 4], &[5, 2, 4], [0, 1, 1, 1], 0.7),
        (&[4, 2, 3], &[4, 2, 5], [1, 0, 1, 1], 1.5),
        (&[2, 1, 3, 4], &[3, 4, 5], [0, 0, 0, 0], 0.3),
        (&[3, 4], &[4], [0, 0, 0, 0], 2.0),
        (&[4], &[5, 4], [1, 1, 0, 0], 0.25),
    ];
    for (i, (a, b, [ta, tb, tba, tbb], alpha)) in cases.into_iter().enumerate() {
        let attrs = vec![("transA", Attr::Int(ta)), ("transB", Attr::Int(tb)), ("transBatchA", Attr::Int(tba)), ("transBatchB", Attr::Int(tbb)), ("alpha", Attr::Float(alpha))];
        let label = format!("{a:?} x {b:?} trans {ta}{tb} batch {tba}{tbb} alpha {alpha}");
        s.case(&label, ms("FusedMatMul", vec![Some(rand(a, 20 + i as u64, -1.0, 1.0)), Some(rand(b, 40 + i as u64, -1.0, 1.0))], attrs), &[true]);
    }
    s.check();
}

#[test]
fn skip_layer_normalizations_match_onnx_runtime() {
    let mut s = Suite::new("skip_layer_norm", 17);
    let (b, seq, h) = (2, 5, 64);
    let x = |seed| Some(rand(&[b, seq, h], seed, -3.0, 3.0));
    let p = |seed| Some(rand(&[h], seed, -1.5, 1.5));
    let eps = || vec![("epsilon", Attr::Float(1e-5))];
    let all = [true; 4];
    s.case("all inputs and outputs", ms("SkipLayerNormalization", vec![x(1), x(2), p(3), p(4), p(5)], eps()), &all);
    s.case("gamma only, default epsilon", ms("SkipLayerNormalization", vec![x(6), x(7), p(8)], vec![]), &[true, false, false, true]);
    s.case("2-D skip", ms("SkipLayerNormalization", vec![x(9), Some(rand(&[seq, h], 10, -3.0, 3.0)), p(11), p(12)], eps()), &[true, true, true, false]);
    s.case("[1, S, H] skip, bias without beta", ms("SkipLayerNormalization", vec![x(13), Some(rand(&[1, seq, h], 14, -3.0, 3.0)), p(15), None, p(16)], eps()), &all);
    s.case("2-D input", ms("SkipLayerNormalization", vec![Some(rand(&[7, h], 17, -2.0, 2.0)), Some(rand(&[7, h], 18, -2.0, 2.0)), p(19), p(20), p(21)], eps()), &all);
    s.case("shifted rows", ms("SkipLayerNormalization", vec![Some(rand(&[b, seq, h], 22, 40.0, 44.0)), x(23), p(24), p(25)], eps()), &[true, true, true, false]);
    s.case("simplified", ms("SkipSimplifiedLayerNormalization", vec![x(26), x(27), p(28)], eps()), &all);
    s.case("simplified bias", ms("SkipSimplifiedLayerNormalization", vec![x(29), x(30), p(31), p(32)], eps()), &all);
    s.case("simplified 2-D skip", ms("SkipSimplifiedLayerNormalization", vec![x(33), Some(rand(&[seq, h], 34, -3.0, 3.0)), p(35)], vec![]), &[true, false, true, true]);
    s.check();
}

#[test]
fn default_domain_layer_normalizations_match_onnx_runtime() {
    // ONNX Runtime's own SimplifiedLayerNormalization, and LayerNormalization at opset 13
    // (before ONNX had it), both in the default domain as its optimizer emits them.
    let mut s = Suite::new("default_domain_norms", 13);
    let x = |seed| Some(rand(&[2, 3, 40], seed, -2.0, 2.0));
    s.case("SimplifiedLayerNormalization", onnx("SimplifiedLayerNormalization", vec![x(1), Some(rand(&[40], 2, -1.0, 1.0))], vec![("epsilon", Attr::Float(1e-6))]), &[true, true]);
    s.case("SimplifiedLayerNormalization axis 1", onnx("SimplifiedLayerNormalization", vec![x(3), Some(rand(&[3, 40], 4, -1.0, 1.0))], vec![("axis", Attr::Int(1))]), &[true, true]);
    s.case("SimplifiedLayerNormalization output only", onnx("SimplifiedLayerNormalization", vec![x(5), Some(rand(&[40], 6, -1.0, 1.0))], vec![]), &[true]);
    s.case("LayerNormalization opset 13", onnx("LayerNormalization", vec![x(7), Some(rand(&[40], 8, -1.0, 1.0)), Some(rand(&[40], 9, -1.0, 1.0))], vec![("epsilon", Attr::Float(1e-12))]), &[true, true, true]);
    s.check();
}

#[test]
fn embed_layer_normalization_matches_onnx_runtime() {
    let mut s = Suite::new("embed_layer_norm", 17);
    let (b, seq, h, vocab, positions) = (3, 6, 32, 50, 10);
    let ids = |seed: u64, n: i64| {
        let mut r = qforge_testkit::Rng::new(seed);
        i32s(&[b, seq], &(0..b * seq).map(|_| r.int(0, n - 1) as i32).collect::<Vec<_>>())
    };
    let word = || Some(rand(&[vocab, h], 1, -1.0, 1.0));
    let pos = || Some(rand(&[positions, h], 2, -1.0, 1.0));
    let seg = || Some(rand(&[3, h], 3, -1.0, 1.0));
    let (gamma, beta) = (|| Some(rand(&[h], 4, 0.5, 1.5)), || Some(rand(&[h], 5, -0.5, 0.5)));
    let mask = i32s(&[b, seq], &[1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0]);
    let eps = || vec![("epsilon", Attr::Float(1e-5))];
    let all = [true; 3];
    s.case("segments, mask", ms("EmbedLayerNormalization", vec![Some(ids(6, vocab as i64)), Some(ids(7, 3)), word(), pos(), seg(), gamma(), beta(), Some(mask.clone())], eps()), &all);
    s.case("no segments, no mask, default epsilon", ms("EmbedLayerNormalization", vec![Some(ids(8, vocab as i64)), None, word(), pos(), None, gamma(), beta()], vec![]), &all);
    let position_ids = i32s(&[b, seq], &(0..b * seq).map(|i| ((i * 7 + 3) % positions) as i32).collect::<Vec<_>>());
    s.case("position ids [B, S]", ms("EmbedLayerNormalization", vec![Some(ids(9, vocab as i64)), Some(ids(10, 3)), word(), pos(), seg(), gamma(), beta(), Some(mask), Some(position_ids)], eps()), &all);
    s.case("position ids [1, S]", ms("EmbedLayerNormalization", vec![Some(ids(11, vocab as i64)), None, word(), pos(), None, gamma(), beta(), None, Some(i32s(&[1, seq], &[9, 8, 0, 1, 5, 5]))], eps()), &[true, true, false]);
    s.check();
}

/// The weights, bias and input of a packed-QKV `Attention` of hidden sizes `dq` (Q and K) and
/// `dv` over `d_in` input features.
fn attention_inputs(seed: u64, b: usize, seq: usize, d_in: usize, dq: usize, dv: usize) -> Vec<Option<Tensor>> {
    let cols = 2 * dq + dv;
    vec![Some(rand(&[b, seq, d_in], seed, -1.0, 1.0)), Some(rand(&[d_in, cols], seed + 1, -0.5, 0.5)), Some(rand(&[cols], seed + 2, -0.5, 0.5))]
}

#[test]
fn attention_matches_onnx_runtime() {
    let mut s = Suite::new("attention", 17);
    let (b, seq, d, n) = (2, 5, 32, 4);
    let heads = || vec![("num_heads", Attr::Int(n as i64))];
    let with = |mut v: Vec<Option<Tensor>>, extra: Vec<Option<Tensor>>| {
        v.extend(extra);
        v
    };
    let causal = || vec![("num_heads", Attr::Int(n as i64)), ("unidirectional", Attr::Int(1))];
    s.case("no mask", ms("Attention", attention_inputs(1, b, seq, d, d, d), heads()), &[true]);
    s.case("key lengths [B]", ms("Attention", with(attention_inputs(4, b, seq, d, d, d), vec![Some(i32s(&[b], &[3, 5]))]), heads()), &[true]);
    s.case("key ends and starts [2B]", ms("Attention", with(attention_inputs(7, b, seq, d, d, d), vec![Some(i32s(&[2 * b], &[4, 5, 1, 2]))]), heads()), &[true]);
    let mask2 = i32s(&[b, seq], &[1, 1, 0, 1, 0, 0, 1, 1, 1, 1]);
    s.case("0/1 mask [B, T]", ms("Attention", with(attention_inputs(10, b, seq, d, d, d), vec![Some(mask2.clone())]), heads()), &[true]);
    s.case("dummy mask [B, 1]", ms("Attention", with(attention_inputs(13, b, seq, d, d, d), vec![Some(i32s(&[b, 1], &[0, 1]))]), heads()), &[true]);
    let mut r = qforge_testkit::Rng::new(16);
    let mask3: Vec<i32> = (0..b * seq * seq).map(|i| if i % 7 == 0 { 1 } else { r.int(0, 1) as i32 }).collect();
    s.case("0/1 mask [B, S, T]", ms("Attention", with(attention_inputs(17, b, seq, d, d, d), vec![Some(i32s(&[b, seq, seq], &mask3))]), heads()), &[true]);
    s.case("fully masked rows", ms("Attention", with(attention_inputs(20, b, seq, d, d, d), vec![Some(i32s(&[b, seq], &[0; 10]))]), heads()), &[true]);
    s.case("unidirectional", ms("Attention", attention_inputs(23, b, seq, d, d, d), causal()), &[true]);
    s.case("unidirectional, [B, T] mask", ms("Attention", with(attention_inputs(26, b, seq, d, d, d), vec![Some(mask2.clone())]), causal()), &[true]);
    let mut attrs = heads();
    attrs.extend([("mask_filter_value", Attr::Float(-3.0)), ("scale", Attr::Float(0.3))]);
    s.case("mask_filter_value, scale", ms("Attention", with(attention_inputs(29, b, seq, d, d, d), vec![Some(i32s(&[b], &[2, 4]))]), attrs), &[true]);
    let mut attrs = heads();
    attrs.push(("qkv_hidden_sizes", Attr::Ints(vec![16, 16, 48])));
    s.case("qkv_hidden_sizes, input wider than Q", ms("Attention", attention_inputs(32, b, seq, 40, 16, 48), attrs), &[true]);
    let past = Some(rand(&[2, b, n, 3, d / n], 35, -1.0, 1.0));
    s.case("past and present", ms("Attention", with(attention_inputs(36, b, seq, d, d, d), vec![None, past.clone()]), heads()), &[true, true]);
    let mask_t = i32s(&[b, seq + 3], &[1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1]);
    s.case("past, unidirectional, [B, T] mask", ms("Attention", with(attention_inputs(39, b, seq, d, d, d), vec![Some(mask_t), past.clone()]), causal()), &[true, true]);
    s.case("past, one new token, unidirectional", ms("Attention", with(attention_inputs(42, b, 1, d, d, d), vec![None, past]), causal()), &[true, true]);
    s.case("present without past", ms("Attention", attention_inputs(45, b, seq, d, d, d), heads()), &[true, true]);
    let bias_b = Some(rand(&[b, 1, seq, seq], 48, -2.0, 2.0));
    s.case("attention_bias [B, 1, S, T], mask", ms("Attention", with(attention_inputs(49, b, seq, d, d, d), vec![Some(mask2), None, bias_b]), heads()), &[true]);
    let bias_n = Some(rand(&[1, n, seq, seq], 52, -2.0, 2.0));
    s.case("attention_bias [1, N, S, T]", ms("Attention", with(attention_inputs(53, b, seq, d, d, d), vec![None, None, bias_n]), heads()), &[true]);
    s.check();
}

/// A MultiHeadAttention case's tensors: query `[B, S, D]`, key `[B, L, D]`, value
/// `[B, L, D_v]`, bias.
struct Mha {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
}

impl Mha {
    fn new(seed: u64, b: usize, seq: usize, kv_seq: usize, d: usize, dv: usize) -> Mha {
        Mha {
            q: rand(&[b, seq, d], seed, -1.0, 1.0),
            k: rand(&[b, kv_seq, d], seed + 1, -1.0, 1.0),
            v: rand(&[b, kv_seq, dv], seed + 2, -1.0, 1.0),
            bias: rand(&[2 * d + dv], seed + 3, -0.5, 0.5),
        }
    }
}

/// `[B, L, N · H]` split into heads and stacked along a new axis of size `parts` after the
/// heads: `[B, L, N, parts, H]`, part `j` from `xs[j]`.
fn pack(xs: &[&Tensor], heads: usize) -> Tensor {
    let s = xs[0].shape();
    let (b, l, d) = (s[0], s[1], s[2]);
    let h = d / heads;
    let vals: Vec<&[f32]> = xs.iter().map(|x| x.as_slice::<f32>().unwrap()).collect();
    let mut out = Vec::with_capacity(b * l * d * xs.len());
    for t in 0..b * l {
        for n in 0..heads {
            for v in &vals {
                out.extend_from_slice(&v[t * d + n * h..t * d + (n + 1) * h]);
            }
        }
    }
    Tensor::from_vec(&[b, l, heads, xs.len(), h], out).unwrap()
}

/// `[B, L, N · H]` as `[B, N, L, H]`.
fn to_bnsh(x: &Tensor, heads: usize) -> Tensor {
    let s = x.shape();
    let (b, l, d) = (s[0], s[1], s[2]);
    let h = d / heads;
    let v = x.as_slice::<f32>().unwrap();
    let mut out = Vec::with_capacity(v.len());
    for bi in 0..b {
        for n in 0..heads {
            for t in 0..l {
                out.extend_from_slice(&v[(bi * l + t) * d + n * h..(bi * l + t) * d + (n + 1) * h]);
            }
        }
    }
    Tensor::from_vec(&[b, heads, l, h], out).unwrap()
}

#[test]
fn multi_head_attention_matches_onnx_runtime() {
    let mut s = Suite::new("multi_head_attention", 17);
    let (b, seq, d, n) = (2, 4, 32, 4);
    let heads = || vec![("num_heads", Attr::Int(n as i64))];
    let causal = || vec![("num_heads", Attr::Int(n as i64)), ("unidirectional", Attr::Int(1))];
    let mha = |ins: Vec<Option<Tensor>>, attrs| ms("MultiHeadAttention", ins, attrs);
    let m = Mha::new(1, b, seq, seq, d, d);
    s.case("Q, K, V, bias", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias)], heads()), &[true]);
    let m = Mha::new(5, b, seq, 7, d, 48);
    s.case("cross attention L != S, D_v != D, no bias", mha(vec![Some(m.q), Some(m.k), Some(m.v)], heads()), &[true]);
    let m = Mha::new(9, b, seq, 6, d, d);
    s.case("key lengths [B]", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), Some(i32s(&[b], &[6, 2]))], heads()), &[true]);
    let m = Mha::new(13, b, seq, 6, d, d);
    let mask2 = i32s(&[b, 6], &[1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1]);
    s.case("key_padding_mask [B, T]", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), Some(mask2)], heads()), &[true]);
    let m = Mha::new(17, b, seq, 6, d, d);
    let mask3 = i32s(&[b, seq, 6], &(0..b * seq * 6).map(|i| ((i * 5 + 1) % 3 != 0) as i32).collect::<Vec<_>>());
    let mut attrs = heads();
    attrs.extend([("mask_filter_value", Attr::Float(-50.0)), ("scale", Attr::Float(0.2))]);
    s.case("key_padding_mask [B, S, T], scale", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), Some(mask3)], attrs), &[true]);
    let m = Mha::new(21, b, seq, seq, d, d);
    s.case("unidirectional", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias)], causal()), &[true]);
    let m = Mha::new(25, b, seq, seq, d, d);
    let ab = rand(&[b, 1, seq, seq], 29, -2.0, 2.0);
    s.case("attention_bias [B, 1, S, T]", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), None, Some(ab)], heads()), &[true]);
    let m = Mha::new(30, b, seq, seq, d, d);
    let (pk, pv) = (rand(&[b, n, 3, d / n], 34, -1.0, 1.0), rand(&[b, n, 3, d / n], 35, -1.0, 1.0));
    s.case("past and present", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), None, None, Some(pk.clone()), Some(pv.clone())], heads()), &[true, true, true]);
    let m = Mha::new(36, b, seq, seq, d, d);
    let mask_t = i32s(&[b, seq + 3], &[1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]);
    let ab = rand(&[1, n, seq, seq + 3], 40, -1.0, 1.0);
    s.case("past, unidirectional, mask, attention_bias [1, N, S, T]", mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), Some(mask_t), Some(ab), Some(pk), Some(pv)], causal()), &[true, true, true]);
    let m = Mha::new(41, b, seq, 5, d, d);
    s.case("key and value [B, N, L, H]", mha(vec![Some(m.q), Some(to_bnsh(&m.k, n)), Some(to_bnsh(&m.v, n))], heads()), &[true, true, true]);
    // The packed forms, which ONNX Runtime's CPU kernel refuses, against their unpacked
    // equivalents.
    let m = Mha::new(45, b, seq, seq, d, d);
    let packed = pack(&[&m.q, &m.k, &m.v], n);
    s.pair("packed QKV [B, S, N, 3, H]",
        mha(vec![Some(packed), None, None, Some(m.bias.clone())], causal()),
        mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias)], causal()), &[true]);
    let m = Mha::new(49, b, seq, 6, d, d);
    let packed = pack(&[&m.k, &m.v], n);
    let mask = i32s(&[b], &[5, 6]);
    s.pair("packed KV [B, L, N, 2, H]",
        mha(vec![Some(m.q.clone()), Some(packed), None, Some(m.bias.clone()), Some(mask.clone())], heads()),
        mha(vec![Some(m.q), Some(m.k), Some(m.v), Some(m.bias), Some(mask)], heads()), &[true]);
    s.check();
}

#[test]
fn rotary_embedding_matches_onnx_runtime() {
    let mut s = Suite::new("rotary_embedding", 17);
    let (b, seq, n, h, max_pos) = (2, 5, 3, 16, 12);
    let caches = |seed, half| (Some(rand(&[max_pos, half], seed, -1.0, 1.0)), Some(rand(&[max_pos, half], seed + 1, -1.0, 1.0)));
    let pos_bs = i64t(&[b, seq], &[0, 1, 2, 3, 4, 7, 6, 5, 11, 0]);
    let rot = |ins, attrs| ms("RotaryEmbedding", ins, attrs);
    let (c, sn) = caches(1, h / 2);
    s.case("3-D, position ids [B, S]", rot(vec![Some(rand(&[b, seq, n * h], 3, -2.0, 2.0)), Some(pos_bs.clone()), c, sn], vec![]), &[true]);
    let (c, sn) = caches(4, h / 2);
    s.case("3-D interleaved, position offset", rot(vec![Some(rand(&[b, seq, n * h], 6, -2.0, 2.0)), Some(i64t(&[1], &[4])), c, sn], vec![("interleaved", Attr::Int(1)), ("num_heads", Attr::Int(n as i64))]), &[true]);
    let (c, sn) = caches(7, 3);
    s.case("partial rotary_embedding_dim", rot(vec![Some(rand(&[b, seq, n * h], 9, -2.0, 2.0)), Some(pos_bs.clone()), c, sn], vec![("num_heads", Attr::Int(n as i64)), ("rotary_embedding_dim", Attr::Int(6))]), &[true]);
    let (c, sn) = caches(10, 3);
    s.case("partial interleaved", rot(vec![Some(rand(&[b, seq, n * h], 12, -2.0, 2.0)), Some(i64t(&[], &[2])), c, sn], vec![("num_heads", Attr::Int(n as i64)), ("rotary_embedding_dim", Attr::Int(6)), ("interleaved", Attr::Int(1))]), &[true]);
    let (c, sn) = caches(13, h / 2);
    s.case("4-D [B, N, S, H]", rot(vec![Some(rand(&[b, n, seq, h], 15, -2.0, 2.0)), Some(pos_bs), c, sn], vec![]), &[true]);
    s.check();
}

fn zeros(shape: &[usize]) -> Option<Tensor> {
    f32s(shape, vec![0.0; shape.iter().product()])
}

fn ints32(shape: &[usize], v: i32) -> Option<Tensor> {
    Some(Tensor::from_vec(shape, vec![v; shape.iter().product()]).unwrap())
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    // Activations and FusedMatMul.
    expect_err(run_ms("BiasGelu", &[], vec![zeros(&[2, 8]), zeros(&[4])], 1), &["bias", "last dimension 8", "[4]"]);
    expect_err(run_ms("BiasGelu", &[], vec![zeros(&[2, 8])], 1), &["input 1 is required"]);
    expect_err(run_ms("FastGelu", &[], vec![zeros(&[2, 8]), zeros(&[2, 8])], 1), &["bias", "1-D"]);
    expect_err(run_ms("FusedMatMul", &[], vec![zeros(&[2, 3]), zeros(&[4, 5])], 1), &["do not align"]);
    expect_err(run_ms("FusedMatMul", &[("transBatchA", Attr::Int(1))], vec![zeros(&[2, 3, 4]), zeros(&[4, 5])], 1), &["transBatchA", "rank of at least 3"]);
    // Normalizations.
    let sln = |x: &[usize], skip: &[usize], g: usize| vec![zeros(x), zeros(skip), zeros(&[g])];
    expect_err(run_ms("SkipLayerNormalization", &[], sln(&[2, 3, 8], &[2, 4, 8], 8), 1), &["skip", "[2, 4, 8]"]);
    expect_err(run_ms("SkipLayerNormalization", &[], sln(&[2, 3, 8], &[2, 3, 8], 6), 1), &["gamma", "hidden size 8", "[6]"]);
    expect_err(run_ms("SkipLayerNormalization", &[], sln(&[8], &[8], 8), 1), &["input", "2-D or 3-D"]);
    let mut ins = sln(&[2, 3, 8], &[2, 3, 8], 8);
    ins.extend([None, zeros(&[3])]);
    expect_err(run_ms("SkipLayerNormalization", &[], ins, 1), &["bias", "[3]"]);
    expect_err(run_ms("SkipLayerNormalization", &[("epsilon", Attr::Float(-1.0))], sln(&[2, 3, 8], &[2, 3, 8], 8), 1), &["epsilon", "nonnegative"]);
    expect_err(run("SimplifiedLayerNormalization", 17, &[], vec![zeros(&[2, 8]), zeros(&[5])], 1), &["scale", "5 values", "8 normalized"]);
    // EmbedLayerNormalization.
    let eln = |ids: Option<Tensor>, word: &[usize], pos: &[usize]| vec![ids, None, zeros(word), zeros(pos), None, zeros(&[8]), zeros(&[8])];
    expect_err(run_ms("EmbedLayerNormalization", &[], eln(ints32(&[2, 3], 10), &[10, 8], &[4, 8]), 3), &["input_ids", "10", "10 rows of word_embedding"]);
    expect_err(run_ms("EmbedLayerNormalization", &[], eln(ints32(&[2, 3], -1), &[10, 8], &[4, 8]), 3), &["input_ids", "-1"]);
    expect_err(run_ms("EmbedLayerNormalization", &[], eln(ints32(&[2, 5], 1), &[10, 8], &[4, 8]), 3), &["sequence length 5", "4 rows of position_embedding"]);
    expect_err(run_ms("EmbedLayerNormalization", &[], eln(ints32(&[6], 1), &[10, 8], &[4, 8]), 3), &["input_ids", "2-D"]);
    expect_err(run_ms("EmbedLayerNormalization", &[], eln(ints32(&[2, 3], 1), &[10, 8], &[4, 6]), 3), &["position_embedding", "[rows, 8]", "[4, 6]"]);
    let mut ins = eln(ints32(&[2, 3], 1), &[10, 8], &[4, 8]);
    ins[1] = ints32(&[2, 3], 0);
    expect_err(run_ms("EmbedLayerNormalization", &[], ins, 3), &["segment_ids and segment_embedding", "together"]);
    let mut ins = eln(ints32(&[2, 3], 1), &[10, 8], &[4, 8]);
    ins.push(ints32(&[2, 4], 1));
    expect_err(run_ms("EmbedLayerNormalization", &[], ins, 3), &["mask", "[2, 3]", "[2, 4]"]);
    // Attention.
    let heads = [("num_heads", Attr::Int(2))];
    let attn = |x: &[usize], w: &[usize], bias: usize| vec![zeros(x), zeros(w), zeros(&[bias])];
    expect_err(run_ms("Attention", &[], attn(&[1, 2, 8], &[8, 24], 24), 1), &["num_heads", "required"]);
    expect_err(run_ms("Attention", &heads, attn(&[1, 2, 8], &[6, 24], 24), 1), &["weights has 6 rows", "hidden size is 8"]);
    expect_err(run_ms("Attention", &heads, attn(&[1, 2, 8], &[8, 22], 22), 1), &["22 columns", "num_heads 2"]);
    expect_err(run_ms("Attention", &heads, attn(&[1, 2, 8], &[8, 24], 12), 1), &["bias", "[24]", "[12]"]);
    expect_err(run_ms("Attention", &heads, vec![zeros(&[1, 2, 8]), zeros(&[8, 24])], 1), &["input 2 is required"]);
    expect_err(run_ms("Attention", &heads, attn(&[2, 8], &[8, 24], 24), 1), &["input", "3-D"]);
    expect_err(run_ms("Attention", &[("num_heads", Attr::Int(2)), ("qkv_hidden_sizes", Attr::Ints(vec![8, 6, 8]))], attn(&[1, 2, 8], &[8, 22], 22), 1), &["qkv_hidden_sizes", "[8, 6, 8]"]);
    expect_err(run_ms("Attention", &[("num_heads", Attr::Int(2)), ("do_rotary", Attr::Int(1))], attn(&[1, 2, 8], &[8, 24], 24), 1), &["do_rotary", "not supported"]);
    let with_mask = |m: Option<Tensor>| {
        let mut v = attn(&[2, 3, 8], &[8, 24], 24);
        v.push(m);
        v
    };
    expect_err(run_ms("Attention", &heads, with_mask(ints32(&[3], 1)), 1), &["mask_index", "[2]", "[4]", "[2, 3]", "[2, 3, 3]", "got [3]"]);
    expect_err(run_ms("Attention", &heads, with_mask(ints32(&[2, 1, 3, 3], 1)), 1), &["4-D mask_index", "not supported"]);
    expect_err(run_ms("Attention", &heads, with_mask(Some(Tensor::from_vec(&[2, 3], vec![1.0f32; 6]).unwrap())), 1), &["mask_index", "int64", "got float"]);
    let mut ins = with_mask(None);
    ins.push(zeros(&[2, 2, 2, 4]));
    expect_err(run_ms("Attention", &heads, ins, 2), &["past", "[2, 2, 2, past_sequence, 4]", "got [2, 2, 2, 4]"]);
    let mut ins = with_mask(None);
    ins.extend([None, zeros(&[2, 2, 3, 4])]);
    expect_err(run_ms("Attention", &heads, ins, 1), &["attention_bias", "[2, 2, 3, 4]"]);
    // MultiHeadAttention.
    expect_err(run_ms("MultiHeadAttention", &heads, vec![zeros(&[2, 3, 8])], 1), &["key is required"]);
    expect_err(run_ms("MultiHeadAttention", &heads, vec![zeros(&[2, 3, 8]), zeros(&[2, 4, 8]), zeros(&[2, 5, 8])], 1), &["key and value must be", "[2, 4, 8]", "[2, 5, 8]"]);
    expect_err(run_ms("MultiHeadAttention", &heads, vec![zeros(&[2, 3, 7]), zeros(&[2, 4, 7]), zeros(&[2, 4, 7])], 1), &["hidden size 7", "num_heads 2"]);
    expect_err(run_ms("MultiHeadAttention", &heads, vec![zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), zeros(&[20])], 1), &["bias", "[24]", "[20]"]);
    expect_err(run_ms("MultiHeadAttention", &heads, vec![zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), None, ints32(&[8], 1)], 1), &["key_padding_mask", "got [8]"]);
    let ins = vec![zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), None, None, None, zeros(&[2, 2, 1, 4])];
    expect_err(run_ms("MultiHeadAttention", &heads, ins, 1), &["past_key and past_value", "together"]);
    let ins = vec![zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), None, None, None, zeros(&[2, 2, 1, 4]), zeros(&[2, 2, 2, 4])];
    expect_err(run_ms("MultiHeadAttention", &heads, ins, 3), &["past_key and past_value", "[2, 2, 1, 4]", "[2, 2, 2, 4]"]);
    expect_err(run_ms("MultiHeadAttention", &heads, vec![zeros(&[2, 3, 8]), zeros(&[2, 3, 8]), zeros(&[2, 3, 8])], 4), &["'qk' output", "not supported"]);
    // RotaryEmbedding.
    let rot = |x: &[usize], pos: Tensor, cache: &[usize]| vec![zeros(x), Some(pos), zeros(cache), zeros(cache)];
    expect_err(run_ms("RotaryEmbedding", &[], rot(&[1, 2, 8], i64t(&[1], &[3]), &[4, 2]), 1), &["position 4", "4 rows"]);
    expect_err(run_ms("RotaryEmbedding", &[], rot(&[1, 2, 8], i64t(&[1, 3], &[0, 1, 2]), &[4, 2]), 1), &["position_ids", "[1, 2]", "[1, 3]"]);
    expect_err(run_ms("RotaryEmbedding", &[], rot(&[1, 2, 6], i64t(&[1], &[0]), &[4, 4]), 1), &["hidden size 6", "heads of 8"]);
    expect_err(run_ms("RotaryEmbedding", &[("rotary_embedding_dim", Attr::Int(4))], rot(&[1, 2, 8], i64t(&[1], &[0]), &[4, 2]), 1), &["num_heads", "required"]);
    expect_err(run_ms("RotaryEmbedding", &[("num_heads", Attr::Int(2)), ("rotary_embedding_dim", Attr::Int(6))], rot(&[1, 2, 8], i64t(&[1], &[0]), &[4, 3]), 1), &["rotary_embedding_dim 6", "head size 4"]);
    expect_err(run_ms("RotaryEmbedding", &[], vec![zeros(&[1, 2, 8]), Some(i64t(&[1], &[0])), zeros(&[4, 4]), zeros(&[4, 3])], 1), &["cos_cache and sin_cache", "[4, 4]", "[4, 3]"]);
}
