//! GridSample, RoiAlign, AffineGrid, DFT, STFT, the windows and MelWeightMatrix refuse bad
//! inputs with errors that name the problem, never panics. (Their results are checked by
//! the ONNX node tests.)

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor};
use qforge_runtime::Session;

/// A one-node model of `op` at `opset` whose inputs are fed at run time (an empty name is an
/// omitted input).
fn one_node(op: &str, opset: i64, inputs: &[&str], attrs: Vec<(&str, Attr)>) -> Result<Session, String> {
    let mut g = Graph::new("g");
    let ins: Vec<Option<qforge_ir::ValueId>> = inputs.iter().map(|n| (!n.is_empty()).then(|| g.add_input(*n, None).unwrap())).collect();
    let y = g.new_value("y", None).unwrap();
    let mut node = Node::new(op, "n").with_outputs([y]);
    node.inputs = ins;
    for (name, value) in attrs {
        node = node.with_attr(name, value);
    }
    g.add_node(node).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: opset }], graph: g, ..Default::default() };
    Session::new(&model).map_err(|e| e.to_string())
}

/// The error of running `s` on `feeds`.
fn run_err(s: &Session, feeds: Vec<(&str, Tensor)>) -> String {
    s.run(feeds.into_iter().map(|(n, t)| (n.to_string(), t)).collect()).expect_err("the run must fail").to_string()
}

fn f32s(shape: &[usize]) -> Tensor {
    Tensor::zeros(DType::F32, shape).unwrap()
}

fn string(s: &str) -> Attr {
    Attr::String(s.as_bytes().to_vec())
}

#[test]
fn grid_sample_rejects_mismatched_grids_modes_and_ranks() {
    let s = one_node("GridSample", 20, &["x", "grid"], vec![]).unwrap();
    let e = run_err(&s, vec![("x", f32s(&[1, 2, 4, 4])), ("grid", f32s(&[1, 3, 3, 3]))]);
    assert!(e.contains("grid must have shape") && e.contains("[1, 3, 3, 3]"), "{e}");
    let e = run_err(&s, vec![("x", f32s(&[2, 2, 4, 4])), ("grid", f32s(&[1, 3, 3, 2]))]);
    assert!(e.contains("N = 2"), "{e}");
    let ok = s.run(vec![("x".into(), f32s(&[1, 2, 0, 4])), ("grid".into(), f32s(&[1, 3, 3, 2]))]).unwrap();
    assert_eq!(ok[0].1.shape(), [1, 2, 3, 3]);
    let legacy = one_node("GridSample", 16, &["x", "grid"], vec![]).unwrap();
    let e = run_err(&legacy, vec![("x", f32s(&[1, 1, 2, 2, 2])), ("grid", f32s(&[1, 1, 1, 1, 3]))]);
    assert!(e.contains("4-D") && e.contains("opset 16"), "{e}");
    let e = one_node("GridSample", 16, &["x", "grid"], vec![("mode", string("linear"))]).err().unwrap();
    assert!(e.contains("mode 'linear'") && e.contains("bilinear"), "{e}");
    let e = one_node("GridSample", 20, &["x", "grid"], vec![("padding_mode", string("wrap"))]).err().unwrap();
    assert!(e.contains("padding_mode 'wrap'"), "{e}");
}

#[test]
fn roi_align_checks_rois_and_batch_indices() {
    let s = one_node("RoiAlign", 16, &["x", "rois", "b"], vec![]).unwrap();
    let rois = Tensor::from_vec(&[1, 4], vec![0f32, 0.0, 3.0, 3.0]).unwrap();
    let e = run_err(&s, vec![("x", f32s(&[1, 1, 4, 4])), ("rois", rois.clone()), ("b", Tensor::from_vec(&[1], vec![3i64]).unwrap())]);
    assert!(e.contains("batch index 3") && e.contains("batch of 1"), "{e}");
    let e = run_err(&s, vec![("x", f32s(&[1, 1, 4, 4])), ("rois", f32s(&[1, 5])), ("b", Tensor::from_vec(&[1], vec![0i64]).unwrap())]);
    assert!(e.contains("rois must have shape"), "{e}");
    let huge = Tensor::from_vec(&[1, 4], vec![0f32, 0.0, 1e12, 1e12]).unwrap();
    let e = run_err(&s, vec![("x", f32s(&[1, 1, 4, 4])), ("rois", huge), ("b", Tensor::from_vec(&[1], vec![0i64]).unwrap())]);
    assert!(e.contains("samples per bin"), "{e}");
    let e = one_node("RoiAlign", 16, &["x", "rois", "b"], vec![("output_height", Attr::Int(0))]).err().unwrap();
    assert!(e.contains("must be positive"), "{e}");
}

#[test]
fn affine_grid_checks_theta_against_size() {
    let s = one_node("AffineGrid", 20, &["theta", "size"], vec![]).unwrap();
    let size = Tensor::from_vec(&[4], vec![2i64, 1, 3, 3]).unwrap();
    let e = run_err(&s, vec![("theta", f32s(&[2, 3, 4])), ("size", size)]);
    assert!(e.contains("theta must have shape [2, 2, 3]"), "{e}");
    let e = run_err(&s, vec![("theta", f32s(&[1, 2, 3])), ("size", Tensor::from_vec(&[4], vec![1i64, 1, -3, 3]).unwrap())]);
    assert!(e.contains("negative"), "{e}");
}

#[test]
fn dft_and_stft_check_axes_and_lengths() {
    let s = one_node("DFT", 20, &["x", "len", "axis"], vec![]).unwrap();
    let x = f32s(&[1, 8, 1]);
    let e = run_err(&s, vec![("x", x.clone()), ("len", Tensor::scalar(8i64)), ("axis", Tensor::scalar(2i64))]);
    assert!(e.contains("real/imaginary axis"), "{e}");
    let e = run_err(&s, vec![("x", x.clone()), ("len", Tensor::scalar(0i64)), ("axis", Tensor::scalar(1i64))]);
    assert!(e.contains("dft_length must be in"), "{e}");
    let e = run_err(&s, vec![("x", x.clone()), ("len", Tensor::scalar(1i64 << 40)), ("axis", Tensor::scalar(1i64))]);
    assert!(e.contains("dft_length must be in"), "{e}");
    let e = run_err(&s, vec![("x", f32s(&[1, 8, 3])), ("len", Tensor::scalar(8i64)), ("axis", Tensor::scalar(1i64))]);
    assert!(e.contains("last axis of 1 (real) or 2 (complex)"), "{e}");

    let s = one_node("STFT", 17, &["x", "step", "window", "frame"], vec![]).unwrap();
    let x = f32s(&[1, 16, 1]);
    let e = run_err(&s, vec![("x", x.clone()), ("step", Tensor::scalar(0i64)), ("window", f32s(&[4])), ("frame", Tensor::scalar(4i64))]);
    assert!(e.contains("frame_step must be positive"), "{e}");
    let e = run_err(&s, vec![("x", x.clone()), ("step", Tensor::scalar(2i64)), ("window", f32s(&[5])), ("frame", Tensor::scalar(4i64))]);
    assert!(e.contains("window must have shape [4]"), "{e}");
    let e = run_err(&s, vec![("x", x), ("step", Tensor::scalar(2i64)), ("window", f32s(&[32])), ("frame", Tensor::scalar(32i64))]);
    assert!(e.contains("exceeds the signal length 16"), "{e}");
}

#[test]
fn windows_and_mel_matrices_check_their_sizes() {
    let s = one_node("HannWindow", 17, &["size"], vec![]).unwrap();
    let e = run_err(&s, vec![("size", Tensor::scalar(-3i64))]);
    assert!(e.contains("must not be negative"), "{e}");
    let e = run_err(&s, vec![("size", Tensor::scalar(i64::MAX))]);
    assert!(e.contains("bytes") || e.contains("large"), "{e}");
    let e = one_node("BlackmanWindow", 17, &["size"], vec![("output_datatype", Attr::Int(8))]).err().unwrap();
    assert!(e.contains("output_datatype"), "{e}");
    let ok = s.run(vec![("size".into(), Tensor::scalar(0i32))]).unwrap();
    assert_eq!(ok[0].1.shape(), [0]);

    let s = one_node("MelWeightMatrix", 17, &["bins", "dft", "rate", "lo", "hi"], vec![]).unwrap();
    let feeds = |hi: f32| vec![("bins", Tensor::scalar(8i64)), ("dft", Tensor::scalar(16i64)), ("rate", Tensor::scalar(8000i64)), ("lo", Tensor::scalar(0f32)), ("hi", Tensor::scalar(hi))];
    let e = run_err(&s, feeds(20000.0));
    assert!(e.contains("Nyquist"), "{e}");
    let e = run_err(&s, feeds(-1.0));
    assert!(e.contains("lower_edge_hertz"), "{e}");
}
