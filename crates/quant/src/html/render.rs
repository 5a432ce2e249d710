//! Writing the [`HtmlReport`] as one self-contained HTML page that is also well-formed XML.

use std::fmt::Write as _;

use super::svg::{escape, Axis, Chart, Mark};
use super::{ActivationHistogram, HtmlReport, WeightRanges, HISTOGRAM_BINS};
use crate::compare::TensorComparison;
use crate::report::ActivationRecord;
use crate::sensitivity::BudgetOutcome;

const STYLE: &str = "
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;padding:0 16px;color:#222;max-width:1240px;line-height:1.4}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ccc}
p.note{color:#555;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border-bottom:1px solid #e2e2e2;padding:2px 10px 2px 0;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
svg{background:#fff;display:block}
svg text{font-family:inherit}
text.tick{font-size:10px;fill:#555}
text.axis-label{font-size:12px;fill:#222}
line.grid{stroke:#ececec}
rect.frame{fill:none;stroke:#999}
rect.mark.qdq{fill:#3b6fb6}rect.mark.float{fill:#a9c4e6}rect.mark.inf{fill:#2e9e50}
rect.mark:hover,rect.range:hover{fill:#e07b00}
path.bin{fill:#7d8fa3}
line.clip{stroke:#d62728;stroke-width:2}
line.observed{stroke:#222;stroke-width:1.5;stroke-dasharray:5 3}
line.zero{stroke:#666}
path.clip-band{fill:#f6d2d2}rect.range{fill:#3b6fb6}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(590px,1fr));gap:18px}
figure{margin:0}figcaption{font-size:13px;margin-bottom:4px;overflow-wrap:anywhere}
.swatch{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:-1px}
details summary{cursor:pointer;font-size:13px;color:#333}
";

/// SQNR in dB for people: two decimals, `inf`, or `n/a` when nothing was compared.
fn db(v: f64) -> String {
    if v.is_nan() {
        "n/a".into()
    } else if v.is_finite() {
        format!("{v:.2}")
    } else {
        format!("{v}")
    }
}

/// `v` with five significant digits, in scientific notation outside `[1e-3, 1e5)`.
fn sig(v: f64) -> String {
    let magnitude = v.abs();
    if v == 0.0 || !v.is_finite() {
        format!("{v}")
    } else if (1e-3..1e5).contains(&magnitude) {
        let decimals = (4 - magnitude.log10().floor() as i32).max(0) as usize;
        format!("{v:.decimals$}")
    } else {
        format!("{v:.4e}")
    }
}

fn qualified(graph: &str, name: &str) -> String {
    if graph.is_empty() { name.to_string() } else { format!("{graph}:{name}") }
}

/// A table with element id `id`: `headers`, then `rows` of plain text (escaped here);
/// columns listed in `numeric` are right-aligned.
fn table(out: &mut String, id: &str, headers: &[&str], numeric: &[usize], rows: impl IntoIterator<Item = Vec<String>>) {
    let _ = write!(out, "<table id=\"{}\"><thead><tr>", escape(id));
    for h in headers {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for (c, cell) in row.iter().enumerate() {
            let class = if numeric.contains(&c) { " class=\"num\"" } else { "" };
            let _ = write!(out, "<td{class}>{}</td>", escape(cell));
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
}

/// The page for `r` (see the module documentation of [`super`]). The result is well-formed
/// XML as well as HTML; every name from the models is escaped.
pub fn render(r: &HtmlReport) -> String {
    let mut out = String::new();
    let title = format!("qforge quantization report: {}", r.subject.model);
    let _ = write!(out, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/><title>{}</title><style>{STYLE}</style></head><body><h1>{}</h1>", escape(&title), escape(&title));
    summary(&mut out, r);
    sqnr_section(&mut out, r);
    histogram_section(&mut out, r);
    weight_section(&mut out, r);
    sensitivity_section(&mut out, r.report.accuracy_budget.as_ref());
    float_section(&mut out, r);
    let _ = writeln!(out, "<p class=\"note\">The data of this page, as JSON: {}.</p></body></html>", escape(&r.subject.json));
    out
}

fn summary(out: &mut String, r: &HtmlReport) {
    let rep = r.report;
    let quantized = rep.nodes.iter().filter(|n| n.quantized).count();
    let c = &r.comparison;
    let rows = [
        ("model", r.subject.model.clone()),
        ("quantized model", r.subject.output.clone()),
        ("backend", r.subject.backend.clone()),
        ("calibration data", format!("{} ({} samples)", r.subject.calibration_data, rep.samples)),
        ("nodes quantized", format!("{quantized} of {}", rep.nodes.len())),
        ("activations with Q/DQ", rep.activations.len().to_string()),
        ("constants stored quantized", rep.constants.len().to_string()),
        ("affine nodes folded into weights", rep.affine_folded.to_string()),
        ("MatMul+Add pairs made Gemm", rep.matmul_add_fused.to_string()),
        ("loop-carried constants uncarried / loop invariants moved", format!("{} / {}", rep.loop_carried_uncarried, rep.loop_invariants_hoisted)),
        ("opset", format!("{} -> {}", rep.opset.0, rep.opset.1)),
        ("weight rounding", if rep.gptq_enabled { format!("gptq: {}", rep.gptq_summary()) } else { "nearest".into() }),
        ("calibration time", format!("{:.2} s", rep.calibration_seconds)),
        ("quantization time (total)", format!("{:.2} s", rep.total_seconds)),
        ("this report's comparison", format!("{} of {} calibration samples, {:.2} s", c.samples, rep.samples, r.seconds)),
    ];
    out.push_str("<h2 id=\"summary\">Summary</h2>");
    table(out, "summary-table", &["", ""], &[], rows.into_iter().map(|(k, v)| vec![k.to_string(), v]));
    let mut warnings: Vec<String> = rep.skipped.iter().map(|(g, v, why)| format!("'{v}' ({g}) stays float: {why}")).collect();
    warnings.extend(rep.violations.iter().map(|v| v.to_string()));
    warnings.extend(rep.widened.iter().map(|r| r.to_string()));
    warnings.extend(rep.narrow_inputs.iter().map(|r| r.to_string()));
    warnings.extend(rep.narrow_weight_channels.iter().map(|r| r.to_string()));
    warnings.extend(rep.upcast_note());
    warnings.extend(rep.constant_inputs_note());
    warnings.extend(rep.floors_note());
    warnings.extend(rep.pair_sums_note());
    warnings.extend(rep.bias_adjusted.iter().map(|(w, n)| format!("weight '{w}': scale enlarged on {n} channel(s) so the int32 bias does not overflow")));
    let nonfinite: u64 = rep.activations.iter().map(|a| a.nonfinite).sum();
    if nonfinite > 0 {
        warnings.push(format!("{nonfinite} NaN/Inf activation values were seen during calibration and left out of the ranges"));
    }
    if !warnings.is_empty() {
        out.push_str("<ul id=\"warnings\">");
        for w in warnings {
            let _ = write!(out, "<li>{}</li>", escape(&w));
        }
        out.push_str("</ul>");
    }
}

/// The activations the SQNR chart shows: those with compared elements.
fn charted(c: &[TensorComparison]) -> impl Iterator<Item = &TensorComparison> {
    c.iter().filter(|t| t.metrics.count > 0)
}

fn sqnr_section(out: &mut String, r: &HtmlReport) {
    let c = &r.comparison;
    out.push_str("<h2 id=\"sqnr\">Per-layer SQNR along the graph</h2>");
    let _ = write!(out, "<p class=\"note\">SQNR = 10·log10(Σx²/Σ(x−y)²) of each float activation x against the quantized model's y, over {} sample(s), in topological order (about 6 dB per bit). Hover a bar for the tensor and its op.\
        <span class=\"swatch\" style=\"background:#3b6fb6\"></span>compared with its fake-quantized value (Q/DQ)\
        <span class=\"swatch\" style=\"background:#a9c4e6\"></span>a float value of the quantized model\
        <span class=\"swatch\" style=\"background:#2e9e50\"></span>identical (infinite SQNR, drawn at the top)</p>", c.samples);
    let shown: Vec<&TensorComparison> = charted(&c.activations).collect();
    let finite = shown.iter().map(|t| t.metrics.sqnr_db).filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((0.0f64, 1.0f64), |(l, h), v| (l.min(v), h.max(v)));
    let mut chart = Chart::new("sqnr-chart", 1200.0, 340.0, Axis::positions(shown.len(), "activation index in graph order"), Axis::linear(lo, hi, "SQNR (dB)"));
    for (k, t) in shown.iter().enumerate() {
        let v = t.metrics.sqnr_db;
        let class = match (v.is_infinite() && v > 0.0, t.fake_quantized) {
            (true, _) => "mark inf",
            (false, true) => "mark qdq",
            (false, false) => "mark float",
        };
        let mark = Mark::new(class, format!("#{k} {} ({}): {} dB{}", qualified(&t.graph, &t.name), t.op, db(v), if t.fake_quantized { ", Q/DQ" } else { "" }))
            .with("index", k).with("graph", &t.graph).with("name", &t.name).with("op", &t.op).with("sqnr", v);
        chart.rect(k as f64 + 0.1, k as f64 + 0.9, 0.0, v, &mark);
    }
    out.push_str(&chart.finish());
    let not_charted = c.activations.len() - shown.len();
    if not_charted > 0 {
        let _ = write!(out, "<p class=\"note\">{not_charted} matched activation(s) had no finite element pair to compare and are not drawn.</p>");
    }
    let row = |t: &TensorComparison| vec![qualified(&t.graph, &t.name), t.op.clone(), db(t.metrics.sqnr_db), format!("{:.6}", t.metrics.cosine), format!("{:.3e}", t.metrics.max_abs_error)];
    out.push_str("<h3>Graph outputs</h3><p class=\"note\">The QDQ graph as written: float arithmetic between each DequantizeLinear and QuantizeLinear, the run every tensor above comes from.</p>");
    table(out, "outputs", &["output", "op", "SQNR dB", "cosine", "max |err|"], &[2, 3, 4], c.outputs.iter().map(row));
    if let Some(as_run) = &c.outputs_as_run {
        out.push_str("<p class=\"note\">As deployed: the QDQ units run as integer operators that round as ONNX Runtime's kernels do.</p>");
        table(out, "outputs-as-deployed", &["output", "op", "SQNR dB", "cosine", "max |err|"], &[2, 3, 4], as_run.iter().map(row));
    }
    out.push_str("<h3>Lowest SQNR</h3>");
    table(out, "worst", &["tensor", "op", "SQNR dB", "cosine", "max |err|"], &[2, 3, 4], c.worst(10).into_iter().map(row));
}

fn histogram_section(out: &mut String, r: &HtmlReport) {
    out.push_str("<h2 id=\"histograms\">Activation histograms with their quantization ranges</h2>");
    if r.histograms.is_empty() {
        out.push_str("<p class=\"note\">No compared activation has Q/DQ.</p>");
        return;
    }
    let _ = write!(out, "<p class=\"note\">The {} quantized activations with the lowest SQNR, lowest first: values over the report's {} sample(s) on a canonical grid of at most {HISTOGRAM_BINS} bins (count on a log scale). \
        <span class=\"swatch\" style=\"background:#d62728\"></span>the range QuantizeLinear represents, scale·(qmin−zero point) to scale·(qmax−zero point)\
        <span class=\"swatch\" style=\"background:#222\"></span>dashed: the extremes observed in calibration</p><div class=\"figures\">", r.histograms.len(), r.comparison.samples);
    for (k, h) in r.histograms.iter().enumerate() {
        histogram_figure(out, k, h, &r.report.activations[h.activation], &r.comparison.activations[h.comparison]);
    }
    out.push_str("</div>");
}

fn histogram_figure(out: &mut String, k: usize, h: &ActivationHistogram, a: &ActivationRecord, t: &TensorComparison) {
    let hist = &h.histogram;
    let _ = write!(out, "<figure><figcaption><b>{}</b> ({}): SQNR {} dB; {} scale {}, zero point {}{}</figcaption>", escape(&qualified(&t.graph, &h.value)), escape(&t.op), db(t.metrics.sqnr_db), escape(&a.dtype), sig(a.scale as f64), a.zero_point,
        if a.fixed { " (fixed by the target)" } else { "" });
    let mut lo = a.clip_range.0.min(hist.min) as f64;
    let mut hi = a.clip_range.1.max(hist.max) as f64;
    if let Some((min, max)) = a.observed {
        (lo, hi) = (lo.min(min as f64), hi.max(max as f64));
    }
    let peak = hist.counts.iter().copied().max().unwrap_or(1).max(1);
    let mut chart = Chart::new(&format!("hist-{k}"), 590.0, 250.0, Axis::linear(lo, hi, "value"), Axis::log10(1.0, peak as f64, "count (log)"));
    let bins: Vec<_> = hist.counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &count)| (hist.bin_start(i), hist.bin_start(i + 1), 0.5, count as f64)).collect();
    chart.rects(&bins, &Mark::new("bin", format!("{} values in {} bins of width {}", hist.total(), hist.counts.len(), sig(hist.bin_width()))));
    let (clip_lo, clip_hi) = a.clip_range;
    chart.vline(clip_lo as f64, &Mark::new("clip clip-lo", format!("quantization range low: {}", sig(clip_lo as f64))).with("value", clip_lo));
    chart.vline(clip_hi as f64, &Mark::new("clip clip-hi", format!("quantization range high: {}", sig(clip_hi as f64))).with("value", clip_hi));
    if let Some((min, max)) = a.observed {
        chart.vline(min as f64, &Mark::new("observed observed-min", format!("observed min: {}", sig(min as f64))).with("value", min));
        chart.vline(max as f64, &Mark::new("observed observed-max", format!("observed max: {}", sig(max as f64))).with("value", max));
    }
    out.push_str(&chart.finish());
    if hist.counts.is_empty() {
        out.push_str("<p class=\"note\">No value was seen on the report's samples.</p>");
    }
    out.push_str("</figure>");
}

fn weight_section(out: &mut String, r: &HtmlReport) {
    let c = &r.comparison;
    out.push_str("<h2 id=\"weights\">Per-channel weight ranges</h2>");
    if r.weights.is_empty() {
        out.push_str("<p class=\"note\">No quantized weight was compared.</p>");
    } else {
        let _ = write!(out, "<p class=\"note\">The {} weights (int32 biases aside) with the lowest channel SQNR, in graph order: per output channel, the float weight's min..max \
            <span class=\"swatch\" style=\"background:#3b6fb6\"></span>over the range its stored integers represent\
            <span class=\"swatch\" style=\"background:#f6d2d2\"></span>scale·(qmin−zero point) to scale·(qmax−zero point).</p><div class=\"figures\">", r.weights.len());
        for (k, w) in r.weights.iter().enumerate() {
            weight_figure(out, k, w, &c.weights[w.comparison]);
        }
        out.push_str("</div>");
    }
    if !c.weights.is_empty() {
        let _ = write!(out, "<details><summary>All {} quantized weights</summary>", c.weights.len());
        let channel = |v: Option<f64>| v.map_or("-".to_string(), db);
        table(out, "weight-table", &["weight", "read by", "op", "SQNR dB", "min channel dB", "median channel dB", "channels"], &[3, 4, 5, 6],
            c.weights.iter().map(|w| vec![qualified(&w.graph, &w.name), w.consumer.clone(), w.op.clone(), db(w.metrics.sqnr_db), channel(w.min_channel_sqnr_db), channel(w.median_channel_sqnr_db), w.channel_sqnr_db.len().to_string()]));
        out.push_str("</details>");
    }
}

fn weight_figure(out: &mut String, k: usize, w: &WeightRanges, cmp: &crate::compare::WeightComparison) {
    let axis = cmp.axis.map_or("whole tensor".to_string(), |a| format!("axis {a}"));
    let _ = write!(out, "<figure><figcaption><b>{}</b> read by {} ({}): SQNR {} dB, lowest channel {} dB ({axis})</figcaption>", escape(&qualified(&cmp.graph, &w.name)), escape(&cmp.consumer), escape(&cmp.op),
        db(cmp.metrics.sqnr_db), cmp.min_channel_sqnr_db.map_or("-".to_string(), db));
    let values = w.min.iter().chain(&w.max).chain(w.clip.iter().flat_map(|(a, b)| [a, b])).copied().filter(|v| v.is_finite());
    let (lo, hi) = values.fold((0.0f32, 0.0f32), |(l, h), v| (l.min(v), h.max(v)));
    let channels = w.min.len();
    let mut chart = Chart::new(&format!("weight-{k}"), 590.0, 250.0, Axis::positions(channels, &format!("output channel ({axis})")), Axis::linear(lo as f64, hi as f64, "weight value"));
    let band: Vec<_> = w.clip.iter().enumerate().map(|(ch, &(a, b))| (ch as f64, ch as f64 + 1.0, a as f64, b as f64)).collect();
    chart.rects(&band, &Mark { class: "clip-band".into(), ..Default::default() });
    for (ch, (&min, &max)) in w.min.iter().zip(&w.max).enumerate() {
        let sqnr = cmp.channel_sqnr_db.get(ch).map_or(String::new(), |&s| format!(", SQNR {} dB", db(s)));
        let mark = Mark::new("range", format!("channel {ch}: {} .. {}{sqnr}", sig(min as f64), sig(max as f64))).with("channel", ch);
        chart.rect(ch as f64 + 0.15, ch as f64 + 0.85, min as f64, max as f64, &mark);
    }
    chart.hline(0.0, &Mark { class: "zero".into(), ..Default::default() });
    out.push_str(&chart.finish());
    out.push_str("</figure>");
}

fn sensitivity_section(out: &mut String, budget: Option<&BudgetOutcome>) {
    out.push_str("<h2 id=\"sensitivity\">Sensitivity ranking</h2>");
    let Some(b) = budget else {
        out.push_str("<p id=\"sensitivity-not-run\">Not run in this quantization. Run <code>qforge sensitivity MODEL.onnx --calibration-data PATH</code> for the ranking, \
            or quantize with an accuracy budget (<code>--max-output-error E</code> or <code>--min-sqnr DB</code>), which ranks the groups and returns the most sensitive to float until the budget is met.</p>");
        return;
    };
    let to_db = |e: f64| -20.0 * e.log10();
    let _ = write!(out, "<p>Accuracy budget: {} at most {:.4e} ({:.2} dB). Every group quantized: {:.4e} ({:.2} dB, in the Q/DQ simulation); after {} measurement(s) in {} round(s), the converted model run as integer operators: {:.4e} ({:.2} dB), {} of {} groups float; {} ({:.1} s).</p>",
        escape(&b.metric), b.max_error, to_db(b.max_error), b.error_all_quantized, to_db(b.error_all_quantized), b.prefix_search.len() + b.decisions.len(), b.rounds.len(), b.error_final, to_db(b.error_final),
        b.units_float, b.units, if b.met { "met" } else { "NOT met" }, b.seconds);
    if !b.rounds.is_empty() {
        out.push_str("<p>Each round searches in the Q/DQ simulation, then measures the converted model; when that misses the budget, the next round aims the simulation at the budget times the simulated error over the converted one.</p>");
        table(out, "budget-rounds", &["round", "simulated error at most", "groups float", "simulated error", "converted error", "converted dB"], &[0, 2, 3, 4, 5], b.rounds.iter().map(|r| vec![
            r.round.to_string(), format!("{:.4e}", r.max_error_simulated), r.units_float.to_string(), format!("{:.4e}", r.error_simulated), format!("{:.4e}", r.error_converted), format!("{:.2}", to_db(r.error_converted)),
        ]));
    }
    const RANKS_CHARTED: usize = 40;
    let ranked: Vec<_> = b.ranking.iter().take(RANKS_CHARTED).collect();
    let finite = ranked.iter().map(|u| u.only_quantized_sqnr_db).filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((0.0f64, 1.0f64), |(l, h), v| (l.min(v), h.max(v)));
    let mut chart = Chart::new("sensitivity-chart", 1200.0, 280.0, Axis::positions(ranked.len(), "rank (most sensitive first)"), Axis::linear(lo, hi, "SQNR, only it quantized (dB)"));
    for (rank, u) in ranked.iter().enumerate() {
        let mark = Mark::new("mark qdq", format!("#{} {} {} [{}] ({}): {} dB only quantized, {} dB only float", rank + 1, u.unit.kind, u.unit.id, u.unit.values.join(", "), u.unit.ops.join(", "), db(u.only_quantized_sqnr_db), db(u.only_float_sqnr_db)))
            .with("rank", rank + 1).with("sqnr", u.only_quantized_sqnr_db);
        chart.rect(rank as f64 + 0.1, rank as f64 + 0.9, 0.0, u.only_quantized_sqnr_db, &mark);
    }
    out.push_str(&chart.finish());
    if !b.prefix_search.is_empty() {
        out.push_str("<p>The fewest most sensitive groups whose return to float meets the budget, searched by bisection:</p>");
        table(out, "budget-prefix", &["step", "round", "groups float", "error"], &[0, 1, 2, 3], b.prefix_search.iter().enumerate().map(|(i, t)| vec![
            (i + 1).to_string(), t.round.to_string(), t.units_float.to_string(), format!("{:.4e}", t.error),
        ]));
    }
    const DECISIONS_SHOWN_OPEN: usize = 20;
    let kept = b.decisions.iter().filter(|d| d.kept_float).count();
    let open = if b.decisions.len() <= DECISIONS_SHOWN_OPEN { " open=\"open\"" } else { "" };
    let _ = write!(out, "<details{open}><summary>Walk back over those groups, least sensitive first: {} tried quantized again, {kept} kept float</summary>", b.decisions.len());
    table(out, "budget-decisions", &["step", "round", "unit", "values", "ops", "error float", "error quantized", "outcome"], &[0, 1, 5, 6], b.decisions.iter().enumerate().map(|(i, d)| vec![
        (i + 1).to_string(), d.round.to_string(), format!("{} #{}", d.unit.kind, d.unit.id), d.unit.values.join(", "), d.unit.ops.join(", "),
        format!("{:.4e}", d.error_float), format!("{:.4e}", d.error_quantized), if d.kept_float { "kept float" } else { "quantized again" }.to_string(),
    ]));
    out.push_str("</details>");
    if !b.weights_following.is_empty() {
        let _ = write!(out, "<p id=\"budget-weights-following\">Returned to float with the activation they multiply (ONNX Runtime would quantize a float activation read with an 8-bit MatMul or Gemm weight at run time): {}.</p>",
            b.weights_following.iter().map(|w| escape(&format!("{} #{} [{}]", w.kind, w.id, w.values.join(", ")))).collect::<Vec<_>>().join("; "));
    }
    let _ = write!(out, "<details><summary>Full ranking ({} units)</summary>", b.ranking.len());
    table(out, "sensitivity-ranking", &["rank", "unit", "values", "ops", "only quantized dB", "only float dB"], &[0, 4, 5], b.ranking.iter().enumerate().map(|(i, u)| vec![
        (i + 1).to_string(), format!("{} #{}", u.unit.kind, u.unit.id), u.unit.values.join(", "), u.unit.ops.join(", "), db(u.only_quantized_sqnr_db), db(u.only_float_sqnr_db),
    ]));
    out.push_str("</details>");
}

fn float_section(out: &mut String, r: &HtmlReport) {
    let float: Vec<_> = r.report.nodes.iter().filter(|n| !n.quantized).collect();
    let _ = write!(out, "<h2 id=\"float\">Nodes left in float ({} of {})</h2>", float.len(), r.report.nodes.len());
    table(out, "float-nodes", &["graph", "node", "op", "kind", "reason"], &[], float.iter().map(|n| vec![
        n.graph.clone(), n.name.clone(), n.op.clone(), n.kind.map_or(String::new(), |k| format!("{k:?}")), n.reason.clone().unwrap_or_default(),
    ]));
}
