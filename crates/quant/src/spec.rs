//! Quantization specs: what a node input or output should be quantized to. They are the one
//! interface between deciding *what* to quantize (a [`crate::Quantizer`]) and *how* Q/DQ is
//! inserted (prepare and convert).

use serde::{Deserialize, Serialize};

use qforge_ir::NodeId;

use crate::QScheme;

/// How many scales a tensor gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Granularity {
    PerTensor,
    /// One scale per index along `axis`.
    PerAxis { axis: usize },
    /// One scale per `block_size` consecutive elements along `axis` (opset 21 blocked Q/DQ).
    PerBlock { axis: usize, block_size: usize },
}

/// How the range of a histogram observer is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "method")]
pub enum RangeMethod {
    /// The observed extremes.
    MinMax,
    /// The central `percentile` percent of the values.
    Percentile { percentile: f64 },
    /// TensorRT-style KL divergence minimization, at the resolution of the target dtype.
    Entropy,
    /// PyTorch's `HistogramObserver` L2 search.
    L2,
    /// The range minimizing the squared quantization error.
    Mse,
    /// The observed extremes, unless the [`RangeMethod::Mse`] range cuts the squared
    /// quantization error at least `gain` times: the clip only where it pays off, min/max
    /// elsewhere (a clipped range risks values beyond the calibration data's).
    Auto { gain: f64 },
}

/// The statistic collected during calibration for a spec.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ObserverKind {
    /// Running min/max (per tensor or per channel, following the spec's granularity).
    MinMax,
    /// Exponential moving average of each sample's min/max (PyTorch
    /// `MovingAverageMinMaxObserver`); samples are folded in calibration order.
    MovingAverageMinMax { averaging_constant: f32 },
    /// A histogram with a range search.
    Histogram { bins: usize, range: RangeMethod },
}

/// Quantize with parameters computed from observed statistics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationSpec {
    pub scheme: QScheme,
    pub granularity: Granularity,
    pub observer: ObserverKind,
    /// Smallest scale the target accepts (`DTypeWithConstraints.scale_min_lower_bound`).
    pub scale_min: Option<f32>,
    /// Weights: the largest sum of two paired same-sign integers
    /// (`DTypeWithConstraints.pair_sum_max`, [`crate::pair_sums`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pair_sum_max: Option<i64>,
}

/// An input edge (node, input index) or an output (node, output index) of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Edge {
    Input { node: NodeId, index: usize },
    Output { node: NodeId, index: usize },
}

/// How a derived spec's parameters follow from other edges' parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Derivation {
    /// Bias of a Conv/Gemm/MatMul: int32, zero point 0, scale = input scale x weight scale
    /// (per channel when the weight is), from `[input edge, weight edge]`.
    BiasScale,
}

/// Fixed parameters, whatever the data (e.g. Sigmoid output: scale 1/256, zero point 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FixedQParams {
    pub scheme: QScheme,
    pub scale: f32,
    pub zero_point: i64,
}

/// What an annotated edge gets.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    Quantize(QuantizationSpec),
    /// The same parameters (and observer) as another edge.
    Shared(Edge),
    Derived { from: Vec<Edge>, how: Derivation },
    Fixed(FixedQParams),
}
