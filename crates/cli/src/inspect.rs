//! `qforge inspect`: a model's interface, op histogram, parameters, subgraphs and runtime support.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use qforge_ir::{Attr, Graph, Model, ValueId};
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

/// Everything `inspect` reports, as JSON (the text form is printed from it).
fn report(model: &Model, path: &Path) -> Json {
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

/// Loads a model and prints its description.
pub fn inspect(path: &Path, json: bool) -> Result<()> {
    let model = qforge_onnx::load(path).with_context(|| format!("cannot load {}", path.display()))?;
    let r = report(&model, path);
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_text(&r);
    }
    Ok(())
}
