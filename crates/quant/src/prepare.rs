//! Prepare: turn annotations into observation groups, and calibrate them.
//!
//! Every annotated activation edge names a value and an integer type. Following seed 000's
//! observer insertion, edges are deduplicated to one *point* per (value, type) in each graph;
//! points tied by shared specs are merged (union-find) into one [`Group`] with one observer and
//! one set of qparams. The producer's output spec defines the group when it has one (so a
//! fixed-qparams output wins over its readers' requests). A share never joins a fixed-qparams
//! point with points of other qparams: a Concat of a Sigmoid's [0, 1] output and a Conv's output
//! shares one group among its other inputs and its output, and requantizes the Sigmoid's.
//! Constant inputs are not observed: convert quantizes their data directly.
//!
//! Calibration runs the float model with [`qforge_runtime::Hooks`] that stream every watched
//! value into its groups' observers. A value of a subgraph read from an enclosing graph is
//! watched where it is defined. A group whose one observed value is a monotone map of a value
//! another group observes alone (`x + 3`, `clip(x, 0, 6)`, `0.4 * x`: see [`monotone_input`])
//! is not watched: its state is derived from that group's after calibration, which then does
//! not read the gate `clip(x + 3, 0, 6)` of a hardswish written out as Add, Clip, Mul.

use std::collections::{BTreeMap, HashMap, HashSet};

use qforge_ir::{Graph, GraphPath, NodeId, Tensor, ValueId, ValueKind};
use qforge_runtime::{Hooks, ValueEvent};

use crate::annotation::Annotations;
use crate::observer::{Monotone, Observer, Step};
use crate::spec::{Edge, FixedQParams, QuantizationSpec, Spec};
use crate::QType;

/// One observer and one set of qparams, shared by the values of its points.
#[derive(Debug, Clone)]
pub struct Group {
    pub spec: QuantizationSpec,
    pub fixed: Option<FixedQParams>,
    /// `(graph index, value)` of each point.
    pub points: Vec<(usize, ValueId)>,
    pub observer: Observer,
    /// Why the group cannot be quantized, found while calibrating (non-float data).
    pub unusable: Option<String>,
    /// Set when only Softmax reads the group's values: their rows' maxima.
    pub softmax_rows: Option<SoftmaxRows>,
    /// The lowest value worth an integer level, set after calibration by
    /// [`QuantPlan::settle_floors`]: values below it saturate without changing any result.
    pub floor: Option<f32>,
    /// How the state follows from another group's, when it is derived rather than observed
    /// (see [`QuantPlan::derive_observations`]): the map of the observed value, e.g.
    /// `min(max(conv_out + 3, 0), 6)`.
    pub derived: Option<String>,
}

impl Group {
    /// The lower end that [`Group::floor`] gives a range `[lo, hi]`: the floor when it is
    /// above `lo`, or when calibration saw non-finite values (a mask of -inf, which then
    /// saturates at the floor, still out of the way, rather than at the finite minimum);
    /// `None` when it does not apply.
    pub fn floor_for(&self, lo: f32, hi: f32) -> Option<f32> {
        self.floor.filter(|&f| f < hi && (f > lo || self.observer.nonfinite() > 0))
    }
}

/// How far below its row's maximum a Softmax input still matters: `e^-16 ≈ 1.1e-7`, so even
/// thousands of positions further down move no probability by a 16-bit output step.
pub const SOFTMAX_SPAN: f32 = 16.0;

/// The rows a Softmax normalizes over, and the smallest maximum of any row seen in
/// calibration. Inputs more than [`SOFTMAX_SPAN`] below every row's maximum (an attention
/// mask's -10000 or float minimum) need no integer level of their own: the range is floored
/// at `least_row_max - SOFTMAX_SPAN` and they saturate there, where they still weigh nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct SoftmaxRows {
    /// The Softmax's `axis` (negative counts from the end).
    pub axis: i64,
    /// Before opset 13 Softmax flattens its input at `axis`: a row is everything from `axis` on.
    pub flattened: bool,
    /// The smallest finite row maximum seen (`+inf` before any).
    pub least_row_max: f32,
}

impl SoftmaxRows {
    /// The rows of the Softmax that `node` is, at opset `opset`.
    pub fn of(node: &qforge_ir::Node, opset: i64) -> SoftmaxRows {
        let flattened = opset < 13;
        SoftmaxRows { axis: node.attr_int("axis").unwrap_or(if flattened { 1 } else { -1 }), flattened, least_row_max: f32::INFINITY }
    }

    /// Lowers `least_row_max` to the smallest finite row maximum of a tensor (rows without a
    /// finite value are skipped; an axis outside the shape records nothing).
    pub fn observe(&mut self, data: &[f32], shape: &[usize]) {
        let rank = shape.len() as i64;
        let axis = if self.axis < 0 { self.axis + rank } else { self.axis };
        if !(0..rank).contains(&axis) || data.len() != shape.iter().product::<usize>() {
            return;
        }
        let axis = axis as usize;
        let (n, inner) = if self.flattened { (shape[axis..].iter().product(), 1) } else { (shape[axis], shape[axis + 1..].iter().product()) };
        if n == 0 {
            return;
        }
        for row_block in data.chunks(n * inner) {
            for i in 0..inner {
                let max = (0..n).map(|k| row_block[k * inner + i]).filter(|x| x.is_finite()).fold(f32::NEG_INFINITY, f32::max);
                if max.is_finite() {
                    self.least_row_max = self.least_row_max.min(max);
                }
            }
        }
    }

    /// The lowest value worth an integer level: `least_row_max - SOFTMAX_SPAN`.
    pub fn floor(&self) -> Option<f32> {
        self.least_row_max.is_finite().then_some(self.least_row_max - SOFTMAX_SPAN)
    }
}

/// A graph's annotations with its points.
#[derive(Debug, Clone)]
pub struct GraphPlan {
    pub path: GraphPath,
    pub annotations: Annotations,
    /// `(value, integer type)` to group index.
    pub points: BTreeMap<(ValueId, QType), usize>,
}

/// Annotations of all graphs of a model, prepared for calibration and conversion.
#[derive(Debug, Clone)]
pub struct QuantPlan {
    pub graphs: Vec<GraphPlan>,
    pub groups: Vec<Group>,
    /// `(graph index, value)` where a value is produced, to the groups observing it.
    watch: HashMap<(usize, ValueId), Vec<usize>>,
    /// The inputs of multi-input nodes whose output shares their qparams (Concat), to where each
    /// is produced.
    shared_inputs: HashMap<(usize, ValueId), (usize, ValueId)>,
    /// Where the values of `shared_inputs` are produced: their own extremes are kept.
    tracked: HashSet<(usize, ValueId)>,
    /// The observed extremes of each tracked value (see [`QuantPlan::value_extremes`]).
    value_extremes: HashMap<(usize, ValueId), (f32, f32)>,
    /// `(group, source group, map)`: groups not observed, whose state is the source's mapped
    /// (see [`QuantPlan::derive_observations`]).
    derived: Vec<(usize, usize, Monotone)>,
}

fn find(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

/// The spec behind an edge, following shared specs.
pub(crate) fn resolve(a: &Annotations, e: Edge, depth: usize) -> Option<&Spec> {
    match a.spec(e)? {
        Spec::Shared(other) if depth < 64 => resolve(a, *other, depth + 1),
        s => Some(s),
    }
}

pub(crate) fn qtype_of(s: &Spec) -> Option<QType> {
    match s {
        Spec::Quantize(q) => Some(q.scheme.qtype),
        Spec::Fixed(f) => Some(f.scheme.qtype),
        _ => None,
    }
}

/// The value an edge carries.
pub fn edge_value(g: &Graph, e: Edge) -> Option<ValueId> {
    match e {
        Edge::Input { node, index } => g.node(node).ok()?.input(index),
        Edge::Output { node, index } => g.node(node).ok()?.output(index),
    }
}

impl QuantPlan {
    /// Builds groups from the annotations of every graph (`annotated[i]` belongs to
    /// `model_graph.graphs()[i]`) of a model at default-domain opset `opset`.
    pub fn new(main: &Graph, annotated: Vec<Annotations>, opset: i64) -> QuantPlan {
        let all = main.graphs();
        // Points: (graph, value, type) with the spec that defines them and whether it is the producer's.
        let mut ids: BTreeMap<(usize, ValueId, QType), usize> = BTreeMap::new();
        let mut specs: Vec<(Spec, bool)> = vec![];
        // (sharing point, shared point, the edge shared with) per Shared spec.
        let mut unions: Vec<(usize, usize, (usize, Edge))> = vec![];
        // Per node with a shared output: the points of its quantized inputs and of those outputs.
        let mut sharing_nodes: Vec<(Vec<usize>, Vec<usize>)> = vec![];
        // The inputs of Concat-like nodes, to where each is produced: their own extremes are kept.
        let mut shared_inputs = HashMap::new();
        for (gi, ((_, g), a)) in all.iter().zip(&annotated).enumerate() {
            let point = |e: Edge, ids: &mut BTreeMap<_, usize>, specs: &mut Vec<(Spec, bool)>| -> Option<usize> {
                let v = edge_value(g, e)?;
                if g.value(v).ok()?.is_constant() {
                    return None;
                }
                let spec = resolve(a, e, 0)?;
                let qt = qtype_of(spec)?;
                let is_output = matches!(e, Edge::Output { .. });
                let id = *ids.entry((gi, v, qt)).or_insert_with(|| {
                    specs.push((spec.clone(), is_output));
                    specs.len() - 1
                });
                if is_output && !specs[id].1 {
                    specs[id] = (spec.clone(), true);
                }
                Some(id)
            };
            for (&n, ann) in &a.nodes {
                let inputs = ann.inputs.iter().enumerate().map(|(i, s)| (Edge::Input { node: n, index: i }, s));
                let outputs = ann.outputs.iter().enumerate().map(|(k, s)| (Edge::Output { node: n, index: k }, s));
                let (mut ins, mut shared_outs) = (vec![], vec![]);
                for (e, s) in inputs.chain(outputs) {
                    let Some(s) = s else { continue };
                    let Some(p) = point(e, &mut ids, &mut specs) else { continue };
                    match e {
                        Edge::Input { .. } => ins.push(p),
                        Edge::Output { .. } if matches!(s, Spec::Shared(_)) => shared_outs.push(p),
                        Edge::Output { .. } => {}
                    }
                    if let Spec::Shared(other) = s {
                        if let Some(q) = point(*other, &mut ids, &mut specs) {
                            unions.push((p, q, (gi, *other)));
                        }
                    }
                }
                if !shared_outs.is_empty() {
                    sharing_nodes.push((ins, shared_outs));
                }
                for v in concat_inputs(g, a, n).unwrap_or_default() {
                    if let Some(at) = defining_value(&all, gi, v) {
                        shared_inputs.insert((gi, v), at);
                    }
                }
            }
        }
        let mut parent = share(&specs, &unions, &sharing_nodes);
        let mut group_of_root: BTreeMap<usize, usize> = BTreeMap::new();
        let mut groups: Vec<Group> = vec![];
        let mut plans: Vec<GraphPlan> = all.iter().zip(annotated).map(|((path, _), a)| GraphPlan { path: path.clone(), annotations: a, points: BTreeMap::new() }).collect();
        for (&(gi, v, qt), &p) in &ids {
            let root = find(&mut parent, p);
            let gid = *group_of_root.entry(root).or_insert_with(|| {
                let (spec, fixed) = match &specs[root].0 {
                    Spec::Quantize(q) => (q.clone(), None),
                    Spec::Fixed(f) => (QuantizationSpec { scheme: f.scheme, granularity: crate::spec::Granularity::PerTensor, observer: crate::spec::ObserverKind::MinMax, scale_min: None, pair_sum_max: None }, Some(f.clone())),
                    _ => unreachable!("points are made from quantize and fixed specs"),
                };
                groups.push(Group { observer: Observer::new(&spec.observer), spec, fixed, points: vec![], unusable: None, softmax_rows: None, floor: None, derived: None });
                groups.len() - 1
            });
            if let Spec::Fixed(f) = &specs[p].0 {
                groups[gid].fixed.get_or_insert_with(|| f.clone());
            }
            groups[gid].points.push((gi, v));
            plans[gi].points.insert((v, qt), gid);
        }
        for grp in &mut groups {
            grp.softmax_rows = softmax_rows(&all, &grp.points, opset);
        }
        let derived = derived_groups(&all, &groups, &plans);
        for (gid, src, f) in &derived {
            let (gi, v) = observed_points(&all, &groups[*src])[0];
            groups[*gid].derived = Some(f.describe(all[gi].1.value(v).map_or("?", |x| x.name.as_str())));
        }
        // Watch each point where its value is produced.
        let mut watch: HashMap<(usize, ValueId), Vec<usize>> = HashMap::new();
        for (gid, grp) in groups.iter().enumerate() {
            if derived.iter().any(|&(d, _, _)| d == gid) {
                continue;
            }
            for (gi, v) in observed_points(&all, grp) {
                if let Some(at) = defining_value(&all, gi, v) {
                    let e = watch.entry(at).or_default();
                    if !e.contains(&gid) {
                        e.push(gid);
                    }
                }
            }
        }
        let tracked = shared_inputs.values().copied().collect();
        QuantPlan { graphs: plans, groups, watch, shared_inputs, tracked, value_extremes: HashMap::new(), derived }
    }

    /// Gives each derived group the state its source reached, mapped ([`Observer::mapped`]):
    /// what observing the group's own values would have given, exactly for the extremes, on
    /// the source's bins carried through the map for a histogram. Run once after calibration.
    pub fn derive_observations(&mut self) {
        for (gid, src, f) in &self.derived {
            if let Some(observer) = self.groups[*src].observer.mapped(f) {
                self.groups[*gid].unusable = self.groups[*src].unusable.clone();
                self.groups[*gid].observer = observer;
            }
        }
    }

    /// The values of the main graph that [`QuantPlan::calibrator`] reads: the observed ones and
    /// the tracked inputs of shared-qparams nodes.
    pub fn main_graph_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        let main = self.graphs.iter().position(|g| g.path.is_empty());
        self.watch.keys().chain(&self.tracked).filter(move |(gi, _)| Some(*gi) == main).map(|&(_, v)| v)
    }

    /// Hooks that stream watched values into the observers.
    pub fn calibrator(&mut self) -> Calibrator<'_> {
        Calibrator { plan: self }
    }

    /// Whether every observer's state merges exactly (no moving average), so samples may be
    /// calibrated in any split and merged with [`QuantPlan::merge_observations`].
    pub fn mergeable(&self) -> bool {
        !self.groups.iter().any(|g| matches!(g.observer, Observer::MovingAverage { .. }))
    }

    /// Adds the observations of `other`, a clone of this plan calibrated on other samples.
    pub fn merge_observations(&mut self, other: &QuantPlan) -> Result<(), String> {
        for (mine, theirs) in self.groups.iter_mut().zip(&other.groups) {
            mine.observer.merge(&theirs.observer)?;
            if let (Some(m), Some(t)) = (&mut mine.softmax_rows, &theirs.softmax_rows) {
                m.least_row_max = m.least_row_max.min(t.least_row_max);
            }
            if mine.unusable.is_none() {
                mine.unusable.clone_from(&theirs.unusable);
            }
        }
        for (&at, &range) in &other.value_extremes {
            widen(&mut self.value_extremes, at, range);
        }
        Ok(())
    }

    /// Sets each group's [`Group::floor`] from calibration:
    /// * a Softmax input: [`SoftmaxRows::floor`], `SOFTMAX_SPAN` below every row's maximum;
    /// * a value every reader of which passes a floor back ([`floor_through`]): an Add into a
    ///   floored sum (an attention mask added to the scores) or an op that only moves or casts
    ///   values into a floored output, followed to a fixed point.
    ///
    /// Below its floor a value saturates without changing any result. Without floors a mask
    /// of the float minimum gets a scale whose ratio to the sum's overflows the integer Add of
    /// ONNX Runtime and qforge, and a mask of -inf saturates at its finite range's lower end,
    /// 0, which unmasks it.
    pub fn settle_floors(&mut self, main: &Graph) {
        let all = main.graphs();
        let mut floors: Vec<Option<f32>> = self.groups.iter().map(|g| g.softmax_rows.as_ref().and_then(SoftmaxRows::floor)).collect();
        let group_at = |gi: usize, v: ValueId| self.graphs[gi].points.range((v, QType::U4)..=(v, QType::S32)).map(|(_, &gid)| gid).next();
        for _ in 0..self.groups.len() {
            let mut changed = false;
            for (gid, grp) in self.groups.iter().enumerate() {
                if grp.softmax_rows.is_some() || grp.fixed.is_some() {
                    continue;
                }
                let floor = floor_through(&all, &grp.points, gid, &group_at, &floors, &self.groups);
                if floor != floors[gid] {
                    floors[gid] = floor;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        for (grp, floor) in self.groups.iter_mut().zip(floors) {
            grp.floor = floor;
        }
    }

    /// The observed extremes of value `v` of graph `gi` on its own, for an input of a node
    /// whose output shares its qparams (`None` for other values, or when no finite value
    /// reached it).
    pub fn value_extremes(&self, gi: usize, v: ValueId) -> Option<(f32, f32)> {
        self.value_extremes.get(self.shared_inputs.get(&(gi, v))?).copied()
    }

    /// The graph index of a hook event's path.
    fn graph_index(&self, path: &[(NodeId, &str)]) -> Option<usize> {
        self.graphs.iter().position(|g| g.path.len() == path.len() && g.path.iter().zip(path).all(|(a, b)| a.0 == b.0 && a.1 == b.1))
    }
}

/// Union-find parents of the points after sharing. Each share `(a, b, target)` joins point
/// `a` to point `b`, unless that would put values of other ranges under fixed qparams:
/// * a point has fixed qparams when its spec is fixed, or when it is the shared output of a node
///   whose quantized inputs all have the same fixed qparams (a Reshape of a Sigmoid's output);
/// * a point without fixed qparams that shares with a fixed one joins, instead, the first other
///   point that shared with the same edge (a Concat's output and its other inputs form one group
///   when one input is a Sigmoid's output, which the Concat then requantizes);
/// * a fixed point that shares with a point of other qparams keeps its own.
fn share(specs: &[(Spec, bool)], unions: &[(usize, usize, (usize, Edge))], sharing_nodes: &[(Vec<usize>, Vec<usize>)]) -> Vec<usize> {
    let mut fixed: Vec<Option<FixedQParams>> = specs.iter().map(|(s, _)| if let Spec::Fixed(f) = s { Some(f.clone()) } else { None }).collect();
    loop {
        let mut changed = false;
        for (ins, outs) in sharing_nodes {
            let Some(first) = ins.first().and_then(|&p| fixed[p].clone()) else { continue };
            if ins.iter().all(|&p| fixed[p].as_ref() == Some(&first)) {
                for &o in outs {
                    if fixed[o].is_none() {
                        fixed[o] = Some(first.clone());
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    let mut parent: Vec<usize> = (0..specs.len()).collect();
    let mut instead: HashMap<(usize, Edge), usize> = HashMap::new();
    for &(a, b, target) in unions {
        let b = match (&fixed[a], &fixed[b]) {
            (fa, fb) if fa == fb => b,
            (None, Some(_)) => *instead.entry(target).or_insert(a),
            _ => continue,
        };
        let (ra, rb) = (find(&mut parent, a), find(&mut parent, b));
        if ra != rb {
            // The root keeps a producer-defined spec when either side has one.
            let (keep, drop) = if specs[rb].1 && !specs[ra].1 { (rb, ra) } else { (ra, rb) };
            parent[drop] = keep;
        }
    }
    parent
}

/// The groups whose state follows from another group's, as `(group, source, map)`: the group
/// observes one value, computed by [`monotone_input`] ops (through members of its own that it
/// does not observe, as a Clip's input) from a value of the same graph that a group of the same
/// observer kind observes alone (or whose state is itself derived, the maps then composed),
/// and the state carries over that map ([`Observer::mapped`]). A derived group is not
/// observed: calibration reads the source once instead of both.
fn derived_groups(all: &[(GraphPath, &Graph)], groups: &[Group], plans: &[GraphPlan]) -> Vec<(usize, usize, Monotone)> {
    // The one value whose data a group's observer sees.
    let observed_alone = |gid: usize| -> Option<(usize, ValueId)> {
        let grp = &groups[gid];
        match observed_points(all, grp)[..] {
            [point] if grp.softmax_rows.is_none() => Some(point),
            _ => None,
        }
    };
    let direct: Vec<Option<(usize, Monotone)>> = (0..groups.len()).map(|gid| {
        let (gi, mut v) = observed_alone(gid)?;
        let g = all[gi].1;
        // Back through the maps whose inputs the group holds itself (a Clip's input, clamped
        // to the group's range and so not observed), to an input of another group.
        let mut f = Monotone::default();
        for _ in 0..=groups[gid].points.len() {
            let (producer, _) = g.value(v).ok()?.producer()?;
            let (x, step) = monotone_input(g, g.node(producer).ok()?)?;
            f = step.then(&f);
            if g.value(x).ok()?.kind() == ValueKind::Outer {
                return None;
            }
            if !groups[gid].points.contains(&(gi, x)) {
                let observes_x = |s: usize| s != gid && observed_alone(s) == Some((gi, x)) && groups[s].spec.observer == groups[gid].spec.observer;
                let src = plans[gi].points.range((x, QType::U4)..=(x, QType::S32)).map(|(_, &s)| s).find(|&s| observes_x(s))?;
                // The kind of state, and the map, carry over (fresh states tell).
                groups[gid].observer.mapped(&f)?;
                return Some((src, f));
            }
            v = x;
        }
        None
    }).collect();
    // Compose each chain down to its observed root; a chain is as long as its graph at most.
    (0..groups.len()).filter_map(|gid| {
        let (mut src, mut f) = direct[gid].clone()?;
        for _ in 0..groups.len() {
            let Some((up, g)) = &direct[src] else { break };
            (src, f) = (*up, g.then(&f));
        }
        Some((gid, src, f))
    }).collect()
}

/// The points of a group whose values its observer sees: all but those read only by a clamp
/// into the group ([`clamped_in_group`]).
fn observed_points(all: &[(GraphPath, &Graph)], grp: &Group) -> Vec<(usize, ValueId)> {
    grp.points.iter().copied().filter(|&(gi, v)| !clamped_in_group(all[gi].1, v, |w| grp.points.contains(&(gi, w)))).collect()
}

/// The one non-constant input of an elementwise op and the monotone map its output is of it,
/// when every other input is a finite float32 scalar constant (any shape of one element, so
/// broadcasting keeps the values of the input):
///
/// | op | map |
/// |---|---|
/// | `Add(x, c)`, `Add(c, x)` | `x + c` |
/// | `Sub(x, c)` | `x + (-c)` |
/// | `Sub(c, x)` | `-x + c` |
/// | `Mul(x, c)`, `Mul(c, x)`, `c ≠ 0` | `x * c` |
/// | `Div(x, c)`, `c ≠ 0` | `x / c` |
/// | `Neg(x)` | `-x` |
/// | `Relu(x)` | `max(x, 0)` |
/// | `Clip(x, lo, hi)` | `min(max(x, lo), hi)`, either bound absent |
/// | `HardSigmoid(x)` | `min(max(x * alpha + beta, 0), 1)` |
pub(crate) fn monotone_input(g: &Graph, node: &qforge_ir::Node) -> Option<(ValueId, Monotone)> {
    use Step::*;
    if !(node.domain.is_empty() || node.domain == "ai.onnx") || node.outputs.len() != 1 {
        return None;
    }
    let variable = |i: usize| node.input(i).filter(|&v| g.value(v).is_ok_and(|x| !x.is_constant()));
    let scalar = |i: usize| -> Option<f32> {
        let t = g.value(node.input(i)?).ok().filter(|v| v.is_constant())?.initializer()?;
        match t.as_slice::<f32>().ok()? {
            [c] if c.is_finite() => Some(*c),
            _ => None,
        }
    };
    let nonzero = |c: f32| (c != 0.0).then_some(c);
    // An optional scalar input: absent, or a constant.
    let bound = |i: usize| -> Option<Option<f32>> { if node.input(i).is_none() { Some(None) } else { scalar(i).map(Some) } };
    let (x, steps) = match (node.op_type.as_str(), node.inputs.len(), variable(0), variable(1)) {
        ("Add", 2, Some(x), None) => (x, vec![Add(scalar(1)?)]),
        ("Add", 2, None, Some(x)) => (x, vec![Add(scalar(0)?)]),
        ("Sub", 2, Some(x), None) => (x, vec![Add(-scalar(1)?)]),
        ("Sub", 2, None, Some(x)) => (x, vec![Neg, Add(scalar(0)?)]),
        ("Mul", 2, Some(x), None) => (x, vec![Mul(nonzero(scalar(1)?)?)]),
        ("Mul", 2, None, Some(x)) => (x, vec![Mul(nonzero(scalar(0)?)?)]),
        ("Div", 2, Some(x), None) => (x, vec![Div(nonzero(scalar(1)?)?)]),
        ("Neg", 1, Some(x), _) => (x, vec![Neg]),
        ("Relu", 1, Some(x), _) => (x, vec![Max(0.0)]),
        ("Clip", 1..=3, Some(x), _) if node.attr("min").is_none() && node.attr("max").is_none() => {
            (x, [bound(1)?.map(Max), bound(2)?.map(Min)].into_iter().flatten().collect())
        }
        ("Clip", 1, Some(x), _) => (x, [node.attr_float("min").map(Max), node.attr_float("max").map(Min)].into_iter().flatten().collect()),
        ("HardSigmoid", 1, Some(x), _) => (x, vec![Mul(nonzero(node.attr_float("alpha").unwrap_or(0.2))?), Add(node.attr_float("beta").unwrap_or(0.5)), Max(0.0), Min(1.0)]),
        _ => return None,
    };
    Some((x, Monotone { steps }))
}

/// Whether `v` is read only by a clamping op (Relu, Clip) whose output is in the same group
/// (`in_group`). Such a value is not observed: the group's range is the clamped range, and
/// quantizing the input to it saturates exactly where the clamp would (ONNX Runtime likewise
/// drops Relu/Clip in front of a QuantizeLinear whose range lies inside the clamp's).
fn clamped_in_group(g: &Graph, v: ValueId, in_group: impl Fn(ValueId) -> bool) -> bool {
    let [(reader, 0)] = g.consumers(v) else { return false };
    !g.is_output(v) && g.node(*reader).is_ok_and(|n| n.domain.is_empty() && matches!(n.op_type.as_str(), "Relu" | "Clip") && n.output(0).is_some_and(&in_group))
}

/// Where a value of graph `gi` is produced: itself, or for an outer value the defining value
/// of an enclosing graph.
pub(crate) fn defining_value(all: &[(GraphPath, &Graph)], gi: usize, v: ValueId) -> Option<(usize, ValueId)> {
    let (path, g) = &all[gi];
    let val = g.value(v).ok()?;
    if val.kind() != ValueKind::Outer {
        return Some((gi, v));
    }
    let parent_path = &path[..path.len().checked_sub(1)?];
    let pi = all.iter().position(|(p, _)| p.as_slice() == parent_path)?;
    let pv = all[pi].1.value_by_name(&val.name)?;
    defining_value(all, pi, pv)
}

/// The quantized non-constant inputs of node `n` when its output shares their qparams and
/// there are at least two of them (a Concat); `None` otherwise.
pub(crate) fn concat_inputs(g: &Graph, a: &Annotations, n: NodeId) -> Option<Vec<ValueId>> {
    let ann = a.get(n)?;
    if !ann.outputs.iter().any(|s| matches!(s, Some(Spec::Shared(_)))) {
        return None;
    }
    let inputs: Vec<ValueId> = ann.inputs.iter().enumerate().filter(|(_, s)| s.is_some())
        .filter_map(|(i, _)| edge_value(g, Edge::Input { node: n, index: i }))
        .filter(|&v| !g.value(v).is_ok_and(|x| x.is_constant())).collect();
    (inputs.len() >= 2).then_some(inputs)
}

/// The rows of the Softmax nodes that are the only readers of every point, when they all
/// normalize the same way.
fn softmax_rows(all: &[(GraphPath, &Graph)], points: &[(usize, ValueId)], opset: i64) -> Option<SoftmaxRows> {
    let mut rows: Option<SoftmaxRows> = None;
    for &(gi, v) in points {
        let g = all.get(gi)?.1;
        if g.is_output(v) || g.consumers(v).is_empty() {
            return None;
        }
        for &(n, _) in g.consumers(v) {
            let node = g.node(n).ok()?;
            if node.op_type != "Softmax" || !node.domain.is_empty() {
                return None;
            }
            let these = SoftmaxRows::of(node, opset);
            match &rows {
                Some(r) if (r.axis, r.flattened) != (these.axis, these.flattened) => return None,
                Some(_) => {}
                None => rows = Some(these),
            }
        }
    }
    rows
}

/// Ops whose output holds values of their first input (or, for Concat, of every input),
/// moved or cast: a floor on the output holds for those inputs too (as for Where's two value
/// inputs).
const FLOOR_PASSING: &[&str] = &["Identity", "Cast", "CastLike", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Tile", "Slice", "Gather", "Concat"];

/// The floor of a group whose every reader passes one back, the lowest of them:
/// * an Add with output floor `F` gives `F - hi`, for the largest value `hi` of its other
///   input (a constant, or a group's observed maximum);
/// * a [`FLOOR_PASSING`] op, or Where's value inputs, give their output's floor;
/// * a reader of only the type or shape (Shape, Size, CastLike's second input), or one whose
///   outputs are all in the group itself (shared data movement), gives none.
///
/// `None` when any reader is another op (a ReduceMax that looks for fully masked rows), an
/// output has no floor, or a value is a graph output.
fn floor_through(all: &[(GraphPath, &Graph)], points: &[(usize, ValueId)], gid: usize, group_at: &dyn Fn(usize, ValueId) -> Option<usize>, floors: &[Option<f32>], groups: &[Group]) -> Option<f32> {
    let mut floor: Option<f32> = None;
    for &(gi, v) in points {
        let g = all.get(gi)?.1;
        if g.is_output(v) {
            return None;
        }
        for &(n, i) in g.consumers(v) {
            let node = g.node(n).ok()?;
            let metadata_only = matches!((node.op_type.as_str(), i), ("Shape" | "Size", _) | ("CastLike", 1));
            if metadata_only || (!node.outputs.is_empty() && node.outputs.iter().flatten().all(|&w| group_at(gi, w) == Some(gid))) {
                continue;
            }
            if !node.domain.is_empty() {
                return None;
            }
            let out_floor = floors[group_at(gi, node.output(0)?)?]?;
            let this = match node.op_type.as_str() {
                "Add" if node.inputs.len() == 2 => {
                    let u = node.input(1 - i.min(1))?;
                    let hi = match g.value(u).ok()?.initializer() {
                        Some(t) => t.as_slice::<f32>().ok()?.iter().copied().filter(|x| x.is_finite()).reduce(f32::max)?,
                        None => groups[group_at(gi, u)?].observer.extremes()?.1,
                    };
                    out_floor - hi
                }
                op if FLOOR_PASSING.contains(&op) && (i == 0 || op == "Concat") => out_floor,
                // Where(condition, x, y): x and y pass through.
                "Where" if i > 0 => out_floor,
                _ => return None,
            };
            floor = Some(floor.map_or(this, |f| f.min(this)));
        }
    }
    floor
}

/// Widens the extremes recorded for `at` to include `[lo, hi]`.
fn widen(extremes: &mut HashMap<(usize, ValueId), (f32, f32)>, at: (usize, ValueId), (lo, hi): (f32, f32)) {
    let e = extremes.entry(at).or_insert((lo, hi));
    *e = (e.0.min(lo), e.1.max(hi));
}

/// Calibration hooks: each watched value is observed by its groups.
pub struct Calibrator<'a> {
    plan: &'a mut QuantPlan,
}

impl Hooks for Calibrator<'_> {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let gi = self.plan.graph_index(event.path)?;
        if self.plan.tracked.contains(&(gi, event.value)) {
            if let Some((lo, hi, _)) = value.as_slice::<f32>().ok().map(crate::observer::finite_extremes).filter(|(lo, hi, _)| lo <= hi) {
                widen(&mut self.plan.value_extremes, (gi, event.value), (lo, hi));
            }
        }
        let groups = self.plan.watch.get(&(gi, event.value))?;
        for &gid in groups {
            let g = &mut self.plan.groups[gid];
            match value.as_slice::<f32>() {
                Ok(data) => {
                    g.observer.observe(data);
                    if let Some(rows) = &mut g.softmax_rows {
                        rows.observe(data, value.shape());
                    }
                }
                Err(_) => {
                    g.unusable.get_or_insert_with(|| format!("value '{}' holds {} data, not float32", event.name, value.dtype()));
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each op of [`monotone_input`]'s table on `x` and scalar constants gives its map; other
    /// operands give none.
    #[test]
    fn monotone_inputs_read_the_op_table() {
        use qforge_ir::{Attr, Node};
        use Step::*;
        let mut g = Graph::new("g");
        let x = g.add_input("x", None).unwrap();
        let y = g.add_input("y", None).unwrap();
        let c = g.add_initializer("c", Tensor::from_vec(&[1, 1], vec![2.5f32]).unwrap()).unwrap();
        let zero = g.add_initializer("zero", Tensor::scalar(0.0f32)).unwrap();
        let pair = g.add_initializer("pair", Tensor::from_vec(&[2], vec![1.0f32, 2.0]).unwrap()).unwrap();
        let int = g.add_initializer("int", Tensor::scalar(3i64)).unwrap();
        let node = |op: &str, inputs: &[Option<ValueId>], attrs: &[(&str, f32)]| {
            let mut n = Node::new(op, op);
            n.inputs = inputs.to_vec();
            n.outputs = vec![None];
            for &(a, v) in attrs {
                n = n.with_attr(a, Attr::Float(v));
            }
            monotone_input(&g, &n).map(|(v, f)| (v, f.steps))
        };
        let (x_, c_, y_) = (Some(x), Some(c), Some(y));
        assert_eq!(node("Add", &[x_, c_], &[]), Some((x, vec![Add(2.5)])));
        assert_eq!(node("Add", &[c_, x_], &[]), Some((x, vec![Add(2.5)])));
        assert_eq!(node("Sub", &[x_, c_], &[]), Some((x, vec![Add(-2.5)])));
        assert_eq!(node("Sub", &[c_, x_], &[]), Some((x, vec![Neg, Add(2.5)])));
        assert_eq!(node("Mul", &[c_, x_], &[]), Some((x, vec![Mul(2.5)])));
        assert_eq!(node("Div", &[x_, c_], &[]), Some((x, vec![Div(2.5)])));
        assert_eq!(node("Neg", &[x_], &[]), Some((x, vec![Neg])));
        assert_eq!(node("Relu", &[x_], &[]), Some((x, vec![Max(0.0)])));
        assert_eq!(node("Clip", &[x_, Some(zero), c_], &[]), Some((x, vec![Max(0.0), Min(2.5)])));
        assert_eq!(node("Clip", &[x_, None, c_], &[]), Some((x, vec![Min(2.5)])));
        assert_eq!(node("Clip", &[x_], &[("min", -1.0), ("max", 1.0)]), Some((x, vec![Max(-1.0), Min(1.0)])));
        assert_eq!(node("HardSigmoid", &[x_], &[("alpha", 0.25)]), Some((x, vec![Mul(0.25), Add(0.5), Max(0.0), Min(1.0)])));
        // Not a monotone map of one input: a constant over x, two inputs, a zero factor, a
        // vector, an integer, or a clamp bound that is not a constant.
        for (op, inputs) in [("Div", vec![c_, x_]), ("Add", vec![x_, y_]), ("Mul", vec![x_, Some(zero)]), ("Add", vec![x_, Some(pair)]), ("Add", vec![x_, Some(int)]), ("Clip", vec![x_, y_, c_])] {
            assert_eq!(node(op, &inputs, &[]), None, "{op} {inputs:?}");
        }
    }

    #[test]
    fn softmax_rows_follow_the_axis_and_the_pre_13_flattening() {
        // x[a][b][c] = 100a + 10b + c over [2, 3, 4], one masked value.
        let mut data: Vec<f32> = (0..24).map(|i| (100 * (i / 12) + 10 * (i / 4 % 3) + i % 4) as f32).collect();
        data[3] = f32::NEG_INFINITY;
        let least = |axis: i64, flattened: bool| {
            let mut rows = SoftmaxRows { axis, flattened, least_row_max: f32::INFINITY };
            rows.observe(&data, &[2, 3, 4]);
            rows.least_row_max
        };
        // Rows along c: the first row's finite maximum is x[0][0][2] = 2.
        assert_eq!(least(-1, false), 2.0);
        assert_eq!(least(2, false), 2.0);
        // Rows along b: max over b of x[0][b][0] is 20.
        assert_eq!(least(1, false), 20.0);
        // Before opset 13, axis 1 flattens [3, 4] into one row per a: 23 for a = 0.
        assert_eq!(least(1, true), 23.0);
        // An axis outside the shape records nothing.
        assert_eq!(least(3, false), f32::INFINITY);
        let rows = SoftmaxRows { axis: -1, flattened: false, least_row_max: 2.0 };
        assert_eq!(rows.floor(), Some(2.0 - SOFTMAX_SPAN));
    }
}
