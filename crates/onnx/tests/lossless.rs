//! A model using every part of the format survives load and save unchanged, field for field:
//! opset imports, metadata, doc strings, value_info (also for names that match no value),
//! functions with attribute references, every attribute type, subgraphs reading outer values,
//! packed int4 and string tensors, training info and quantization annotations.

use prost::Message;
use qforge_onnx::proto::{self, attribute_proto::AttributeType as T};

fn s(x: &str) -> Option<String> {
    Some(x.to_string())
}

fn vi(name: &str, elem: i32, dims: &[i64]) -> proto::ValueInfoProto {
    use proto::tensor_shape_proto::{dimension::Value, Dimension};
    proto::ValueInfoProto {
        name: s(name),
        r#type: Some(proto::TypeProto {
            denotation: None,
            value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor {
                elem_type: Some(elem),
                shape: Some(proto::TensorShapeProto {
                    dim: dims.iter().map(|&d| Dimension { denotation: None, value: Some(if d < 0 { Value::DimParam("N".into()) } else { Value::DimValue(d) }) }).collect(),
                }),
            })),
        }),
        doc_string: s("doc of value"),
        metadata_props: vec![kv("k", "v")],
    }
}

fn kv(k: &str, v: &str) -> proto::StringStringEntryProto {
    proto::StringStringEntryProto { key: s(k), value: s(v) }
}

fn attr(name: &str, t: T) -> proto::AttributeProto {
    proto::AttributeProto { name: s(name), r#type: Some(t as i32), ..Default::default() }
}

fn tensor(name: &str, dtype: i32, dims: &[i64], raw: &[u8]) -> proto::TensorProto {
    proto::TensorProto { name: (!name.is_empty()).then(|| name.to_string()), data_type: Some(dtype), dims: dims.to_vec(), raw_data: Some(raw.to_vec().into()), ..Default::default() }
}

fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<proto::AttributeProto>) -> proto::NodeProto {
    proto::NodeProto {
        op_type: s(op),
        name: s(name),
        input: inputs.iter().map(|x| x.to_string()).collect(),
        output: outputs.iter().map(|x| x.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    }
}

fn model() -> proto::ModelProto {
    let then_branch = proto::GraphProto {
        name: s("then"),
        node: vec![node("Add", "inner_add", &["x", "w"], &["t"], vec![])],
        output: vec![vi("t", 1, &[-1, 4])],
        ..Default::default()
    };
    let mut everything = vec![
        proto::AttributeProto { f: Some(0.5), doc_string: s("a float"), ..attr("f", T::Float) },
        proto::AttributeProto { i: Some(-3), ..attr("i", T::Int) },
        proto::AttributeProto { s: Some(b"text".to_vec()), ..attr("s", T::String) },
        proto::AttributeProto { t: Some(tensor("", 22, &[3], &[0x7f, 0x08])), ..attr("t", T::Tensor) },
        proto::AttributeProto { floats: vec![1.0, 2.0], ..attr("fs", T::Floats) },
        proto::AttributeProto { ints: vec![1, -2, 3], ..attr("is", T::Ints) },
        proto::AttributeProto { strings: vec![b"a".to_vec(), b"b".to_vec()], ..attr("ss", T::Strings) },
        proto::AttributeProto { tensors: vec![tensor("", 7, &[1], &5i64.to_le_bytes())], ..attr("ts", T::Tensors) },
        proto::AttributeProto { tp: vi("", 10, &[2]).r#type, ..attr("tp", T::TypeProto) },
    ];
    everything.push(proto::AttributeProto { g: Some(then_branch.clone()), ..attr("then_branch", T::Graph) });
    everything.push(proto::AttributeProto { g: Some(then_branch), ..attr("else_branch", T::Graph) });
    let graph = proto::GraphProto {
        name: s("main"),
        doc_string: s("the main graph"),
        node: vec![
            node("Relu", "relu", &["x"], &["r"], vec![]),
            node("If", "if", &["c"], &["y"], everything),
            node("MyFn", "call", &["r", ""], &["z"], vec![proto::AttributeProto { f: Some(2.0), ..attr("alpha", T::Float) }]),
        ],
        initializer: vec![tensor("w", 1, &[4], &[0; 16]), tensor("names", 8, &[2], &[])],
        input: vec![vi("x", 1, &[-1, 4]), vi("c", 9, &[])],
        output: vec![vi("y", 1, &[-1, 4]), vi("z", 1, &[-1, 4])],
        value_info: vec![vi("r", 1, &[-1, 4]), vi("ghost", 1, &[7])],
        quantization_annotation: vec![proto::TensorAnnotation { tensor_name: s("r"), quant_parameter_tensor_names: vec![kv("SCALE_TENSOR", "w")] }],
        metadata_props: vec![kv("graph", "meta")],
        ..Default::default()
    };
    let mut graph = graph;
    graph.initializer[1].raw_data = None;
    graph.initializer[1].string_data = vec![b"cat".to_vec(), b"dog".to_vec()];
    let function = proto::FunctionProto {
        name: s("MyFn"),
        domain: s("custom"),
        input: vec!["a".into(), "b".into()],
        output: vec!["o".into()],
        attribute: vec!["beta".into()],
        attribute_proto: vec![proto::AttributeProto { f: Some(1.0), ..attr("alpha", T::Float) }],
        node: vec![node("LeakyRelu", "lr", &["a"], &["o"], vec![proto::AttributeProto { ref_attr_name: s("alpha"), ..attr("alpha", T::Float) }])],
        opset_import: vec![proto::OperatorSetIdProto { domain: s(""), version: Some(17) }],
        doc_string: s("a function"),
        ..Default::default()
    };
    proto::ModelProto {
        ir_version: Some(10),
        opset_import: vec![proto::OperatorSetIdProto { domain: s(""), version: Some(17) }, proto::OperatorSetIdProto { domain: s("custom"), version: Some(1) }],
        producer_name: s("qforge-test"),
        producer_version: s("1"),
        domain: s("test.domain"),
        model_version: Some(7),
        doc_string: s("a model"),
        graph: Some(graph),
        metadata_props: vec![kv("author", "me")],
        training_info: vec![proto::TrainingInfoProto { initialization: Some(proto::GraphProto { name: s("init"), ..Default::default() }), ..Default::default() }],
        functions: vec![function],
        ..Default::default()
    }
}

#[test]
fn every_field_survives_a_round_trip() {
    let original = model();
    let loaded = qforge_onnx::load_bytes(&original.encode_to_vec(), None).unwrap();
    loaded.graph.check().unwrap();
    let saved = proto::ModelProto::decode(qforge_onnx::to_bytes(&loaded).unwrap().as_slice()).unwrap();
    assert_eq!(saved, original);
}

#[test]
fn subgraph_reads_of_outer_values_are_captures() {
    let loaded = qforge_onnx::load_bytes(&model().encode_to_vec(), None).unwrap();
    let g = &loaded.graph;
    let (_, if_node) = g.nodes().find(|(_, n)| n.op_type == "If").unwrap();
    let captured: Vec<String> = if_node.captures().iter().map(|v| g.value_name(*v)).collect();
    assert_eq!(captured, vec!["w".to_string(), "x".to_string()]);
}

/// Inputs the loader fuzzer found; each must fail to load, or load to a model whose saved
/// form is a fixpoint: saving the reloaded model gives the same bytes. (A file whose nodes are
/// not in topological order is saved sorted, so its IR may be renumbered once.)
#[test]
fn fuzzer_findings_round_trip() {
    let cases: &[&[u8]] = &[
        &[8, 30, 58, 59, 10, 12, 248, 1, 120, 18, 1, 121, 34, 4, 82, 101, 108, 117, 18, 1, 103, 90, 19, 42, 1, 120, 82, 14, 10, 12, 8, 1, 18, 8, 10, 67, 8, 1, 10, 2, 8, 2, 90, 19, 10, 1, 46, 10, 10, 12, 14, 8, 1, 18, 8, 10, 2, 8, 1, 10, 2, 8, 2, 66, 2, 16, 28],
        &[8, 30, 58, 59, 10, 12, 10, 1, 121, 18, 1, 117, 58, 4, 101, 121, 108, 18, 82, 1, 103, 90, 19, 10, 1, 120, 18, 14, 10, 12, 8, 1, 18, 8, 10, 2, 8, 1, 10, 2, 8, 2, 106, 19, 42, 1, 121, 18, 14, 10, 12, 8, 1, 18, 8, 10, 2, 8, 1, 10, 2, 8, 2, 8, 30, 58, 59, 10, 12, 10, 1, 120, 18, 1, 121, 58, 4, 117, 101, 108, 18, 82, 1, 103, 90, 19, 10, 17, 120, 18, 14, 42, 12, 40, 1, 18, 8, 10, 2, 8, 1, 10, 2, 8, 2, 106, 19, 42, 1, 121, 18, 14, 10, 12, 8, 1, 18, 8, 10, 2, 8, 1, 10, 2, 8, 2, 66, 2, 16, 28, 66, 2, 16, 28],
    ];
    for bytes in cases {
        let Ok(model) = qforge_onnx::load_bytes(bytes, None) else { continue };
        if model.graph.check().is_err() {
            continue;
        }
        let bytes = qforge_onnx::to_bytes(&model).unwrap();
        let again = qforge_onnx::load_bytes(&bytes, None).unwrap();
        assert_eq!(qforge_onnx::to_bytes(&again).unwrap(), bytes);
    }
}
