//! `TensorProto` <-> [`Tensor`], including external data.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use prost::bytes::Bytes;
use qforge_ir::{DType, Tensor};

use crate::proto::{self, tensor_proto::DataLocation};
use crate::OnnxError;

/// Where tensor data may come from, and how much may be allocated.
pub(crate) struct TensorSource<'a> {
    /// The model file, for messages.
    pub path: &'a Path,
    /// The model's folder, for external data; `None` when loading from bytes.
    pub base_dir: Option<&'a Path>,
    /// The largest single tensor accepted, in bytes.
    pub max_tensor_bytes: u64,
    /// Bytes that all tensors together may still allocate.
    pub budget: u64,
    pub mmaps: HashMap<PathBuf, memmap2::Mmap>,
}

impl TensorSource<'_> {
    fn err(&self, tensor: &str, reason: impl Into<String>) -> OnnxError {
        OnnxError::Tensor { path: self.path.to_path_buf(), tensor: tensor.to_string(), reason: reason.into() }
    }

    fn charge(&mut self, tensor: &str, bytes: usize) -> Result<(), OnnxError> {
        if bytes as u64 > self.budget {
            return Err(self.err(tensor, format!("{bytes} more bytes would exceed the load budget; raise LoadOptions::max_total_bytes if the model is genuinely this large")));
        }
        self.budget -= bytes as u64;
        Ok(())
    }

    /// Resolves an external data location inside the model folder and returns its bytes.
    fn external(&mut self, tensor: &str, tp: &proto::TensorProto, need: usize) -> Result<Vec<u8>, OnnxError> {
        let mut location = None;
        let mut offset = 0u64;
        let mut length = None;
        for e in &tp.external_data {
            let v = e.value.clone().unwrap_or_default();
            match e.key.as_deref() {
                Some("location") => location = Some(v),
                Some("offset") => offset = v.parse().map_err(|_| self.err(tensor, format!("external data offset '{v}' is not a number")))?,
                Some("length") => length = Some(v.parse::<u64>().map_err(|_| self.err(tensor, format!("external data length '{v}' is not a number")))?),
                _ => {}
            }
        }
        let location = location.ok_or_else(|| self.err(tensor, "external data has no location"))?;
        let ext = |reason: String| OnnxError::ExternalData { path: self.path.to_path_buf(), tensor: tensor.to_string(), location: location.clone(), reason };
        let base = self.base_dir.ok_or_else(|| ext("external data needs the model's folder; load the model from its file".into()))?;
        let rel = Path::new(&location);
        if rel.is_absolute() || rel.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) {
            return Err(ext("the location must be a relative path inside the model's folder (no absolute paths, no '..')".into()));
        }
        let canon_base = base.canonicalize().map_err(|e| ext(format!("cannot resolve the model folder: {e}")))?;
        let file = canon_base.join(rel).canonicalize().map_err(|e| ext(format!("cannot open: {e}")))?;
        if !file.starts_with(&canon_base) {
            return Err(ext("the location leads outside the model's folder through a link".into()));
        }
        if let Some(l) = length {
            if l != need as u64 {
                return Err(ext(format!("length {l} does not match the {need} bytes the tensor's type and shape need")));
            }
        }
        if !self.mmaps.contains_key(&file) {
            let f = std::fs::File::open(&file).map_err(|e| ext(format!("cannot open: {e}")))?;
            // SAFETY: the map is read-only and only copied from; a file truncated under us
            // while loading is outside what any loader can defend against.
            let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ext(format!("cannot map: {e}")))?;
            self.mmaps.insert(file.clone(), m);
        }
        let map = &self.mmaps[&file];
        let end = offset.checked_add(need as u64).filter(|&e| e <= map.len() as u64)
            .ok_or_else(|| ext(format!("bytes {offset}..{} lie beyond the end of the file ({} bytes)", offset as u128 + need as u128, map.len())))?;
        Ok(map[offset as usize..end as usize].to_vec())
    }
}

fn le_bytes<T: Copy, const N: usize>(values: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| f(v)).collect()
}

/// Converts a tensor, reading its data from `raw_data`, the typed field its type uses, or
/// external data. Every length is checked against the declared type and shape before
/// anything is allocated.
pub(crate) fn from_proto(tp: &proto::TensorProto, src: &mut TensorSource) -> Result<Tensor, OnnxError> {
    let name = tp.name.clone().unwrap_or_default();
    let code = tp.data_type.unwrap_or(0);
    let dtype = DType::from_onnx(code).ok_or_else(|| src.err(&name, format!("element type {code} is not a known ONNX type")))?;
    if tp.segment.is_some() {
        return Err(src.err(&name, "segmented tensors are not supported"));
    }
    let shape: Vec<usize> = tp.dims.iter()
        .map(|&d| usize::try_from(d).map_err(|_| src.err(&name, format!("negative dimension {d}"))))
        .collect::<Result<_, _>>()?;
    let need = Tensor::checked_byte_len(dtype, &shape, src.max_tensor_bytes)
        .map_err(|e| src.err(&name, format!("{e}; raise LoadOptions::max_tensor_bytes if this is intended")))?;
    let n: usize = shape.iter().product();
    src.charge(&name, need)?;
    let bad = |src: &TensorSource, field: &str, got: usize, want: usize| {
        src.err(&name, format!("{field} holds {got} values, but {dtype}{shape:?} needs {want}"))
    };
    if tp.data_location == Some(DataLocation::External as i32) {
        let raw = src.external(&name, tp, need)?;
        return Tensor::from_raw(dtype, &shape, &raw).map_err(|e| src.err(&name, e.to_string()));
    }
    if dtype == DType::String {
        if tp.string_data.len() != n {
            return Err(bad(src, "string_data", tp.string_data.len(), n));
        }
        return Tensor::from_strings(&shape, tp.string_data.clone()).map_err(|e| src.err(&name, e.to_string()));
    }
    if let Some(raw) = &tp.raw_data {
        if raw.len() != need {
            return Err(src.err(&name, format!("raw_data has {} bytes, but {dtype}{shape:?} needs {need}", raw.len())));
        }
        return Tensor::from_raw(dtype, &shape, raw).map_err(|e| src.err(&name, e.to_string()));
    }
    use DType::*;
    let (field, got, want, raw): (&str, usize, usize, Vec<u8>) = match dtype {
        F32 => ("float_data", tp.float_data.len(), n, le_bytes(&tp.float_data, f32::to_le_bytes)),
        Complex64 => ("float_data", tp.float_data.len(), 2 * n, le_bytes(&tp.float_data, f32::to_le_bytes)),
        F64 => ("double_data", tp.double_data.len(), n, le_bytes(&tp.double_data, f64::to_le_bytes)),
        Complex128 => ("double_data", tp.double_data.len(), 2 * n, le_bytes(&tp.double_data, f64::to_le_bytes)),
        I64 => ("int64_data", tp.int64_data.len(), n, le_bytes(&tp.int64_data, i64::to_le_bytes)),
        U64 => ("uint64_data", tp.uint64_data.len(), n, le_bytes(&tp.uint64_data, u64::to_le_bytes)),
        U32 => ("uint64_data", tp.uint64_data.len(), n, le_bytes(&tp.uint64_data, |v| (v as u32).to_le_bytes())),
        I32 => ("int32_data", tp.int32_data.len(), n, le_bytes(&tp.int32_data, i32::to_le_bytes)),
        I16 | U16 | F16 | BF16 => ("int32_data", tp.int32_data.len(), n, le_bytes(&tp.int32_data, |v| (v as u16).to_le_bytes())),
        I8 | U8 | Bool | F8E4M3FN | F8E4M3FNUZ | F8E5M2 | F8E5M2FNUZ | F8E8M0 => {
            ("int32_data", tp.int32_data.len(), n, le_bytes(&tp.int32_data, |v| [v as u8]))
        }
        I4 | U4 | F4E2M1 => ("int32_data", tp.int32_data.len(), n.div_ceil(2), le_bytes(&tp.int32_data, |v| [v as u8])),
        I2 | U2 => ("int32_data", tp.int32_data.len(), n.div_ceil(4), le_bytes(&tp.int32_data, |v| [v as u8])),
        F6E2M3 | F6E3M2 => return Err(src.err(&name, "6-bit float tensors are only supported in raw_data")),
        String => unreachable!("handled above"),
    };
    if got != want {
        if got == 0 && n > 0 {
            return Err(src.err(&name, format!("has no data for its {n} elements")));
        }
        return Err(bad(src, field, got, want));
    }
    Tensor::from_raw(dtype, &shape, &raw).map_err(|e| src.err(&name, e.to_string()))
}

/// A standalone `TensorProto` (as in the `.pb` files of the ONNX backend tests), with its name.
/// External data is not allowed here.
pub fn tensor_from_proto(tp: &proto::TensorProto) -> Result<(String, Tensor), OnnxError> {
    let path = Path::new("<tensor>");
    let mut src = TensorSource { path, base_dir: None, max_tensor_bytes: 4 << 30, budget: 4 << 30, mmaps: HashMap::new() };
    Ok((tp.name.clone().unwrap_or_default(), from_proto(tp, &mut src)?))
}

/// Decodes a serialized `TensorProto` (a backend-test `.pb` file).
pub fn tensor_from_proto_bytes(bytes: &[u8]) -> Result<(String, Tensor), OnnxError> {
    use prost::Message;
    let tp = proto::TensorProto::decode(bytes).map_err(|e| OnnxError::Decode { path: "<tensor>".into(), reason: e.to_string() })?;
    tensor_from_proto(&tp)
}

/// A numeric tensor's element bytes, owned by a handle to the tensor, so `raw_data` can share
/// them instead of copying.
struct RawBytes(Tensor);

impl AsRef<[u8]> for RawBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.raw_bytes().unwrap_or_default()
    }
}

/// The `TensorProto` of a tensor: `raw_data` for numeric types, `string_data` for strings.
pub fn tensor_to_proto(name: &str, t: &Tensor) -> proto::TensorProto {
    proto::TensorProto {
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: Some(t.dtype().onnx_code()),
        name: (!name.is_empty()).then(|| name.to_string()),
        raw_data: t.raw_bytes().is_some().then(|| Bytes::from_owner(RawBytes(t.clone()))),
        string_data: t.strings().map(|s| s.to_vec()).unwrap_or_default(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src() -> TensorSource<'static> {
        TensorSource { path: Path::new("m.onnx"), base_dir: None, max_tensor_bytes: 1 << 20, budget: 1 << 20, mmaps: HashMap::new() }
    }

    #[test]
    fn typed_fields_decode() {
        let tp = proto::TensorProto { dims: vec![2], data_type: Some(10), int32_data: vec![0x3c00, 0xc000], ..Default::default() };
        let t = from_proto(&tp, &mut src()).unwrap();
        assert_eq!(t.to_f64_vec().unwrap(), vec![1.0, -2.0]);
        let tp = proto::TensorProto { dims: vec![3], data_type: Some(22), int32_data: vec![0x7f, 0x08], ..Default::default() };
        assert_eq!(from_proto(&tp, &mut src()).unwrap().packed_ints().unwrap(), vec![-1, 7, -8]);
        let tp = proto::TensorProto { dims: vec![2], data_type: Some(9), int32_data: vec![1, 0], ..Default::default() };
        assert_eq!(from_proto(&tp, &mut src()).unwrap().bools().unwrap(), vec![true, false]);
    }

    #[test]
    fn declared_size_must_match_data() {
        let tp = proto::TensorProto { dims: vec![3], data_type: Some(1), float_data: vec![1.0], ..Default::default() };
        let e = from_proto(&tp, &mut src()).unwrap_err().to_string();
        assert!(e.contains("float_data holds 1 values"), "{e}");
        let tp = proto::TensorProto { dims: vec![1 << 40, 1 << 30], data_type: Some(1), raw_data: Some(vec![0; 4].into()), ..Default::default() };
        let e = from_proto(&tp, &mut src()).unwrap_err().to_string();
        assert!(e.contains("exceeds the limit"), "{e}");
        let tp = proto::TensorProto { dims: vec![-1], data_type: Some(1), ..Default::default() };
        assert!(from_proto(&tp, &mut src()).is_err());
        let tp = proto::TensorProto { dims: vec![1], data_type: Some(99), ..Default::default() };
        assert!(from_proto(&tp, &mut src()).unwrap_err().to_string().contains("99"));
    }

    #[test]
    fn budget_limits_total_allocation() {
        let mut s = src();
        s.budget = 10;
        let tp = proto::TensorProto { dims: vec![4], data_type: Some(1), raw_data: Some(vec![0; 16].into()), ..Default::default() };
        assert!(from_proto(&tp, &mut s).unwrap_err().to_string().contains("budget"));
    }
}
