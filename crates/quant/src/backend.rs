//! BackendConfig: what a deployment target supports, as data (one TOML file per target).
//!
//! This is the single source of what a target can run quantized: its supported patterns, the
//! dtype combinations each pattern accepts (with constraints on ranges and scales), and how
//! the pattern's output is observed. Built-in targets live in `backends/*.toml` at the
//! repository root and are compiled in; users can load their own file.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::pattern::Pattern;
use crate::spec::{Granularity, QuantizationSpec};
use crate::{Convention, QType};

/// An element type in a dtype config: a quantized integer type, or `"f32"` (not quantized).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfigDType {
    Float,
    Int(QType),
}

impl<'de> Deserialize<'de> for ConfigDType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        if name == "f32" {
            return Ok(ConfigDType::Float);
        }
        QType::deserialize(serde::de::value::StrDeserializer::<D::Error>::new(&name)).map(ConfigDType::Int)
    }
}

impl ConfigDType {
    /// The integer type, or `None` for float.
    pub fn qtype(self) -> Option<QType> {
        match self {
            ConfigDType::Int(q) => Some(q),
            ConfigDType::Float => None,
        }
    }
}

/// Which granularities a target accepts for a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GranularityKind {
    PerTensor,
    PerChannel,
    PerBlock,
}

impl GranularityKind {
    pub fn of(g: &Granularity) -> GranularityKind {
        match g {
            Granularity::PerTensor => GranularityKind::PerTensor,
            Granularity::PerAxis { .. } => GranularityKind::PerChannel,
            Granularity::PerBlock { .. } => GranularityKind::PerBlock,
        }
    }
}

/// A dtype with the target's constraints on how it may be quantized
/// (PyTorch's `DTypeWithConstraints`, plus symmetry and granularity).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DTypeWithConstraints {
    pub dtype: ConfigDType,
    pub quant_min_lower_bound: Option<i64>,
    pub quant_max_upper_bound: Option<i64>,
    pub scale_min_lower_bound: Option<f32>,
    pub scale_max_upper_bound: Option<f32>,
    /// The target needs exactly this scale (fixed-qparams ops).
    pub scale_exact_match: Option<f32>,
    pub zero_point_exact_match: Option<i64>,
    /// The target needs symmetric (`true`) or accepts only affine (`false`) quantization.
    pub symmetric: Option<bool>,
    /// Accepted granularities; all when absent.
    pub granularity: Option<Vec<GranularityKind>>,
    /// Accepted block sizes for per-block quantization; all when absent.
    pub block_sizes: Option<Vec<usize>>,
    /// Weights: the largest `|a| + |b|` of two same-sign integers the target's kernel adds
    /// into one saturating 16-bit sum (ONNX Runtime's x86 u8 x s8 kernels without VNNI; which
    /// weights pair up is [`crate::pair_sums::reduction_pairs`]). Absent: sums never saturate.
    pub pair_sum_max: Option<i64>,
}

impl DTypeWithConstraints {
    /// The integer range the target takes, when it bounds the dtype's range (an unbounded
    /// end is the dtype's own).
    pub fn bounds(&self) -> Option<(i64, i64)> {
        let (lo, hi) = self.dtype.qtype()?.range();
        match (self.quant_min_lower_bound, self.quant_max_upper_bound) {
            (None, None) => None,
            (l, h) => Some((l.unwrap_or(lo), h.unwrap_or(hi))),
        }
    }

    /// Why `spec` violates these constraints, or `None` when it satisfies them.
    pub fn violation(&self, spec: &QuantizationSpec) -> Option<String> {
        let want = self.dtype.qtype()?;
        let s = &spec.scheme;
        if s.qtype != want {
            return Some(format!("dtype {:?} is requested, the target takes {:?}", s.qtype, want));
        }
        let (qmin, qmax) = s.qrange();
        if self.quant_min_lower_bound.is_some_and(|lb| qmin < lb) || self.quant_max_upper_bound.is_some_and(|ub| qmax > ub) {
            let (lo, hi) = self.bounds().expect("a bound is set");
            return Some(format!("range [{qmin}, {qmax}] exceeds the target's [{lo}, {hi}] (a qconfig's quant_range = [{lo}, {hi}] fits it)"));
        }
        if let Some(sym) = self.symmetric {
            if sym != s.symmetric {
                return Some(format!("the target needs {} quantization", if sym { "symmetric" } else { "affine" }));
            }
        }
        if let Some(g) = &self.granularity {
            if !g.contains(&GranularityKind::of(&spec.granularity)) {
                return Some(format!("{:?} quantization is not supported (the target takes {g:?})", GranularityKind::of(&spec.granularity)));
            }
        }
        if let (Some(sizes), Granularity::PerBlock { block_size, .. }) = (&self.block_sizes, spec.granularity) {
            if !sizes.contains(&block_size) {
                return Some(format!("block size {block_size} is not supported (the target takes {sizes:?})"));
            }
        }
        if let (Some(lb), Some(min)) = (self.scale_min_lower_bound, spec.scale_min) {
            if min < lb {
                return Some(format!("scale lower bound {min} is below the target's {lb}"));
            }
        }
        None
    }
}

/// Supported dtypes for one pattern's input activation, output, weight and bias
/// (PyTorch's `DTypeConfig`). An absent entry means float.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DTypeConfig {
    pub input: Option<DTypeWithConstraints>,
    pub output: Option<DTypeWithConstraints>,
    pub weight: Option<DTypeWithConstraints>,
    pub bias: Option<ConfigDType>,
    /// Dynamic quantization: activations are quantized at run time.
    #[serde(default)]
    pub is_dynamic: bool,
}

/// How a pattern's output is observed relative to its input (PyTorch's `ObservationType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ObservationType {
    /// The output gets its own observer (conv, linear, add, ...).
    #[default]
    OutputUseDifferentObserverAsInput,
    /// The output shares the input's observer: data movement, max pooling, concat.
    OutputShareObserverWithInput,
    /// The pattern is quantized only through its neighbours: no observer of its own.
    InputOutputNotObserved,
}

/// One supported pattern (PyTorch's `BackendPatternConfig`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendPatternConfig {
    pub pattern: Pattern,
    #[serde(default)]
    pub observation: ObservationType,
    /// Names of entries of [`BackendConfig::dtype_configs`], in order of preference.
    pub dtype_configs: Vec<String>,
    /// Input indices of the pattern's root that are weights when they are constants (one that
    /// is not is quantized as an activation). The root is the innermost op along first inputs
    /// (`Conv` in `Relu(Conv)`), the one carrying weight and bias.
    #[serde(default)]
    pub weight_inputs: Vec<usize>,
    /// Input indices of the root that are biases.
    #[serde(default)]
    pub bias_inputs: Vec<usize>,
    /// Input indices of the anchor's inputs that are activations to observe; all non-weight,
    /// non-bias inputs when absent.
    pub activation_inputs: Option<Vec<usize>>,
    /// The target runs the pattern with quantized inputs and a float output (ONNX Runtime's
    /// QGemm without an output scale; TensorRT's int8 Conv and GEMM with a float output). Where no quantized input reads a weighted unit's output, the
    /// output then stays float: its Q/DQ would only add error.
    #[serde(default)]
    pub float_output: bool,
}

/// A deployment target.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Which reference the target's qparams follow.
    pub convention: Convention,
    pub dtype_configs: BTreeMap<String, DTypeConfig>,
    pub patterns: Vec<BackendPatternConfig>,
}

/// Built-in targets: name and TOML text.
const BUILTIN: &[(&str, &str)] = &[
    ("x86", include_str!("../../../backends/x86.toml")),
    ("xnnpack", include_str!("../../../backends/xnnpack.toml")),
    ("tensorrt", include_str!("../../../backends/tensorrt.toml")),
    ("ort", include_str!("../../../backends/ort.toml")),
];

/// Errors loading a backend config.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("unknown backend '{0}'; built-in backends are {1}, or give a path to a .toml file")]
    Unknown(String, String),
    #[error("backend config {source_name}: {reason}")]
    Invalid { source_name: String, reason: String },
    #[error("backend config {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

impl BackendConfig {
    /// Names of the built-in targets.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTIN.iter().map(|(n, _)| *n).collect()
    }

    /// A built-in target by name, or a config file when `name_or_path` ends in `.toml`.
    pub fn load(name_or_path: &str) -> Result<BackendConfig, BackendError> {
        if name_or_path.ends_with(".toml") {
            let text = std::fs::read_to_string(Path::new(name_or_path))
                .map_err(|source| BackendError::Io { path: name_or_path.to_string(), source })?;
            return Self::from_toml(&text, name_or_path);
        }
        let (_, text) = BUILTIN.iter().find(|(n, _)| *n == name_or_path)
            .ok_or_else(|| BackendError::Unknown(name_or_path.to_string(), Self::builtin_names().join(", ")))?;
        Self::from_toml(text, name_or_path)
    }

    /// Parses and validates a config (every referenced dtype config exists, patterns are
    /// non-empty).
    pub fn from_toml(text: &str, source_name: &str) -> Result<BackendConfig, BackendError> {
        let invalid = |reason: String| BackendError::Invalid { source_name: source_name.to_string(), reason };
        let cfg: BackendConfig = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        for p in &cfg.patterns {
            if p.pattern.size() == 0 {
                return Err(invalid(format!("pattern '{}' has no op", p.pattern)));
            }
            for d in &p.dtype_configs {
                if !cfg.dtype_configs.contains_key(d) {
                    return Err(invalid(format!("pattern '{}' names dtype config '{d}', which is not defined", p.pattern)));
                }
            }
        }
        Ok(cfg)
    }

    /// Patterns whose anchor can be `op_type`, largest first (so fused patterns win).
    pub fn patterns_for(&self, op_type: &str) -> Vec<&BackendPatternConfig> {
        let mut v: Vec<_> = self.patterns.iter().filter(|p| p.pattern.anchor_ops().iter().any(|o| o == op_type)).collect();
        v.sort_by_key(|p| std::cmp::Reverse(p.pattern.size()));
        v
    }

    pub fn dtype_config(&self, name: &str) -> Option<&DTypeConfig> {
        self.dtype_configs.get(name)
    }

    /// The integer types some pattern of the target takes for a weight, in [`QType`] order.
    pub fn weight_qtypes(&self) -> Vec<QType> {
        let used = self.patterns.iter().flat_map(|p| &p.dtype_configs).filter_map(|n| self.dtype_config(n));
        let set: std::collections::BTreeSet<QType> = used.filter_map(|d| d.weight.as_ref()?.dtype.qtype()).collect();
        set.into_iter().collect()
    }

    /// The `pair_sum_max` the target declares for weights of `qtype`, if any.
    pub fn pair_sum_max(&self, qtype: QType) -> Option<i64> {
        self.dtype_configs.values().filter_map(|d| d.weight.as_ref()).find(|w| w.dtype.qtype() == Some(qtype))?.pair_sum_max
    }

    /// The fixed output qparams `(scale, zero point)` the target gives op `op_type` alone at
    /// `qtype`: the `scale_exact_match` of a single-op pattern's output (Sigmoid, Softmax, Tanh:
    /// outputs bounded by the op's definition). `None` when no such pattern fixes them.
    pub fn fixed_output(&self, op_type: &str, qtype: QType) -> Option<(f32, i64)> {
        self.patterns_for(op_type).into_iter().filter(|p| p.pattern.size() == 1)
            .flat_map(|p| p.dtype_configs.iter().filter_map(|d| self.dtype_config(d)?.output.as_ref()))
            .find_map(|o| match (o.dtype.qtype(), o.scale_exact_match) {
                (Some(q), Some(scale)) if q == qtype => Some((scale, o.zero_point_exact_match.unwrap_or(0))),
                _ => None,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_parse_and_validate() {
        for name in BackendConfig::builtin_names() {
            let b = BackendConfig::load(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(b.name, name);
            assert!(!b.patterns_for("Conv").is_empty(), "{name} quantizes Conv");
        }
        assert!(matches!(BackendConfig::load("nope"), Err(BackendError::Unknown(..))));
    }

    #[test]
    fn bad_configs_are_rejected_with_reasons() {
        let text = r#"
            name = "t"
            convention = "pytorch"
            [dtype_configs.a]
            input = { dtype = "u8" }
            [[patterns]]
            pattern = "Conv"
            dtype_configs = ["missing"]
        "#;
        let e = BackendConfig::from_toml(text, "t.toml").unwrap_err().to_string();
        assert!(e.contains("'missing'"), "{e}");
        let e = BackendConfig::from_toml("name = 1", "t.toml").unwrap_err().to_string();
        assert!(e.contains("t.toml"), "{e}");
    }

    #[test]
    fn larger_patterns_come_first() {
        let b = BackendConfig::load("x86").unwrap();
        let sizes: Vec<usize> = b.patterns_for("Relu").iter().map(|p| p.pattern.size()).collect();
        assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
        assert!(sizes[0] >= 2);
    }
}
