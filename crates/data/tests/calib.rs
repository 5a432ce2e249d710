use std::fs;
use std::path::{Path, PathBuf};

use qforge_data::{write_npy, write_npz, CalibrationSet, DataResult, ModelInput};
use qforge_ir::{DType, Tensor};

/// A fresh temporary directory, removed when dropped.
struct Tmp(PathBuf);

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

impl std::ops::Deref for Tmp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

fn tmp(name: &str) -> Tmp {
    let dir = std::env::temp_dir().join(format!("qforge-calib-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    Tmp(dir)
}

fn inputs() -> Vec<ModelInput> {
    vec![
        ModelInput { name: "input:0".into(), dtype: Some(DType::F32), dims: Some(vec![Some(1), Some(2), None]), required: true },
        ModelInput { name: "sr".into(), dtype: Some(DType::I64), dims: Some(vec![]), required: true },
        ModelInput { name: "state".into(), dtype: Some(DType::F32), dims: None, required: false },
    ]
}

fn x(len: usize, start: f32) -> Tensor {
    Tensor::from_vec(&[1, 2, len], (0..2 * len).map(|v| start + v as f32).collect()).unwrap()
}

fn sr(v: i64) -> Tensor {
    Tensor::scalar(v)
}

/// Writes `PATH/<sample>/<file>` for each (sample, file, tensor).
fn folders(root: &Path, files: &[(&str, &str, Tensor)]) {
    for (sample, file, t) in files {
        fs::create_dir_all(root.join(sample)).unwrap();
        write_npy(&root.join(sample).join(file), t).unwrap();
    }
}

fn two_samples(root: &Path) {
    folders(root, &[
        ("a", "input_0.npy", x(3, 0.)), ("a", "sr.npy", sr(16000)),
        ("b", "input_0.npy", x(5, 10.)), ("b", "sr.npy", sr(8000)), ("b", "state.npy", Tensor::from_vec(&[2], vec![1f32, 2.]).unwrap()),
    ]);
}

fn named(v: &[(&str, Tensor)]) -> Vec<(String, Tensor)> {
    v.iter().map(|(n, t)| (n.to_string(), t.clone())).collect()
}

fn err<T: std::fmt::Debug>(r: DataResult<T>) -> String {
    r.unwrap_err().to_string()
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
}

#[test]
fn sample_folders_load_ragged_shapes_scalars_and_sanitized_names() {
    let root = tmp("folders");
    two_samples(&root);
    fs::write(root.join("README.txt"), "not a sample").unwrap();
    fs::create_dir_all(root.join(".cache")).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_eq!((set.layout(), set.len(), set.is_empty()), ("sample folders", 2, false));
    assert_eq!((set.sample_name(0), set.sample_name(1)), ("a", "b"));
    assert_eq!(set.load(0).unwrap(), named(&[("input:0", x(3, 0.)), ("sr", sr(16000))]));
    assert_eq!(set.load(1).unwrap(), named(&[
        ("input:0", x(5, 10.)), ("sr", sr(8000)), ("state", Tensor::from_vec(&[2], vec![1f32, 2.]).unwrap()),
    ]));
    assert!(err(set.load(2)).contains("sample 2 requested but the set has 2"));
}

#[test]
fn manifest_gives_order_and_file_names() {
    let root = tmp("manifest");
    folders(&root, &[
        ("00000", "x.npy", x(3, 0.)), ("00000", "rate.npy", sr(1)),
        ("00001", "x.npy", x(4, 5.)), ("00001", "rate.npy", sr(2)),
        ("00002", "x.npy", x(6, 9.)), ("00002", "rate.npy", sr(3)),
    ]);
    fs::write(root.join("manifest.json"), r#"{"format": "qeval-calib-v1", "num_samples": 2,
        "inputs": [{"name": "input:0", "file": "x.npy", "dtype": "float32", "shapes": [[1,2,6],[1,2,3]]},
                   {"name": "sr", "file": "rate.npy", "dtype": "int64", "shape": []}],
        "samples": ["00002", "00000"], "stacked_npz": null}"#).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_eq!((set.layout(), set.len(), set.sample_name(0), set.sample_name(1)), ("sample folders", 2, "00002", "00000"));
    assert_eq!(set.load(0).unwrap(), named(&[("input:0", x(6, 9.)), ("sr", sr(3))]));
    assert_eq!(set.load(1).unwrap(), named(&[("input:0", x(3, 0.)), ("sr", sr(1))]));
}

#[test]
fn manifest_without_samples_uses_its_stacked_npz() {
    let root = tmp("manifest-stacked");
    let xs = Tensor::from_vec(&[2, 1, 2, 1], vec![1f32, 2., 3., 4.]).unwrap();
    write_npz(&root.join("calib.npz"), &named(&[("input:0", xs), ("sr", Tensor::from_vec(&[2], vec![5i64, 6]).unwrap())])).unwrap();
    fs::write(root.join("manifest.json"), r#"{"format": "qeval-calib-v1", "num_samples": 2,
        "inputs": [{"name": "input:0"}, {"name": "sr"}], "samples": [], "stacked_npz": "calib.npz"}"#).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_eq!((set.layout(), set.len()), ("stacked npz", 2));
    assert_eq!(set.load(1).unwrap()[1], ("sr".to_string(), sr(6)));
}

#[test]
fn manifest_disagreeing_with_the_file_is_reported() {
    let root = tmp("manifest-mismatch");
    folders(&root, &[("s", "input_0.npy", x(3, 0.)), ("s", "sr.npy", sr(1))]);
    fs::write(root.join("manifest.json"), r#"{"inputs": [{"name": "input:0", "shape": [1,2,4]}, {"name": "sr", "dtype": "int32"}],
        "samples": ["s"]}"#).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_has(&err(set.load(0)), &["sample 's'", "input 'input:0'", "manifest.json says shape [1, 2, 4]", "[1, 2, 3]"]);
}

#[test]
fn stacked_npz_splits_axis_zero() {
    let root = tmp("stacked");
    let p = root.join("calib.npz");
    let xs = Tensor::from_vec(&[3, 1, 2, 2], (0..12).map(|v| v as f32).collect()).unwrap();
    let rates = Tensor::from_vec(&[3], vec![8000i64, 16000, 22050]).unwrap();
    write_npz(&p, &named(&[("sr", rates), ("input:0", xs)])).unwrap();
    let set = CalibrationSet::open(&p, &inputs()).unwrap();
    assert_eq!((set.layout(), set.len(), set.sample_name(2)), ("stacked npz", 3, "index 2 of calib.npz"));
    let want = Tensor::from_vec(&[1, 2, 2], vec![4f32, 5., 6., 7.]).unwrap();
    assert_eq!(set.load(1).unwrap(), named(&[("input:0", want), ("sr", sr(16000))]));
}

/// `[N, C, H, W]` for a model input `[batch, C, H, W]`: the array has the model's rank, so its
/// axis 0 is the batch axis and every sample keeps a batch of one; the loader says so.
#[test]
fn stacked_npz_with_the_models_rank_splits_its_batch_axis() {
    let root = tmp("stacked-batch");
    let p = root.join("calib.npz");
    let xs = Tensor::from_vec(&[3, 2, 2], (0..12).map(|v| v as f32).collect()).unwrap();
    let rates = Tensor::from_vec(&[3], vec![8000i64, 16000, 22050]).unwrap();
    write_npz(&p, &named(&[("sr", rates), ("input:0", xs)])).unwrap();
    let set = CalibrationSet::open(&p, &inputs()).unwrap();
    assert_eq!(set.len(), 3);
    let want = Tensor::from_vec(&[1, 2, 2], vec![8f32, 9., 10., 11.]).unwrap();
    assert_eq!(set.load(2).unwrap(), named(&[("input:0", want), ("sr", sr(22050))]));
    let notes = set.notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_has(&notes[0], &["input 'input:0'", "[3, 2, 2]", "batch axis", "[1, 2, 2]"]);
    // A fixed first dimension other than 1 is not a batch axis: the rank mismatch is an error.
    let fixed = vec![ModelInput { name: "input:0".into(), dtype: Some(DType::F32), dims: Some(vec![Some(2), Some(2), None]), required: true }];
    let p2 = root.join("fixed.npz");
    write_npz(&p2, &named(&[("input:0", Tensor::from_vec(&[3, 2, 2], vec![0f32; 12]).unwrap())])).unwrap();
    let set = CalibrationSet::open(&p2, &fixed).unwrap();
    assert!(set.notes().is_empty());
    assert_has(&err(set.load(0)), &["index 0 of fixed.npz", "shape mismatch", "[2, 2]"]);
}

#[test]
fn npz_per_sample_sorted_by_file_name_with_ragged_shapes() {
    let root = tmp("npz-files");
    write_npz(&root.join("s1.npz"), &named(&[("input:0", x(7, 1.)), ("sr", sr(2))])).unwrap();
    write_npz(&root.join("s0.npz"), &named(&[("sr", sr(1)), ("input_0", x(2, 0.))])).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_eq!((set.layout(), set.len(), set.sample_name(0)), ("npz per sample", 2, "s0.npz"));
    assert_eq!(set.load(0).unwrap(), named(&[("input:0", x(2, 0.)), ("sr", sr(1))]));
    assert_eq!(set.load(1).unwrap(), named(&[("input:0", x(7, 1.)), ("sr", sr(2))]));
}

#[test]
fn missing_path_is_an_error() {
    let dir = tmp("missing");
    let p = dir.join("nope");
    assert_has(&err(CalibrationSet::open(&p, &inputs())), &["nope", "does not exist"]);
}

#[test]
fn empty_sets_are_errors() {
    let root = tmp("empty");
    assert_has(&err(CalibrationSet::open(&root, &inputs())), &["no sample folders and no .npz files"]);
    write_npy(&root.join("sr.npy"), &sr(1)).unwrap();
    assert_has(&err(CalibrationSet::open(&root, &inputs())), &["put each sample's files in its own subfolder"]);
    let p = root.join("zero.npz");
    write_npz(&p, &named(&[("input:0", Tensor::zeros(DType::F32, &[0, 1, 2, 3]).unwrap()),
        ("sr", Tensor::zeros(DType::I64, &[0]).unwrap())])).unwrap();
    assert_has(&err(CalibrationSet::open(&p, &inputs())), &["zero.npz", "N = 0 samples"]);
}

#[test]
fn unreadable_files_are_errors() {
    let root = tmp("unreadable");
    two_samples(&root);
    fs::write(root.join("b").join("sr.npy"), b"garbage").unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert!(set.load(0).is_ok());
    assert_has(&err(set.load(1)), &["sample 'b'", "input 'sr'", "not a valid .npy", "numpy.save"]);

    let bad = root.join("bad.npz");
    fs::write(&bad, b"PK not really").unwrap();
    assert_has(&err(CalibrationSet::open(&bad, &inputs())), &["bad.npz", "not a readable .npz"]);
    let dir = tmp("unreadable-npz");
    write_npz(&dir.join("a.npz"), &named(&[("input:0", x(2, 0.)), ("sr", sr(1))])).unwrap();
    fs::write(dir.join("b.npz"), b"nope").unwrap();
    assert_has(&err(CalibrationSet::open(&dir, &inputs())), &["sample 'b.npz'", "not a readable .npz"]);
}

#[test]
fn missing_required_input_names_sample_input_and_files() {
    let root = tmp("missing-input");
    two_samples(&root);
    fs::remove_file(root.join("b").join("sr.npy")).unwrap();
    assert_has(&err(CalibrationSet::open(&root, &inputs())),
        &["sample 'b'", "input 'sr'", "required input 'sr' is missing", "present: input_0.npy, state.npy"]);
}

#[test]
fn unknown_input_lists_the_model_inputs() {
    let root = tmp("unknown");
    two_samples(&root);
    write_npy(&root.join("a").join("speed.npy"), &sr(3)).unwrap();
    assert_has(&err(CalibrationSet::open(&root, &inputs())),
        &["sample 'a'", "input 'speed'", "not an input of the model", "'input:0', 'sr', 'state'"]);
    let p = root.join("calib.npz");
    write_npz(&p, &named(&[("input:0", Tensor::zeros(DType::F32, &[1, 1, 2, 3]).unwrap()),
        ("sr", Tensor::zeros(DType::I64, &[1]).unwrap()), ("pitch", Tensor::zeros(DType::I64, &[1]).unwrap())])).unwrap();
    assert_has(&err(CalibrationSet::open(&p, &inputs())), &["input 'pitch'", "not an input of the model"]);
}

#[test]
fn dtype_mismatch_says_declared_and_got() {
    let root = tmp("dtype");
    two_samples(&root);
    write_npy(&root.join("b").join("sr.npy"), &Tensor::scalar(8000i32)).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_has(&err(set.load(1)), &["sample 'b'", "input 'sr'", "the model declares int64, the data is int32", "astype(numpy.int64)"]);
}

#[test]
fn rank_and_fixed_dim_mismatches_show_both_shapes() {
    let root = tmp("shape");
    two_samples(&root);
    write_npy(&root.join("a").join("input_0.npy"), &Tensor::zeros(DType::F32, &[1, 3, 4]).unwrap()).unwrap();
    write_npy(&root.join("b").join("input_0.npy"), &Tensor::zeros(DType::F32, &[2, 5]).unwrap()).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert_has(&err(set.load(0)), &["sample 'a'", "input 'input:0'", "declares [1, 2, ?]", "has [1, 3, 4]"]);
    assert_has(&err(set.load(1)), &["sample 'b'", "input 'input:0'", "declares [1, 2, ?]", "has [2, 5]"]);
}

#[test]
fn nan_and_inf_are_counted_with_the_first_index() {
    let root = tmp("nan");
    two_samples(&root);
    let mut v: Vec<f32> = (0..6).map(|v| v as f32).collect();
    (v[4], v[5]) = (f32::NAN, f32::INFINITY);
    write_npy(&root.join("b").join("input_0.npy"), &Tensor::from_vec(&[1, 2, 3], v).unwrap()).unwrap();
    let set = CalibrationSet::open(&root, &inputs()).unwrap();
    assert!(set.load(0).is_ok());
    assert_has(&err(set.load(1)), &["sample 'b'", "input 'input:0'", "2 NaN/Inf", "index [0, 1, 1] (flat 4)"]);
}

#[test]
fn stacked_arrays_with_different_sample_counts() {
    let dir = tmp("stacked-n");
    let p = dir.join("calib.npz");
    write_npz(&p, &named(&[("input:0", Tensor::zeros(DType::F32, &[4, 1, 2, 3]).unwrap()),
        ("sr", Tensor::zeros(DType::I64, &[3]).unwrap())])).unwrap();
    assert_has(&err(CalibrationSet::open(&p, &inputs())), &["calib.npz", "'input:0' has 4", "'sr' has 3"]);
    write_npz(&p, &named(&[("input:0", Tensor::zeros(DType::F32, &[4, 1, 2, 3]).unwrap()), ("sr", sr(1))])).unwrap();
    assert_has(&err(CalibrationSet::open(&p, &inputs())), &["input 'sr'", "is a scalar"]);
}

#[test]
fn bad_manifests_are_refused() {
    let root = tmp("bad-manifest");
    two_samples(&root);
    let with = |json: &str| {
        fs::write(root.join("manifest.json"), json).unwrap();
        err(CalibrationSet::open(&root, &inputs()))
    };
    assert_has(&with("{\"inputs\": [oops"), &["manifest.json", "not a valid qeval-calib-v1 manifest"]);
    assert_has(&with(r#"{"inputs": [{"name": "input:0"}, {"name": "sr", "file": "rate.npy"}], "samples": ["a"]}"#),
        &["sample 'a'", "input 'sr'", "a/rate.npy, which does not exist", "present: input_0.npy, sr.npy"]);
    for escape in [r#""file": "../b/sr.npy""#, r#""file": "/etc/passwd""#] {
        let json = format!(r#"{{"inputs": [{{"name": "input:0"}}, {{"name": "sr", {escape}}}], "samples": ["a"]}}"#);
        assert_has(&with(&json), &["manifest.json", "leaves the data directory"]);
    }
    assert_has(&with(r#"{"inputs": [{"name": "input:0"}, {"name": "sr"}], "samples": ["../a"]}"#), &["'../a'", "leaves the data directory"]);
    assert_has(&with(r#"{"inputs": [{"name": "input:0"}], "samples": ["a"]}"#), &["input 'sr'", "required input 'sr' is missing"]);
    assert_has(&with(r#"{"inputs": [{"name": "input:0"}, {"name": "sr"}], "samples": ["a"], "num_samples": 3}"#),
        &["num_samples is 3 but lists 1"]);
}

#[cfg(unix)]
#[test]
fn manifest_symlink_out_of_the_directory_is_refused() {
    let root = tmp("symlink");
    let outside = tmp("symlink-outside");
    two_samples(&root);
    write_npy(&outside.join("sr.npy"), &sr(1)).unwrap();
    std::os::unix::fs::symlink(outside.join("sr.npy"), root.join("a").join("link.npy")).unwrap();
    fs::write(root.join("manifest.json"),
        r#"{"inputs": [{"name": "input:0"}, {"name": "sr", "file": "link.npy"}], "samples": ["a"]}"#).unwrap();
    assert_has(&err(CalibrationSet::open(&root, &inputs())), &["sample 'a'", "resolves outside the data directory"]);
}
