use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::{DType, IrError, IrResult};

/// Element types that can be viewed directly as a typed slice of a [`Tensor`].
pub trait Elem: bytemuck::Pod + Copy + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! elem {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Elem for $t { const DTYPE: DType = DType::$d; })* };
}
elem!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i8 => I8, u8 => U8, i16 => I16,
      u16 => U16, i32 => I32, u32 => U32, i64 => I64, u64 => U64);

/// Element storage, aligned for its element width, so typed views are free and typed vectors
/// move in without a copy.
#[derive(Clone, PartialEq)]
enum Bytes {
    W1(Vec<u8>),
    W2(Vec<u16>),
    W4(Vec<u32>),
    W8(Vec<u64>),
}

impl Bytes {
    /// Zeroed storage of `len` bytes for elements `width` bytes wide.
    fn zeroed(len: usize, width: usize) -> Bytes {
        match width {
            8 if len.is_multiple_of(8) => Bytes::W8(vec![0; len / 8]),
            4 if len.is_multiple_of(4) => Bytes::W4(vec![0; len / 4]),
            2 if len.is_multiple_of(2) => Bytes::W2(vec![0; len / 2]),
            _ => Bytes::W1(vec![0; len]),
        }
    }
    fn from_slice(b: &[u8], width: usize) -> Bytes {
        let mut out = Bytes::zeroed(b.len(), width);
        out.as_mut().copy_from_slice(b);
        out
    }
    fn from_vec<T: Elem>(v: Vec<T>) -> Bytes {
        match std::mem::size_of::<T>() {
            8 => Bytes::W8(bytemuck::allocation::cast_vec(v)),
            4 => Bytes::W4(bytemuck::allocation::cast_vec(v)),
            2 => Bytes::W2(bytemuck::allocation::cast_vec(v)),
            _ => Bytes::W1(bytemuck::allocation::cast_vec(v)),
        }
    }
    fn as_ref(&self) -> &[u8] {
        match self {
            Bytes::W1(v) => v,
            Bytes::W2(v) => bytemuck::cast_slice(v),
            Bytes::W4(v) => bytemuck::cast_slice(v),
            Bytes::W8(v) => bytemuck::cast_slice(v),
        }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            Bytes::W1(v) => v,
            Bytes::W2(v) => bytemuck::cast_slice_mut(v),
            Bytes::W4(v) => bytemuck::cast_slice_mut(v),
            Bytes::W8(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

/// Storage width for an element type (1 for packed and byte-sized types).
fn width_of(dtype: DType) -> usize {
    match dtype.bits() {
        16 => 2,
        32 => 4,
        64 | 128 => 8,
        _ => 1,
    }
}

#[derive(Clone, PartialEq)]
enum Data {
    Bytes(Bytes),
    Strings(Vec<Vec<u8>>),
}

/// A dense tensor of any ONNX element type.
///
/// Numeric elements are stored little-endian in memory aligned for their width; `bool` as one
/// byte per element (0 or 1); 4- and 2-bit types packed low bits first as in ONNX (opset 21);
/// strings as byte strings. Storage is shared: `clone` is cheap and writes copy on demand.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Arc<Data>,
}

/// The largest tensor the IR will allocate, in bytes (16 GiB). Loaders apply tighter limits.
pub const MAX_TENSOR_BYTES: u64 = 16 << 30;

fn element_count(shape: &[usize]) -> Option<u128> {
    shape.iter().try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
}

impl Tensor {
    /// Bytes needed for `dtype` elements of `shape`, or an error when that exceeds `limit`.
    pub fn checked_byte_len(dtype: DType, shape: &[usize], limit: u64) -> IrResult<usize> {
        let too_large = |needed| IrError::TooLarge { shape: shape.to_vec(), dtype, needed, limit };
        let n = element_count(shape).ok_or_else(|| too_large(u128::MAX))?;
        let bytes = if dtype == DType::String { n.saturating_mul(8) } else { dtype.storage_bytes(n) };
        if bytes > limit as u128 {
            return Err(too_large(bytes));
        }
        Ok(bytes as usize)
    }

    /// A tensor of zeros (empty strings for `String`).
    pub fn zeros(dtype: DType, shape: &[usize]) -> IrResult<Tensor> {
        let bytes = Self::checked_byte_len(dtype, shape, MAX_TENSOR_BYTES)?;
        let data = if dtype == DType::String {
            Data::Strings(vec![Vec::new(); bytes / 8])
        } else {
            Data::Bytes(Bytes::zeroed(bytes, width_of(dtype)))
        };
        Ok(Tensor { dtype, shape: shape.to_vec(), data: Arc::new(data) })
    }

    /// A tensor from little-endian raw bytes, as in ONNX `raw_data`. The length must match exactly.
    pub fn from_raw(dtype: DType, shape: &[usize], raw: &[u8]) -> IrResult<Tensor> {
        if dtype == DType::String {
            return Err(IrError::BadTensor { tensor: String::new(), reason: "string tensors have no raw byte form".into() });
        }
        let expected = Self::checked_byte_len(dtype, shape, MAX_TENSOR_BYTES)?;
        if raw.len() != expected {
            return Err(IrError::BadTensor {
                tensor: String::new(),
                reason: format!("{} {dtype} elements of shape {shape:?} need {expected} bytes, got {}",
                    element_count(shape).unwrap_or(0), raw.len()),
            });
        }
        Ok(Tensor { dtype, shape: shape.to_vec(), data: Arc::new(Data::Bytes(Bytes::from_slice(raw, width_of(dtype)))) })
    }

    /// A tensor that takes ownership of typed elements (no copy).
    pub fn from_vec<T: Elem>(shape: &[usize], values: Vec<T>) -> IrResult<Tensor> {
        let n = element_count(shape).unwrap_or(u128::MAX);
        if n != values.len() as u128 {
            return Err(IrError::BadTensor {
                tensor: String::new(),
                reason: format!("shape {shape:?} holds {n} elements, got {}", values.len()),
            });
        }
        Ok(Tensor { dtype: T::DTYPE, shape: shape.to_vec(), data: Arc::new(Data::Bytes(Bytes::from_vec(values))) })
    }

    /// A tensor copied from typed elements.
    pub fn from_slice<T: Elem>(shape: &[usize], values: &[T]) -> IrResult<Tensor> {
        let n = element_count(shape).unwrap_or(u128::MAX);
        if n != values.len() as u128 {
            return Err(IrError::BadTensor {
                tensor: String::new(),
                reason: format!("shape {shape:?} holds {n} elements, got {}", values.len()),
            });
        }
        Self::from_raw(T::DTYPE, shape, bytemuck::cast_slice(values))
    }

    /// A rank-0 tensor.
    pub fn scalar<T: Elem>(value: T) -> Tensor {
        Self::from_slice(&[], &[value]).expect("one element fits a scalar")
    }

    /// A boolean tensor.
    pub fn from_bools(shape: &[usize], values: &[bool]) -> IrResult<Tensor> {
        let bytes: Vec<u8> = values.iter().map(|&b| b as u8).collect();
        Self::from_raw(DType::Bool, shape, &bytes)
    }

    /// A string tensor.
    pub fn from_strings(shape: &[usize], values: Vec<Vec<u8>>) -> IrResult<Tensor> {
        let n = element_count(shape).unwrap_or(u128::MAX);
        if n != values.len() as u128 {
            return Err(IrError::BadTensor {
                tensor: String::new(),
                reason: format!("shape {shape:?} holds {n} elements, got {} strings", values.len()),
            });
        }
        Ok(Tensor { dtype: DType::String, shape: shape.to_vec(), data: Arc::new(Data::Strings(values)) })
    }

    /// Signed 4-bit values (each in [-8, 7]) packed two per byte, first element in the low nibble.
    pub fn from_i4(shape: &[usize], values: &[i8]) -> IrResult<Tensor> {
        Self::from_packed(DType::I4, shape, values.iter().map(|&v| v as i64))
    }

    /// Unsigned 4-bit values (each in [0, 15]) packed two per byte, first element in the low nibble.
    pub fn from_u4(shape: &[usize], values: &[u8]) -> IrResult<Tensor> {
        Self::from_packed(DType::U4, shape, values.iter().map(|&v| v as i64))
    }

    /// A tensor of a sub-byte integer type (`I4`, `U4`, `I2`, `U2`) from its values, each
    /// kept modulo `2^bits` (two's complement, so in-range values are exact and others wrap,
    /// as ONNX `Cast` to these types does), packed from the low bits of each byte up.
    pub fn from_packed(dtype: DType, shape: &[usize], values: impl ExactSizeIterator<Item = i64>) -> IrResult<Tensor> {
        let bits = dtype.bits();
        if !matches!(dtype, DType::I4 | DType::U4 | DType::I2 | DType::U2) {
            return Err(IrError::BadTensor { tensor: String::new(), reason: format!("{dtype} is not a packed integer type") });
        }
        let n = values.len();
        let (per_byte, mask) = (8 / bits, (1u8 << bits) - 1);
        let mut raw = vec![0u8; n.div_ceil(per_byte)];
        for (i, v) in values.enumerate() {
            raw[i / per_byte] |= (v as u8 & mask) << (bits * (i % per_byte));
        }
        let t = Self::from_raw(dtype, shape, &raw)?;
        if t.len() != n {
            return Err(IrError::BadTensor { tensor: String::new(), reason: format!("shape {shape:?} does not hold {n} elements") });
        }
        Ok(t)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same data under a new shape with the same element count.
    pub fn reshaped(&self, shape: &[usize]) -> IrResult<Tensor> {
        if element_count(shape) != Some(self.len() as u128) {
            return Err(IrError::BadTensor {
                tensor: String::new(),
                reason: format!("cannot reshape {:?} to {shape:?}", self.shape),
            });
        }
        Ok(Tensor { dtype: self.dtype, shape: shape.to_vec(), data: self.data.clone() })
    }

    /// Little-endian element bytes (packed for sub-byte types). `None` for string tensors.
    pub fn raw_bytes(&self) -> Option<&[u8]> {
        match &*self.data {
            Data::Bytes(b) => Some(b.as_ref()),
            Data::Strings(_) => None,
        }
    }

    /// Mutable element bytes; copies the storage first when it is shared.
    pub fn raw_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match Arc::make_mut(&mut self.data) {
            Data::Bytes(b) => Some(b.as_mut()),
            Data::Strings(_) => None,
        }
    }

    pub fn strings(&self) -> Option<&[Vec<u8>]> {
        match &*self.data {
            Data::Strings(s) => Some(s),
            Data::Bytes(_) => None,
        }
    }

    fn mismatch(&self, requested: DType) -> IrError {
        IrError::DTypeMismatch { tensor: String::new(), actual: self.dtype, requested }
    }

    /// The elements as a typed slice; errors when `T` is not the tensor's element type.
    pub fn as_slice<T: Elem>(&self) -> IrResult<&[T]> {
        match (&*self.data, self.dtype == T::DTYPE) {
            (Data::Bytes(b), true) => Ok(bytemuck::cast_slice(b.as_ref())),
            _ => Err(self.mismatch(T::DTYPE)),
        }
    }

    /// The elements as a mutable typed slice; copies shared storage first.
    pub fn as_slice_mut<T: Elem>(&mut self) -> IrResult<&mut [T]> {
        if self.dtype != T::DTYPE {
            return Err(self.mismatch(T::DTYPE));
        }
        match Arc::make_mut(&mut self.data) {
            Data::Bytes(b) => Ok(bytemuck::cast_slice_mut(b.as_mut())),
            Data::Strings(_) => unreachable!("string tensors have no Elem view"),
        }
    }

    /// Boolean elements.
    pub fn bools(&self) -> IrResult<Vec<bool>> {
        match (&*self.data, self.dtype) {
            (Data::Bytes(b), DType::Bool) => Ok(b.as_ref().iter().map(|&x| x != 0).collect()),
            _ => Err(self.mismatch(DType::Bool)),
        }
    }

    /// Unpacked elements of a sub-byte integer type (`I4`, `U4`, `I2`, `U2`), sign-extended
    /// for the signed ones.
    pub fn packed_ints(&self) -> IrResult<Vec<i8>> {
        let raw = match (&*self.data, self.dtype) {
            (Data::Bytes(b), DType::I4 | DType::U4 | DType::I2 | DType::U2) => b.as_ref(),
            _ => return Err(self.mismatch(DType::I4)),
        };
        let bits = self.dtype.bits();
        let (per_byte, mask, shift) = (8 / bits, (1u8 << bits) - 1, 8 - bits as u32);
        let signed = matches!(self.dtype, DType::I4 | DType::I2);
        Ok((0..self.len())
            .map(|i| {
                let v = (raw[i / per_byte] >> (bits * (i % per_byte))) & mask;
                if signed { ((v << shift) as i8) >> shift } else { v as i8 }
            })
            .collect())
    }

    /// Takes the elements out as a typed vector, without a copy when the storage is not shared.
    pub fn into_vec<T: Elem>(self) -> IrResult<Vec<T>> {
        if self.dtype != T::DTYPE {
            return Err(self.mismatch(T::DTYPE));
        }
        let data = Arc::try_unwrap(self.data).unwrap_or_else(|shared| (*shared).clone());
        match data {
            Data::Bytes(b) => Ok(match b {
                Bytes::W1(v) => bytemuck::allocation::cast_vec(v),
                Bytes::W2(v) => bytemuck::allocation::cast_vec(v),
                Bytes::W4(v) => bytemuck::allocation::cast_vec(v),
                Bytes::W8(v) => bytemuck::allocation::cast_vec(v),
            }),
            Data::Strings(_) => unreachable!("string tensors have no Elem view"),
        }
    }

    /// Elements converted to f64, for numeric types that have an exact or natural widening
    /// (floats, integers, bool, packed 4- and 2-bit integers). Errors for strings, complex and 8-bit float formats.
    pub fn to_f64_vec(&self) -> IrResult<Vec<f64>> {
        use DType::*;
        Ok(match self.dtype {
            F32 => self.as_slice::<f32>()?.iter().map(|&v| v as f64).collect(),
            F64 => self.as_slice::<f64>()?.to_vec(),
            F16 => self.as_slice::<f16>()?.iter().map(|v| v.to_f64()).collect(),
            BF16 => self.as_slice::<bf16>()?.iter().map(|v| v.to_f64()).collect(),
            I8 => self.as_slice::<i8>()?.iter().map(|&v| v as f64).collect(),
            U8 => self.as_slice::<u8>()?.iter().map(|&v| v as f64).collect(),
            I16 => self.as_slice::<i16>()?.iter().map(|&v| v as f64).collect(),
            U16 => self.as_slice::<u16>()?.iter().map(|&v| v as f64).collect(),
            I32 => self.as_slice::<i32>()?.iter().map(|&v| v as f64).collect(),
            U32 => self.as_slice::<u32>()?.iter().map(|&v| v as f64).collect(),
            I64 => self.as_slice::<i64>()?.iter().map(|&v| v as f64).collect(),
            U64 => self.as_slice::<u64>()?.iter().map(|&v| v as f64).collect(),
            Bool => self.bools()?.into_iter().map(|b| b as u8 as f64).collect(),
            I4 | U4 | I2 | U2 => self.packed_ints()?.into_iter().map(f64::from).collect(),
            other => return Err(self.mismatch(other)),
        })
    }

    /// Integer elements widened to i64 (integers and bool). Used for shape arithmetic.
    pub fn to_i64_vec(&self) -> IrResult<Vec<i64>> {
        use DType::*;
        Ok(match self.dtype {
            I64 => self.as_slice::<i64>()?.to_vec(),
            I32 => self.as_slice::<i32>()?.iter().map(|&v| v as i64).collect(),
            I8 => self.as_slice::<i8>()?.iter().map(|&v| v as i64).collect(),
            U8 => self.as_slice::<u8>()?.iter().map(|&v| v as i64).collect(),
            I16 => self.as_slice::<i16>()?.iter().map(|&v| v as i64).collect(),
            U16 => self.as_slice::<u16>()?.iter().map(|&v| v as i64).collect(),
            U32 => self.as_slice::<u32>()?.iter().map(|&v| v as i64).collect(),
            U64 => self.as_slice::<u64>()?.iter().map(|&v| v as i64).collect(),
            Bool => self.bools()?.into_iter().map(|b| b as i64).collect(),
            I4 | U4 | I2 | U2 => self.packed_ints()?.into_iter().map(i64::from).collect(),
            other => return Err(self.mismatch(other)),
        })
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor<{}>{:?}", self.dtype, self.shape)?;
        if let Ok(v) = self.to_f64_vec() {
            let head: Vec<_> = v.iter().take(8).collect();
            write!(f, " {head:?}{}", if v.len() > 8 { "…" } else { "" })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_views_and_cow() {
        let t = Tensor::from_vec(&[2, 3], vec![1f32, 2., 3., 4., 5., 6.]).unwrap();
        let mut u = t.clone();
        u.as_slice_mut::<f32>().unwrap()[0] = 9.0;
        assert_eq!(t.as_slice::<f32>().unwrap()[0], 1.0);
        assert_eq!(u.as_slice::<f32>().unwrap()[0], 9.0);
        assert!(t.as_slice::<i32>().is_err());
        assert_eq!(t.raw_bytes().unwrap().len(), 24);
    }

    #[test]
    fn raw_length_is_checked() {
        assert!(Tensor::from_raw(DType::F32, &[3], &[0; 11]).is_err());
        assert!(Tensor::from_raw(DType::I4, &[3], &[0; 2]).is_ok());
        assert!(Tensor::from_raw(DType::I4, &[3], &[0; 3]).is_err());
    }

    #[test]
    fn huge_shapes_are_refused_without_allocating() {
        let e = Tensor::zeros(DType::F32, &[1 << 40, 1 << 40]).unwrap_err();
        assert!(matches!(e, IrError::TooLarge { .. }));
        let e = Tensor::zeros(DType::F32, &[usize::MAX, usize::MAX, 4]).unwrap_err();
        assert!(matches!(e, IrError::TooLarge { .. }));
    }

    #[test]
    fn int4_packing_matches_onnx_layout() {
        let t = Tensor::from_i4(&[3], &[-1, 7, -8]).unwrap();
        assert_eq!(t.raw_bytes().unwrap(), &[0x7f, 0x08]);
        assert_eq!(t.packed_ints().unwrap(), vec![-1, 7, -8]);
        let u = Tensor::from_u4(&[2], &[15, 1]).unwrap();
        assert_eq!(u.raw_bytes().unwrap(), &[0x1f]);
        assert_eq!(t.to_i64_vec().unwrap(), vec![-1, 7, -8]);
        assert_eq!(u.to_i64_vec().unwrap(), vec![15, 1]);
    }
}
