//! Calibration data as a directory of images with `preprocess.toml`: every sample equals what
//! Pillow and numpy make of the same file under the same spec (`scripts/oracle/pil_images.py`;
//! PNG exactly, JPEG within a few 8-bit units), a real model quantized from images equals the
//! one quantized from the Pillow-preprocessed arrays byte for byte, and bad specs and images
//! give errors that name the file and what to change.

use std::path::Path;
use std::process::{Command, Output};

use qforge_data::{read_npz, CalibrationSet, ModelInput};
use qforge_ir::{DType, Tensor};
use qforge_testkit::{compare, oracle, real_models, TempDir};

/// Pillow's images and expectations, written into a fresh directory.
fn pil_cases() -> TempDir {
    let dir = TempDir::new("pil-images");
    let out = oracle("pil_images.py", &[dir.path().as_os_str()]);
    assert!(out.status.success(), "pil_images.py failed: {}", String::from_utf8_lossy(&out.stderr));
    dir
}

fn input(dtype: DType, dims: [Option<usize>; 4]) -> Vec<ModelInput> {
    vec![ModelInput { name: "x".into(), dtype: Some(dtype), dims: Some(dims.to_vec()), required: true }]
}

fn qforge(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge")).arg("quantize").args(args).output().expect("qforge runs")
}

/// Loads every image of `case` and compares it with Pillow's, in 8-bit steps (`unit` in the
/// input's scale). PNG files: at most one step anywhere and a quarter on average (when a
/// resize shrinks both axes, Pillow 13 may run its two passes in the other order than qforge,
/// and a pixel rounded between the passes can end one step apart: a fifth of them here;
/// [`one_axis_resizes_equal_pillow_exactly`] checks the filter itself exactly).
/// The JPEG: at most 6 steps and half a step on average (the decoders round their inverse
/// DCTs and upsample chroma differently; measured: 4 steps, 0.3 on average).
fn check_case(root: &Path, case: &str, inputs: &[ModelInput], unit: f64) {
    let set = CalibrationSet::open(&root.join(case), inputs).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_eq!(set.layout(), "images");
    let want = read_npz(&root.join(format!("{case}.expected.npz"))).unwrap();
    assert_eq!(set.len(), want.len(), "{case}: every image is a sample");
    for i in 0..set.len() {
        let name = set.sample_name(i).to_string();
        let got = set.load(i).unwrap_or_else(|e| panic!("{case}/{name}: {e}"));
        assert_eq!(got.len(), 1);
        let (_, exp) = want.iter().find(|(k, _)| *k == name).unwrap_or_else(|| panic!("{case}: no expectation for {name}"));
        let t: &Tensor = &got[0].1;
        assert_eq!(t.shape(), exp.shape(), "{case}/{name}: shape");
        assert_eq!(t.dtype(), exp.dtype(), "{case}/{name}: dtype");
        let (a, b) = (t.to_f64_vec().unwrap(), exp.to_f64_vec().unwrap());
        let steps: Vec<f64> = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / unit).collect();
        let worst = steps.iter().cloned().fold(0.0, f64::max);
        let mean = steps.iter().sum::<f64>() / steps.len() as f64;
        let (max_steps, mean_steps) = if name.ends_with(".png") { (1.001, 0.25) } else { (6.0, 0.5) };
        assert!(worst <= max_steps && mean <= mean_steps, "{case}/{name}: {worst} steps from Pillow at most, {mean} on average");
    }
}

/// Resizing along one axis equals Pillow exactly: one pass, no order to choose.
#[test]
fn one_axis_resizes_equal_pillow_exactly() {
    let d = pil_cases();
    let any_size = input(DType::U8, [Some(1), Some(3), None, None]);
    for case in ["width_only", "height_only"] {
        let set = CalibrationSet::open(&d.path().join(case), &any_size).unwrap();
        let want = read_npz(&d.path().join(format!("{case}.expected.npz"))).unwrap();
        assert_eq!(set.len(), 3);
        for i in 0..set.len() {
            let got = set.load(i).unwrap().remove(0).1;
            let exp = &want.iter().find(|(k, _)| k == set.sample_name(i)).unwrap().1;
            let (worst, ok) = compare(&got, exp, 0.0, 0.0);
            assert!(ok, "{case}/{}: {worst} steps from Pillow", set.sample_name(i));
        }
    }
}

#[test]
fn images_are_preprocessed_as_pillow_does() {
    let d = pil_cases();
    let root = d.path();
    check_case(root, "shorter_crop_imagenet", &input(DType::F32, [Some(1), Some(3), None, None]), 1.0 / 255.0 / 0.229);
    check_case(root, "exact_bgr_nhwc", &input(DType::F32, [None, None, None, Some(3)]), 1.0 / 127.5);
    check_case(root, "gray_upscale", &input(DType::F32, [Some(1), Some(1), None, None]), 1.0 / 255.0 / 0.5);
    check_case(root, "orientation", &input(DType::F32, [None, Some(3), Some(224), Some(224)]), 1.0 / 255.0 / 0.229);
    let set = CalibrationSet::open(&root.join("shorter_crop_imagenet"), &input(DType::F16, [Some(1), Some(3), None, None])).unwrap();
    let want = read_npz(&root.join("shorter_crop_imagenet.expected.npz")).unwrap();
    let png = (0..set.len()).find(|&i| set.sample_name(i).ends_with(".png")).unwrap();
    let got = set.load(png).unwrap().remove(0).1;
    assert_eq!(got.dtype(), DType::F16, "a float16 input gets float16 pixels");
    let exp = &want.iter().find(|(k, _)| k == set.sample_name(png)).unwrap().1;
    let (worst, ok) = compare(&got, exp, 1.0 / 1024.0, 0.0);
    assert!(ok, "float16 pixels are Pillow's rounded to half precision: {worst}");
    check_case(root, "uint8_model_size", &input(DType::U8, [Some(1), Some(3), Some(33), Some(47)]), 1.0);
}

#[test]
fn a_model_quantized_from_images_equals_one_quantized_from_pillow_arrays() {
    let orientation = real_models().into_iter().find(|m| m.name == "orientation").expect("orientation in the test cache (run scripts/setup.sh)");
    let d = pil_cases();
    let root = d.path();
    let want = read_npz(&root.join("orientation.expected.npz")).unwrap();
    let (images, arrays) = (root.join("png_only"), root.join("arrays"));
    std::fs::create_dir_all(&images).unwrap();
    std::fs::copy(root.join("orientation/preprocess.toml"), images.join("preprocess.toml")).unwrap();
    for (name, t) in want.iter().filter(|(k, _)| k.ends_with(".png")) {
        std::fs::copy(root.join("orientation").join(name), images.join(name)).unwrap();
        let s = arrays.join(name.trim_end_matches(".png"));
        std::fs::create_dir_all(&s).unwrap();
        qforge_data::write_npy(&s.join("x.npy"), t).unwrap();
    }
    let (a, b) = (root.join("from_images.onnx"), root.join("from_arrays.onnx"));
    let run = |data: &Path, out: &Path| {
        let o = qforge(&[orientation.path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), data.as_os_str()]);
        assert!(o.status.success(), "qforge failed: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout)
    };
    let said = run(&images, &a);
    assert!(said.contains("images feed input 'x'") && said.contains("center crop 224x224"), "the summary says how images were read:\n{said}");
    run(&arrays, &b);
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "quantizing from images and from Pillow's arrays gives different models");
}

#[test]
fn bad_image_sets_name_the_file_and_the_fix() {
    let d = pil_cases();
    let root = d.path();
    let rgb = input(DType::F32, [Some(1), Some(3), None, None]);
    let err = |case: &Path, inputs: &[ModelInput]| -> String {
        match CalibrationSet::open(case, inputs).and_then(|s| (0..s.len()).try_for_each(|i| s.load(i).map(|_| ()))) {
            Ok(()) => panic!("{} was accepted", case.display()),
            Err(e) => e.to_string(),
        }
    };
    let fresh = |name: &str, toml: Option<&str>| -> std::path::PathBuf {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(root.join("images/rgb0.png"), dir.join("rgb0.png")).unwrap();
        if let Some(t) = toml {
            std::fs::write(dir.join("preprocess.toml"), t).unwrap();
        }
        dir
    };

    let e = err(&fresh("no_spec", None), &rgb);
    assert!(e.contains("preprocess.toml") && e.contains("mean"), "{e}");
    let e = err(&fresh("no_mean", Some("resize = [32, 32]\n")), &rgb);
    assert!(e.contains("preprocess.toml") && e.contains("mean = [") && e.contains("float"), "{e}");
    let e = err(&fresh("typo", Some("resize = [32, 32]\nmean = [0.5]\nstd = [0.5]\ncrop = [8, 8]\n")), &rgb);
    assert!(e.contains("preprocess.toml") && e.contains("crop"), "unknown keys are refused: {e}");
    let e = err(&fresh("gray_for_rgb", Some("color = \"gray\"\nmean = [0.5]\nstd = [0.5]\n")), &rgb);
    assert!(e.contains("3 channels") && e.contains("gray"), "{e}");
    let e = err(&fresh("wrong_size", Some("resize = [32, 32]\nmean = [0.5]\nstd = [0.5]\n")), &input(DType::F32, [None, Some(3), Some(224), Some(224)]));
    assert!(e.contains("32x32") && e.contains("224"), "{e}");
    let e = err(&fresh("big_crop", Some("center_crop = [500, 500]\nmean = [0.5]\nstd = [0.5]\n")), &rgb);
    assert!(e.contains("rgb0.png") && e.contains("center_crop"), "the image is named: {e}");
    let e = err(&fresh("zero_std", Some("mean = [0.5]\nstd = [0.5, 0.0, 0.5]\n")), &rgb);
    assert!(e.contains("std"), "{e}");
    let broken = fresh("broken", Some("mean = [0.5]\nstd = [0.5]\n"));
    std::fs::write(broken.join("zz.jpg"), b"not a jpeg").unwrap();
    let e = err(&broken, &rgb);
    assert!(e.contains("zz.jpg") && e.contains("PNG or JPEG"), "{e}");
    let empty = root.join("spec_only");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("preprocess.toml"), "mean = [0.5]\nstd = [0.5]\n").unwrap();
    let e = err(&empty, &rgb);
    assert!(e.contains("no image") && e.contains(".png"), "{e}");
    let two = vec![rgb[0].clone(), ModelInput { name: "scale".into(), dtype: Some(DType::F32), dims: Some(vec![]), required: true }];
    let e = err(&fresh("two_inputs", Some("input = \"x\"\nmean = [0.5]\nstd = [0.5]\n")), &two);
    assert!(e.contains("'scale'") && e.contains("sample folders"), "{e}");
}
