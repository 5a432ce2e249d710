use std::path::Path;

use qforge_ir::{DType, Tensor};

use crate::{DataError, DataResult};

/// The largest array a `.npy` file may declare (4 GiB); larger headers are rejected before
/// anything is allocated.
const MAX_NPY_BYTES: u64 = 4 << 30;

/// NumPy `descr` strings for each supported element type (little-endian or byte-order-free).
fn descr(dtype: DType) -> Option<&'static str> {
    use DType::*;
    Some(match dtype {
        F32 => "<f4",
        F64 => "<f8",
        F16 => "<f2",
        I8 => "|i1",
        U8 => "|u1",
        I16 => "<i2",
        U16 => "<u2",
        I32 => "<i4",
        U32 => "<u4",
        I64 => "<i8",
        U64 => "<u8",
        Bool => "|b1",
        _ => return None,
    })
}

fn dtype_of_descr(d: &str) -> Option<DType> {
    let norm = d.replace(['=', '|'], "<");
    DType::ALL.into_iter().find(|t| descr(*t).is_some_and(|x| x.replace('|', "<") == norm))
}

/// Reads a `.npy` file (format versions 1-3, C order, little-endian numeric or bool).
pub fn read_npy(path: &Path) -> DataResult<Tensor> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io { path: path.into(), source })?;
    read_npy_bytes(&bytes).map_err(|reason| DataError::BadNpy { path: path.into(), reason })
}

/// Parses `.npy` bytes; the error is a reason without the file name.
pub fn read_npy_bytes(bytes: &[u8]) -> Result<Tensor, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("missing the \\x93NUMPY magic".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10usize),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("unsupported format version {v}")),
    };
    let header = bytes.get(start..start.saturating_add(header_len)).ok_or("truncated header")?;
    let header = std::str::from_utf8(header).map_err(|_| "header is not text")?;
    let field = |key: &str| -> Result<&str, String> {
        let at = header.find(&format!("'{key}'")).ok_or(format!("header has no '{key}'"))?;
        Ok(header[at + key.len() + 2..].trim_start().trim_start_matches(':').trim_start())
    };
    let d = field("descr")?;
    let d = d.strip_prefix('\'').and_then(|s| s.split('\'').next()).ok_or("descr is not a string")?;
    let dtype = dtype_of_descr(d).ok_or(format!("element type '{d}' is not supported (use little-endian numeric or bool)"))?;
    if field("fortran_order")?.starts_with("True") {
        return Err("Fortran-order arrays are not supported; save with np.ascontiguousarray".into());
    }
    let s = field("shape")?;
    let s = s.strip_prefix('(').and_then(|s| s.split(')').next()).ok_or("shape is not a tuple")?;
    let shape = s.split(',').map(str::trim).filter(|x| !x.is_empty())
        .map(|x| x.trim_end_matches('L').parse::<usize>().map_err(|_| format!("bad dimension '{x}'")))
        .collect::<Result<Vec<_>, _>>()?;
    let need = Tensor::checked_byte_len(dtype, &shape, MAX_NPY_BYTES).map_err(|e| e.to_string())?;
    let data = &bytes[start + header_len..];
    if data.len() != need {
        return Err(format!("{dtype}{shape:?} needs {need} data bytes, the file has {}", data.len()));
    }
    Tensor::from_raw(dtype, &shape, data).map_err(|e| e.to_string())
}

/// The `.npy` (version 1.0) encoding of a tensor.
pub fn npy_bytes(t: &Tensor) -> Result<Vec<u8>, String> {
    let d = descr(t.dtype()).ok_or(format!("{} tensors cannot be written as .npy", t.dtype()))?;
    let shape = match t.shape() {
        [n] => format!("({n},)"),
        s => format!("({})", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{d}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(t.raw_bytes().ok_or("string tensors cannot be written as .npy")?);
    Ok(out)
}

/// Writes a tensor as a `.npy` file.
pub fn write_npy(path: &Path, t: &Tensor) -> DataResult<()> {
    let bytes = npy_bytes(t).map_err(|reason| DataError::BadNpy { path: path.into(), reason })?;
    std::fs::write(path, bytes).map_err(|source| DataError::Io { path: path.into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_all_types() {
        let ts = [
            Tensor::from_vec(&[2, 3], vec![1f32, -2., 3.5, 0., 1e-8, 7.]).unwrap(),
            Tensor::from_vec(&[4], vec![1i64, -2, 3, 1 << 40]).unwrap(),
            Tensor::from_vec(&[], vec![5u8]).unwrap(),
            Tensor::from_bools(&[2], &[true, false]).unwrap(),
        ];
        for t in ts {
            assert_eq!(read_npy_bytes(&npy_bytes(&t).unwrap()).unwrap(), t);
        }
    }

    #[test]
    fn rejects_bad_headers() {
        assert!(read_npy_bytes(b"not numpy").is_err());
        let mut b = npy_bytes(&Tensor::from_vec(&[2], vec![1f32, 2.]).unwrap()).unwrap();
        b.pop();
        assert!(read_npy_bytes(&b).unwrap_err().contains("needs 8 data bytes"));
        let huge = b"\x93NUMPY\x01\x00\x40\x00{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 100000), }\n";
        assert!(read_npy_bytes(huge).is_err());
    }
}
