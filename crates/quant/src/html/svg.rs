//! A small SVG plotting helper for the HTML report: a plot area with labeled, ticked axes,
//! and marks (rectangles, vertical lines) placed in data coordinates.
//!
//! Every text written is escaped with [`escape`]; coordinates are written with one decimal and
//! data attributes with Rust's shortest round-trip float format, so the same data gives the
//! same bytes. Marks carry a CSS class, an optional hover text (`<title>`) and `data-*`
//! attributes holding the exact values they draw; styling is left to the page's CSS.

use std::fmt::Write as _;

/// `text` with `&`, `<`, `>`, `"` and `'` replaced by character references, so it may stand
/// in element content or in a quoted attribute value of HTML or XML.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// How data values map to positions along an axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Positions follow `log10(value)`; the axis interval is positive.
    Log10,
}

/// One axis: the data interval it shows, its scale, tick step (linear) and label.
#[derive(Debug, Clone)]
pub struct Axis {
    lo: f64,
    hi: f64,
    scale: Scale,
    step: f64,
    label: String,
}

/// The tick step from {1, 2, 5}·10^k closest above `span / 5`.
fn nice_step(span: f64) -> f64 {
    let rough = span / 5.0;
    let magnitude = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * magnitude).find(|&s| s >= rough).unwrap_or(10.0 * magnitude)
}

impl Axis {
    /// A linear axis covering `[lo, hi]`, widened outward to multiples of its tick step. A
    /// degenerate or non-finite interval becomes one unit wide around its finite end (or
    /// `[0, 1]`).
    pub fn linear(lo: f64, hi: f64, label: &str) -> Axis {
        let (lo, hi) = match (lo.is_finite(), hi.is_finite()) {
            (true, true) if hi > lo => (lo, hi),
            (true, true) => (lo - 0.5, lo + 0.5),
            (true, false) => (lo, lo + 1.0),
            (false, true) => (hi - 1.0, hi),
            (false, false) => (0.0, 1.0),
        };
        let step = nice_step(hi - lo);
        Axis { lo: (lo / step).floor() * step, hi: (hi / step).ceil() * step, scale: Scale::Linear, step, label: label.to_string() }
    }

    /// A linear axis over exactly `[0, count]` (at least `[0, 1]`), for marks at integer
    /// positions such as indices or ranks.
    pub fn positions(count: usize, label: &str) -> Axis {
        let hi = count.max(1) as f64;
        Axis { lo: 0.0, hi, scale: Scale::Linear, step: nice_step(hi).max(1.0), label: label.to_string() }
    }

    /// A log10 axis covering `[lo, hi]` (both positive), widened outward to powers of ten.
    pub fn log10(lo: f64, hi: f64, label: &str) -> Axis {
        let lo = if lo > 0.0 && lo.is_finite() { lo } else { 1.0 };
        let hi = if hi > lo && hi.is_finite() { hi } else { lo * 10.0 };
        Axis { lo: 10f64.powf(lo.log10().floor()), hi: 10f64.powf(hi.log10().ceil()), scale: Scale::Log10, step: 10.0, label: label.to_string() }
    }

    /// Where `v` lies along the axis, from 0 (at `lo`) to 1 (at `hi`), clamped to `[0, 1]`
    /// (+inf maps to 1, -inf and NaN to 0).
    pub fn fraction(&self, v: f64) -> f64 {
        let f = match self.scale {
            Scale::Linear => (v - self.lo) / (self.hi - self.lo),
            Scale::Log10 => (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10()),
        };
        if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) }
    }

    /// Tick positions: multiples of the step (linear) or powers of ten (log).
    pub fn ticks(&self) -> Vec<f64> {
        match self.scale {
            Scale::Linear => {
                let step = self.step;
                let first = (self.lo / step).ceil() as i64;
                let last = (self.hi / step).floor() as i64;
                (first..=last).map(|k| k as f64 * step).collect()
            }
            Scale::Log10 => (self.lo.log10().round() as i32..=self.hi.log10().round() as i32).map(|k| 10f64.powi(k)).collect(),
        }
    }

    /// The text of tick `v`: on a linear axis as many decimals as the step needs, or
    /// scientific notation for very large or small magnitudes; on a log axis the plain number
    /// from 0.001 to 10000, else `1eK`.
    pub fn tick_label(&self, v: f64) -> String {
        if v == 0.0 {
            return "0".into();
        }
        if self.scale == Scale::Log10 {
            let exponent = v.log10().round() as i32;
            return if (-3..=4).contains(&exponent) { format!("{v}") } else { format!("1e{exponent}") };
        }
        let step = self.step;
        let magnitude = self.lo.abs().max(self.hi.abs());
        if magnitude >= 1e5 || step < 1e-3 {
            return format!("{v:.1e}");
        }
        let decimals = (-step.log10().floor()).max(0.0) as usize;
        format!("{v:.decimals$}")
    }
}

/// What a mark carries besides its geometry: a CSS class, a hover text and `data-*`
/// attributes (names without the `data-` prefix; values escaped when written).
#[derive(Debug, Clone, Default)]
pub struct Mark {
    pub class: String,
    pub title: Option<String>,
    pub data: Vec<(&'static str, String)>,
}

impl Mark {
    /// A mark of CSS class `class` with hover text `title`.
    pub fn new(class: &str, title: impl Into<String>) -> Mark {
        Mark { class: class.to_string(), title: Some(title.into()), data: vec![] }
    }

    /// The mark with attribute `data-{name}` set to `value`.
    pub fn with(mut self, name: &'static str, value: impl ToString) -> Mark {
        self.data.push((name, value.to_string()));
        self
    }

    fn attributes(&self) -> String {
        let mut s = format!(" class=\"{}\"", escape(&self.class));
        for (name, value) in &self.data {
            let _ = write!(s, " data-{name}=\"{}\"", escape(value));
        }
        s
    }

    fn close(&self, element: &str) -> String {
        match &self.title {
            Some(t) => format!("><title>{}</title></{element}>", escape(t)),
            None => "/>".to_string(),
        }
    }
}

/// Space around the plot area for tick labels and axis labels, in pixels.
const MARGIN_LEFT: f64 = 64.0;
const MARGIN_RIGHT: f64 = 16.0;
const MARGIN_TOP: f64 = 10.0;
const MARGIN_BOTTOM: f64 = 42.0;

/// An SVG chart being drawn: axes fixed at creation, marks appended in drawing order.
#[derive(Debug, Clone)]
pub struct Chart {
    id: String,
    width: f64,
    height: f64,
    x: Axis,
    y: Axis,
    marks: String,
}

impl Chart {
    /// A `width` by `height` pixel chart with element id `id` (escaped) and the given axes.
    pub fn new(id: &str, width: f64, height: f64, x: Axis, y: Axis) -> Chart {
        Chart { id: id.to_string(), width, height, x, y, marks: String::new() }
    }

    /// The horizontal pixel position of data value `v` (clamped to the plot area).
    pub fn px(&self, v: f64) -> f64 {
        MARGIN_LEFT + self.x.fraction(v) * (self.width - MARGIN_LEFT - MARGIN_RIGHT)
    }

    /// The vertical pixel position of data value `v` (clamped to the plot area).
    pub fn py(&self, v: f64) -> f64 {
        self.height - MARGIN_BOTTOM - self.y.fraction(v) * (self.height - MARGIN_TOP - MARGIN_BOTTOM)
    }

    /// A rectangle over data `[x0, x1] × [y0, y1]` (in either order), at least half a pixel
    /// wide and tall so that thin marks stay visible.
    pub fn rect(&mut self, x0: f64, x1: f64, y0: f64, y1: f64, mark: &Mark) {
        let (a, b) = (self.px(x0), self.px(x1));
        let (c, d) = (self.py(y0), self.py(y1));
        let (left, top) = (a.min(b), c.min(d));
        let (w, h) = ((a - b).abs().max(0.5), (c - d).abs().max(0.5));
        let _ = write!(self.marks, "<rect x=\"{left:.1}\" y=\"{top:.1}\" width=\"{w:.1}\" height=\"{h:.1}\"{}{}", mark.attributes(), mark.close("rect"));
    }

    /// Rectangles over data `[x0, x1] × [y0, y1]` (each as in [`Chart::rect`]) drawn as one
    /// `<path>`: for many marks that need no hover text of their own.
    pub fn rects(&mut self, rects: &[(f64, f64, f64, f64)], mark: &Mark) {
        if rects.is_empty() {
            return;
        }
        let mut d = String::new();
        for &(x0, x1, y0, y1) in rects {
            let (a, b) = (self.px(x0), self.px(x1));
            let (c, e) = (self.py(y0), self.py(y1));
            let _ = write!(d, "M{:.1} {:.1}h{:.1}v{:.1}h{:.1}z", a.min(b), c.min(e), (a - b).abs().max(0.5), (c - e).abs().max(0.5), -(a - b).abs().max(0.5));
        }
        let _ = write!(self.marks, "<path d=\"{d}\"{}{}", mark.attributes(), mark.close("path"));
    }

    /// A vertical line across the plot area at data `x`.
    pub fn vline(&mut self, x: f64, mark: &Mark) {
        let px = self.px(x);
        let (top, bottom) = (MARGIN_TOP, self.height - MARGIN_BOTTOM);
        let _ = write!(self.marks, "<line x1=\"{px:.1}\" y1=\"{top:.1}\" x2=\"{px:.1}\" y2=\"{bottom:.1}\"{}{}", mark.attributes(), mark.close("line"));
    }

    /// A horizontal line across the plot area at data `y`.
    pub fn hline(&mut self, y: f64, mark: &Mark) {
        let py = self.py(y);
        let (left, right) = (MARGIN_LEFT, self.width - MARGIN_RIGHT);
        let _ = write!(self.marks, "<line x1=\"{left:.1}\" y1=\"{py:.1}\" x2=\"{right:.1}\" y2=\"{py:.1}\"{}{}", mark.attributes(), mark.close("line"));
    }

    /// The finished `<svg>` element: frame, grid lines, tick labels, axis labels, then the
    /// marks. Uses classes `frame`, `grid`, `tick` and `axis-label` for styling.
    pub fn finish(self) -> String {
        let (w, h) = (self.width, self.height);
        let (left, right, top, bottom) = (MARGIN_LEFT, w - MARGIN_RIGHT, MARGIN_TOP, h - MARGIN_BOTTOM);
        let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"{}\" width=\"{w:.0}\" height=\"{h:.0}\" viewBox=\"0 0 {w:.0} {h:.0}\">", escape(&self.id));
        for t in self.x.ticks() {
            let px = self.px(t);
            let _ = write!(s, "<line class=\"grid\" x1=\"{px:.1}\" y1=\"{top:.1}\" x2=\"{px:.1}\" y2=\"{bottom:.1}\"/><text class=\"tick\" x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                bottom + 14.0, escape(&self.x.tick_label(t)));
        }
        for t in self.y.ticks() {
            let py = self.py(t);
            let _ = write!(s, "<line class=\"grid\" x1=\"{left:.1}\" y1=\"{py:.1}\" x2=\"{right:.1}\" y2=\"{py:.1}\"/><text class=\"tick\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                left - 4.0, py + 4.0, escape(&self.y.tick_label(t)));
        }
        let _ = write!(s, "<rect class=\"frame\" x=\"{left:.1}\" y=\"{top:.1}\" width=\"{:.1}\" height=\"{:.1}\"/>", right - left, bottom - top);
        let _ = write!(s, "<text class=\"axis-label\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>", (left + right) / 2.0, h - 6.0, escape(&self.x.label));
        let (cx, cy) = (14.0, (top + bottom) / 2.0);
        let _ = write!(s, "<text class=\"axis-label\" x=\"{cx:.1}\" y=\"{cy:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 {cx:.1} {cy:.1})\">{}</text>", escape(&self.y.label));
        s.push_str(&self.marks);
        s.push_str("</svg>");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(escape(r#"a<b>&"c"'"#), "a&lt;b&gt;&amp;&quot;c&quot;&#39;");
    }

    #[test]
    fn linear_axes_widen_to_ticks_and_map_to_the_plot_area() {
        let a = Axis::linear(-3.2, 41.0, "dB");
        assert_eq!((a.lo, a.hi), (-10.0, 50.0));
        assert_eq!(a.ticks(), vec![-10.0, 0.0, 10.0, 20.0, 30.0, 40.0, 50.0]);
        assert_eq!(a.tick_label(20.0), "20");
        let c = Chart::new("c", 400.0, 200.0, Axis::linear(0.0, 1.0, "x"), a);
        assert_eq!(c.px(0.0), MARGIN_LEFT);
        assert_eq!(c.px(1.0), 400.0 - MARGIN_RIGHT);
        assert_eq!(c.py(f64::INFINITY), MARGIN_TOP);
        assert_eq!(c.py(-10.0), 200.0 - MARGIN_BOTTOM);
    }

    #[test]
    fn log_axes_tick_at_powers_of_ten() {
        let a = Axis::log10(0.5, 3000.0, "count");
        assert_eq!((a.lo, a.hi), (0.1, 10000.0));
        assert_eq!(a.ticks().len(), 6);
        assert_eq!(a.tick_label(100.0), "100");
        assert_eq!(a.tick_label(0.1), "0.1");
        assert_eq!(Axis::log10(1.0, 2e6, "count").tick_label(1e6), "1e6");
    }

    #[test]
    fn degenerate_intervals_get_a_width() {
        let a = Axis::linear(2.0, 2.0, "x");
        assert!(a.lo < 2.0 && a.hi > 2.0);
        let b = Axis::linear(f64::NAN, f64::INFINITY, "x");
        assert_eq!((b.lo, b.hi), (0.0, 1.0));
    }
}
