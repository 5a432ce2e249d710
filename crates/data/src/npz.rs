use std::io::{Read, Write};
use std::path::Path;

use qforge_ir::Tensor;

use crate::npy::{npy_bytes, read_npy_bytes};
use crate::{DataError, DataResult};

/// Reads every array of a `.npz` archive, in archive order, keyed by member name without `.npy`.
pub fn read_npz(path: &Path) -> DataResult<Vec<(String, Tensor)>> {
    let bad = |reason: String| DataError::BadNpz { path: path.into(), reason };
    let file = std::fs::File::open(path).map_err(|source| DataError::Io { path: path.into(), source })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let mut member = zip.by_index(i).map_err(|e| bad(e.to_string()))?;
        let name = member.name().to_string();
        let key = name.strip_suffix(".npy").unwrap_or(&name).to_string();
        let mut bytes = Vec::new();
        member.by_ref().take(5 << 30).read_to_end(&mut bytes).map_err(|e| bad(format!("{name}: {e}")))?;
        let t = read_npy_bytes(&bytes).map_err(|r| bad(format!("member '{name}': {r}")))?;
        out.push((key, t));
    }
    Ok(out)
}

/// Writes named tensors as a `.npz` archive (deflate-compressed members `<name>.npy`), via a
/// temporary file renamed into place.
pub fn write_npz(path: &Path, tensors: &[(String, Tensor)]) -> DataResult<()> {
    let bad = |reason: String| DataError::BadNpz { path: path.into(), reason };
    let tmp = path.with_extension("npz.tmp");
    let io = |source| DataError::Io { path: tmp.clone(), source };
    let file = std::fs::File::create(&tmp).map_err(io)?;
    let mut zip = zip::ZipWriter::new(file);
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    for (name, t) in tensors {
        let bytes = npy_bytes(t).map_err(|r| bad(format!("'{name}': {r}")))?;
        zip.start_file(format!("{name}.npy"), opts).map_err(|e| bad(e.to_string()))?;
        zip.write_all(&bytes).map_err(io)?;
    }
    zip.finish().map_err(|e| bad(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|source| DataError::Io { path: path.into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npz_round_trip() {
        let dir = std::env::temp_dir().join(format!("qforge-npz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npz");
        let ts = vec![
            ("x".to_string(), Tensor::from_vec(&[2], vec![1f32, 2.]).unwrap()),
            ("ids".to_string(), Tensor::from_vec(&[1, 3], vec![4i64, 5, 6]).unwrap()),
        ];
        write_npz(&p, &ts).unwrap();
        assert_eq!(read_npz(&p).unwrap(), ts);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
