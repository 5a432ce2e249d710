//! HTP generations as data (`backends/htp/socs.toml`): per generation the precisions its
//! weighted ops run, and per op type the constraints that need a newer generation.

use serde::Deserialize;

use super::precision::Precision;

/// One HTP generation (`v68`, `v69`, ...).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generation {
    pub name: String,
    /// Chips with this generation, e.g. `"SM8550"`.
    #[serde(default)]
    pub chips: Vec<String>,
    #[serde(default)]
    pub description: String,
    /// Precisions of weighted ops (Conv, ConvTranspose, Gemm, MatMul with a constant weight).
    pub precisions: Vec<Precision>,
}

/// A constraint on some op types: when a node matches the condition, the generation must be
/// `since` or newer.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpConstraint {
    pub ops: Vec<String>,
    /// Width of the quantized activation inputs the constraint is about.
    pub activation_bits: u32,
    /// How many such inputs (at least) trigger it.
    pub activation_inputs: usize,
    /// The oldest generation that accepts it.
    pub since: String,
    /// What the constraint is about, for messages.
    pub rule: String,
}

/// The generations table.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SocTable {
    /// Oldest first.
    pub generation: Vec<Generation>,
    #[serde(default)]
    pub op_constraint: Vec<OpConstraint>,
}

/// Errors reading the table or choosing a generation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SocError {
    #[error("HTP table {source_name}: {reason}")]
    Invalid { source_name: String, reason: String },
    #[error("unknown --soc '{name}'; use a generation ({generations}) or a chip ({chips})")]
    Unknown { name: String, generations: String, chips: String },
}

const BUILTIN: &str = include_str!("../../../../backends/htp/socs.toml");

impl SocTable {
    /// The table shipped in `backends/htp/socs.toml`.
    pub fn builtin() -> SocTable {
        SocTable::from_toml(BUILTIN, "backends/htp/socs.toml").expect("the built-in HTP table is valid")
    }

    /// Parses and checks a table: names are unique, and every constraint names a known generation.
    pub fn from_toml(text: &str, source_name: &str) -> Result<SocTable, SocError> {
        let invalid = |reason: String| SocError::Invalid { source_name: source_name.to_string(), reason };
        let t: SocTable = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if t.generation.is_empty() {
            return Err(invalid("no generation is listed".into()));
        }
        for (i, g) in t.generation.iter().enumerate() {
            if t.generation[..i].iter().any(|o| o.name == g.name) {
                return Err(invalid(format!("generation '{}' is listed twice", g.name)));
            }
        }
        for c in &t.op_constraint {
            if t.index(&c.since).is_none() {
                return Err(invalid(format!("constraint '{}' names generation '{}', which is not listed", c.rule, c.since)));
            }
        }
        Ok(t)
    }

    fn index(&self, name: &str) -> Option<usize> {
        self.generation.iter().position(|g| g.name == name)
    }

    /// The generation named `name` (`"v73"`) or holding chip `name` (`"SM8550"`), case-insensitively.
    pub fn find(&self, name: &str) -> Result<&Generation, SocError> {
        let same = |a: &str| a.eq_ignore_ascii_case(name);
        self.generation.iter().find(|g| same(&g.name) || g.chips.iter().any(|c| same(c))).ok_or_else(|| SocError::Unknown {
            name: name.to_string(),
            generations: self.generation.iter().map(|g| g.name.as_str()).collect::<Vec<_>>().join(", "),
            chips: self.generation.iter().flat_map(|g| &g.chips).map(String::as_str).collect::<Vec<_>>().join(", "),
        })
    }

    /// The newest generation.
    pub fn newest(&self) -> &Generation {
        self.generation.last().expect("the table lists at least one generation")
    }

    /// The oldest generation whose weighted ops run `p`.
    pub fn oldest_with(&self, p: Precision) -> Option<&Generation> {
        self.generation.iter().find(|g| g.precisions.contains(&p))
    }

    /// Whether generation `g` is `since` or newer (table order).
    pub fn at_least(&self, g: &Generation, since: &str) -> bool {
        match (self.index(&g.name), self.index(since)) {
            (Some(a), Some(b)) => a >= b,
            _ => false,
        }
    }
}

impl Generation {
    /// The supported precision closest to `wanted`: same activation width first, then same
    /// weight width, then the widest weights.
    pub fn closest(&self, wanted: Precision) -> Option<Precision> {
        let bits = |q: crate::QType| q.range().1;
        self.precisions.iter().copied().max_by_key(|p| (p.activation() == wanted.activation(), p.weight() == wanted.weight(), bits(p.weight())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_table_loads_and_finds_by_name_or_chip() {
        let t = SocTable::builtin();
        assert_eq!(t.find("V73").unwrap().name, "v73");
        assert_eq!(t.find("sm8650").unwrap().name, "v75");
        let e = t.find("v42").unwrap_err().to_string();
        assert!(e.contains("v68") && e.contains("SM8550"), "{e}");
    }

    #[test]
    fn bad_tables_name_the_problem() {
        let e = SocTable::from_toml("[[generation]]\nname = 'a'\nprecisions = ['8a8w']\n[[op_constraint]]\nops = ['X']\nactivation_bits = 16\nactivation_inputs = 1\nsince = 'b'\nrule = 'r'", "t.toml").unwrap_err();
        assert!(e.to_string().contains("'b'"), "{e}");
        let e = SocTable::from_toml("[[generation]]\nname = 'a'\nprecisions = ['9a9w']", "t.toml").unwrap_err();
        assert!(e.to_string().contains("9a9w"), "{e}");
    }
}
