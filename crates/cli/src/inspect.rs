//! `qforge inspect`: a model's interface, op histogram, parameters, subgraphs and runtime support.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use qforge_ir::{Attr, DType, Graph, Model, Node, ValueId};
use qforge_quant::pair_sums::{ReductionAxis, U8ChannelMaxima, FULL_REACH};
use qforge_quant::convert::MATMUL_NBITS_OPS;
use qforge_runtime::Registry;
use serde_json::{json, Value as Json};

fn describe_value(g: &Graph, v: ValueId) -> Json {
    let val = g.value(v).expect("graph interface values exist");
    let (dtype, shape) = match &val.ty {
        Some(t) => (
            t.elem().map(|d| d.onnx_name().to_string()),
            t.shape().map(|s| s.iter().map(|d| match d {
                qforge_ir::Dim::Known(k) => json!(k),
                qforge_ir::Dim::Sym(s) => json!(s),
                qforge_ir::Dim::Unknown => Json::Null,
            }).collect::<Vec<_>>()),
        ),
        None => (None, None),
    };
    json!({ "name": val.name, "dtype": dtype, "shape": shape })
}

/// Walks a graph and its subgraphs, counting ops, parameters and unsupported ops.
struct Walk<'a> {
    model: &'a Model,
    registry: &'a Registry,
    ops: BTreeMap<String, u64>,
    params: u64,
    param_bytes: u64,
    subgraphs: Vec<Json>,
    unsupported: BTreeMap<String, u64>,
}

/// For a node that multiplies u8 activations by constant s8 weights in ONNX Runtime's u8 x s8
/// kernels: the op whose reduction order the kernel follows, the integer weight and its zero
/// point (QDQ Conv/Gemm/MatMul reading both through DequantizeLinear, QLinearConv,
/// QLinearMatMul, ConvInteger, MatMulInteger, QGemm).
fn u8s8_operands(g: &Graph, n: &Node) -> Option<(&'static str, ValueId, ValueId, Option<ValueId>)> {
    let through_dq = |v: ValueId| -> Option<(ValueId, Option<ValueId>)> {
        let (p, _) = g.producer(v)?;
        let dq = g.node(p).ok()?;
        (dq.op_type == "DequantizeLinear").then(|| (dq.input(0), dq.input(2))).and_then(|(x, zp)| Some((x?, zp)))
    };
    let (op, x, w, w_zp) = match (n.domain.as_str(), n.op_type.as_str()) {
        ("", "Conv" | "Gemm" | "MatMul") => {
            let (x, _) = through_dq(n.input(0)?)?;
            let (w, w_zp) = through_dq(n.input(1)?)?;
            let op = match n.op_type.as_str() { "Conv" => "Conv", "Gemm" => "Gemm", _ => "MatMul" };
            (op, x, w, w_zp)
        }
        ("", "QLinearConv") => ("Conv", n.input(0)?, n.input(3)?, n.input(5)),
        ("", "QLinearMatMul") => ("MatMul", n.input(0)?, n.input(3)?, n.input(5)),
        ("", "ConvInteger") => ("Conv", n.input(0)?, n.input(1)?, n.input(3)),
        ("", "MatMulInteger") => ("MatMul", n.input(0)?, n.input(1)?, n.input(3)),
        ("com.microsoft", "QGemm") => ("Gemm", n.input(0)?, n.input(3)?, n.input(5)),
        _ => return None,
    };
    let constant = g.value(w).ok()?.initializer().is_some_and(|t| t.dtype() == DType::I8);
    let u8_activation = g.value(x).ok()?.ty.as_ref().and_then(|t| t.elem()) == Some(DType::U8);
    (constant && u8_activation).then_some((op, x, w, w_zp))
}

/// The [`MATMUL_NBITS_OPS`] nodes of `folded` ([`folded`]; subgraphs included) that ONNX
/// Runtime runs as `MatMulNBits`, quantizing their float activation at run time: they read a
/// float activation (not the output of a DequantizeLinear) and a weight dequantized from an 8-
/// or 4-bit initializer, and no QuantizeLinear reads their output. (ONNX Runtime also leaves
/// one unfused when its scale equals another node's initializer, which it merges.)
fn weight_only_matmuls(folded: &Model) -> Vec<Json> {
    let mut found = vec![];
    visit_nodes(folded, &mut |path, g, id, n| {
        if !(n.domain.is_empty() && MATMUL_NBITS_OPS.contains(&n.op_type.as_str())) {
            return;
        }
        let dequantized = |v: Option<ValueId>| v.and_then(|v| g.producer(v)).and_then(|(p, _)| g.node(p).ok()).filter(|p| p.op_type == "DequantizeLinear");
        let (Some(a), Some(dq)) = (n.input(0), dequantized(n.input(1))) else { return };
        let low_bit = dq.input(0).and_then(|w| g.value(w).ok()?.initializer().map(|t| t.dtype()))
            .is_some_and(|d| matches!(d, DType::I8 | DType::U8 | DType::I4 | DType::U4));
        let float_activation = dequantized(Some(a)).is_none() && g.value(a).ok().and_then(|v| v.ty.as_ref()?.elem()).is_none_or(|d| d == DType::F32);
        let quantized_output = n.output(0).is_some_and(|o| g.consumers(o).iter().any(|&(c, _)| g.node(c).is_ok_and(|c| c.op_type == "QuantizeLinear")));
        if low_bit && float_activation && !quantized_output {
            let weight = dq.input(0).map(|w| g.value_name(w)).unwrap_or_default();
            let node = if path.is_empty() { n.display_name(id) } else { format!("{path} > {}", n.display_name(id)) };
            found.push(json!({ "node": node, "op": n.op_type, "weight": weight }));
        }
    });
    found
}

/// The float value quantized into the u8 activation `x`: the input of the QuantizeLinear that
/// produces it, when one does.
fn quantized_from(g: &Graph, x: ValueId) -> Option<String> {
    let (p, _) = g.producer(x)?;
    let q = g.node(p).ok()?;
    (q.op_type == "QuantizeLinear").then(|| q.input(0)).flatten().map(|v| g.value_name(v).to_string())
}

impl Walk<'_> {
    fn count_tensor(&mut self, t: &qforge_ir::Tensor) {
        self.params += t.len() as u64;
        self.param_bytes += t.raw_bytes().map(|b| b.len() as u64).unwrap_or(0);
    }

    fn graph(&mut self, g: &Graph, path: &str) {
        for (_, v) in g.initializers() {
            self.count_tensor(v.initializer().unwrap());
        }
        for (id, n) in g.nodes() {
            let op = n.qualified_op();
            *self.ops.entry(op.clone()).or_default() += 1;
            let opset = self.model.opset(&n.domain).unwrap_or(0);
            if self.registry.lookup(&n.domain, &n.op_type, opset).is_none() {
                *self.unsupported.entry(format!("{op} (opset {opset})")).or_default() += 1;
            }
            if n.op_type == "Constant" && n.domain.is_empty() {
                if let Some(Attr::Tensor(t)) = n.attr("value") {
                    self.count_tensor(t);
                }
            }
            for (attr, sub) in n.subgraphs() {
                let here = format!("{}.{attr}", n.display_name(id));
                let sub_path = if path.is_empty() { here } else { format!("{path} > {here}") };
                self.subgraphs.push(json!({ "path": sub_path, "op": n.op_type, "nodes": sub.node_count() }));
                self.graph(sub, &sub_path);
            }
        }
    }
}

/// The u8 activation a u8 x s8 weight reads: its name, the float value quantized into it (the
/// input of the QuantizeLinear producing it, when one does), and where its channels are.
pub(crate) struct U8Activation {
    pub name: String,
    pub quantized_from: Option<String>,
    pub axis: ReductionAxis,
}

/// `model` with its constants folded (a weight quantized at run time, `QuantizeLinear` of a
/// float constant, becomes the integers it computes) and its types inferred: what the pair-sum
/// check reads.
pub(crate) fn folded(model: &Model) -> Model {
    let mut folded = model.clone();
    qforge_onnx::fold_constant_nodes(&mut folded);
    let opsets = folded.opset_imports.clone();
    if qforge_runtime::fold_constants(&mut folded.graph, &opsets, |n| n.op_type == "DequantizeLinear").is_err() {
        folded = model.clone();
    }
    qforge_ir::infer::infer_model(&mut folded);
    folded
}

/// Calls `f(path, graph, node id, node)` for every node of `model` and its subgraphs (`path`:
/// the owning nodes and attributes, `a.body > b.then_branch`; empty in the main graph).
fn visit_nodes(model: &Model, f: &mut dyn FnMut(&str, &Graph, qforge_ir::NodeId, &Node)) {
    let mut stack: Vec<(&Graph, String)> = vec![(&model.graph, String::new())];
    while let Some((g, path)) = stack.pop() {
        for (id, n) in g.nodes() {
            for (attr, sub) in n.subgraphs() {
                let here = format!("{}.{attr}", n.display_name(id));
                stack.push((sub, if path.is_empty() { here } else { format!("{path} > {here}") }));
            }
            f(&path, g, id, n);
        }
    }
}

/// Calls `f(path, graph, node id, node, (op, activation, weight, weight zero point))` for every
/// node of `model` and its subgraphs that has an ONNX Runtime u8 x s8 kernel ([`u8s8_operands`]).
fn visit_u8s8(model: &Model, f: &mut dyn FnMut(&str, &Graph, qforge_ir::NodeId, &Node, (&'static str, ValueId, ValueId, Option<ValueId>))) {
    visit_nodes(model, &mut |path, g, id, n| {
        if let Some(operands) = u8s8_operands(g, n) {
            f(path, g, id, n, operands);
        }
    });
}

/// The u8 activations read by u8 x s8 weights in `folded` ([`folded`]; subgraphs included),
/// each with the axis of its channels.
fn u8s8_activations(folded: &Model) -> Vec<(String, ReductionAxis)> {
    let mut out = vec![];
    visit_u8s8(folded, &mut |_, g, _, n, (_, x, _, _)| {
        if let Some(axis) = ReductionAxis::of(n, true) {
            out.push((g.value_name(x).to_string(), axis));
        }
    });
    out
}

/// The constant s8 weights read against u8 activations by an op with an ONNX Runtime u8 x s8
/// kernel ([`u8s8_operands`]), in `folded` ([`folded`]):
/// how many, and for each with pairs that kernel adds into one 16-bit sum that can saturate on
/// x86 CPUs without VNNI (`qforge_quant::pair_sums`), how many such pairs.
/// `reach(activation)` is the largest u8 the activation reaches, one value for the tensor or
/// one per channel, when the caller knows it (`quantize` does per tensor, from calibration;
/// `inspect --data` measures it per channel); `None` is the full u8 range. Two same-sign
/// integers `a`, `b` read against channels reaching `r_a`, `r_b` are over the limit when
/// `r_a·|a| + r_b·|b|` exceeds the `ort` backend's `pair_sum_max` (declared at reach 255) times
/// 255.
pub(crate) fn pair_sums(folded: &Model, reach: &dyn Fn(&U8Activation) -> Option<Vec<i64>>) -> Json {
    let limit = qforge_quant::backend::BackendConfig::load("ort").ok().and_then(|b| b.pair_sum_max(qforge_quant::QType::S8))
        .expect("the built-in ort backend declares pair_sum_max for its s8 weights") * FULL_REACH;
    let (mut weights, mut saturating) = (0u64, vec![]);
    visit_u8s8(folded, &mut |path, g, id, n, (op, x, w, w_zp)| {
        let Some(axis) = ReductionAxis::of(n, true) else { return };
        let activation = U8Activation { name: g.value_name(x).to_string(), quantized_from: quantized_from(g, x), axis };
        let t = g.value(w).ok().and_then(|v| v.initializer()).expect("u8s8_operands checks the weight is an initializer");
        let zero = w_zp.and_then(|z| g.value(z).ok()?.initializer()?.to_i64_vec().ok()).is_none_or(|z| z.iter().all(|&x| x == 0));
        let as_op = ["group", "transB"].into_iter().fold(Node::new(op, ""), |m, a| match n.attr(a) {
            Some(v) => m.with_attr(a, v.clone()),
            None => m,
        });
        let (Some(pairs), Some(channel), Ok(q), true) = (qforge_quant::pair_sums::reduction_pairs(&as_op, t.shape()),
            qforge_quant::pair_sums::reduction_channel(&as_op, t.shape()), t.to_i64_vec(), zero) else { return };
        weights += 1;
        let reaches = reach(&activation).unwrap_or_else(|| vec![FULL_REACH]);
        let reach_of = |e: usize| match reaches.as_slice() {
            [one] => *one,
            per_channel => per_channel.get(channel(e)).copied().unwrap_or(FULL_REACH),
        }.clamp(0, FULL_REACH);
        let over = pairs.iter().filter(|&&[a, b]| qforge_quant::pair_sums::pair_over(q[a], q[b], [reach_of(a), reach_of(b)], limit)).count();
        if over > 0 {
            let node = if path.is_empty() { n.display_name(id) } else { format!("{path} > {}", n.display_name(id)) };
            saturating.push(json!({ "node": node, "op": n.op_type, "weight": g.value_name(w), "pairs": over, "of": pairs.len() }));
        }
    });
    json!({ "weights": weights, "saturating": saturating })
}

/// The activations' reach measured on sample data (`inspect --data`).
struct Measured {
    maxima: U8ChannelMaxima,
    data: String,
    samples: usize,
}

/// Everything `inspect` reports, as JSON (the text form is printed from it); `folded` is
/// `model` as [`folded`] gives it.
fn report(model: &Model, folded: &Model, path: &Path, measured: Option<&Measured>) -> Json {
    let registry = Registry::builtin();
    let mut w = Walk {
        model,
        registry,
        ops: BTreeMap::new(),
        params: 0,
        param_bytes: 0,
        subgraphs: vec![],
        unsupported: BTreeMap::new(),
    };
    w.graph(&model.graph, "");
    let mut sums = pair_sums(folded, &|a| measured.and_then(|m| m.maxima.get(&a.name, a.axis)).map(|u| u.iter().map(|&v| v as i64).collect()));
    sums["reach"] = match measured {
        Some(m) => json!({ "data": m.data, "samples": m.samples }),
        None => json!({ "data": null, "samples": null }),
    };
    let g = &model.graph;
    let opsets: BTreeMap<String, i64> = model.opset_imports.iter()
        .map(|o| (if o.domain.is_empty() { "ai.onnx".to_string() } else { o.domain.clone() }, o.version))
        .collect();
    json!({
            "model": path.display().to_string(),
            "ir_version": model.ir_version,
            "producer": format!("{} {}", model.producer_name, model.producer_version).trim().to_string(),
            "opsets": opsets,
            "inputs": g.real_inputs().map(|v| describe_value(g, v)).collect::<Vec<_>>(),
            "outputs": g.outputs().iter().map(|v| describe_value(g, *v)).collect::<Vec<_>>(),
            "nodes": w.ops.values().sum::<u64>(),
            "ops": w.ops,
            "parameters": w.params,
            "parameter_bytes": w.param_bytes,
            "subgraphs": w.subgraphs,
            "functions": model.functions.iter().map(|f| format!("{}::{}", f.domain, f.name)).collect::<Vec<_>>(),
            "unsupported_ops": w.unsupported,
            "u8s8_pair_sums": sums,
            "weight_only_matmuls": weight_only_matmuls(folded),
    })
}

fn shape_text(v: &Json) -> String {
    match v["shape"].as_array() {
        Some(dims) => format!("[{}]", dims.iter().map(|d| match d {
            Json::Null => "?".to_string(),
            Json::String(s) => s.clone(),
            d => d.to_string(),
        }).collect::<Vec<_>>().join(", ")),
        None => "[unknown rank]".into(),
    }
}

fn print_text(j: &Json) {
    println!("model      {}", j["model"].as_str().unwrap_or(""));
    println!("ir version {}   producer: {}", j["ir_version"], j["producer"].as_str().unwrap_or(""));
    let opsets: Vec<String> = j["opsets"].as_object().unwrap().iter().map(|(d, v)| format!("{d} {v}")).collect();
    println!("opsets     {}", opsets.join(", "));
    for (title, key) in [("inputs", "inputs"), ("outputs", "outputs")] {
        println!("{title}:");
        for v in j[key].as_array().unwrap() {
            println!("  {:<32} {:<8} {}", v["name"].as_str().unwrap_or(""), v["dtype"].as_str().unwrap_or("?"), shape_text(v));
        }
    }
    let params = j["parameters"].as_u64().unwrap_or(0);
    let bytes = j["parameter_bytes"].as_u64().unwrap_or(0);
    println!("parameters {params} ({:.2} MB)", bytes as f64 / 1e6);
    println!("nodes      {} (subgraphs included)", j["nodes"]);
    println!("ops:");
    let mut ops: Vec<(&String, &Json)> = j["ops"].as_object().unwrap().iter().collect();
    ops.sort_by(|a, b| b.1.as_u64().cmp(&a.1.as_u64()).then(a.0.cmp(b.0)));
    for (op, n) in ops {
        println!("  {op:<28} {n}");
    }
    let subs = j["subgraphs"].as_array().unwrap();
    if !subs.is_empty() {
        println!("subgraphs:");
        for s in subs {
            println!("  {} ({} nodes)", s["path"].as_str().unwrap_or(""), s["nodes"]);
        }
    }
    let pairs = &j["u8s8_pair_sums"];
    let saturating = pairs["saturating"].as_array().unwrap();
    let weights = pairs["weights"].as_u64().unwrap_or(0);
    let measured = pairs["reach"]["samples"].as_u64().map(|n| (n, pairs["reach"]["data"].as_str().unwrap_or("")));
    let reach = match measured {
        Some((n, data)) => format!("for the activations {n} sample(s) of {data} give, each input channel up to the largest u8 it reached"),
        None => "at full u8 range, 255 x (|a| + |b|) > 32767; --data measures what your inputs reach".to_string(),
    };
    if !saturating.is_empty() {
        println!("warning    {} of {weights} u8 x s8 weights have pairs whose 16-bit sum can saturate in ONNX Runtime on x86 CPUs without VNNI \
            ({reach}), so there its results can leave the ONNX semantics; qforge's ort backend fits them to the reach of each input channel in calibration and in its check (README: ONNX Runtime on CPUs without VNNI):", saturating.len());
        let mut worst: Vec<&Json> = saturating.iter().collect();
        worst.sort_by_key(|s| std::cmp::Reverse(s["pairs"].as_u64()));
        for s in worst.iter().take(5) {
            println!("  {:<28} {} of {} pairs ({} '{}')", s["node"].as_str().unwrap_or(""), s["pairs"], s["of"], s["op"].as_str().unwrap_or(""), s["weight"].as_str().unwrap_or(""));
        }
        if worst.len() > 5 {
            println!("  ... {} more (--json lists them all)", worst.len() - 5);
        }
    } else if weights > 0 {
        match measured {
            Some((n, data)) => println!("pair sums  all {weights} u8 x s8 weights fit ONNX Runtime's 16-bit pair sums for the activations {n} sample(s) of {data} give (exact on x86 CPUs without VNNI for them)"),
            None => println!("pair sums  all {weights} u8 x s8 weights fit ONNX Runtime's 16-bit pair sums (exact on x86 CPUs without VNNI too)"),
        }
    }
    let weight_only = j["weight_only_matmuls"].as_array().unwrap();
    if !weight_only.is_empty() {
        println!("warning    {} MatMul/Gemm node(s) read a float activation with an 8- or 4-bit weight: ONNX Runtime runs such a node as MatMulNBits, \
            quantizing that activation to int8 at run time (blocks of 32, accuracy level 4), so there its results leave the ONNX semantics qforge's runtime computes:", weight_only.len());
        for w in weight_only.iter().take(5) {
            println!("  {:<28} {} '{}'", w["node"].as_str().unwrap_or(""), w["op"].as_str().unwrap_or(""), w["weight"].as_str().unwrap_or(""));
        }
        if weight_only.len() > 5 {
            println!("  ... {} more (--json lists them all)", weight_only.len() - 5);
        }
    }
    let unsupported = j["unsupported_ops"].as_object().unwrap();
    if unsupported.is_empty() {
        println!("runtime    every op is supported");
    } else {
        println!("runtime    unsupported ops:");
        for (op, n) in unsupported {
            println!("  {op:<28} {n}");
        }
    }
}

/// Loads a model and prints its description. With `data`, the model first runs on its samples
/// (the first `limit`), so that the pair-sum check uses the reach of each activation channel on
/// them instead of the full u8 range.
pub fn inspect(path: &Path, json: bool, data: Option<&Path>, limit: Option<usize>) -> Result<()> {
    let model = qforge_onnx::load(path).with_context(|| format!("cannot load {}", path.display()))?;
    let folded = folded(&model);
    let measured = match data {
        Some(data) => Some(measure(&model, &folded, path, data, limit, json)?),
        None => None,
    };
    let r = report(&model, &folded, path, measured.as_ref());
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_text(&r);
    }
    Ok(())
}

/// Runs `model` on the samples of `data` (the first `limit`), as its runs without hooks do (QDQ
/// units as integer operators, so each u8 activation is what an integer kernel gives), with
/// [`U8ChannelMaxima`] watching the activations its u8 x s8 weights read.
fn measure(model: &Model, folded: &Model, path: &Path, data: &Path, limit: Option<usize>, quiet: bool) -> Result<Measured> {
    use qforge_quant::pipeline::SampleSource;
    if limit == Some(0) {
        anyhow::bail!("--limit 0 measures nothing; give at least 1");
    }
    let samples = crate::samples::open_samples(data, &crate::samples::model_inputs(model))?;
    let len = limit.map_or(samples.len(), |n| n.min(samples.len()));
    let session = qforge_runtime::Session::new(model).with_context(|| format!("cannot run {}", path.display()))?;
    let mut maxima = U8ChannelMaxima::new(u8s8_activations(folded));
    let mut progress = crate::samples::progress("measuring", quiet);
    for i in 0..len {
        let feed = samples.load(i).map_err(|e| anyhow::anyhow!("sample {}: {e}", samples.name(i)))?;
        let feed = feed.into_iter().map(|(n, t)| (n, qforge_runtime::Value::Tensor(t))).collect();
        session.run_values_observed(feed, &mut maxima).with_context(|| format!("cannot run {} on sample {}", path.display(), samples.name(i)))?;
        progress(i + 1, len);
    }
    Ok(Measured { maxima, data: data.display().to_string(), samples: len })
}

