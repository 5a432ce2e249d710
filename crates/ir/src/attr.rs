use crate::{Graph, Tensor, ValueType};

/// A node attribute value: ONNX `AttributeProto`, by type.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Float(f32),
    Int(i64),
    String(Vec<u8>),
    Tensor(Tensor),
    Graph(Box<Graph>),
    /// A sparse tensor, kept as its encoded `SparseTensorProto` bytes.
    SparseTensor(Vec<u8>),
    Type(ValueType),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<Vec<u8>>),
    Tensors(Vec<Tensor>),
    Graphs(Vec<Graph>),
    SparseTensors(Vec<Vec<u8>>),
    Types(Vec<ValueType>),
}

/// A named attribute. `ref_attr_name` is set inside function bodies for attributes that take
/// the value of the calling node's attribute; `value` then only carries the declared type.
#[derive(Debug, Clone, PartialEq)]
pub struct Attribute {
    pub name: String,
    pub value: Attr,
    pub doc_string: String,
    pub ref_attr_name: Option<String>,
}

impl Attribute {
    pub fn new(name: impl Into<String>, value: Attr) -> Attribute {
        Attribute { name: name.into(), value, doc_string: String::new(), ref_attr_name: None }
    }
}

impl Attr {
    /// The ONNX `AttributeType` name, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Attr::Float(_) => "FLOAT",
            Attr::Int(_) => "INT",
            Attr::String(_) => "STRING",
            Attr::Tensor(_) => "TENSOR",
            Attr::Graph(_) => "GRAPH",
            Attr::SparseTensor(_) => "SPARSE_TENSOR",
            Attr::Type(_) => "TYPE_PROTO",
            Attr::Floats(_) => "FLOATS",
            Attr::Ints(_) => "INTS",
            Attr::Strings(_) => "STRINGS",
            Attr::Tensors(_) => "TENSORS",
            Attr::Graphs(_) => "GRAPHS",
            Attr::SparseTensors(_) => "SPARSE_TENSORS",
            Attr::Types(_) => "TYPE_PROTOS",
        }
    }

    /// The subgraphs held by this attribute.
    pub fn graphs(&self) -> Vec<&Graph> {
        match self {
            Attr::Graph(g) => vec![g],
            Attr::Graphs(gs) => gs.iter().collect(),
            _ => vec![],
        }
    }

    pub fn graphs_mut(&mut self) -> Vec<&mut Graph> {
        match self {
            Attr::Graph(g) => vec![g],
            Attr::Graphs(gs) => gs.iter_mut().collect(),
            _ => vec![],
        }
    }
}
