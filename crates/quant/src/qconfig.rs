//! QConfig and QConfigMapping: what the user asks for, per node.
//!
//! A [`QConfigMapping`] assigns each node a [`QConfig`] (or `None`: keep float) with PyTorch's
//! five levels of priority, lowest first: global, op type, node-scope regex, node name (or an
//! enclosing scope), and op type + occurrence order within a scope. It loads from TOML:
//!
//! ```toml
//! [global]
//! activation = { dtype = "u8", observer = "histogram", range = "l2" }
//! weight = { dtype = "s8", symmetric = true, per_channel = true }
//!
//! [[op_type]]
//! op = "Softmax"
//! qconfig = "none"
//!
//! [[scope_regex]]
//! regex = '^encoder\.layer\.\d+\.attention'
//! activation = { dtype = "u16" }
//!
//! [[name]]
//! name = "/head/Conv"            # a node name, or a scope such as "head"
//! qconfig = "none"
//!
//! [[op_order]]
//! scope = ""                      # the whole graph
//! op = "Conv"
//! index = 0                       # the first Conv in topological order
//! qconfig = "none"
//! ```

use std::collections::HashMap;

use regex::Regex;
use serde::Deserialize;

use qforge_ir::{node_scope, Graph, NodeId};

use crate::spec::{Granularity, ObserverKind, QuantizationSpec, RangeMethod};
use crate::{Convention, QScheme, QType};

/// The error reduction at which `range = "auto"` clips a tensor instead of keeping its
/// extremes: 3x (4.8 dB) keeps min/max on every tensor of the benchmark's four models and
/// clips the wide-tailed block inputs of PP-OCRv5's detector.
pub const AUTO_CLIP_GAIN: f64 = 3.0;

/// How one tensor (activation or weight) should be quantized, as a user writes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorQConfig {
    pub dtype: QType,
    #[serde(default)]
    pub symmetric: bool,
    /// One scale per output channel (weights; the axis follows from the op).
    #[serde(default)]
    pub per_channel: bool,
    /// One scale per block of this many elements along the input-channel axis (weights).
    pub block_size: Option<usize>,
    #[serde(default)]
    pub reduce_range: bool,
    /// An explicit integer range, e.g. `[-127, 127]`.
    pub quant_range: Option<(i64, i64)>,
    #[serde(default)]
    pub observer: ObserverName,
    /// Range selection for histogram observers.
    #[serde(default)]
    pub range: RangeName,
    pub percentile: Option<f64>,
    pub bins: Option<usize>,
    pub averaging_constant: Option<f32>,
    pub eps: Option<f32>,
}

/// Observer names accepted in config files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ObserverName {
    #[default]
    Minmax,
    MovingAverage,
    Histogram,
}

/// Range-selection names accepted in config files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RangeName {
    #[default]
    Minmax,
    Percentile,
    Entropy,
    L2,
    Mse,
    Auto,
}

impl TensorQConfig {
    /// A plain config of a dtype: affine, per tensor, min/max.
    pub fn of(dtype: QType) -> TensorQConfig {
        TensorQConfig {
            dtype,
            symmetric: false,
            per_channel: false,
            block_size: None,
            reduce_range: false,
            quant_range: None,
            observer: ObserverName::Minmax,
            range: RangeName::Minmax,
            percentile: None,
            bins: None,
            averaging_constant: None,
            eps: None,
        }
    }

    /// The spec for a tensor whose channel axis is `channel_axis` (and whose block axis, the
    /// reduction axis of a weight, is `block_axis`), under a backend's qparams convention.
    pub fn spec(&self, convention: Convention, channel_axis: Option<usize>, block_axis: Option<usize>) -> QuantizationSpec {
        let scheme = QScheme {
            qtype: self.dtype,
            symmetric: self.symmetric,
            reduce_range: self.reduce_range,
            quant_range: self.quant_range,
            eps: self.eps.unwrap_or(f32::EPSILON),
            convention,
        };
        let granularity = match (self.block_size, block_axis, self.per_channel, channel_axis) {
            (Some(block_size), Some(axis), _, _) => Granularity::PerBlock { axis, block_size },
            (_, _, true, Some(axis)) => Granularity::PerAxis { axis },
            _ => Granularity::PerTensor,
        };
        let range = match self.range {
            RangeName::Minmax => RangeMethod::MinMax,
            RangeName::Percentile => RangeMethod::Percentile { percentile: self.percentile.unwrap_or(99.999) },
            RangeName::Entropy => RangeMethod::Entropy,
            RangeName::L2 => RangeMethod::L2,
            RangeName::Mse => RangeMethod::Mse,
            RangeName::Auto => RangeMethod::Auto { gain: AUTO_CLIP_GAIN },
        };
        let observer = match (self.observer, range) {
            (ObserverName::Minmax, RangeMethod::MinMax) => ObserverKind::MinMax,
            (ObserverName::MovingAverage, _) => ObserverKind::MovingAverageMinMax { averaging_constant: self.averaging_constant.unwrap_or(0.01) },
            (_, range) => ObserverKind::Histogram { bins: self.bins.unwrap_or(2048), range },
        };
        QuantizationSpec { scheme, granularity, observer, scale_min: None, pair_sum_max: None }
    }
}

/// What a node's activations and weights are quantized to. A missing part stays float.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct QConfig {
    pub activation: Option<TensorQConfig>,
    pub weight: Option<TensorQConfig>,
}

/// An entry's QConfig: inline, or the word "none" to keep float.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
enum QConfigEntry {
    Named { qconfig: String },
    Inline(QConfig),
}

impl QConfig {
    /// Why the config asks for something qforge cannot give, or `None`. Activations are
    /// observed per tensor (the integer kernels of ONNX Runtime, TensorRT and QNN take one
    /// activation scale per tensor); weights take their range from their data (each channel's
    /// extremes, or `--weight-range mse`), not from an observer.
    pub fn unsupported(&self) -> Option<String> {
        if let Some(a) = &self.activation {
            if a.per_channel || a.block_size.is_some() {
                return Some("activation: per_channel and block_size apply to weights; activations are quantized per tensor".into());
            }
        }
        if let Some(w) = &self.weight {
            if w.observer != ObserverName::Minmax || w.range != RangeName::Minmax || w.percentile.is_some() || w.bins.is_some() || w.averaging_constant.is_some() {
                return Some("weight: observer, range, percentile, bins and averaging_constant apply to activations; a weight's range comes from its data (per channel, or --weight-range mse)".into());
            }
        }
        None
    }
}

impl QConfigEntry {
    fn resolve(self, context: &str) -> Result<Option<QConfig>, String> {
        match self {
            QConfigEntry::Inline(q) => match q.unsupported() {
                Some(why) => Err(format!("{context}: {why}")),
                None => Ok(Some(q)),
            },
            QConfigEntry::Named { qconfig } if qconfig == "none" => Ok(None),
            QConfigEntry::Named { qconfig } => Err(format!("{context}: qconfig '{qconfig}' is not known (use \"none\" or an inline table)")),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    global: Option<toml::Value>,
    #[serde(default)]
    op_type: Vec<toml::Value>,
    #[serde(default)]
    scope_regex: Vec<toml::Value>,
    #[serde(default)]
    name: Vec<toml::Value>,
    #[serde(default)]
    op_order: Vec<toml::Value>,
}

/// Per-node QConfig assignment with PyTorch's five priority levels.
#[derive(Debug, Clone, Default)]
pub struct QConfigMapping {
    pub global: Option<QConfig>,
    pub op_type: Vec<(String, Option<QConfig>)>,
    pub scope_regex: Vec<(Regex, Option<QConfig>)>,
    pub name: Vec<(String, Option<QConfig>)>,
    /// (scope, op type, occurrence index within the scope, qconfig).
    pub op_order: Vec<(String, String, usize, Option<QConfig>)>,
}

fn take_str(v: &mut toml::Table, key: &str, ctx: &str) -> Result<String, String> {
    match v.remove(key) {
        Some(toml::Value::String(s)) => Ok(s),
        Some(_) => Err(format!("{ctx}: '{key}' must be a string")),
        None => Err(format!("{ctx}: '{key}' is missing")),
    }
}

fn entry(v: toml::Table, ctx: &str) -> Result<Option<QConfig>, String> {
    let e: QConfigEntry = toml::Value::Table(v).try_into().map_err(|e: toml::de::Error| format!("{ctx}: {e}"))?;
    e.resolve(ctx)
}

impl QConfigMapping {
    /// A mapping with only a global config.
    pub fn global(q: QConfig) -> QConfigMapping {
        QConfigMapping { global: Some(q), ..Default::default() }
    }

    /// Parses the TOML form (see the module docs). Errors name the section and entry.
    pub fn from_toml(text: &str) -> Result<QConfigMapping, String> {
        let f: File = toml::from_str(text).map_err(|e| e.to_string())?;
        let table = |v: toml::Value, ctx: &str| match v {
            toml::Value::Table(t) => Ok(t),
            toml::Value::String(s) if s == "none" => Ok(toml::Table::from_iter([("qconfig".to_string(), toml::Value::String(s))])),
            _ => Err(format!("{ctx}: expected a table")),
        };
        let mut m = QConfigMapping::default();
        if let Some(g) = f.global {
            m.global = entry(table(g, "[global]")?, "[global]")?;
        }
        for (i, v) in f.op_type.into_iter().enumerate() {
            let ctx = format!("[[op_type]] #{}", i + 1);
            let mut t = table(v, &ctx)?;
            let op = take_str(&mut t, "op", &ctx)?;
            m.op_type.push((op, entry(t, &ctx)?));
        }
        for (i, v) in f.scope_regex.into_iter().enumerate() {
            let ctx = format!("[[scope_regex]] #{}", i + 1);
            let mut t = table(v, &ctx)?;
            let re = take_str(&mut t, "regex", &ctx)?;
            let re = Regex::new(&re).map_err(|e| format!("{ctx}: {e}"))?;
            m.scope_regex.push((re, entry(t, &ctx)?));
        }
        for (i, v) in f.name.into_iter().enumerate() {
            let ctx = format!("[[name]] #{}", i + 1);
            let mut t = table(v, &ctx)?;
            let name = take_str(&mut t, "name", &ctx)?;
            m.name.push((name, entry(t, &ctx)?));
        }
        for (i, v) in f.op_order.into_iter().enumerate() {
            let ctx = format!("[[op_order]] #{}", i + 1);
            let mut t = table(v, &ctx)?;
            let scope = take_str(&mut t, "scope", &ctx).unwrap_or_default();
            let op = take_str(&mut t, "op", &ctx)?;
            let index = match t.remove("index") {
                Some(toml::Value::Integer(i)) if i >= 0 => i as usize,
                _ => return Err(format!("{ctx}: 'index' must be a non-negative integer")),
            };
            m.op_order.push((scope, op, index, entry(t, &ctx)?));
        }
        Ok(m)
    }

    /// The entries above the global level that apply to no node of `graphs` (a model's main
    /// graph and its subgraphs), described as `level 'key'`: an op type no node has, a scope
    /// regex no node's scope matches, a name that is neither a node's name nor a scope, an
    /// occurrence index beyond the occurrences any one graph has. Such an entry does nothing,
    /// which the user should hear about.
    pub fn unmatched(&self, graphs: &[&Graph]) -> Vec<String> {
        let mut op_type = vec![false; self.op_type.len()];
        let mut scope_regex = vec![false; self.scope_regex.len()];
        let mut name = vec![false; self.name.len()];
        // Occurrences count per graph, as `assign` counts them: the most any one graph has.
        let mut occurrences: HashMap<(&str, &str), usize> = self.op_order.iter().map(|(s, op, _, _)| ((s.as_str(), op.as_str()), 0)).collect();
        for g in graphs {
            let mut in_graph: HashMap<(&str, &str), usize> = occurrences.keys().map(|&k| (k, 0)).collect();
            for (_, node) in g.nodes() {
                let first_out = node.output(0).map(|v| g.value_name(v)).unwrap_or_default();
                let scope = node_scope(&node.name, &first_out);
                for (hit, (op, _)) in op_type.iter_mut().zip(&self.op_type) {
                    *hit |= *op == node.op_type;
                }
                for (hit, (re, _)) in scope_regex.iter_mut().zip(&self.scope_regex) {
                    *hit |= re.is_match(&scope);
                }
                for (hit, (n, _)) in name.iter_mut().zip(&self.name) {
                    *hit |= in_scope(&node.name, &scope, n);
                }
                for ((s, op), seen) in in_graph.iter_mut() {
                    if *op == node.op_type && (s.is_empty() || in_scope("", &scope, s)) {
                        *seen += 1;
                    }
                }
            }
            for (k, n) in in_graph {
                let most = occurrences.entry(k).or_default();
                *most = (*most).max(n);
            }
        }
        let mut out = vec![];
        out.extend(self.op_type.iter().zip(&op_type).filter(|(_, &hit)| !hit).map(|((op, _), _)| format!("op_type '{op}'")));
        out.extend(self.scope_regex.iter().zip(&scope_regex).filter(|(_, &hit)| !hit).map(|((re, _), _)| format!("scope_regex '{}'", re.as_str())));
        out.extend(self.name.iter().zip(&name).filter(|(_, &hit)| !hit).map(|((n, _), _)| format!("name '{n}'")));
        for (s, op, index, _) in &self.op_order {
            let seen = occurrences.get(&(s.as_str(), op.as_str())).copied().unwrap_or(0);
            if *index >= seen {
                out.push(format!("op_order '{op}' #{index} in scope '{s}' ({seen} such node(s))"));
            }
        }
        out
    }

    /// The QConfig of every node of `g` (`None`: keep float), with the level that decided it.
    pub fn assign(&self, g: &Graph) -> HashMap<NodeId, (Option<QConfig>, &'static str)> {
        let order = g.topo_order().unwrap_or_else(|_| g.nodes().map(|(id, _)| id).collect());
        let mut seen: HashMap<(String, String), usize> = HashMap::new();
        let mut out = HashMap::new();
        for id in order {
            let node = g.node(id).expect("topological order lists live nodes");
            let first_out = node.output(0).map(|v| g.value_name(v)).unwrap_or_default();
            let scope = node_scope(&node.name, &first_out);
            let mut q = (self.global.clone(), "global");
            if let Some((_, c)) = self.op_type.iter().rev().find(|(op, _)| *op == node.op_type) {
                q = (c.clone(), "op_type");
            }
            if let Some((_, c)) = self.scope_regex.iter().find(|(re, _)| re.is_match(&scope)) {
                q = (c.clone(), "scope_regex");
            }
            if let Some((_, c)) = self.name.iter().filter(|(n, _)| in_scope(&node.name, &scope, n)).max_by_key(|(n, _)| n.len()) {
                q = (c.clone(), "name");
            }
            // Each (scope, op type) counts this node once, however many entries it has.
            let mut counted: Vec<(String, String)> = vec![];
            for (s, op, index, c) in &self.op_order {
                if *op == node.op_type && (s.is_empty() || in_scope("", &scope, s)) {
                    let key = (s.clone(), op.clone());
                    if seen.get(&key).copied().unwrap_or(0) == *index {
                        q = (c.clone(), "op_order");
                    }
                    if !counted.contains(&key) {
                        counted.push(key);
                    }
                }
            }
            for key in counted {
                *seen.entry(key).or_default() += 1;
            }
            out.insert(id, q);
        }
        out
    }
}

/// Whether a `name` entry applies to the node named `node_name` with scope `scope`: it names
/// the node, its scope, or a scope enclosing it.
fn in_scope(node_name: &str, scope: &str, name: &str) -> bool {
    node_name == name || scope == name || scope.starts_with(&format!("{name}."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use qforge_ir::{Node, ValueId};

    fn graph() -> (Graph, Vec<NodeId>) {
        let mut g = Graph::new("g");
        let mut x: ValueId = g.add_input("x", None).unwrap();
        let mut ids = vec![];
        for name in ["/encoder/layer.0/attention/MatMul", "/encoder/layer.0/attention/Softmax", "/encoder/layer.1/ffn/MatMul", "/head/Conv", "/head/Conv_1"] {
            let op = name.rsplit('/').next().unwrap().trim_end_matches("_1");
            let y = g.new_value(format!("{name}_out"), None).unwrap();
            ids.push(g.add_node(Node::new(op, name).with_inputs([x]).with_outputs([y])).unwrap());
            x = y;
        }
        g.set_outputs(vec![x]).unwrap();
        (g, ids)
    }

    #[test]
    fn several_occurrences_of_one_op_in_one_scope_each_get_their_entry() {
        let (g, ids) = graph();
        let float = |i| ("head".to_string(), "Conv".to_string(), i, None);
        let m = QConfigMapping { global: Some(QConfig::default()), op_order: vec![float(0), float(1)], ..Default::default() };
        let a = m.assign(&g);
        for &id in &ids[3..] {
            assert_eq!(a[&id], (None, "op_order"), "{}", g.node(id).unwrap().name);
        }
        assert!(a[&ids[0]].0.is_some());
    }

    #[test]
    fn entries_that_apply_to_no_node_are_listed() {
        let (g, _) = graph();
        let re = |r: &str| (Regex::new(r).unwrap(), None);
        let m = QConfigMapping {
            op_type: vec![("MatMul".into(), None), ("LSTM".into(), None)],
            // Regular expressions see scopes (`encoder.layer.0.attention`), not node names.
            scope_regex: vec![re(r"^encoder\.layer\.[01]"), re("MatMul$")],
            name: vec![("head".into(), None), ("/head/Conv_1".into(), None), ("/head/Conv_2".into(), None), ("encoder.lay".into(), None)],
            op_order: vec![("head".into(), "Conv".into(), 1, None), ("head".into(), "Conv".into(), 2, None)],
            ..Default::default()
        };
        assert_eq!(m.unmatched(&[&g]), vec![
            "op_type 'LSTM'".to_string(),
            "scope_regex 'MatMul$'".to_string(),
            "name '/head/Conv_2'".to_string(),
            "name 'encoder.lay'".to_string(),
            "op_order 'Conv' #2 in scope 'head' (2 such node(s))".to_string(),
        ]);
        // Occurrences count per graph: two graphs with two Convs each still have no third.
        assert!(m.unmatched(&[&g, &g]).contains(&"op_order 'Conv' #2 in scope 'head' (2 such node(s))".to_string()));
    }

    #[test]
    fn priority_levels_apply_in_order() {
        let text = r#"
            [global]
            activation = { dtype = "u8" }

            [[op_type]]
            op = "Softmax"
            qconfig = "none"

            [[scope_regex]]
            regex = '^encoder\.layer\.\d+\.attention$'
            activation = { dtype = "u16" }

            [[name]]
            name = "head"
            activation = { dtype = "s8" }

            [[op_order]]
            scope = "head"
            op = "Conv"
            index = 1
            qconfig = "none"
        "#;
        let m = QConfigMapping::from_toml(text).unwrap();
        let (g, ids) = graph();
        let a = m.assign(&g);
        let dtype = |i: usize| a[&ids[i]].0.as_ref().and_then(|q| q.activation.as_ref()).map(|t| t.dtype);
        assert_eq!(dtype(0), Some(QType::U16), "scope regex beats global");
        assert_eq!(a[&ids[1]].1, "scope_regex", "scope regex beats op type");
        assert_eq!(dtype(2), Some(QType::U8), "global");
        assert_eq!(dtype(3), Some(QType::S8), "name (enclosing scope)");
        assert_eq!(a[&ids[4]], (None, "op_order"), "second Conv in scope 'head' stays float");
    }

    #[test]
    fn errors_name_the_entry() {
        let e = QConfigMapping::from_toml("[[op_type]]\nop = 'Conv'\nqconfig = 'fast'").unwrap_err();
        assert!(e.contains("[[op_type]] #1") && e.contains("'fast'"), "{e}");
        let e = QConfigMapping::from_toml("[[scope_regex]]\nregex = '('\nqconfig = 'none'").unwrap_err();
        assert!(e.contains("[[scope_regex]] #1"), "{e}");
        let e = QConfigMapping::from_toml("[global]\nactivation = { dtype = 'u9' }").unwrap_err();
        assert!(e.contains("[global]"), "{e}");
    }

    #[test]
    fn settings_that_would_be_ignored_are_refused() {
        let e = QConfigMapping::from_toml("[global]\nactivation = { dtype = 'u8', per_channel = true }").unwrap_err();
        assert!(e.contains("[global]") && e.contains("per tensor"), "{e}");
        let e = QConfigMapping::from_toml("[[name]]\nname = 'conv'\nweight = { dtype = 's8', observer = 'histogram', range = 'mse' }").unwrap_err();
        assert!(e.contains("[[name]] #1") && e.contains("weight-range"), "{e}");
        let ok = "[global]\nactivation = { dtype = 'u8', observer = 'moving_average' }\nweight = { dtype = 's8', symmetric = true, per_channel = true }";
        assert!(QConfigMapping::from_toml(ok).is_ok());
    }

    #[test]
    fn tensor_config_to_spec() {
        let w = TensorQConfig { symmetric: true, per_channel: true, ..TensorQConfig::of(QType::S8) };
        let s = w.spec(Convention::Ort, Some(0), Some(1));
        assert_eq!(s.granularity, Granularity::PerAxis { axis: 0 });
        assert!(s.scheme.symmetric);
        let b = TensorQConfig { block_size: Some(32), ..TensorQConfig::of(QType::S4) };
        assert_eq!(b.spec(Convention::Ort, Some(0), Some(1)).granularity, Granularity::PerBlock { axis: 1, block_size: 32 });
        let h = TensorQConfig { observer: ObserverName::Histogram, range: RangeName::Entropy, ..TensorQConfig::of(QType::U8) };
        assert!(matches!(h.spec(Convention::Ort, None, None).observer, ObserverKind::Histogram { bins: 2048, .. }));
    }
}
