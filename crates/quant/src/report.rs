//! The quantization report: every node with whether it was quantized and why not, every
//! quantized activation with its observed range and qparams, every quantized constant.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::annotation::FloatKind;
use crate::convert::ConvertLog;
use crate::prepare::QuantPlan;
use crate::spec::Granularity;
use crate::QType;

/// One node's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct NodeRecord {
    pub graph: String,
    pub name: String,
    pub op: String,
    pub quantized: bool,
    /// The backend pattern and dtype config that quantized it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<FloatKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One activation given Q/DQ.
#[derive(Debug, Clone, Serialize)]
pub struct ActivationRecord {
    pub graph: String,
    pub value: String,
    /// Values with the same group share one observer and one set of qparams.
    pub group: usize,
    pub dtype: String,
    pub scale: f32,
    pub zero_point: i64,
    /// The real values the integer type represents with these qparams,
    /// `scale·(qmin − zero_point)` to `scale·(qmax − zero_point)` over the type's full range
    /// (what QuantizeLinear saturates to).
    pub clip_range: (f32, f32),
    /// The observed extremes `[min, max]`.
    pub observed: Option<(f32, f32)>,
    /// The qparams are fixed by the target (e.g. Sigmoid's output).
    pub fixed: bool,
    /// NaN/Inf values seen during calibration (left out of the range).
    pub nonfinite: u64,
    /// The range's lower end when set by the value's floor (`Group::floor_for`): nothing below
    /// it changes a result (a Softmax input more than `SOFTMAX_SPAN` below every row's
    /// maximum, or an attention mask added to one; see `QuantPlan::settle_floors`).
    pub floor: Option<f32>,
    /// Set when the range was not observed but follows from another value's: the monotone map
    /// (a scalar Add, Mul, Clip, Relu, ...) of that value, e.g. `min(max(conv_out + 3, 0), 6)`.
    /// Its extremes are exact; a histogram's bins are the source's carried through the map.
    pub derived: Option<String>,
}

/// One constant stored quantized.
#[derive(Debug, Clone, Serialize)]
pub struct ConstantRecord {
    pub graph: String,
    pub value: String,
    pub dtype: String,
    pub granularity: Granularity,
    /// Number of scales.
    pub scales: usize,
}

/// An annotated node that breaks the target's rules (from the quantizer's `validate`).
#[derive(Debug, Clone, Serialize)]
pub struct ViolationRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub rule: String,
    pub fix: String,
}

impl ViolationRecord {
    /// The record of violation `v` of graph `g` (named `graph`).
    pub fn new(graph: &str, g: &qforge_ir::Graph, v: crate::quantizer::Violation) -> ViolationRecord {
        let node = g.node(v.node).ok();
        ViolationRecord {
            graph: graph.to_string(),
            node: node.map(|x| x.display_name(v.node)).unwrap_or_default(),
            op: node.map(|x| x.qualified_op()).unwrap_or_default(),
            rule: v.rule,
            fix: v.fix,
        }
    }
}

impl std::fmt::Display for ViolationRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node '{}' ({}, graph '{}'): {}; fix: {}", self.node, self.op, self.graph, self.rule, self.fix)
    }
}

/// What a quantization run did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub samples: usize,
    /// BatchNormalization and constant Mul/Add/Sub/Div nodes folded into weights.
    pub affine_folded: usize,
    /// MatMul + Add(bias) pairs rewritten as one Gemm.
    pub matmul_add_fused: usize,
    /// Loop-carried constants (weights) that their Loop passes on unchanged, now read from the
    /// enclosing graph and quantized as weights.
    pub loop_carried_uncarried: usize,
    /// Loop-invariant nodes moved out of Loop bodies, computed once per Loop run.
    pub loop_invariants_hoisted: usize,
    /// Graph inputs with an initializer (every weight, in ONNX IR 3 models) quantized as
    /// constants; the output no longer lists them as inputs.
    pub constant_inputs: Vec<String>,
    /// How a model computing in float16/bfloat16 was made to compute in float32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upcast: Option<crate::passes::Upcast>,
    /// Default-domain opset before and after.
    pub opset: (i64, i64),
    pub calibration_seconds: f64,
    pub total_seconds: f64,
    pub nodes: Vec<NodeRecord>,
    pub activations: Vec<ActivationRecord>,
    /// Activations planned for Q/DQ but left float: (graph, value, reason).
    pub skipped: Vec<(String, String, String)>,
    pub constants: Vec<ConstantRecord>,
    /// Weights whose scale was enlarged so their bias fits int32: (weight, channels).
    pub bias_adjusted: Vec<(String, usize)>,
    /// Whether weight scales were chosen by least squared error (`--weight-range mse`).
    pub weight_range_search: bool,
    /// The weights the range search narrowed: the factor applied to each channel's min/max
    /// scale (1 where it kept min/max).
    pub weight_ranges: Vec<WeightRangeRecord>,
    /// Whether bias correction ran ([`crate::bias_correction`]).
    pub bias_correction_enabled: bool,
    /// Bias correction, node by node: the float shift added to each output channel's bias.
    pub bias_correction: Vec<BiasCorrectionRecord>,
    /// Weighted nodes bias correction left alone: (graph, node, op, reason).
    pub bias_uncorrected: Vec<(String, String, String, String)>,
    /// Whether weights were rounded by GPTQ ([`crate::weight_rounding`]).
    pub gptq_enabled: bool,
    /// GPTQ rounding, node by node, with its output error proxy against nearest rounding.
    pub gptq: Vec<GptqRecord>,
    /// Weighted nodes GPTQ left at nearest rounding: (graph, node, op, reason).
    pub gptq_skipped: Vec<(String, String, String, String)>,
    /// Annotated nodes that break the target's rules.
    pub violations: Vec<ViolationRecord>,
    /// Nodes given wider activations than their precision's, so that a narrow Concat input
    /// keeps its resolution (calibration ran again with them).
    pub widened: Vec<WidenedRecord>,
    /// Inputs of Concat-like nodes (output sharing its inputs' qparams) that keep fewer than
    /// [`crate::convert::FEW_LEVELS`] levels of the output's qparams.
    pub narrow_inputs: Vec<NarrowInputRecord>,
    /// Weights with one scale per tensor whose output channels keep fewer than
    /// [`crate::convert::FEW_WEIGHT_LEVELS`] levels of it.
    pub narrow_weight_channels: Vec<NarrowWeightRecord>,
    /// Weights whose integers were fitted so that no two the target's kernel pairs overflow its
    /// 16-bit sums (the weight dtype's `pair_sum_max`, [`crate::pair_sums`]).
    pub pair_sums: Vec<PairSumRecord>,
    /// Input channels whose maxima the output check's samples raised: in the quantized model
    /// their activations went beyond the reach the float model's calibrated maxima gave, and
    /// the weights reading them were fitted again ([`crate::pipeline::convert_logged`]).
    pub pair_sum_reach_raised: usize,
    /// Input channels still beyond their reach in the quantized model after the last refit
    /// ([`crate::pipeline::MAX_REACH_REFITS`]).
    pub pair_sum_reach_exceeded: usize,
    /// What an accuracy budget returned to float, decision by decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy_budget: Option<crate::sensitivity::BudgetOutcome>,
    /// What lowering to integer operators did (`--format qoperator`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lowering: Option<LoweringRecord>,
    /// The quantized model's outputs against the float model's on a few calibration samples
    /// ([`crate::pipeline::QuantizeOptions::check_samples`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_check: Option<OutputCheck>,
}

/// The graph outputs of the quantized model, run by qforge's runtime, compared with the float
/// model's that calibration computed, on `samples` calibration samples spread over the set:
/// the figure of how much a quantization run lost, given with every run.
#[derive(Debug, Clone, Serialize)]
pub struct OutputCheck {
    pub samples: usize,
    pub outputs: Vec<crate::compare::TensorComparison>,
    /// Wall time of the check (of every check, when convert refitted weights and checked
    /// again), outside the report's `total_seconds`.
    pub seconds: f64,
}

impl OutputCheck {
    /// Below this SQNR (a relative RMS error above 32 %) an output is called far from float.
    /// ocr_det's text map keeps its detection F1 at 12.5 dB; a mel spectrogram at 4 dB or a
    /// layout detector at 2 dB does not.
    pub const POOR_SQNR_DB: f64 = 10.0;

    /// One line per output, and a warning for each output far from the float model's.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for o in &self.outputs {
            let m = &o.metrics;
            if let Some(e) = o.exact {
                let _ = writeln!(s, "check: output '{}' (not float) against float on {} calibration sample(s): {} of {} elements equal ({:.2} s)", o.name, self.samples, e.equal, e.count, self.seconds);
                continue;
            }
            let _ = writeln!(s, "check: output '{}' against float on {} calibration sample(s): SQNR {:.2} dB, cosine {:.5}, max |error| {:.4e} ({:.2} s)", o.name, self.samples, m.sqnr_db, m.cosine, m.max_abs_error, self.seconds);
            if m.sqnr_db < Self::POOR_SQNR_DB {
                let _ = writeln!(s, "warning: output '{}' is far from the float model's (SQNR {:.2} dB < {} dB); check it on the task's own metric: `qforge sensitivity` ranks what causes it, and --min-sqnr DB returns the most sensitive groups to float until every output reaches DB", o.name, m.sqnr_db, Self::POOR_SQNR_DB);
            }
        }
        s
    }
}

/// An input of a node whose output shares its qparams, narrow against the output's range.
#[derive(Debug, Clone, Serialize)]
pub struct NarrowInputRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub value: String,
    /// Integer levels of the output's qparams the input's observed range spans.
    pub levels: u64,
    /// The input's observed extremes.
    pub observed: (f32, f32),
    /// What the output's qparams represent.
    pub output_range: (f32, f32),
}

impl std::fmt::Display for NarrowInputRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} '{}' ({}) quantizes its input '{}' over the output's [{:.4}, {:.4}]: the input's range [{:.4}, {:.4}] gets {} level(s); \
            a wider type (16 bits) for that node or keeping it in float keeps the input's resolution",
            self.op, self.node, self.graph, self.value, self.output_range.0, self.output_range.1, self.observed.0, self.observed.1, self.levels)
    }
}

/// A node whose activations the quantizer widened because an input of a Concat (the node, or
/// the Concat whose output the node carries on with its qparams) spanned few levels of the
/// Concat's output qparams.
#[derive(Debug, Clone, Serialize)]
pub struct WidenedRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    /// The output's integer type before and after.
    pub from: QType,
    pub to: QType,
    /// The Concat with the narrow input, and that input.
    pub concat: String,
    pub value: String,
    /// Levels of the Concat's output qparams before widening the input's range spanned.
    pub levels: u64,
}

impl std::fmt::Display for WidenedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (from, to) = (format!("{:?}", self.from).to_lowercase(), format!("{:?}", self.to).to_lowercase());
        if self.node == self.concat {
            write!(f, "{} '{}' ({}) takes {to} activations instead of {from}: its input '{}' spanned {} level(s) of the {from} output", self.op, self.node, self.graph, self.value, self.levels)
        } else {
            write!(f, "{} '{}' ({}) takes {to} activations instead of {from}: it carries on the output of Concat '{}', whose input '{}' spanned {} level(s) of {from}", self.op, self.node, self.graph, self.concat, self.value, self.levels)
        }
    }
}

/// A per-tensor weight some of whose output channels span few levels of its one scale.
#[derive(Debug, Clone, Serialize)]
pub struct NarrowWeightRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub weight: String,
    /// Output channels spanning fewer than [`crate::convert::FEW_WEIGHT_LEVELS`] levels.
    pub narrow_channels: usize,
    pub channels: usize,
    /// The fewest levels any output channel spans.
    pub fewest_levels: u64,
}

impl std::fmt::Display for NarrowWeightRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "weight '{}' of {} '{}' ({}) has one scale for the whole tensor: {} of its {} output channels span fewer than {} levels of it (the fewest {}); \
            per-channel weights (the default, unless --per-tensor or the backend asks otherwise) give each channel its own scale",
            self.weight, self.op, self.node, self.graph, self.narrow_channels, self.channels, crate::convert::FEW_WEIGHT_LEVELS, self.fewest_levels)
    }
}

/// One weight fitted to the target's `pair_sum_max` ([`crate::pair_sums`]).
#[derive(Debug, Clone, Serialize)]
pub struct PairSumRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub weight: String,
    /// Channels (scale parameters) whose scale rose above min/max so that their pairs fit.
    pub rescaled: usize,
    pub channels: usize,
    /// Pairs whose integers were pulled in onto the constraint.
    pub projected_pairs: usize,
    /// Fitted for every input channel at 255: the activation has no measured reach (its
    /// channels seen fewer than [`crate::pair_sums::REACH_MIN_VALUES`] times each, as a pooled
    /// feature's are, not observed, or not read as u8).
    pub full_reach: bool,
}

/// The scales the weight range search chose for one weight.
#[derive(Debug, Clone, Serialize)]
pub struct WeightRangeRecord {
    pub graph: String,
    pub value: String,
    /// Channels whose scale is below its min/max scale.
    pub narrowed: usize,
    /// Per channel, the chosen scale over the min/max scale.
    pub factors: Vec<f32>,
}

/// The bias correction of one node.
#[derive(Debug, Clone, Serialize)]
pub struct BiasCorrectionRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    /// The largest `|shift|` over the output channels.
    pub max_abs_shift: f32,
    /// The float value added to the bias of each output channel.
    pub shift: Vec<f32>,
}

/// The GPTQ rounding of one weight: the output error proxy `Σ (w − ŵ)ᵀ H (w − ŵ)` over its
/// outputs (`H`: the second moments of its input on the calibration data) with nearest
/// rounding and with GPTQ's.
#[derive(Debug, Clone, Serialize)]
pub struct GptqRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub nearest_error: f64,
    pub gptq_error: f64,
}

/// One QDQ unit rewritten into integer operators.
#[derive(Debug, Clone, Serialize)]
pub struct LoweredRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    /// What it became (e.g. `QLinearConv`, `ConvInteger+Cast+Mul`, `MaxPool on integers`).
    pub into: String,
}

/// One QDQ unit left as it was by lowering, with the reason.
#[derive(Debug, Clone, Serialize)]
pub struct NotLoweredRecord {
    pub graph: String,
    pub node: String,
    pub op: String,
    pub reason: String,
}

/// What lowering the QDQ model to integer operators did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoweringRecord {
    /// Units lowered, counted by what they became.
    pub lowered: BTreeMap<String, usize>,
    pub units: Vec<LoweredRecord>,
    /// Units that stay QDQ, each with its node and why.
    pub not_lowered: Vec<NotLoweredRecord>,
    /// `DequantizeLinear -> QuantizeLinear` pairs with equal qparams removed.
    pub qdq_pairs_removed: usize,
    /// Op histogram of the lowered model (every graph).
    pub ops_after: BTreeMap<String, usize>,
}

impl LoweringRecord {
    /// The record of a lowering log and the op histogram of the lowered model.
    pub fn new(log: &crate::passes::LowerLog, ops_after: BTreeMap<String, usize>) -> LoweringRecord {
        let mut lowered = BTreeMap::new();
        for u in &log.lowered {
            *lowered.entry(u.into.clone()).or_default() += 1;
        }
        LoweringRecord {
            lowered,
            units: log.lowered.iter().map(|u| LoweredRecord { graph: u.graph.clone(), node: u.node.clone(), op: u.op.clone(), into: u.into.clone() }).collect(),
            not_lowered: log.not_lowered.iter().map(|u| NotLoweredRecord { graph: u.graph.clone(), node: u.node.clone(), op: u.op.clone(), reason: u.reason.clone() }).collect(),
            qdq_pairs_removed: log.pairs_removed,
            ops_after,
        }
    }

    /// Lines for the stderr summary: counts, then every unit that stays QDQ with its reason.
    /// A summary for people: counts, float nodes grouped by op and reason, warnings.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let forms: Vec<String> = self.lowered.iter().map(|(k, v)| format!("{v} x {k}")).collect();
        let _ = writeln!(s, "lowered to integer operators: {} units ({}); {} DequantizeLinear->QuantizeLinear pairs with equal qparams removed",
            self.units.len(), if forms.is_empty() { "none".into() } else { forms.join(", ") }, self.qdq_pairs_removed);
        if !self.not_lowered.is_empty() {
            let _ = writeln!(s, "stay QDQ ({} units not lowered):", self.not_lowered.len());
            for n in &self.not_lowered {
                let _ = writeln!(s, "  node '{}' ({}, graph '{}'): {}", n.node, n.op, n.graph, n.reason);
            }
        }
        s
    }
}

impl Report {
    /// Adds what convert did in one graph.
    pub fn add_log(&mut self, graph: &str, plan: &QuantPlan, log: &ConvertLog) {
        for (value, gid, p) in &log.activations {
            let grp = &plan.groups[*gid];
            let (qmin, qmax) = grp.spec.scheme.qtype.range();
            self.activations.push(ActivationRecord {
                graph: graph.to_string(),
                value: value.clone(),
                group: *gid,
                dtype: format!("{:?}", grp.spec.scheme.qtype).to_lowercase(),
                scale: p.scale,
                zero_point: p.zero_point,
                clip_range: (p.scale * (qmin - p.zero_point) as f32, p.scale * (qmax - p.zero_point) as f32),
                observed: grp.observer.extremes(),
                fixed: grp.fixed.is_some(),
                nonfinite: grp.observer.nonfinite(),
                floor: grp.observer.extremes().filter(|_| grp.fixed.is_none()).and_then(|(lo, hi)| grp.floor_for(lo, hi)),
                derived: grp.derived.clone(),
            });
        }
        self.skipped.extend(log.skipped.iter().map(|(v, why)| (graph.to_string(), v.clone(), why.clone())));
        self.constants.extend(log.constants.iter().map(|(value, qtype, granularity, scales)| ConstantRecord {
            graph: graph.to_string(),
            value: value.clone(),
            dtype: format!("{qtype:?}").to_lowercase(),
            granularity: *granularity,
            scales: *scales,
        }));
        self.bias_adjusted.extend(log.bias_adjusted.iter().cloned());
        self.narrow_weight_channels.extend(log.narrow_weight_channels.iter().map(|(node, op, weight, narrow, channels, fewest)| NarrowWeightRecord {
            graph: graph.to_string(),
            node: node.clone(),
            op: op.clone(),
            weight: weight.clone(),
            narrow_channels: *narrow,
            channels: *channels,
            fewest_levels: *fewest,
        }));
        self.pair_sums.extend(log.pair_sums_fitted.iter().map(|(node, op, weight, rescaled, channels, projected, full_reach)| PairSumRecord {
            graph: graph.to_string(),
            node: node.clone(),
            op: op.clone(),
            weight: weight.clone(),
            rescaled: *rescaled,
            channels: *channels,
            projected_pairs: *projected,
            full_reach: *full_reach,
        }));
        self.narrow_inputs.extend(log.narrow_inputs.iter().map(|(node, op, value, levels, observed, output_range)| NarrowInputRecord {
            graph: graph.to_string(),
            node: node.clone(),
            op: op.clone(),
            value: value.clone(),
            levels: *levels,
            observed: *observed,
            output_range: *output_range,
        }));
        self.weight_ranges.extend(log.weight_searched.iter().filter(|(_, f)| f.iter().any(|&x| x < 1.0)).map(|(value, factors)| WeightRangeRecord {
            graph: graph.to_string(),
            value: value.clone(),
            narrowed: factors.iter().filter(|&&x| x < 1.0).count(),
            factors: factors.clone(),
        }));
        self.bias_correction.extend(log.bias_corrected.iter().map(|(node, op, shift)| BiasCorrectionRecord {
            graph: graph.to_string(),
            node: node.clone(),
            op: op.clone(),
            max_abs_shift: shift.iter().fold(0f32, |m, d| m.max(d.abs())),
            shift: shift.clone(),
        }));
        self.bias_uncorrected.extend(log.bias_uncorrected.iter().map(|(n, op, why)| (graph.to_string(), n.clone(), op.clone(), why.clone())));
        self.gptq.extend(log.gptq_rounded.iter().map(|(node, op, nearest, rounded)| GptqRecord { graph: graph.to_string(), node: node.clone(), op: op.clone(), nearest_error: *nearest, gptq_error: *rounded }));
        self.gptq_skipped.extend(log.gptq_skipped.iter().map(|(n, op, why)| (graph.to_string(), n.clone(), op.clone(), why.clone())));
    }

    /// What GPTQ rounding did, in one line: weights rounded, the median ratio of their output
    /// error proxy to nearest rounding's, weights left at nearest.
    pub fn gptq_summary(&self) -> String {
        let mut ratios: Vec<f64> = self.gptq.iter().filter(|r| r.nearest_error > 0.0).map(|r| r.gptq_error / r.nearest_error).collect();
        ratios.sort_by(f64::total_cmp);
        let median = ratios.get(ratios.len() / 2).map_or(String::new(), |m| format!("; output error proxy {:.0} % of nearest rounding's (median)", 100.0 * m));
        format!("{} weight(s) rounded{median}, {} left at nearest", self.gptq.len(), self.gptq_skipped.len())
    }

    /// What happened to initializers listed as graph inputs, when there were any.
    pub fn constant_inputs_note(&self) -> Option<String> {
        let first = self.constant_inputs.first()?;
        Some(format!("{} initializer(s) listed as graph inputs (ONNX IR 3 lists every weight so) are quantized as constants and no longer inputs (first: '{first}')", self.constant_inputs.len()))
    }

    /// How a half-precision model was made to compute in float32, when it was.
    pub fn upcast_note(&self) -> Option<String> {
        let u = self.upcast.as_ref()?;
        let boundary = if u.boundary.is_empty() { String::new() } else { format!("; its inputs and outputs keep their types, cast where they enter and leave ({})", u.boundary.join(", ")) };
        Some(format!("the model computes in {}: it is quantized computing in float32 instead ({} value(s), {} constant(s), {} cast target(s) widened; {} cast(s) left converting float32 to float32 removed){boundary}",
            u.from.join(" and "), u.values, u.constants, u.targets, u.casts_removed))
    }

    /// How many weights were fitted to the target's 16-bit pair sums, when any were.
    pub fn pair_sums_note(&self) -> Option<String> {
        if self.pair_sums.is_empty() {
            return None;
        }
        let rescaled: usize = self.pair_sums.iter().map(|r| r.rescaled).sum();
        let channels: usize = self.pair_sums.iter().map(|r| r.channels).sum();
        let projected: usize = self.pair_sums.iter().map(|r| r.projected_pairs).sum();
        let full = match self.pair_sums.iter().filter(|r| r.full_reach).count() {
            0 => String::new(),
            k => format!(" ({k} of them at full reach, for inputs with no measured reach: seen fewer than {} times per channel, as pooled features are, or not observed)", crate::pair_sums::REACH_MIN_VALUES),
        };
        let samples = self.output_check.as_ref().map_or(0, |c| c.samples);
        let mut raised = match self.pair_sum_reach_raised {
            0 => String::new(),
            k => format!("; {k} input channel(s) went beyond that reach in the quantized model on the {samples} check sample(s), and their weights were fitted again to what they reached"),
        };
        if self.pair_sum_reach_exceeded > 0 {
            raised += &format!(" ({} still beyond it after {} refits: ONNX Runtime can saturate there)", self.pair_sum_reach_exceeded, crate::pipeline::MAX_REACH_REFITS);
        }
        Some(format!("{} weight(s) fitted so that no two weights the target adds into one 16-bit sum can overflow it with activations within their channels' calibrated reach (ONNX Runtime's u8 x s8 kernels on x86 without VNNI): \
            {rescaled} of their {channels} channel scales raised, {projected} weight pair(s) pulled in (the report's pair_sums lists them){full}{raised}", self.pair_sums.len()))
    }

    /// The activations whose range starts above their observed minimum, when there are any.
    pub fn floors_note(&self) -> Option<String> {
        let floored: Vec<&ActivationRecord> = self.activations.iter().filter(|a| a.floor.is_some()).collect();
        let first = floored.first()?;
        Some(format!("{} activation(s) feeding a Softmax keep no levels for values it ignores (more than {} below every row's maximum, or a mask that sends them there): their range starts at the 'floor' the report gives (first: '{}', observed from {:.4e}, floor {:.4e})",
            floored.len(), crate::prepare::SOFTMAX_SPAN, first.value, first.observed.map_or(f32::NAN, |o| o.0), first.floor.unwrap_or(f32::NAN)))
    }

    pub fn summary(&self) -> String {
        let q = self.nodes.iter().filter(|n| n.quantized).count();
        let mut s = String::new();
        let _ = writeln!(s, "quantized {q} of {} nodes; {} activations with Q/DQ, {} constants stored quantized", self.nodes.len(), self.activations.len(), self.constants.len());
        if q == 0 && !self.nodes.is_empty() {
            let _ = writeln!(s, "warning: no node is quantized, so the output computes what the float model does (each node's reason is listed below); a --backend or --config whose types the target supports quantizes it");
        }
        let derived = self.activations.iter().filter(|a| a.derived.is_some()).count();
        let _ = writeln!(s, "calibration: {} samples{} in {:.2} s{}; total {:.2} s; opset {} -> {}; {} BatchNormalization/affine nodes folded into weights{}",
            self.samples, if self.widened.is_empty() { "" } else { " (twice: again with the widened activations below)" }, self.calibration_seconds,
            if derived > 0 { format!(" ({derived} activation ranges derived, not observed: scalar maps of observed ones, the report's 'derived')") } else { String::new() },
            self.total_seconds, self.opset.0, self.opset.1, self.affine_folded,
            if self.matmul_add_fused > 0 { format!("; {} MatMul+Add pair(s) made Gemm", self.matmul_add_fused) } else { String::new() });
        if self.loop_carried_uncarried + self.loop_invariants_hoisted > 0 {
            let _ = writeln!(s, "loops: {} loop-carried constant(s) passed on unchanged now read from the enclosing graph; {} loop-invariant node(s) moved before their Loop", self.loop_carried_uncarried, self.loop_invariants_hoisted);
        }
        let mut float: BTreeMap<(String, String), usize> = BTreeMap::new();
        for n in self.nodes.iter().filter(|n| !n.quantized) {
            *float.entry((n.op.clone(), n.reason.clone().unwrap_or_default())).or_default() += 1;
        }
        if !float.is_empty() {
            let _ = writeln!(s, "left in float:");
            for ((op, why), count) in float {
                let _ = writeln!(s, "  {count:>4} x {op}: {why}");
            }
        }
        for (graph, value, why) in &self.skipped {
            let _ = writeln!(s, "warning: '{value}' ({graph}) stays float: {why}");
        }
        for v in &self.violations {
            let _ = writeln!(s, "warning: {v}");
        }
        if let Some(note) = self.upcast_note() {
            let _ = writeln!(s, "note: {note}");
        }
        if let Some(note) = self.constant_inputs_note() {
            let _ = writeln!(s, "note: {note}");
        }
        if let Some(note) = self.floors_note() {
            let _ = writeln!(s, "note: {note}");
        }
        if let Some(note) = self.pair_sums_note() {
            let _ = writeln!(s, "note: {note}");
        }
        for (w, c) in &self.bias_adjusted {
            let _ = writeln!(s, "note: weight '{w}': scale enlarged on {c} channel(s) so the int32 bias does not overflow");
        }
        if self.weight_range_search {
            let _ = writeln!(s, "weight range search: {} weight(s) with narrowed scales on {} channel(s)", self.weight_ranges.len(), self.weight_ranges.iter().map(|w| w.narrowed).sum::<usize>());
        }
        if self.bias_correction_enabled {
            let _ = writeln!(s, "bias correction: {} node(s) corrected, {} left alone", self.bias_correction.len(), self.bias_uncorrected.len());
        }
        if self.gptq_enabled {
            let _ = writeln!(s, "gptq rounding: {}", self.gptq_summary());
            let mut why: BTreeMap<(String, String), usize> = BTreeMap::new();
            for (_, _, op, reason) in &self.gptq_skipped {
                *why.entry((op.clone(), reason.clone())).or_default() += 1;
            }
            for ((op, reason), count) in why {
                let _ = writeln!(s, "  {count:>4} x {op}: {reason}");
            }
        }
        for r in &self.widened {
            let _ = writeln!(s, "note: {r}");
        }
        for r in &self.narrow_inputs {
            let _ = writeln!(s, "warning: {r}");
        }
        const LISTED: usize = 5;
        let mut narrow: Vec<&NarrowWeightRecord> = self.narrow_weight_channels.iter().collect();
        narrow.sort_by(|a, b| (b.narrow_channels * a.channels).cmp(&(a.narrow_channels * b.channels)));
        for r in narrow.into_iter().take(LISTED) {
            let _ = writeln!(s, "warning: {r}");
        }
        if self.narrow_weight_channels.len() > LISTED {
            let _ = writeln!(s, "warning: {} more weight(s) like these (the report's narrow_weight_channels lists them all)", self.narrow_weight_channels.len() - LISTED);
        }
        let nonfinite: u64 = self.activations.iter().map(|a| a.nonfinite).sum();
        if nonfinite > 0 {
            let _ = writeln!(s, "warning: {nonfinite} NaN/Inf activation values were seen during calibration and left out of the ranges");
        }
        if let Some(l) = &self.lowering {
            s += &l.summary();
        }
        s
    }
}
