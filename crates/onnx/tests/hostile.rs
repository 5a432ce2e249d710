//! Hostile and malformed inputs get errors, never panics or huge allocations: truncated
//! files, random bytes, huge declared dimensions, deep subgraph nesting, and external data
//! that tries to leave the model's folder.

use prost::Message;
use proptest::prelude::*;
use qforge_onnx::proto::{self, attribute_proto::AttributeType, tensor_proto::DataLocation};
use qforge_onnx::{load, load_bytes, save_with_options, OnnxError, SaveOptions};
use qforge_testkit::{real_models, TempDir};

fn model_with(initializer: proto::TensorProto) -> Vec<u8> {
    let name = initializer.name.clone().unwrap();
    proto::ModelProto {
        ir_version: Some(8),
        opset_import: vec![proto::OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
        graph: Some(proto::GraphProto {
            name: Some("g".into()),
            initializer: vec![initializer],
            output: vec![proto::ValueInfoProto { name: Some(name), ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
fn truncated_files_fail_cleanly() {
    let m = real_models().into_iter().find(|m| m.name == "ocr_cls").unwrap();
    let bytes = std::fs::read(&m.path).unwrap();
    let lengths = (0..2048).chain((2048..bytes.len()).step_by(1009));
    let mut errors = 0;
    for len in lengths {
        match load_bytes(&bytes[..len], None) {
            Err(_) => errors += 1,
            // A cut between top-level fields can leave a well-formed (smaller) model.
            Ok(model) => model.graph.check().unwrap_or_else(|e| panic!("prefix {len} loaded an inconsistent graph: {e}")),
        }
    }
    assert!(errors > 2000, "only {errors} prefixes were rejected");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = load_bytes(&bytes, None);
    }
}

#[test]
fn huge_declared_dims_are_refused_before_allocating() {
    let t = proto::TensorProto {
        name: Some("w".into()),
        dims: vec![1 << 40, 1 << 40],
        data_type: Some(1),
        raw_data: Some(vec![0; 4].into()),
        ..Default::default()
    };
    let e = load_bytes(&model_with(t), None).unwrap_err().to_string();
    assert!(e.contains("tensor 'w'") && e.contains("exceeds the limit"), "{e}");
    // Within the size limit but with no data behind it: 3.6 GB declared, 0 bytes present.
    let t = proto::TensorProto { name: Some("v".into()), dims: vec![30_000, 30_000], data_type: Some(1), ..Default::default() };
    let e = load_bytes(&model_with(t), None).unwrap_err().to_string();
    assert!(e.contains("tensor 'v'") && e.contains("no data"), "{e}");
    let t = proto::TensorProto { name: Some("u".into()), dims: vec![3, -2], data_type: Some(1), ..Default::default() };
    assert!(load_bytes(&model_with(t), None).unwrap_err().to_string().contains("negative dimension"));
}

fn nested(depth: usize) -> proto::GraphProto {
    let mut g = proto::GraphProto {
        name: Some(format!("g{depth}")),
        node: vec![proto::NodeProto { op_type: Some("Identity".into()), input: vec!["x".into()], output: vec![format!("y{depth}")], ..Default::default() }],
        output: vec![proto::ValueInfoProto { name: Some(format!("y{depth}")), ..Default::default() }],
        ..Default::default()
    };
    if depth > 0 {
        g.node.push(proto::NodeProto {
            op_type: Some("Loop".into()),
            input: vec!["".into(), "c".into()],
            output: vec![format!("z{depth}")],
            attribute: vec![proto::AttributeProto {
                name: Some("body".into()),
                r#type: Some(AttributeType::Graph as i32),
                g: Some(nested(depth - 1)),
                ..Default::default()
            }],
            ..Default::default()
        });
    }
    g
}

fn nested_model(depth: usize) -> Vec<u8> {
    let mut g = nested(depth);
    g.input = ["x", "c"].iter().map(|n| proto::ValueInfoProto { name: Some(n.to_string()), ..Default::default() }).collect();
    proto::ModelProto { ir_version: Some(8), graph: Some(g), ..Default::default() }.encode_to_vec()
}

#[test]
fn deep_subgraph_nesting_is_bounded() {
    let shallow = load_bytes(&nested_model(3), None).unwrap();
    shallow.graph.check().unwrap();
    for depth in [40, 200] {
        let e = load_bytes(&nested_model(depth), None).unwrap_err();
        assert!(matches!(e, OnnxError::Decode { .. } | OnnxError::Invalid { .. }), "depth {depth}: {e}");
    }
}

fn external_model(location: &str) -> Vec<u8> {
    let entry = |k: &str, v: &str| proto::StringStringEntryProto { key: Some(k.into()), value: Some(v.into()) };
    model_with(proto::TensorProto {
        name: Some("w".into()),
        dims: vec![2],
        data_type: Some(1),
        external_data: vec![entry("location", location), entry("offset", "0"), entry("length", "8")],
        data_location: Some(DataLocation::External as i32),
        ..Default::default()
    })
}

#[test]
fn external_data_cannot_leave_the_model_folder() {
    let root = TempDir::new("extdata");
    let dir = root.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(root.path().join("secret.bin"), [0u8; 8]).unwrap();
    std::fs::write(dir.join("ok.bin"), 1.5f32.to_le_bytes().repeat(2)).unwrap();
    std::os::unix::fs::symlink(root.path().join("secret.bin"), dir.join("link.bin")).unwrap();
    let secret = root.path().join("secret.bin").to_string_lossy().into_owned();
    for (location, expect) in [("../secret.bin", "relative path"), (secret.as_str(), "relative path"), ("link.bin", "outside the model's folder"), ("missing.bin", "cannot open")] {
        let path = dir.join("m.onnx");
        std::fs::write(&path, external_model(location)).unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains(expect) && e.contains("tensor 'w'"), "{location}: {e}");
    }
    let path = dir.join("m.onnx");
    std::fs::write(&path, external_model("ok.bin")).unwrap();
    let m = load(&path).unwrap();
    let w = m.graph.value(m.graph.value_by_name("w").unwrap()).unwrap().initializer().unwrap().clone();
    assert_eq!(w.as_slice::<f32>().unwrap(), &[1.5, 1.5]);
    assert!(load_bytes(&external_model("ok.bin"), None).unwrap_err().to_string().contains("model's folder"));
}

#[test]
fn large_models_are_saved_with_external_data() {
    let tmp = TempDir::new("extsave");
    let m = real_models().into_iter().find(|m| m.name == "orientation").unwrap();
    let model = load(&m.path).unwrap();
    let out = tmp.path().join("small_limit.onnx");
    save_with_options(&model, &out, &SaveOptions { external_data_threshold: 1000, external_min_tensor_bytes: 256 }).unwrap();
    let data = tmp.path().join("small_limit.onnx.data");
    assert!(data.exists() && std::fs::metadata(&data).unwrap().len() > 1_000_000);
    assert!(std::fs::metadata(&out).unwrap().len() < std::fs::metadata(&m.path).unwrap().len() / 2);
    let reloaded = load(&out).unwrap();
    let (a, b) = (qforge_onnx::to_bytes(&reloaded).unwrap(), qforge_onnx::to_bytes(&model).unwrap());
    assert!(a == b, "external data round trip changed the model");
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n.to_string_lossy().contains(".tmp")).collect();
    assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
}

#[test]
fn saved_files_hold_exactly_the_serialized_model() {
    // Models of several MiB are written in many pieces; the file must equal one encoding.
    let tmp = TempDir::new("streamsave");
    for m in real_models().into_iter().filter(|m| m.name == "orientation" || m.name == "ocr_det") {
        let model = load(&m.path).unwrap();
        let out = tmp.path().join(format!("{}.onnx", m.name));
        qforge_onnx::save(&model, &out).unwrap();
        let written = std::fs::read(&out).unwrap();
        assert!(written.len() > 3 << 20, "{}: {} bytes is too small to need several pieces", m.name, written.len());
        assert!(written == qforge_onnx::to_bytes(&model).unwrap(), "{}: the saved file differs from the encoded model", m.name);
    }
}
