//! HTP precisions: activation and weight widths, as QConfigs.
//!
//! Activations are asymmetric unsigned (u8 or u16, zero point free), weights symmetric signed
//! per output channel on the narrow range (`[-127, 127]`, `[-7, 7]`, `[-32767, 32767]`), or per
//! block along the input-channel axis for `16a4w-block`; bias is int32 with
//! `scale = input scale x weight scale`. Qparams follow PyTorch's observers, as the QNN
//! quantizer's do, with its smallest activation scales (`eps`): 2^-12 for 8-bit and 2^-20 for
//! 16-bit activations. Weight scales are not clamped (eps is the smallest normal float):
//! BatchNormalization folding can leave weights far below 2^-12, which QNN's eps would round
//! to zero.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer};

use crate::qconfig::{ObserverName, QConfig, RangeName, TensorQConfig};
use crate::QType;

/// One of the precisions `--precision` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Precision {
    /// u8 activations, s8 weights.
    A8W8,
    /// u16 activations, s8 weights.
    A16W8,
    /// u16 activations, s16 weights.
    A16W16,
    /// u16 activations, s4 weights per channel.
    A16W4,
    /// u8 activations, s4 weights per channel.
    A8W4,
    /// u16 activations, s4 weights per block along the input-channel axis.
    A16W4Block,
}

/// How a precision becomes a QConfig: the block size of block-wise weights and the range
/// selection of activation observers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrecisionOptions {
    /// Elements per block along the input-channel axis (`16a4w-block`).
    pub block_size: usize,
    pub range: RangeName,
}

impl Default for PrecisionOptions {
    /// Blocks of 64, MSE activation ranges (`qforge quantize`'s default `--method`).
    fn default() -> Self {
        PrecisionOptions { block_size: 64, range: RangeName::Mse }
    }
}

impl Precision {
    /// Every precision, in the order the CLI lists them.
    pub const ALL: [Precision; 6] = [Precision::A8W8, Precision::A16W8, Precision::A16W16, Precision::A16W4, Precision::A8W4, Precision::A16W4Block];

    /// The name `--precision` takes, e.g. `"16a4w-block"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::A8W8 => "8a8w",
            Precision::A16W8 => "16a8w",
            Precision::A16W16 => "16a16w",
            Precision::A16W4 => "16a4w",
            Precision::A8W4 => "8a4w",
            Precision::A16W4Block => "16a4w-block",
        }
    }

    /// The activation type (unsigned, asymmetric).
    pub fn activation(self) -> QType {
        match self {
            Precision::A8W8 | Precision::A8W4 => QType::U8,
            _ => QType::U16,
        }
    }

    /// The weight type (signed, symmetric).
    pub fn weight(self) -> QType {
        match self {
            Precision::A8W8 | Precision::A16W8 => QType::S8,
            Precision::A16W16 => QType::S16,
            Precision::A16W4 | Precision::A8W4 | Precision::A16W4Block => QType::S4,
        }
    }

    /// Whether weights get one scale per block rather than per output channel.
    pub fn is_blockwise(self) -> bool {
        self == Precision::A16W4Block
    }

    /// The precision with these activation and weight types and weight granularity, if any.
    pub fn of(activation: QType, weight: QType, blockwise: bool) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.activation() == activation && p.weight() == weight && p.is_blockwise() == blockwise)
    }

    /// This precision with 16-bit activations and the same weights (`8a8w` -> `16a8w`,
    /// `8a4w` -> `16a4w`); `None` when its activations are already 16-bit.
    pub fn with_16bit_activations(self) -> Option<Precision> {
        (self.activation() == QType::U8).then(|| Precision::of(QType::U16, self.weight(), self.is_blockwise())).flatten()
    }

    /// The precision a QConfig made by [`Precision::qconfig`] stands for.
    pub fn of_qconfig(q: &QConfig) -> Option<Precision> {
        let (a, w) = (q.activation.as_ref()?, q.weight.as_ref()?);
        Precision::of(a.dtype, w.dtype, w.block_size.is_some())
    }

    /// The QConfig of this precision: activations asymmetric with the PyTorch observer for
    /// `options.range`, weights symmetric on the narrow range, per channel or per block.
    pub fn qconfig(self, options: PrecisionOptions) -> QConfig {
        let act = self.activation();
        let eps = if act == QType::U16 { 2f32.powi(-20) } else { 2f32.powi(-12) };
        let activation = TensorQConfig {
            observer: if options.range == RangeName::Minmax { ObserverName::Minmax } else { ObserverName::Histogram },
            range: options.range,
            eps: Some(eps),
            ..TensorQConfig::of(act)
        };
        let (_, wmax) = self.weight().range();
        let weight = TensorQConfig {
            symmetric: true,
            per_channel: true,
            block_size: self.is_blockwise().then_some(options.block_size),
            quant_range: Some((-wmax, wmax)),
            eps: Some(f32::MIN_POSITIVE),
            ..TensorQConfig::of(self.weight())
        };
        QConfig { activation: Some(activation), weight: Some(weight) }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown precision name, with the accepted ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision '{0}'; use one of 8a8w, 16a8w, 16a16w, 16a4w, 8a4w, 16a4w-block")]
pub struct UnknownPrecision(pub String);

impl FromStr for Precision {
    type Err = UnknownPrecision;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Precision::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| UnknownPrecision(s.to_string()))
    }
}

impl<'de> Deserialize<'de> for Precision {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Granularity;
    use crate::Convention;

    #[test]
    fn names_round_trip_and_types_match() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
            assert_eq!(Precision::of(p.activation(), p.weight(), p.is_blockwise()), Some(p));
            assert_eq!(Precision::of_qconfig(&p.qconfig(PrecisionOptions::default())), Some(p));
        }
        assert!("4a4w".parse::<Precision>().is_err());
    }

    #[test]
    fn weights_are_symmetric_on_the_narrow_range() {
        let q = Precision::A16W4Block.qconfig(PrecisionOptions { block_size: 32, range: RangeName::Minmax });
        let w = q.weight.unwrap().spec(Convention::PyTorch, Some(0), Some(1));
        assert_eq!(w.scheme.qrange(), (-7, 7));
        assert_eq!(w.granularity, Granularity::PerBlock { axis: 1, block_size: 32 });
        let a = q.activation.unwrap().spec(Convention::PyTorch, None, None);
        assert_eq!((a.scheme.qtype, a.scheme.symmetric), (QType::U16, false));
    }
}
