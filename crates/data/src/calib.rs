//! Calibration data sets: the sample inputs a quantizer runs through a model to observe ranges.
//!
//! Three layouts are recognised under one path:
//! - a directory of sample folders, `PATH/<sample>/<input>.npy`, with an optional
//!   `PATH/manifest.json` (format `qeval-calib-v1`) giving the sample order and file names;
//! - one `.npz` file of arrays stacked along a leading sample axis `[N, ...]` (an array with
//!   the model's rank whose first declared dimension is dynamic or 1 is split along that batch
//!   axis instead: each sample keeps a batch of 1);
//! - a directory of `.npz` files, one sample each, sorted by file name.

use std::fs;
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use qforge_ir::{DType, Tensor};
use serde::Deserialize;

use crate::images::{self, ImagePlan};
use crate::{read_npy, read_npz, DataError, DataResult};

/// What the model declares for one input, for validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInput {
    /// The graph input name, as samples must be keyed (or its [`sanitize`]d form as a file name).
    pub name: String,
    /// The declared element type; `None` accepts any type.
    pub dtype: Option<DType>,
    /// None = unknown rank; Some(dims) with None for a dynamic dim.
    pub dims: Option<Vec<Option<usize>>>,
    /// false when the model gives the input a default (initializer) so it may be omitted.
    pub required: bool,
}

/// A calibration data set opened and checked against the model's inputs; samples are read one
/// at a time by [`CalibrationSet::load`].
#[derive(Debug)]
pub struct CalibrationSet {
    root: PathBuf,
    inputs: Vec<ModelInput>,
    names: Vec<String>,
    layout: Layout,
}

#[derive(Debug)]
enum Layout {
    Folders(Vec<Vec<Entry>>),
    /// (input, stacked array, whether axis 0 is the model's batch axis).
    Stacked(Vec<(usize, Tensor, bool)>),
    NpzFiles(Vec<PathBuf>),
    /// Image files, each one feed of one input, by a resolved `preprocess.toml`.
    Images(Vec<PathBuf>, ImagePlan),
}

/// One `.npy` file of a sample folder, with what the manifest (if any) says it holds.
#[derive(Debug)]
struct Entry {
    input: usize,
    path: PathBuf,
    dtype: Option<DType>,
    shape: Option<Vec<usize>>,
}

#[derive(Deserialize)]
struct Manifest {
    format: Option<String>,
    num_samples: Option<usize>,
    inputs: Vec<ManifestInput>,
    #[serde(default)]
    samples: Vec<String>,
    stacked_npz: Option<String>,
}

#[derive(Deserialize)]
struct ManifestInput {
    name: String,
    file: Option<String>,
    dtype: Option<String>,
    shape: Option<Vec<usize>>,
    shapes: Option<Vec<Vec<usize>>>,
}

const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "qeval-calib-v1";
const NUMPY_NAMES: [(&str, DType); 12] = [
    ("float32", DType::F32), ("float64", DType::F64), ("float16", DType::F16), ("int8", DType::I8),
    ("uint8", DType::U8), ("int16", DType::I16), ("uint16", DType::U16), ("int32", DType::I32),
    ("uint32", DType::U32), ("int64", DType::I64), ("uint64", DType::U64), ("bool", DType::Bool),
];

/// The file stem used for an input name: every character outside `[A-Za-z0-9_.-]` becomes `_`.
pub fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || "_.-".contains(c) { c } else { '_' }).collect()
}

fn fail(path: &Path, sample: Option<&str>, input: Option<&str>, reason: impl Into<String>) -> DataError {
    DataError::Calibration {
        path: path.into(),
        sample: sample.map(Into::into),
        input: input.map(Into::into),
        reason: reason.into(),
    }
}

fn numpy_name(d: DType) -> String {
    NUMPY_NAMES.iter().find(|(_, t)| *t == d).map_or_else(|| d.to_string(), |(n, _)| n.to_string())
}

/// The inputs' names, quoted, comma-separated.
pub(crate) fn list_inputs(inputs: &[ModelInput]) -> String {
    inputs.iter().map(|m| format!("'{}'", m.name)).collect::<Vec<_>>().join(", ")
}

/// Dimensions as `[1, 3, ?, ?]`, `?` for a dynamic one.
pub(crate) fn fmt_dims(dims: &[Option<usize>]) -> String {
    let d: Vec<String> = dims.iter().map(|d| d.map_or("?".into(), |d| d.to_string())).collect();
    format!("[{}]", d.join(", "))
}

fn is_relative_inside(p: &str) -> bool {
    !p.is_empty() && Path::new(p).components().all(|c| matches!(c, Component::Normal(_)))
}

/// Visible directory entries, sorted by name, as (name, is a directory).
fn entries(dir: &Path) -> DataResult<Vec<(String, bool)>> {
    let io = |e: std::io::Error| fail(dir, None, None, format!("cannot list the directory: {e}"));
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(io)? {
        let e = e.map_err(io)?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            out.push((name, e.path().is_dir()));
        }
    }
    out.sort();
    Ok(out)
}

/// Maps each key (array name or file stem) to a model input, checking for unknown keys,
/// duplicates and missing required inputs. `present` describes what the sample holds.
fn match_keys(
    inputs: &[ModelInput], keys: &[String], path: &Path, sample: Option<&str>, present: &str,
) -> DataResult<Vec<usize>> {
    let mut found: Vec<usize> = Vec::with_capacity(keys.len());
    for key in keys {
        let at = inputs.iter().position(|m| m.name == *key)
            .or_else(|| inputs.iter().position(|m| sanitize(&m.name) == *key))
            .ok_or_else(|| fail(path, sample, Some(key), format!(
                "'{key}' is not an input of the model; its inputs are {}: rename or remove it",
                list_inputs(inputs))))?;
        if found.contains(&at) {
            return Err(fail(path, sample, Some(&inputs[at].name),
                format!("the input is given twice (present: {present}); keep one")));
        }
        found.push(at);
    }
    if let Some(m) = inputs.iter().enumerate().find(|(i, m)| m.required && !found.contains(i)).map(|(_, m)| m) {
        return Err(fail(path, sample, Some(&m.name), format!(
            "required input '{}' is missing (expected {}.npy or key '{}'); present: {present}; add it",
            m.name, sanitize(&m.name), m.name)));
    }
    Ok(found)
}

fn present_list(names: &[String]) -> String {
    if names.is_empty() { "(nothing)".into() } else { names.join(", ") }
}

fn npz_keys(path: &Path, sample: Option<&str>) -> DataResult<Vec<String>> {
    let bad = |e: String| fail(path, sample, None, format!("not a readable .npz archive ({e}); re-save it with numpy.savez"));
    let file = fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    Ok(zip.file_names().map(|n| n.strip_suffix(".npy").unwrap_or(n).to_string()).collect())
}

/// The reason of a file error, without the file name the caller already reports.
fn reason(e: DataError) -> String {
    match e {
        DataError::Io { source, .. } => source.to_string(),
        DataError::BadNpy { reason, .. } | DataError::BadNpz { reason, .. } | DataError::Calibration { reason, .. } => reason,
    }
}

fn read_npz_checked(path: &Path, sample: Option<&str>) -> DataResult<Vec<(String, Tensor)>> {
    read_npz(path).map_err(|e| fail(path, sample, None,
        format!("not a readable .npz archive ({}); re-save it with numpy.savez", reason(e))))
}

/// Count and flat index of the first NaN/Inf of a float tensor (`None` for other types).
fn non_finite(t: &Tensor) -> Option<(usize, usize)> {
    fn scan<T: Copy>(v: &[T], finite: impl Fn(T) -> bool) -> Option<(usize, usize)> {
        let mut bad = v.iter().enumerate().filter(|(_, x)| !finite(**x)).map(|(i, _)| i);
        let first = bad.next()?;
        Some((1 + bad.count(), first))
    }
    match t.dtype() {
        DType::F32 => scan(t.as_slice::<f32>().ok()?, f32::is_finite),
        DType::F64 => scan(t.as_slice::<f64>().ok()?, f64::is_finite),
        DType::F16 => scan(t.as_slice::<f16>().ok()?, f16::is_finite),
        DType::BF16 => scan(t.as_slice::<bf16>().ok()?, bf16::is_finite),
        _ => None,
    }
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        idx[i] = flat % d.max(1);
        flat /= d.max(1);
    }
    idx
}

/// A one-element array given for a scalar becomes the scalar (numpy writes `np.array([x])`
/// as easily as `np.array(x)`); anything else is returned as it is.
fn as_scalar(t: Tensor) -> Tensor {
    if t.rank() > 0 && t.len() == 1 {
        t.reshaped(&[]).unwrap_or(t)
    } else {
        t
    }
}

/// Checks a tensor against the model's declaration; the error is the reason.
fn validate(m: &ModelInput, t: &Tensor) -> Result<(), String> {
    if let Some(d) = m.dtype.filter(|d| *d != t.dtype()) {
        let (want, got) = (numpy_name(d), numpy_name(t.dtype()));
        return Err(format!("element type mismatch: the model declares {want}, the data is {got}; \
            convert it with .astype(numpy.{want})"));
    }
    if let Some(dims) = &m.dims {
        let fits = dims.len() == t.rank() && dims.iter().zip(t.shape()).all(|(d, &s)| d.is_none_or(|d| d == s));
        if !fits {
            return Err(format!("shape mismatch: the model declares {} (? = any size), the data has {:?}; \
                reshape or regenerate it", fmt_dims(dims), t.shape()));
        }
    }
    if let Some((count, first)) = non_finite(t) {
        return Err(format!("{count} NaN/Inf value(s), the first at index {:?} (flat {first}); \
            clean the data or drop the sample", unravel(first, t.shape())));
    }
    Ok(())
}

impl CalibrationSet {
    /// Opens PATH, detects its layout, checks that every sample has every required input (and
    /// no unknown input), without reading all tensor data into memory up front (the stacked-npz
    /// case keeps its arrays loaded). Files are checked for presence, `.npz` archives for their
    /// member names; array contents are validated by [`CalibrationSet::load`].
    ///
    /// Errors ([`DataError::Calibration`]) when the path does not exist, holds no sample, has
    /// a bad manifest (invalid JSON, wrong format, a missing file, a path leaving PATH), an
    /// unreadable `.npz`, stacked arrays with differing sample counts, or samples whose inputs
    /// do not match `inputs`.
    pub fn open(path: &Path, inputs: &[ModelInput]) -> DataResult<CalibrationSet> {
        if !path.exists() {
            return Err(fail(path, None, None, "does not exist; pass a directory of sample folders, \
                a directory of .npz files, a stacked .npz file or a directory of images with a preprocess.toml"));
        }
        let (names, layout) = if path.is_file() {
            Self::open_stacked(path, inputs)?
        } else if path.join(MANIFEST).is_file() {
            Self::open_manifest(path, inputs)?
        } else {
            Self::open_dir(path, inputs)?
        };
        if names.is_empty() {
            return Err(fail(path, None, None, "the calibration set holds no sample; add at least one"));
        }
        Ok(CalibrationSet { root: path.into(), inputs: inputs.to_vec(), names, layout })
    }

    fn open_stacked(path: &Path, inputs: &[ModelInput]) -> DataResult<(Vec<String>, Layout)> {
        let arrays = read_npz_checked(path, None)?;
        let keys: Vec<String> = arrays.iter().map(|(k, _)| k.clone()).collect();
        let at = match_keys(inputs, &keys, path, None, &present_list(&keys))?;
        let counts: Vec<(String, Option<usize>)> =
            arrays.iter().map(|(k, t)| (k.clone(), t.shape().first().copied())).collect();
        if let Some((k, _)) = counts.iter().find(|(_, n)| n.is_none()) {
            return Err(fail(path, None, Some(k), "the array is a scalar; a stacked .npz needs shape [N, ...] \
                with one entry per sample along axis 0"));
        }
        let n = counts.first().and_then(|c| c.1).unwrap_or(0);
        if n == 0 {
            return Err(fail(path, None, None, "the stacked arrays hold N = 0 samples; add at least one"));
        }
        if counts.iter().any(|c| c.1 != Some(n)) {
            let list: Vec<String> = counts.iter().map(|(k, c)| format!("'{k}' has {}", c.unwrap_or(0))).collect();
            return Err(fail(path, None, None, format!(
                "stacked arrays disagree on the sample count N (axis 0): {}; give every input the same N",
                list.join(", "))));
        }
        let file = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
        let names = (0..n).map(|i| format!("index {i} of {file}")).collect();
        let arrays = at.into_iter().zip(arrays).map(|(i, (_, t))| {
            let batch_axis = inputs[i].dims.as_ref().is_some_and(|d| d.len() == t.rank() && matches!(d[0], None | Some(1)));
            (i, t, batch_axis)
        }).collect();
        Ok((names, Layout::Stacked(arrays)))
    }

    fn open_manifest(root: &Path, inputs: &[ModelInput]) -> DataResult<(Vec<String>, Layout)> {
        let mpath = root.join(MANIFEST);
        let bad = |reason: String| fail(&mpath, None, None, reason);
        let text = fs::read_to_string(&mpath).map_err(|e| bad(format!("cannot be read: {e}")))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| bad(format!("is not a valid {FORMAT} manifest: {e}; fix or delete it")))?;
        if let Some(f) = m.format.as_deref().filter(|f| *f != FORMAT) {
            return Err(bad(format!("has format '{f}', expected '{FORMAT}'")));
        }
        let paths = m.samples.iter().chain(m.inputs.iter().filter_map(|i| i.file.as_ref())).chain(&m.stacked_npz);
        if let Some(p) = paths.into_iter().find(|p| !is_relative_inside(p)) {
            return Err(bad(format!("names the path '{p}', which leaves the data directory; \
                use paths relative to it without '..'")));
        }
        if let Some(n) = m.num_samples.filter(|n| *n != m.samples.len() && !m.samples.is_empty()) {
            return Err(bad(format!("says num_samples is {n} but lists {} samples; make them agree", m.samples.len())));
        }
        if m.samples.is_empty() {
            return match m.stacked_npz {
                Some(s) => Self::open_stacked(&root.join(s), inputs),
                None => Ok((Vec::new(), Layout::Folders(Vec::new()))),
            };
        }
        let keys: Vec<String> = m.inputs.iter().map(|i| i.name.clone()).collect();
        let at = match_keys(inputs, &keys, &mpath, None, &present_list(&keys))?;
        let canon_root = fs::canonicalize(root).map_err(|e| bad(e.to_string()))?;
        let mut samples = Vec::with_capacity(m.samples.len());
        for (s, sample) in m.samples.iter().enumerate() {
            let mut files = Vec::with_capacity(m.inputs.len());
            for (mi, &input) in m.inputs.iter().zip(&at) {
                let file = mi.file.clone().unwrap_or_else(|| format!("{}.npy", sanitize(&mi.name)));
                let path = root.join(sample).join(&file);
                let here = |reason: String| fail(&mpath, Some(sample), Some(&mi.name), reason);
                let canon = fs::canonicalize(&path).map_err(|_| {
                    let present: Vec<String> = entries(&root.join(sample)).map(|e| e.into_iter().map(|(n, _)| n).collect()).unwrap_or_default();
                    here(format!("names the file {sample}/{file}, which does not exist (present: {}); \
                        add it or fix the manifest", present_list(&present)))
                })?;
                if !canon.starts_with(&canon_root) {
                    return Err(here(format!("{sample}/{file} resolves outside the data directory; refusing it")));
                }
                let dtype = mi.dtype.as_deref().map(|d| {
                    NUMPY_NAMES.iter().find(|(n, _)| *n == d).map(|(_, t)| *t)
                        .ok_or_else(|| here(format!("has the unknown dtype '{d}'; use a numpy name such as float32")))
                }).transpose()?;
                let shape = match (&mi.shapes, &mi.shape) {
                    (Some(all), _) => Some(all.get(s).cloned().ok_or_else(|| here(format!(
                        "lists {} shapes for {} samples; give one per sample", all.len(), m.samples.len())))?),
                    (None, shape) => shape.clone(),
                };
                files.push(Entry { input, path, dtype, shape });
            }
            samples.push(files);
        }
        Ok((m.samples, Layout::Folders(samples)))
    }

    fn open_dir(root: &Path, inputs: &[ModelInput]) -> DataResult<(Vec<String>, Layout)> {
        let all = entries(root)?;
        let dirs: Vec<&String> = all.iter().filter(|e| e.1).map(|e| &e.0).collect();
        if dirs.is_empty() {
            let npz: Vec<String> = all.iter().filter(|(n, d)| !d && n.to_ascii_lowercase().ends_with(".npz")).map(|e| e.0.clone()).collect();
            let files: Vec<String> = all.iter().filter(|e| !e.1).map(|e| e.0.clone()).collect();
            let pictures = images::image_files(&files);
            if npz.is_empty() && (!pictures.is_empty() || files.iter().any(|f| f == images::SPEC_FILE)) {
                return Self::open_images(root, inputs, pictures);
            }
            if npz.is_empty() {
                let hint = if all.iter().any(|(n, _)| n.ends_with(".npy")) {
                    "; it holds .npy files directly: put each sample's files in its own subfolder"
                } else { "" };
                return Err(fail(root, None, None, format!("holds no sample folders and no .npz files{hint}; \
                    expected PATH/<sample>/<input>.npy or PATH/<sample>.npz")));
            }
            for name in &npz {
                let p = root.join(name);
                let keys = npz_keys(&p, Some(name))?;
                match_keys(inputs, &keys, &p, Some(name), &present_list(&keys))?;
            }
            let paths = npz.iter().map(|n| root.join(n)).collect();
            return Ok((npz, Layout::NpzFiles(paths)));
        }
        for (i, a) in inputs.iter().enumerate() {
            if let Some(b) = inputs[i + 1..].iter().find(|b| sanitize(&b.name) == sanitize(&a.name)) {
                return Err(fail(root, None, Some(&a.name), format!(
                    "inputs '{}' and '{}' both map to the file {}.npy; add a {MANIFEST} naming each input's file",
                    a.name, b.name, sanitize(&a.name))));
            }
        }
        let mut samples = Vec::with_capacity(dirs.len());
        for sample in &dirs {
            let dir = root.join(sample);
            let files: Vec<String> = entries(&dir)?.into_iter().filter(|e| !e.1).map(|e| e.0).collect();
            let npy: Vec<String> = files.iter().filter_map(|f| f.strip_suffix(".npy")).map(String::from).collect();
            let at = match_keys(inputs, &npy, &dir, Some(sample), &present_list(&files))?;
            samples.push(at.into_iter().zip(&npy)
                .map(|(input, stem)| Entry { input, path: dir.join(format!("{stem}.npy")), dtype: None, shape: None })
                .collect());
        }
        Ok((dirs.into_iter().cloned().collect(), Layout::Folders(samples)))
    }

    fn open_images(root: &Path, inputs: &[ModelInput], pictures: Vec<String>) -> DataResult<(Vec<String>, Layout)> {
        let spec_path = root.join(images::SPEC_FILE);
        if !spec_path.is_file() {
            return Err(fail(root, None, None, format!("holds {} image files but no {}; add one saying how images \
                become the model input, e.g.\n  resize_shorter = 256\n  center_crop = [224, 224]\n  \
                mean = [0.485, 0.456, 0.406]\n  std = [0.229, 0.224, 0.225]\n(see the README, 'Calibration data')",
                pictures.len(), images::SPEC_FILE)));
        }
        if pictures.is_empty() {
            return Err(fail(root, None, None, format!("holds {} but no image; add .png or .jpg files next to it", images::SPEC_FILE)));
        }
        let (path, spec) = images::read_spec(root).map_err(|(p, r)| fail(&p, None, None, r))?;
        let plan = ImagePlan::new(&spec, inputs).map_err(|r| fail(&path, None, None, r))?;
        let files = pictures.iter().map(|n| root.join(n)).collect();
        Ok((pictures, Layout::Images(files, plan)))
    }

    /// The number of samples (at least one once opened).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether the set has no sample; always false for an opened set.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The path the set was opened from.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Sample `i`'s name for messages: its folder, its file name, or `index 3 of calib.npz`.
    /// Panics when `i >= len()`.
    pub fn sample_name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// What the loader reads differently from the layout's plain rule, one line each: stacked
    /// arrays split along the model's batch axis, or how images become the input.
    pub fn notes(&self) -> Vec<String> {
        if let Layout::Images(_, plan) = &self.layout {
            return vec![plan.describe(&self.inputs[plan.input].name)];
        }
        let Layout::Stacked(arrays) = &self.layout else { return vec![] };
        arrays.iter().filter(|(_, _, b)| *b).map(|(i, t, _)| {
            let one = [&[1], &t.shape()[1..]].concat();
            format!("input '{}': the stacked array {:?} has the model's rank, so its axis 0 is read as the batch axis: \
                {} samples of shape {one:?}", self.inputs[*i].name, t.shape(), t.shape()[0])
        }).collect()
    }

    /// The detected layout: `"sample folders"`, `"stacked npz"`, `"npz per sample"` or `"images"`.
    pub fn layout(&self) -> &'static str {
        match self.layout {
            Layout::Folders(_) => "sample folders",
            Layout::Stacked(_) => "stacked npz",
            Layout::NpzFiles(_) => "npz per sample",
            Layout::Images(..) => "images",
        }
    }

    /// Reads sample `i` as (model input name, tensor) pairs in the model's input order,
    /// validated: dtype equal to the declared one, rank and every fixed dim equal to the
    /// declared ones, no NaN/Inf in float inputs, and agreement with the manifest's dtype and
    /// shape when it gives them. Optional inputs absent from the sample are left out.
    pub fn load(&self, i: usize) -> DataResult<Vec<(String, Tensor)>> {
        let sample = self.names.get(i).ok_or_else(|| fail(&self.root, None, None,
            format!("sample {i} requested but the set has {}", self.names.len())))?;
        let mut out: Vec<(usize, Tensor, PathBuf)> = match &self.layout {
            Layout::Folders(samples) => samples[i].iter().map(|e| {
                let name = &self.inputs[e.input].name;
                let here = |r: String| fail(&e.path, Some(sample), Some(name), r);
                let t = read_npy(&e.path).map_err(|err| here(format!("not a valid .npy array ({}); re-save it with numpy.save", reason(err))))?;
                let t = match &e.shape {
                    Some(s) if s.is_empty() => as_scalar(t),
                    _ => t,
                };
                if let Some(d) = e.dtype.filter(|d| *d != t.dtype()) {
                    return Err(here(format!("{MANIFEST} says {} but the file holds {}; regenerate one of them",
                        numpy_name(d), numpy_name(t.dtype()))));
                }
                if let Some(s) = e.shape.as_ref().filter(|s| s.as_slice() != t.shape()) {
                    return Err(here(format!("{MANIFEST} says shape {s:?} but the file holds {:?}; regenerate one of them",
                        t.shape())));
                }
                Ok((e.input, t, e.path.clone()))
            }).collect::<DataResult<_>>()?,
            Layout::Stacked(arrays) => arrays.iter().map(|(input, t, batch_axis)| {
                let shape = if *batch_axis { [&[1], &t.shape()[1..]].concat() } else { t.shape()[1..].to_vec() };
                let shape = shape.as_slice();
                let bytes = t.raw_bytes().unwrap_or_default();
                let per = bytes.len() / t.shape()[0];
                let t = Tensor::from_raw(t.dtype(), shape, &bytes[i * per..(i + 1) * per])
                    .map_err(|e| fail(&self.root, Some(sample), Some(&self.inputs[*input].name), e.to_string()))?;
                Ok((*input, t, self.root.clone()))
            }).collect::<DataResult<_>>()?,
            Layout::Images(files, plan) => {
                let t = plan.load(&files[i]).map_err(|r| fail(&files[i], Some(sample), Some(&self.inputs[plan.input].name), r))?;
                vec![(plan.input, t, files[i].clone())]
            }
            Layout::NpzFiles(paths) => {
                let arrays = read_npz_checked(&paths[i], Some(sample))?;
                let keys: Vec<String> = arrays.iter().map(|(k, _)| k.clone()).collect();
                let at = match_keys(&self.inputs, &keys, &paths[i], Some(sample), &present_list(&keys))?;
                at.into_iter().zip(arrays).map(|(input, (_, t))| (input, t, paths[i].clone())).collect()
            }
        };
        out.sort_by_key(|e| e.0);
        out.into_iter().map(|(input, t, path)| {
            let m = &self.inputs[input];
            let t = if m.dims.as_ref().is_some_and(|d| d.is_empty()) { as_scalar(t) } else { t };
            validate(m, &t).map_err(|r| fail(&path, Some(sample), Some(&m.name), r))?;
            Ok((m.name.clone(), t))
        }).collect()
    }
}
