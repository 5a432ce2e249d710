//! The HTP quantizer: annotation modeled on Qualcomm's QNN quantizer for the Hexagon Tensor
//! Processor (PT2E style), on the shared prepare / calibrate / convert.
//!
//! * [`rules`]: the rule registry (`register_annotator`): per op type an annotate function and
//!   a validate function.
//! * [`precision`]: `8a8w`, `16a8w`, `16a16w`, `16a4w`, `8a4w`, `16a4w-block` as QConfigs.
//! * [`soc`]: HTP generations as data (`backends/htp/socs.toml`), what each one accepts.
//! * [`config`]: per-node precision overrides and per-op rule overrides from a TOML file,
//!   matched with the QConfigMapping's code.
//!
//! [`HtpQuantizer::annotate`] assigns each node a QConfig (the global precision, or an
//! override) and runs the registry; [`HtpQuantizer::validate`] checks the annotations against
//! the chosen generation and returns, per node, the rule broken and the fix.

pub mod config;
pub mod precision;
pub mod rules;
pub mod soc;

use std::collections::HashSet;

use qforge_ir::{Graph, NodeId};

pub use config::{HtpConfig, NodePrecision};
pub use precision::{Precision, PrecisionOptions, UnknownPrecision};
pub use rules::{OpRule, RuleRegistry};
pub use soc::{Generation, SocError, SocTable};

use crate::annotation::Annotations;
use crate::qconfig::QConfigMapping;
use crate::quantizer::{Quantizer, Violation};

/// Errors building an HTP quantizer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HtpError {
    #[error(transparent)]
    Soc(#[from] SocError),
    #[error("HTP config: {0}")]
    Config(String),
    #[error("HTP config: [rules] {op} = \"{rule}\": unknown rule; use one of {known}")]
    UnknownRule { op: String, rule: String, known: String },
    #[error("the block size must be at least 1")]
    BlockSize,
}

/// What an HTP quantizer is asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct HtpOptions {
    /// The precision of every node without an override.
    pub precision: Precision,
    pub precision_options: PrecisionOptions,
    /// A generation or chip of the table; the newest generation when `None`.
    pub soc: Option<String>,
}

/// The HTP quantizer: a rule registry, each node's QConfig, and the generation to validate against.
#[derive(Debug, Clone)]
pub struct HtpQuantizer {
    pub registry: RuleRegistry,
    pub mapping: QConfigMapping,
    pub table: SocTable,
    pub generation: Generation,
    /// How precisions become QConfigs (also for the nodes [`Quantizer::annotate_wider`] widens).
    pub precision_options: PrecisionOptions,
}

impl HtpQuantizer {
    /// The quantizer for `options` with the built-in rules and table, and the overrides of
    /// `config` (per-node precisions, per-op rules).
    pub fn new(options: &HtpOptions, config: Option<&HtpConfig>) -> Result<HtpQuantizer, HtpError> {
        if options.precision_options.block_size == 0 {
            return Err(HtpError::BlockSize);
        }
        let table = SocTable::builtin();
        let generation = match &options.soc {
            Some(name) => table.find(name)?.clone(),
            None => table.newest().clone(),
        };
        let mut registry = RuleRegistry::htp();
        let default = HtpConfig::default();
        let config = config.unwrap_or(&default);
        for (op, name) in &config.rules {
            let rule = RuleRegistry::named(name).ok_or_else(|| HtpError::UnknownRule {
                op: op.clone(),
                rule: name.clone(),
                known: rules::NAMED_RULES.iter().map(|r| r.name).collect::<Vec<_>>().join(", "),
            })?;
            registry.register(op, rule);
        }
        let mapping = config.mapping(options.precision, options.precision_options);
        Ok(HtpQuantizer { registry, mapping, table, generation, precision_options: options.precision_options })
    }
}

impl Quantizer for HtpQuantizer {
    fn annotate(&self, g: &Graph) -> Annotations {
        self.registry.annotate(g, &self.mapping.assign(g))
    }

    fn validate(&self, g: &Graph, a: &Annotations) -> Vec<Violation> {
        self.registry.validate(g, a, &self.table, &self.generation)
    }

    /// HTP ops compute in their annotated integer types; the QNN EP turns `DQ -> Q` into a
    /// Convert op, and rejects a Conv whose output type differs from its input's.
    fn typed_outputs(&self) -> bool {
        true
    }

    /// The nodes of `wider` that take the global precision and have 8-bit activations take
    /// the same precision with 16-bit activations; a config entry naming a node's precision
    /// (any level) keeps it.
    fn annotate_wider(&self, g: &Graph, wider: &HashSet<NodeId>) -> Option<Annotations> {
        let mut qconfigs = self.mapping.assign(g);
        let mut widened = false;
        for n in wider {
            let Some((Some(q), "global")) = qconfigs.get_mut(n) else { continue };
            if let Some(p) = Precision::of_qconfig(q).and_then(Precision::with_16bit_activations) {
                *q = p.qconfig(self.precision_options);
                widened = true;
            }
        }
        widened.then(|| self.registry.annotate(g, &qconfigs))
    }
}
