//! `ModelProto` -> [`Model`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use prost::bytes::Bytes;
use prost::Message;
use qforge_ir::{Attr, Attribute, Function, Graph, IrError, Model, Node, OpsetImport, Tensor, ValueKind};

use crate::proto::{self, attribute_proto::AttributeType};
use crate::tensor::{from_proto as tensor_from_proto, TensorSource};
use crate::{types, OnnxError};

/// Limits applied while loading.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The largest single tensor accepted, in bytes.
    pub max_tensor_bytes: u64,
    /// The most bytes all tensors together may take.
    pub max_total_bytes: u64,
    /// The deepest nesting of subgraphs accepted.
    pub max_subgraph_depth: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { max_tensor_bytes: 16 << 30, max_total_bytes: 64 << 30, max_subgraph_depth: 32 }
    }
}

/// Loads a model file, with external data from its folder.
pub fn load(path: &Path) -> Result<Model, OnnxError> {
    load_with_options(path, &LoadOptions::default())
}

/// [`load`] with explicit limits.
pub fn load_with_options(path: &Path, opts: &LoadOptions) -> Result<Model, OnnxError> {
    let io = |source| OnnxError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.is_dir() {
        return Err(OnnxError::Invalid { path: path.to_path_buf(), what: "is a directory, not a model file".into() });
    }
    // SAFETY: read-only map of a file we only read from; see TensorSource::external.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let base = path.parent().map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p });
    // Tensor bytes decode as slices of the map, not copies.
    decode(Bytes::from_owner(map), path, base, opts)
}

/// Loads a model from bytes. External data is resolved against `base_dir` (and refused
/// without one).
pub fn load_bytes(bytes: &[u8], base_dir: Option<&Path>) -> Result<Model, OnnxError> {
    decode(Bytes::copy_from_slice(bytes), Path::new("<bytes>"), base_dir, &LoadOptions::default())
}

fn decode(bytes: Bytes, path: &Path, base_dir: Option<&Path>, opts: &LoadOptions) -> Result<Model, OnnxError> {
    let mp = proto::ModelProto::decode(bytes).map_err(|e| OnnxError::Decode { path: path.to_path_buf(), reason: e.to_string() })?;
    if mp.graph.is_none() {
        return Err(OnnxError::Decode { path: path.to_path_buf(), reason: "it has no graph".into() });
    }
    let mut l = Loader {
        path: path.to_path_buf(),
        src: TensorSource { path, base_dir, max_tensor_bytes: opts.max_tensor_bytes, budget: opts.max_total_bytes, mmaps: HashMap::new() },
        max_depth: opts.max_subgraph_depth,
    };
    l.model(mp)
}

struct Loader<'a> {
    path: PathBuf,
    src: TensorSource<'a>,
    max_depth: usize,
}

fn opsets(v: &[proto::OperatorSetIdProto]) -> Vec<OpsetImport> {
    v.iter().map(|o| OpsetImport { domain: o.domain.clone().unwrap_or_default(), version: o.version.unwrap_or(0) }).collect()
}

fn props(v: &[proto::StringStringEntryProto]) -> Vec<(String, String)> {
    v.iter().map(|p| (p.key.clone().unwrap_or_default(), p.value.clone().unwrap_or_default())).collect()
}

/// How a graph resolves names it does not define.
#[derive(Clone, Copy, PartialEq)]
enum Scope {
    /// The main graph or a function body: undefined names are errors.
    Closed,
    /// A subgraph: undefined names are read from enclosing graphs.
    Nested,
}

impl Loader<'_> {
    fn invalid(&self, what: String) -> OnnxError {
        OnnxError::Invalid { path: self.path.clone(), what }
    }

    fn ir(&self, source: IrError) -> OnnxError {
        OnnxError::Ir { path: self.path.clone(), source }
    }

    fn model(&mut self, mut mp: proto::ModelProto) -> Result<Model, OnnxError> {
        let gp = mp.graph.take().expect("checked by decode");
        let graph = self.graph(&gp, 0, Scope::Closed)?;
        let functions = mp.functions.iter().map(|f| self.function(f)).collect::<Result<_, _>>()?;
        let extra = proto::ModelProto {
            training_info: std::mem::take(&mut mp.training_info),
            configuration: std::mem::take(&mut mp.configuration),
            ..Default::default()
        };
        Ok(Model {
            ir_version: mp.ir_version.unwrap_or(0),
            opset_imports: opsets(&mp.opset_import),
            producer_name: mp.producer_name.unwrap_or_default(),
            producer_version: mp.producer_version.unwrap_or_default(),
            domain: mp.domain.unwrap_or_default(),
            model_version: mp.model_version.unwrap_or(0),
            doc_string: mp.doc_string.unwrap_or_default(),
            metadata_props: props(&mp.metadata_props),
            functions,
            graph,
            extra: if extra == proto::ModelProto::default() { vec![] } else { extra.encode_to_vec() },
        })
    }

    fn function(&mut self, f: &proto::FunctionProto) -> Result<Function, OnnxError> {
        let name = f.name.clone().unwrap_or_default();
        let gp = proto::GraphProto {
            node: f.node.clone(),
            name: Some(name.clone()),
            input: f.input.iter().map(|n| proto::ValueInfoProto { name: Some(n.clone()), ..Default::default() }).collect(),
            output: f.output.iter().map(|n| proto::ValueInfoProto { name: Some(n.clone()), ..Default::default() }).collect(),
            value_info: f.value_info.clone(),
            ..Default::default()
        };
        let body = self.graph(&gp, 0, Scope::Closed).map_err(|e| match e {
            OnnxError::Invalid { path, what } => OnnxError::Invalid { path, what: format!("function '{name}': {what}") },
            e => e,
        })?;
        Ok(Function {
            name,
            domain: f.domain.clone().unwrap_or_default(),
            overload: f.overload.clone().unwrap_or_default(),
            doc_string: f.doc_string.clone().unwrap_or_default(),
            opset_imports: opsets(&f.opset_import),
            attribute_names: f.attribute.clone(),
            attribute_defaults: f.attribute_proto.iter().map(|a| self.attribute(a, 0)).collect::<Result<_, _>>()?,
            body,
            metadata_props: props(&f.metadata_props),
        })
    }

    fn graph(&mut self, gp: &proto::GraphProto, depth: usize, scope: Scope) -> Result<Graph, OnnxError> {
        if depth > self.max_depth {
            return Err(self.invalid(format!("subgraphs are nested more than {} levels deep", self.max_depth)));
        }
        let gname = gp.name.clone().unwrap_or_default();
        let mut g = Graph::new(gname.clone());
        g.doc_string = gp.doc_string.clone().unwrap_or_default();
        g.metadata_props = props(&gp.metadata_props);
        let path = self.path.clone();
        let dup = |name: &str| OnnxError::Invalid { path: path.clone(), what: format!("graph '{gname}': value '{name}' is defined more than once") };
        for (i, vi) in gp.input.iter().enumerate() {
            let name = vi.name.clone().unwrap_or_default();
            if name.is_empty() {
                return Err(self.invalid(format!("graph '{gname}': input #{i} has no name")));
            }
            let id = g.add_input(name.clone(), vi.r#type.as_ref().and_then(types::from_proto)).map_err(|_| dup(&name))?;
            let v = g.value_mut(id).map_err(|e| self.ir(e))?;
            v.doc_string = vi.doc_string.clone().unwrap_or_default();
            v.metadata_props = props(&vi.metadata_props);
        }
        for (i, tp) in gp.initializer.iter().enumerate() {
            let name = tp.name.clone().unwrap_or_default();
            if name.is_empty() {
                return Err(self.invalid(format!("graph '{gname}': initializer #{i} has no name")));
            }
            let t = tensor_from_proto(tp, &mut self.src)?;
            self.add_constant(&mut g, &name, t, tp.doc_string.clone())?;
        }
        for sp in &gp.sparse_initializer {
            let (name, t) = self.densify(sp)?;
            self.add_constant(&mut g, &name, t, None)?;
        }
        for n in &gp.node {
            for out in n.output.iter().filter(|o| !o.is_empty()) {
                g.new_value(out.clone(), None).map_err(|_| dup(out))?;
            }
        }
        let mut orphans = vec![];
        for vi in &gp.value_info {
            let name = vi.name.clone().unwrap_or_default();
            match g.value_by_name(&name) {
                Some(id) => {
                    let v = g.value_mut(id).map_err(|e| self.ir(e))?;
                    v.ty = vi.r#type.as_ref().and_then(types::from_proto);
                    v.doc_string = vi.doc_string.clone().unwrap_or_default();
                    v.metadata_props = props(&vi.metadata_props);
                    v.in_value_info = true;
                }
                None => orphans.push(vi.clone()),
            }
        }
        for (index, n) in gp.node.iter().enumerate() {
            let label = n.name.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| format!("#{index} ({})", n.op_type.clone().unwrap_or_default()));
            let mut node = Node::new(n.op_type.clone().unwrap_or_default(), n.name.clone().unwrap_or_default());
            node.domain = n.domain.clone().unwrap_or_default();
            node.overload = n.overload.clone().unwrap_or_default();
            node.doc_string = n.doc_string.clone().unwrap_or_default();
            node.metadata_props = props(&n.metadata_props);
            for i in &n.input {
                node.inputs.push(if i.is_empty() { None } else { Some(self.resolve(&mut g, i, scope, &label)?) });
            }
            for o in &n.output {
                node.outputs.push(if o.is_empty() { None } else { g.value_by_name(o) });
            }
            for a in &n.attribute {
                let attr = self.attribute(a, depth).map_err(|e| match e {
                    OnnxError::Invalid { path, what } => OnnxError::Invalid { path, what: format!("node '{label}': {what}") },
                    e => e,
                })?;
                node.attrs.push(attr);
            }
            g.add_node(node).map_err(|e| match e {
                IrError::DuplicateValue { value, .. } => self.invalid(format!("graph '{gname}': value '{value}' is produced by more than one node (second: '{label}')")),
                e => self.ir(e),
            })?;
        }
        let mut outputs = vec![];
        for (i, vi) in gp.output.iter().enumerate() {
            let name = vi.name.clone().unwrap_or_default();
            if name.is_empty() {
                return Err(self.invalid(format!("graph '{gname}': output #{i} has no name")));
            }
            let id = self.resolve(&mut g, &name, scope, "the graph outputs")?;
            let v = g.value_mut(id).map_err(|e| self.ir(e))?;
            if let Some(t) = vi.r#type.as_ref().and_then(types::from_proto) {
                v.ty = Some(t);
            }
            if let Some(d) = &vi.doc_string {
                v.doc_string = d.clone();
            }
            if !vi.metadata_props.is_empty() {
                v.metadata_props = props(&vi.metadata_props);
            }
            outputs.push(id);
        }
        g.set_outputs(outputs).map_err(|e| self.ir(e))?;
        let extra = proto::GraphProto { value_info: orphans, quantization_annotation: gp.quantization_annotation.clone(), ..Default::default() };
        if extra != proto::GraphProto::default() {
            g.extra = extra.encode_to_vec();
        }
        Ok(g)
    }

    fn add_constant(&self, g: &mut Graph, name: &str, t: Tensor, doc: Option<String>) -> Result<(), OnnxError> {
        let id = match g.value_by_name(name) {
            Some(id) if g.value(id).map_err(|e| self.ir(e))?.kind() == ValueKind::Input && g.value(id).unwrap().initializer().is_none() => {
                g.set_initializer(id, t).map_err(|e| self.ir(e))?;
                id
            }
            Some(_) => return Err(self.invalid(format!("graph '{}': initializer '{name}' is defined more than once", g.name))),
            None => g.add_initializer(name, t).map_err(|e| self.ir(e))?,
        };
        if let Some(d) = doc.filter(|d| !d.is_empty()) {
            g.value_mut(id).map_err(|e| self.ir(e))?.doc_string = d;
        }
        Ok(())
    }

    fn resolve(&self, g: &mut Graph, name: &str, scope: Scope, reader: &str) -> Result<qforge_ir::ValueId, OnnxError> {
        if let Some(id) = g.value_by_name(name) {
            return Ok(id);
        }
        match scope {
            Scope::Nested => g.add_outer(name).map_err(|e| self.ir(e)),
            Scope::Closed => Err(self.invalid(format!(
                "graph '{}': {reader} reads '{name}', which no input, initializer or node defines", g.name
            ))),
        }
    }

    /// A sparse initializer as a dense tensor (zeros except at the listed positions).
    fn densify(&mut self, sp: &proto::SparseTensorProto) -> Result<(String, Tensor), OnnxError> {
        let values = sp.values.as_ref().ok_or_else(|| self.invalid("a sparse initializer has no values".into()))?;
        let name = values.name.clone().unwrap_or_default();
        let err = |reason: String| OnnxError::Tensor { path: self.path.clone(), tensor: name.clone(), reason };
        let v = tensor_from_proto(values, &mut self.src)?;
        let idx = sp.indices.as_ref().map(|i| tensor_from_proto(i, &mut self.src)).transpose()?
            .ok_or_else(|| err("sparse initializer has no indices".into()))?;
        let dims: Vec<usize> = sp.dims.iter().map(|&d| usize::try_from(d).map_err(|_| err(format!("negative dimension {d}")))).collect::<Result<_, _>>()?;
        let mut dense = Tensor::zeros(v.dtype(), &dims).map_err(|e| err(e.to_string()))?;
        let n: usize = dims.iter().product();
        let idx = idx.to_i64_vec().map_err(|e| err(e.to_string()))?;
        let nnz = v.len();
        let flat: Vec<usize> = if idx.len() == nnz {
            idx.iter().map(|&i| i as usize).collect()
        } else if idx.len() == nnz * dims.len() {
            idx.chunks(dims.len()).map(|c| c.iter().zip(&dims).fold(0usize, |acc, (&i, &d)| acc * d + i as usize)).collect()
        } else {
            return Err(err(format!("{} indices do not fit {nnz} values", idx.len())));
        };
        let width = v.dtype().bits() / 8;
        if width == 0 || flat.iter().any(|&i| i >= n) {
            return Err(err("sparse indices are out of range or the element type is not byte-sized".into()));
        }
        let src = v.raw_bytes().unwrap().to_vec();
        let dst = dense.raw_bytes_mut().unwrap();
        for (k, &i) in flat.iter().enumerate() {
            dst[i * width..(i + 1) * width].copy_from_slice(&src[k * width..(k + 1) * width]);
        }
        Ok((name, dense))
    }

    fn attribute(&mut self, a: &proto::AttributeProto, depth: usize) -> Result<Attribute, OnnxError> {
        let name = a.name.clone().unwrap_or_default();
        let kind = match a.r#type.and_then(|t| AttributeType::try_from(t).ok()).filter(|t| *t != AttributeType::Undefined) {
            Some(t) => t,
            None => infer_kind(a).ok_or_else(|| self.invalid(format!("attribute '{name}' has no type and no value")))?,
        };
        let tensor = |l: &mut Self, t: &proto::TensorProto| tensor_from_proto(t, &mut l.src);
        // An attribute reference in a function body has a type but takes its value from the
        // caller; it gets an empty value of its kind.
        let is_ref = a.ref_attr_name.is_some();
        let missing = || self.invalid(format!("attribute '{name}' of type {kind:?} has no value"));
        let ty = |t: &proto::TypeProto| types::from_proto(t).ok_or_else(|| self.invalid(format!("attribute '{name}' holds an opaque type")));
        let value = match kind {
            AttributeType::Float => Attr::Float(a.f.unwrap_or(0.0)),
            AttributeType::Int => Attr::Int(a.i.unwrap_or(0)),
            AttributeType::String => Attr::String(a.s.clone().unwrap_or_default()),
            AttributeType::Tensor => match &a.t {
                Some(t) => Attr::Tensor(tensor(self, t)?),
                None if is_ref => Attr::Tensor(Tensor::zeros(qforge_ir::DType::F32, &[0]).map_err(|e| self.ir(e))?),
                None => return Err(missing()),
            },
            AttributeType::Graph => match &a.g {
                Some(g) => Attr::Graph(Box::new(self.graph(g, depth + 1, Scope::Nested)?)),
                None if is_ref => Attr::Graph(Box::default()),
                None => return Err(missing()),
            },
            AttributeType::SparseTensor => Attr::SparseTensor(a.sparse_tensor.as_ref().map(|s| s.encode_to_vec()).unwrap_or_default()),
            AttributeType::TypeProto => match &a.tp {
                Some(t) => Attr::Type(ty(t)?),
                None if is_ref => Attr::Type(qforge_ir::ValueType::Tensor { elem: None, shape: None }),
                None => return Err(missing()),
            },
            AttributeType::Floats => Attr::Floats(a.floats.clone()),
            AttributeType::Ints => Attr::Ints(a.ints.clone()),
            AttributeType::Strings => Attr::Strings(a.strings.clone()),
            AttributeType::Tensors => Attr::Tensors(a.tensors.iter().map(|t| tensor(self, t)).collect::<Result<_, _>>()?),
            AttributeType::Graphs => Attr::Graphs(a.graphs.iter().map(|g| self.graph(g, depth + 1, Scope::Nested)).collect::<Result<_, _>>()?),
            AttributeType::SparseTensors => Attr::SparseTensors(a.sparse_tensors.iter().map(|s| s.encode_to_vec()).collect()),
            AttributeType::TypeProtos => Attr::Types(a.type_protos.iter().map(ty).collect::<Result<_, _>>()?),
            AttributeType::Undefined => unreachable!("filtered above"),
        };
        Ok(Attribute { name, value, doc_string: a.doc_string.clone().unwrap_or_default(), ref_attr_name: a.ref_attr_name.clone() })
    }
}

/// The type of an attribute written without one (files older than IR version 2), from the
/// field that holds its value.
fn infer_kind(a: &proto::AttributeProto) -> Option<AttributeType> {
    use AttributeType as T;
    Some(if a.f.is_some() { T::Float } else if a.i.is_some() { T::Int } else if a.s.is_some() { T::String }
        else if a.t.is_some() { T::Tensor } else if a.g.is_some() { T::Graph } else if a.sparse_tensor.is_some() { T::SparseTensor }
        else if a.tp.is_some() { T::TypeProto } else if !a.floats.is_empty() { T::Floats } else if !a.ints.is_empty() { T::Ints }
        else if !a.strings.is_empty() { T::Strings } else if !a.tensors.is_empty() { T::Tensors } else if !a.graphs.is_empty() { T::Graphs }
        else if !a.sparse_tensors.is_empty() { T::SparseTensors } else if !a.type_protos.is_empty() { T::TypeProtos } else { return None })
}
