//! MaxPool on uint8 and int8 tensors (what QDQ sessions run between a DequantizeLinear and a
//! QuantizeLinear with equal qparams) gives ONNX Runtime's integers: 1-D and 2-D windows,
//! tiled, overlapping, strided, dilated, padded and ceil-mode geometries, random data large
//! enough to be split across threads.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueType};
use qforge_runtime::{Session, SessionOptions};
use qforge_testkit::{int8_range, int8_tensor, ort_run, Rng, TempDir};

/// `x -> MaxPool -> y`, opset 13.
fn model(d: DType, shape: &[usize], attrs: &[(&str, Attr)]) -> Model {
    let mut g = Graph::new("g");
    let dims: Vec<i64> = shape.iter().map(|&v| v as i64).collect();
    let x = g.add_input("x", Some(ValueType::tensor_of(d, &dims))).unwrap();
    let y = g.new_value("y", None).unwrap();
    let mut n = Node::new("MaxPool", "pool").with_inputs([x]).with_outputs([y]);
    for (k, v) in attrs {
        n = n.with_attr(k, v.clone());
    }
    g.add_node(n).unwrap();
    g.set_outputs(vec![y]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

#[test]
fn integer_max_pool_matches_onnx_runtime() {
    let ints = |v: &[i64]| Attr::Ints(v.to_vec());
    let cases: Vec<(Vec<usize>, Vec<(&str, Attr)>)> = vec![
        (vec![1, 200, 2, 96], vec![("kernel_shape", ints(&[2, 2])), ("strides", ints(&[2, 2]))]),
        (vec![2, 5, 9, 11], vec![("kernel_shape", ints(&[3, 3])), ("strides", ints(&[2, 2])), ("pads", ints(&[1, 1, 1, 1]))]),
        (vec![1, 3, 8, 8], vec![("kernel_shape", ints(&[3, 3]))]),
        (vec![1, 4, 10, 13], vec![("kernel_shape", ints(&[2, 3])), ("strides", ints(&[2, 3])), ("ceil_mode", Attr::Int(1))]),
        (vec![1, 2, 9, 9], vec![("kernel_shape", ints(&[2, 2])), ("dilations", ints(&[2, 2]))]),
        (vec![1, 3, 7, 7], vec![("kernel_shape", ints(&[3, 3])), ("auto_pad", Attr::String("SAME_UPPER".into()))]),
        (vec![2, 3, 17], vec![("kernel_shape", ints(&[4])), ("strides", ints(&[4]))]),
        (vec![1, 64, 56, 56], vec![("kernel_shape", ints(&[2, 2])), ("strides", ints(&[2, 2]))]),
    ];
    let tmp = TempDir::new("maxpool_int8");
    let mut rng = Rng::new(5);
    for d in [DType::U8, DType::I8] {
        let (lo, hi) = int8_range(d);
        for (i, (shape, attrs)) in cases.iter().enumerate() {
            let m = model(d, shape, attrs);
            let path = tmp.path().join(format!("pool_{d}_{i}.onnx"));
            qforge_onnx::save(&m, &path).unwrap();
            let n: usize = shape.iter().product();
            let x: Vec<i64> = (0..n).map(|_| rng.int(lo, hi)).collect();
            let feed = vec![("x".to_string(), int8_tensor(d, shape, &x))];
            let want = &ort_run(&path, &feed, 1)[0].1;
            for threads in [1, 2] {
                let s = Session::with_options(&m, SessionOptions { threads }).unwrap();
                let got: Vec<Tensor> = s.run(feed.clone()).unwrap().into_iter().map(|(_, t)| t).collect();
                assert_eq!(got[0].dtype(), d);
                assert_eq!(&got[0], want, "{d} case {i} {shape:?} {attrs:?}, {threads} thread(s)");
            }
        }
    }
}
