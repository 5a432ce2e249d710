use crate::{Attribute, Graph};

/// An operator set a model or function imports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpsetImport {
    /// `""` (or `"ai.onnx"`) is the default ONNX domain.
    pub domain: String,
    pub version: i64,
}

/// A model-local function: ONNX `FunctionProto`. The body is a graph whose inputs and outputs
/// are the function's formal parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub domain: String,
    pub overload: String,
    pub doc_string: String,
    pub opset_imports: Vec<OpsetImport>,
    /// Attribute names without defaults.
    pub attribute_names: Vec<String>,
    /// Attributes with default values.
    pub attribute_defaults: Vec<Attribute>,
    pub body: Graph,
    pub metadata_props: Vec<(String, String)>,
}

/// A model: a main graph and the model-level fields of ONNX `ModelProto`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Model {
    pub ir_version: i64,
    pub opset_imports: Vec<OpsetImport>,
    pub producer_name: String,
    pub producer_version: String,
    pub domain: String,
    pub model_version: i64,
    pub doc_string: String,
    pub metadata_props: Vec<(String, String)>,
    pub functions: Vec<Function>,
    pub graph: Graph,
    /// Encoded `ModelProto` fields the IR does not model (training info, ...), kept for round trips.
    pub extra: Vec<u8>,
}

impl Model {
    /// The imported version of an operator domain (`""` and `"ai.onnx"` are the same domain).
    pub fn opset(&self, domain: &str) -> Option<i64> {
        let norm = |d: &str| if d == "ai.onnx" { "" } else { d }.to_string();
        self.opset_imports.iter().find(|o| norm(&o.domain) == norm(domain)).map(|o| o.version)
    }
}
