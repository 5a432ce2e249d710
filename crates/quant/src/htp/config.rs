//! The HTP config file (`--config` with `--backend htp`): per-node precision overrides, matched
//! by the QConfigMapping's levels (op type < scope regex < name < op-type order, see
//! [`crate::qconfig`]), and rule overrides per op type.
//!
//! ```toml
//! [rules]
//! Resize = "shared"                 # a common rule for an op type (see htp::rules::NAMED_RULES)
//!
//! [[op_type]]
//! op = "Softmax"
//! precision = "float"               # keep float
//!
//! [[scope_regex]]
//! regex = '^head'
//! precision = "16a8w"
//!
//! [[name]]
//! name = "/backbone/conv1/Conv"     # a node name, or a scope
//! precision = "16a8w"
//!
//! [[op_order]]
//! scope = ""                        # the whole graph
//! op = "Conv"
//! index = 0                         # the first Conv in topological order
//! precision = "16a8w"
//! ```

use std::collections::BTreeMap;

use regex::Regex;
use serde::{Deserialize, Deserializer};

use super::precision::{Precision, PrecisionOptions};
use super::HtpError;
use crate::qconfig::{QConfig, QConfigMapping};

/// What a config entry asks for a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePrecision {
    Float,
    Quantized(Precision),
}

impl NodePrecision {
    /// The QConfig (`None`: keep float).
    pub fn qconfig(self, options: PrecisionOptions) -> Option<QConfig> {
        match self {
            NodePrecision::Float => None,
            NodePrecision::Quantized(p) => Some(p.qconfig(options)),
        }
    }
}

impl<'de> Deserialize<'de> for NodePrecision {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "float" {
            return Ok(NodePrecision::Float);
        }
        s.parse().map(NodePrecision::Quantized).map_err(|e| serde::de::Error::custom(format!("{e}, or \"float\"")))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpTypeEntry {
    op: String,
    precision: NodePrecision,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScopeRegexEntry {
    regex: String,
    precision: NodePrecision,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameEntry {
    name: String,
    precision: NodePrecision,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpOrderEntry {
    #[serde(default)]
    scope: String,
    op: String,
    index: usize,
    precision: NodePrecision,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    rules: BTreeMap<String, String>,
    #[serde(default)]
    op_type: Vec<OpTypeEntry>,
    #[serde(default)]
    scope_regex: Vec<ScopeRegexEntry>,
    #[serde(default)]
    name: Vec<NameEntry>,
    #[serde(default)]
    op_order: Vec<OpOrderEntry>,
}

/// A parsed HTP config.
#[derive(Debug, Clone, Default)]
pub struct HtpConfig {
    /// Op type to the name of a common rule.
    pub rules: BTreeMap<String, String>,
    pub op_type: Vec<(String, NodePrecision)>,
    pub scope_regex: Vec<(Regex, NodePrecision)>,
    pub name: Vec<(String, NodePrecision)>,
    /// (scope, op type, occurrence index within the scope, precision).
    pub op_order: Vec<(String, String, usize, NodePrecision)>,
}

impl HtpConfig {
    /// Parses the TOML form (see the module docs). Errors name the entry.
    pub fn from_toml(text: &str) -> Result<HtpConfig, HtpError> {
        let f: File = toml::from_str(text).map_err(|e| HtpError::Config(e.to_string()))?;
        let scope_regex = f.scope_regex.into_iter().enumerate().map(|(i, e)| {
            Regex::new(&e.regex).map(|re| (re, e.precision)).map_err(|err| HtpError::Config(format!("[[scope_regex]] #{}: {err}", i + 1)))
        }).collect::<Result<_, _>>()?;
        Ok(HtpConfig {
            rules: f.rules,
            op_type: f.op_type.into_iter().map(|e| (e.op, e.precision)).collect(),
            scope_regex,
            name: f.name.into_iter().map(|e| (e.name, e.precision)).collect(),
            op_order: f.op_order.into_iter().map(|e| (e.scope, e.op, e.index, e.precision)).collect(),
        })
    }

    /// The QConfigMapping: `global` for every node, with this config's overrides.
    pub fn mapping(&self, global: Precision, options: PrecisionOptions) -> QConfigMapping {
        let q = |p: &NodePrecision| p.qconfig(options);
        QConfigMapping {
            global: Some(global.qconfig(options)),
            op_type: self.op_type.iter().map(|(op, p)| (op.clone(), q(p))).collect(),
            scope_regex: self.scope_regex.iter().map(|(re, p)| (re.clone(), q(p))).collect(),
            name: self.name.iter().map(|(n, p)| (n.clone(), q(p))).collect(),
            op_order: self.op_order.iter().map(|(s, op, i, p)| (s.clone(), op.clone(), *i, q(p))).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_section_and_names_bad_entries() {
        let c = HtpConfig::from_toml("[rules]\nResize = 'shared'\n[[name]]\nname = 'head'\nprecision = '16a8w'\n[[op_order]]\nop = 'Conv'\nindex = 0\nprecision = 'float'").unwrap();
        assert_eq!(c.rules["Resize"], "shared");
        assert_eq!(c.name, vec![("head".to_string(), NodePrecision::Quantized(Precision::A16W8))]);
        assert_eq!(c.op_order, vec![(String::new(), "Conv".to_string(), 0, NodePrecision::Float)]);
        let e = HtpConfig::from_toml("[[op_type]]\nop = 'Conv'\nprecision = '12a3w'").unwrap_err().to_string();
        assert!(e.contains("12a3w") && e.contains("float"), "{e}");
        let e = HtpConfig::from_toml("[[scope_regex]]\nregex = '('\nprecision = 'float'").unwrap_err().to_string();
        assert!(e.contains("[[scope_regex]] #1"), "{e}");
    }
}
