//! Hooks: see (and optionally replace) every value a run produces.

use qforge_ir::{NodeId, Tensor, ValueId};

/// Where a value comes from.
#[derive(Debug, Clone, Copy)]
pub struct ValueEvent<'a> {
    /// The producing node; `None` for graph inputs.
    pub node: Option<NodeId>,
    /// The output index on the node (the input index for graph inputs).
    pub output: usize,
    pub value: ValueId,
    pub name: &'a str,
    /// `(node, graph attribute)` steps from the main graph to the graph holding the value
    /// (empty for the main graph); ids are those of the graph at each step.
    pub path: &'a [(NodeId, &'static str)],
}

/// A node about to run.
#[derive(Debug, Clone, Copy)]
pub struct NodeEvent<'a> {
    pub node: NodeId,
    /// The path of the node's graph, as in [`ValueEvent::path`].
    pub path: &'a [(NodeId, &'static str)],
}

/// Called for every tensor value as it is produced (graph inputs first), with a borrowed view
/// of the tensor: values of the main graph, and values inside If/Loop bodies each time the
/// body runs (with their graph's path). Returning `Some` replaces the value for every later
/// reader and for the graph outputs; that is how fake quantization runs. Constants folded when
/// the session was planned are not reported, nor are sequences and optionals (a tensor taken
/// out of one, e.g. by `SequenceAt`, is).
pub trait Hooks: Send {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor>;

    /// Called before a node runs. `Some(outputs)` (one entry per declared output) skips the
    /// node's kernel: a `Some` output is used as if computed (and reported to
    /// [`Hooks::on_value`]), a `None` output is left uncomputed, so a node that later reads it
    /// fails. The default supplies nothing.
    fn supply(&mut self, _event: &NodeEvent) -> Option<Vec<Option<Tensor>>> {
        None
    }
}
