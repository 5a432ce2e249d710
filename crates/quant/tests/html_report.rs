//! The HTML report of a small quantized model, read back with Python's own HTML and XML
//! parsers (`scripts/oracle/html_report.py`): every SVG is well-formed, the SQNR chart has one
//! bar per compared activation carrying `compare`'s figure, histograms draw their range lines
//! where the scale and zero point put them, the float-node table lists every float node with
//! its reason, names with markup characters come back intact, nothing points to the network,
//! and the same data gives the same bytes.

use qforge_ir::{DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::backend::BackendConfig;
use qforge_quant::compare::compare;
use qforge_quant::html::{build, render, HtmlReport, Subject, WORST_ACTIVATIONS};
use qforge_quant::pipeline::{quantize, QuantizeOptions};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_quant::report::Report;
use qforge_quant::sensitivity::{quantize_within_budget, Budget};
use qforge_testkit::{oracle, TempDir};
use serde_json::Value;

const HOSTILE: &str = "<&>\"'";
const MODEL_NAME: &str = "tiny<&>\"model.onnx";

/// Calibration feeds held in memory.
type Samples = Vec<Vec<(String, Tensor)>>;

fn samples() -> Samples {
    (0..3).map(|i| vec![("x".to_string(), Tensor::from_vec(&[1, 3, 8, 8], qforge_testkit::noise(40 + i, 192, -2.0, 2.0)).unwrap())]).collect()
}

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let out = g.new_value(format!("{name}_out"), None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
    out
}

fn weight(g: &mut Graph, name: &str, shape: &[usize], seed: u64) -> ValueId {
    g.add_initializer(name, Tensor::from_vec(shape, qforge_testkit::noise(seed, shape.iter().product(), -0.5, 0.5)).unwrap()).unwrap()
}

/// `x -> Conv (4 channels) -> Relu -> Conv (6 channels, 1x1) -> Softmax -> y`, the first Conv
/// and the Softmax named with markup characters; the default mapping keeps Softmax float.
fn model() -> Model {
    let mut g = Graph::new("main");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[1, 3, 8, 8]))).unwrap();
    let (w1, b1) = (weight(&mut g, "w1", &[4, 3, 3, 3], 1), weight(&mut g, "b1", &[4], 2));
    let c1 = op(&mut g, "Conv", &format!("conv{HOSTILE}1"), &[x, w1, b1]);
    let r1 = op(&mut g, "Relu", "relu1", &[c1]);
    let w2 = weight(&mut g, "w2", &[6, 4, 1, 1], 3);
    let c2 = op(&mut g, "Conv", "conv2", &[r1, w2]);
    let y = op(&mut g, "Softmax", &format!("soft{HOSTILE}max"), &[c2]);
    g.set_outputs(vec![y]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

fn quantizer() -> ConfigQuantizer {
    let backend = BackendConfig::load("ort").unwrap();
    ConfigQuantizer { mapping: default_mapping(&backend, RangeName::Minmax, true), backend }
}

fn subject() -> Subject {
    Subject { model: MODEL_NAME.into(), output: "q.onnx".into(), backend: "ort".into(), calibration_data: "samples".into(), json: "report.json".into() }
}

fn report_of<'a>(float: &Model, quantized: &Model, report: &'a Report) -> HtmlReport<'a> {
    build(subject(), float, quantized, report, &samples(), 1, &mut |_, _| {}).unwrap()
}

/// The oracle's reading of `html`.
fn read(html: &str) -> Value {
    let dir = TempDir::new("html-report");
    let path = dir.path().join("report.html");
    std::fs::write(&path, html).unwrap();
    let o = oracle("html_report.py", &[path.as_os_str()]);
    assert!(o.status.success(), "oracle failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn svg<'v>(page: &'v Value, id: &str) -> &'v Value {
    page["svgs"].as_array().unwrap().iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("no svg '{id}'"))
}

/// Marks of an svg whose class list contains `class`.
fn marks<'v>(svg: &'v Value, class: &str) -> Vec<&'v Value> {
    svg["marks"].as_array().unwrap().iter().filter(|m| m["class"].as_str().unwrap().split(' ').any(|c| c == class)).collect()
}

fn attr<'v>(mark: &'v Value, name: &str) -> &'v str {
    mark["attrs"][name].as_str().unwrap_or_else(|| panic!("no attribute {name} on {mark}"))
}

fn table(page: &Value, id: &str) -> Vec<Vec<String>> {
    serde_json::from_value(page["tables"][id].clone()).unwrap_or_else(|_| panic!("no table '{id}'"))
}

fn integer_range(dtype: &str) -> (i64, i64) {
    match dtype {
        "u8" => (0, 255),
        "s8" => (-128, 127),
        "u16" => (0, 65535),
        "s16" => (-32768, 32767),
        other => panic!("unexpected activation type {other}"),
    }
}

#[test]
fn page_shows_compare_figures_ranges_and_every_float_node() {
    let float = model();
    let (quantized, report) = quantize(&float, &quantizer(), &samples(), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let data = report_of(&float, &quantized, &report);
    assert_eq!(data.comparison.samples, 3, "three small samples fit the report's budget");
    let html = render(&data);
    let page = read(&html);

    assert_eq!(page["document_is_xml"], true);
    for s in page["svgs"].as_array().unwrap() {
        assert!(s["error"].is_null(), "an SVG is not well-formed XML: {}", s["error"]);
    }
    assert_eq!(page["scripts"], 0);
    assert_eq!(page["links"], 0);
    for url in page["urls"].as_array().unwrap() {
        let url = url.as_str().unwrap();
        assert!(!url.contains("http:") && !url.contains("https:") && !url.starts_with("//"), "network reference {url}");
    }
    assert!(!html.contains(&format!("soft{HOSTILE}max")) && !html.contains(MODEL_NAME), "names are escaped");
    assert_eq!(page["title"], format!("qforge quantization report: {MODEL_NAME}"));

    // One bar per compared activation, in graph order, with compare's own figure.
    let expected = compare(&float, &quantized, &samples(), 1, &mut |_, _| {}).unwrap();
    let compared: Vec<_> = expected.activations.iter().filter(|t| t.metrics.count > 0).collect();
    assert!(compared.len() >= 4, "x, both Conv outputs and the Relu are compared: {compared:?}");
    let bars = marks(svg(&page, "sqnr-chart"), "mark");
    assert_eq!(bars.len(), compared.len());
    for (bar, t) in bars.iter().zip(&compared) {
        assert_eq!(attr(bar, "data-name"), t.name);
        assert_eq!(attr(bar, "data-op"), t.op);
        assert_eq!(attr(bar, "data-sqnr"), t.metrics.sqnr_db.to_string(), "{}", t.name);
        assert!(bar["title"].as_str().unwrap().contains(&t.name), "hover text names the tensor");
    }
    assert!(bars.iter().any(|b| attr(b, "data-name") == format!("conv{HOSTILE}1_out")), "a name with markup characters comes back intact");
    // The graph outputs as written and as deployed, with compare's figures.
    for (id, outputs) in [("outputs", &expected.outputs), ("outputs-as-deployed", expected.outputs_as_run.as_ref().expect("the QDQ units lower"))] {
        let rows = table(&page, id);
        assert_eq!(rows.len(), outputs.len() + 1, "{id}");
        for (row, t) in rows[1..].iter().zip(outputs) {
            let shown: f64 = row[2].parse().unwrap_or_else(|_| panic!("{id}: {row:?}"));
            assert!((shown - t.metrics.sqnr_db).abs() <= 0.005, "{id}: {row:?} against {} dB", t.metrics.sqnr_db);
        }
    }

    // Histograms of the lowest-SQNR quantized activations, range lines from scale and zero point.
    let candidates: Vec<_> = compared.iter().filter(|t| t.fake_quantized && report.activations.iter().any(|a| a.value == t.name)).collect();
    assert_eq!(data.histograms.len(), candidates.len().min(WORST_ACTIVATIONS));
    let mut lowest: Vec<f64> = candidates.iter().map(|t| t.metrics.sqnr_db).collect();
    lowest.sort_by(f64::total_cmp);
    for (k, h) in data.histograms.iter().enumerate() {
        let t = &data.comparison.activations[h.comparison];
        assert_eq!(t.metrics.sqnr_db.to_string(), lowest[k].to_string(), "histograms are the lowest SQNR first");
        assert_eq!(h.histogram.total(), t.metrics.count, "the histogram holds the compared samples' values of '{}'", t.name);
        let a = &report.activations[h.activation];
        assert_eq!(a.value, t.name);
        let (qmin, qmax) = integer_range(&a.dtype);
        let chart = svg(&page, &format!("hist-{k}"));
        let line = |class: &str| -> (f32, f64) {
            let found = marks(chart, class);
            assert_eq!(found.len(), 1, "one {class} line");
            (attr(found[0], "data-value").parse().unwrap(), attr(found[0], "x1").parse().unwrap())
        };
        let ((lo, lo_x), (hi, hi_x)) = (line("clip-lo"), line("clip-hi"));
        assert_eq!(lo, a.scale * (qmin - a.zero_point) as f32, "low range line of '{}'", a.value);
        assert_eq!(hi, a.scale * (qmax - a.zero_point) as f32, "high range line of '{}'", a.value);
        assert!(lo_x < hi_x);
        let (min, max) = a.observed.unwrap();
        assert_eq!((line("observed-min").0, line("observed-max").0), (min, max));
        assert_eq!(marks(chart, "bin").len(), 1, "the bins are drawn");
    }

    // Per-channel ranges: one mark per output channel of each quantized weight; the int32
    // bias, whose range follows from other scales, is compared but not plotted.
    assert!(data.comparison.weights.iter().any(|w| w.name == "b1"));
    let names: Vec<&str> = data.weights.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["w1", "w2"]);
    for (k, w) in data.weights.iter().enumerate() {
        let tensor = float.graph.value(float.graph.value_by_name(&w.name).unwrap()).unwrap().initializer().unwrap();
        assert_eq!(data.comparison.weights[w.comparison].axis, Some(0), "per output channel");
        assert_eq!(marks(svg(&page, &format!("weight-{k}")), "range").len(), tensor.shape()[0], "one mark per channel of {}", w.name);
        let original = tensor.as_slice::<f32>().unwrap();
        let per = original.len() / w.min.len();
        for (c, chunk) in original.chunks(per).enumerate() {
            assert_eq!(w.min[c], chunk.iter().copied().fold(f32::INFINITY, f32::min));
            assert_eq!(w.max[c], chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            assert!(w.clip[c].0 <= w.min[c] && w.max[c] <= w.clip[c].1 * 1.0001, "the stored range covers channel {c} of {}", w.name);
        }
    }

    // Every float node with its reason; the sensitivity section says how to run it.
    let rows = table(&page, "float-nodes");
    let float_nodes: Vec<Vec<String>> = report.nodes.iter().filter(|n| !n.quantized)
        .map(|n| vec![n.graph.clone(), n.name.clone(), n.op.clone(), format!("{:?}", n.kind.unwrap()), n.reason.clone().unwrap()]).collect();
    assert_eq!(rows[1..], float_nodes[..]);
    assert!(float_nodes.iter().any(|r| r[1] == format!("soft{HOSTILE}max") && !r[4].is_empty()), "the Softmax stays float with a reason");
    assert!(page["ids"].as_array().unwrap().iter().any(|i| i == "sensitivity-not-run"));
}

#[test]
fn accuracy_budget_page_has_the_ranking_and_the_decisions() {
    let float = model();
    let (quantized, report) = quantize_within_budget(&float, &quantizer(), &samples(), &samples(), &QuantizeOptions::default(), &Budget::min_sqnr(200.0), &mut |_| {}).unwrap();
    let budget = report.accuracy_budget.as_ref().unwrap();
    assert!(!budget.decisions.is_empty());
    let page = read(&render(&report_of(&float, &quantized, &report)));
    let bars = marks(svg(&page, "sensitivity-chart"), "mark");
    assert_eq!(bars.len(), budget.ranking.len().min(40));
    for (bar, u) in bars.iter().zip(&budget.ranking) {
        assert_eq!(attr(bar, "data-sqnr"), u.only_quantized_sqnr_db.to_string());
    }
    assert_eq!(table(&page, "budget-decisions").len(), budget.decisions.len() + 1);
    let rounds = table(&page, "budget-rounds");
    assert_eq!(rounds.len(), budget.rounds.len() + 1);
    assert_eq!(rounds.last().unwrap()[4], format!("{:.4e}", budget.error_final));
    assert_eq!(table(&page, "sensitivity-ranking").len(), budget.ranking.len() + 1);
    let float_rows = table(&page, "float-nodes");
    assert!(float_rows.iter().any(|r| r[3] == "AccuracyBudget"), "nodes returned to float by the budget are listed");
}

#[test]
fn the_same_data_gives_the_same_bytes() {
    let float = model();
    let (quantized, report) = quantize(&float, &quantizer(), &samples(), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let (mut a, mut b) = (report_of(&float, &quantized, &report), report_of(&float, &quantized, &report));
    (a.seconds, b.seconds) = (0.0, 0.0);
    assert_eq!(render(&a), render(&b));
}
