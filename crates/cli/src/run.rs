//! `qforge run` and `qforge bench`: execute a model with the qforge runtime.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use qforge_ir::{DType, Dim, Model, Tensor};
use qforge_runtime::{Session, SessionOptions, Value};
use serde_json::json;

fn load(path: &Path) -> Result<Model> {
    qforge_onnx::load(path).with_context(|| format!("cannot load {}", path.display()))
}

fn split_arg<'a>(arg: &'a str, flag: &str) -> Result<(&'a str, &'a str)> {
    arg.split_once('=').with_context(|| format!("{flag} '{arg}' must be NAME=VALUE"))
}

/// Reads `NAME=FILE.npy` arguments.
fn read_inputs(args: &[String]) -> Result<Vec<(String, Tensor)>> {
    args.iter()
        .map(|a| {
            let (name, file) = split_arg(a, "--input")?;
            let t = qforge_data::read_npy(Path::new(file)).with_context(|| format!("input '{name}'"))?;
            Ok((name.to_string(), t))
        })
        .collect()
}

/// Seeded uniform [0, 1) floats, or zeros for other types, for inputs the user did not give.
fn random_input(model: &Model, name: &str, shape_args: &[String], seed: u64) -> Result<Tensor> {
    let g = &model.graph;
    let v = g.value(g.value_by_name(name).context("input vanished")?)?;
    let given = shape_args.iter().find_map(|a| split_arg(a, "--shape").ok().filter(|(n, _)| *n == name).map(|(_, d)| d));
    let shape: Vec<usize> = match given {
        Some(dims) => dims.split(',').map(|d| d.trim().parse::<usize>().with_context(|| format!("--shape {name}: bad dimension '{d}'"))).collect::<Result<_>>()?,
        None => {
            let dims = v.ty.as_ref().and_then(|t| t.shape()).with_context(|| format!("input '{name}' has unknown rank; give --shape {name}=D0,D1,..."))?;
            dims.iter().enumerate().map(|(i, d)| match d {
                Dim::Known(k) if *k >= 0 => Ok(*k as usize),
                _ if i == 0 => Ok(1),
                _ => bail!("input '{name}' has dynamic dimension {i} ({d}); give --shape {name}=D0,D1,..."),
            }).collect::<Result<_>>()?
        }
    };
    let dtype = v.ty.as_ref().and_then(|t| t.elem()).unwrap_or(DType::F32);
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 40) as f32) / (1u64 << 24) as f32
    };
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(&shape, (0..n).map(|_| next()).collect::<Vec<f32>>())?,
        other => Tensor::zeros(other, &shape)?,
    })
}

fn session(model: &Model, threads: usize) -> Result<Session> {
    Ok(Session::with_options(model, SessionOptions { threads, ..Default::default() })?)
}

/// `qforge run`: runs once and writes every output to an .npz file, a sequence output's items
/// as `name[0]`, `name[1]`, ... and an optional output as what it holds
/// ([`Value::into_named_tensors`]).
pub fn run(model_path: &Path, inputs: &[String], output: &Path, threads: usize) -> Result<()> {
    let model = load(model_path)?;
    let s = session(&model, threads)?;
    let feed = read_inputs(inputs)?.into_iter().map(|(n, t)| (n, Value::Tensor(t))).collect();
    let outputs = s.run_values(feed).with_context(|| format!("running {}", model_path.display()))?;
    let mut tensors = vec![];
    for (name, value) in outputs {
        let (described, is_tensor) = match &value {
            Value::Tensor(t) => (format!("{} {:?}", t.dtype(), t.shape()), true),
            other => (other.to_string(), false),
        };
        let named = value.into_named_tensors(&name);
        match named.as_slice() {
            _ if is_tensor => eprintln!("{name}: {described}"),
            [] => eprintln!("{name}: {described} (nothing written)"),
            [(only, _)] => eprintln!("{name}: {described}, written as {only}"),
            [(first, _), .., (last, _)] => eprintln!("{name}: {described}, written as {first} .. {last}"),
        }
        tensors.extend(named);
    }
    qforge_data::write_npz(output, &tensors)?;
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

/// How `qforge bench` runs.
pub struct BenchOptions {
    pub threads: usize,
    pub runs: usize,
    pub warmup: usize,
    pub profile: bool,
    pub json: bool,
}

/// `qforge bench`: median latency over `runs` timed runs after `warmup` untimed ones.
pub fn bench(model_path: &Path, inputs: &[String], shapes: &[String], o: BenchOptions) -> Result<()> {
    let BenchOptions { threads, runs, warmup, json, .. } = o;
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    let model = load(model_path)?;
    let s = session(&model, threads)?;
    let mut feed = read_inputs(inputs)?;
    let names: Vec<String> = model.graph.real_inputs().map(|v| model.graph.value_name(v)).collect();
    for (i, name) in names.iter().enumerate() {
        if !feed.iter().any(|(n, _)| n == name) {
            feed.push((name.clone(), random_input(&model, name, shapes, i as u64)?));
        }
    }
    for _ in 0..warmup {
        s.run(feed.clone())?;
    }
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        s.run(feed.clone())?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let (by_node, by_op) = if o.profile { profile(&s, &feed, runs.min(PROFILED_RUNS))? } else { (vec![], vec![]) };
    let median = percentile(&times, 0.5);
    let report = json!({
        "model": model_path.display().to_string(),
        "threads": s.threads(),
        "runs": runs,
        "median_ms": median,
        "mean_ms": times.iter().sum::<f64>() / runs as f64,
        "min_ms": times[0],
        "p10_ms": percentile(&times, 0.1),
        "p90_ms": percentile(&times, 0.9),
        "inputs": feed.iter().map(|(n, t)| json!({"name": n, "dtype": t.dtype().onnx_name(), "shape": t.shape()})).collect::<Vec<_>>(),
        "profile_ms_by_op": by_op.iter().map(|(op, ms)| json!({"op": op, "ms": ms})).collect::<Vec<_>>(),
        "profile_ms_by_node": by_node.iter().map(|n| json!({"node": n.node, "op": n.op, "ms": n.ms})).collect::<Vec<_>>(),
        "qdq_lowering": s.qdq_lowering().map(|l| json!({
            "lowered": l.lowered.len(),
            "lookup_tables": l.lowered.iter().filter(|u| u.into == qforge_runtime::LOOKUP_TABLE).map(|u| json!({"graph": u.graph, "node": u.node, "op": u.op})).collect::<Vec<_>>(),
            "composed_tables": l.composed.iter().map(|c| json!({"graph": c.graph, "node": c.node(), "chain": c.chain})).collect::<Vec<_>>(),
            "tables_in_convs": l.tables_in_convs,
            "not_lowered": l.not_lowered.iter().map(|n| json!({"graph": n.graph, "node": n.node, "op": n.op, "reason": n.reason})).collect::<Vec<_>>(),
        })),
    });
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}: median {median:.3} ms (p10 {:.3}, p90 {:.3}, {runs} runs, {} threads)",
            model_path.display(), report["p10_ms"].as_f64().unwrap(), report["p90_ms"].as_f64().unwrap(), report["threads"]);
        if let Some(l) = s.qdq_lowering() {
            let tables = l.lowered.iter().filter(|u| u.into == qforge_runtime::LOOKUP_TABLE).count();
            println!("QDQ units run as integer operators: {} ({tables} as lookup tables); left in float arithmetic: {}{}", l.lowered.len(), l.not_lowered.len(),
                if l.not_lowered.is_empty() { "" } else { " (--json lists them with the reason)" });
            if !l.composed.is_empty() {
                let nodes: usize = l.composed.iter().map(|c| c.chain.len()).sum();
                println!("elementwise chains over one 8-bit value run as lookup tables: {} (of {nodes} nodes)", l.composed.len());
            }
            if !l.tables_in_convs.is_empty() {
                println!("lookup tables applied inside the convolution before them: {}", l.tables_in_convs.len());
            }
        }
        for (op, ms) in &by_op {
            println!("  {op:<24} {ms:>9.3} ms");
        }
        if !by_node.is_empty() {
            println!("slowest nodes (--json lists every node):");
            for n in by_node.iter().take(SLOWEST_NODES) {
                println!("  {:>9.3} ms  {:<24} {}", n.ms, n.op, n.node);
            }
        }
    }
    Ok(())
}

/// Profiled runs `qforge bench --profile` times (fewer when `--runs` is smaller).
const PROFILED_RUNS: usize = 10;
/// Nodes the text output of `qforge bench --profile` lists.
const SLOWEST_NODES: usize = 10;

/// A node's median wall time in `qforge bench --profile`.
struct NodeTime {
    node: String,
    op: String,
    ms: f64,
}

/// Per-node wall time of `s` on `feed` (the nodes' times, then their sums per op type as
/// `(op, ms)`): the median over `runs` profiled runs of every node's time in a run (summed
/// over its executions when it sits in a loop body), both lists slowest first.
type Profile = (Vec<NodeTime>, Vec<(String, f64)>);

/// The [`Profile`] of `s` on `feed` over `runs` profiled runs.
fn profile(s: &Session, feed: &[(String, Tensor)], runs: usize) -> Result<Profile> {
    let mut samples: Vec<(String, String, Vec<f64>)> = vec![];
    let mut index: std::collections::HashMap<String, usize> = Default::default();
    for run in 0..runs.max(1) {
        let (_, steps) = s.run_profiled(feed.to_vec())?;
        for st in steps {
            let i = *index.entry(st.node.clone()).or_insert_with(|| {
                samples.push((st.node, st.op, vec![]));
                samples.len() - 1
            });
            let times = &mut samples[i].2;
            times.resize(run + 1, 0.0);
            times[run] += st.seconds * 1e3;
        }
    }
    let mut by_node: Vec<NodeTime> = samples.into_iter().map(|(node, op, mut t)| {
        // A node a run did not execute (an If branch not taken) took no time in it.
        t.resize(runs.max(1), 0.0);
        t.sort_by(|a, b| a.total_cmp(b));
        NodeTime { node, op, ms: percentile(&t, 0.5) }
    }).collect();
    let mut by_op: Vec<(String, f64)> = vec![];
    for n in &by_node {
        match by_op.iter_mut().find(|(o, _)| *o == n.op) {
            Some(e) => e.1 += n.ms,
            None => by_op.push((n.op.clone(), n.ms)),
        }
    }
    by_node.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    by_op.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok((by_node, by_op))
}
