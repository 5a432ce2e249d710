//! [`Model`] -> `ModelProto`, written atomically.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;
use qforge_ir::{Attr, Attribute, Function, Graph, Model, OpsetImport, ValueId};

use crate::proto::{self, attribute_proto::AttributeType, tensor_proto::DataLocation};
use crate::tensor::tensor_to_proto;
use crate::{types, OnnxError};

/// Protobuf messages cannot exceed 2 GiB; stay clear of it.
const PROTOBUF_LIMIT: u64 = (2u64 << 30) - (64 << 20);

/// How a model is written.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Above this many serialized bytes, large tensors go to an external data file
    /// `<model file name>.data` next to the model.
    pub external_data_threshold: u64,
    /// Tensors of at least this many bytes are moved to external data when it is used.
    pub external_min_tensor_bytes: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions { external_data_threshold: PROTOBUF_LIMIT, external_min_tensor_bytes: 1024 }
    }
}

/// Serializes a model. Fails when it would exceed the protobuf limit; use [`save`], which
/// writes external data, for such models.
pub fn to_bytes(model: &Model) -> Result<Vec<u8>, OnnxError> {
    let mp = model_proto(model);
    if mp.encoded_len() as u64 > PROTOBUF_LIMIT {
        return Err(OnnxError::Invalid { path: "<bytes>".into(), what: "the model exceeds the 2 GB protobuf limit; save it to a file to use external data".into() });
    }
    Ok(mp.encode_to_vec())
}

/// Writes a model file atomically (temporary file, then rename).
pub fn save(model: &Model, path: &Path) -> Result<(), OnnxError> {
    save_with_options(model, path, &SaveOptions::default())
}

/// [`save`] with explicit options.
pub fn save_with_options(model: &Model, path: &Path, opts: &SaveOptions) -> Result<(), OnnxError> {
    let mut mp = model_proto(model);
    if mp.encoded_len() as u64 > opts.external_data_threshold {
        let file_name = path.file_name().map(|n| format!("{}.data", n.to_string_lossy()))
            .ok_or_else(|| OnnxError::Invalid { path: path.to_path_buf(), what: "the output path has no file name".into() })?;
        let mut data = vec![];
        if let Some(g) = mp.graph.as_mut() {
            externalize(g, &file_name, opts.external_min_tensor_bytes, &mut data);
        }
        write_atomic(&path.with_file_name(&file_name), |f| f.write_all(&data))?;
    }
    write_atomic(path, |f| {
        let mut sink = FileSink { file: f, buf: Vec::with_capacity(SINK_BYTES), error: None };
        mp.encode(&mut sink).map_err(std::io::Error::other)?;
        sink.finish()
    })
}

/// Bytes [`FileSink`] gathers before each write.
const SINK_BYTES: usize = 1 << 20;

/// A protobuf encoding target that writes to a file in [`SINK_BYTES`] pieces, so a model is
/// never serialized whole in memory. The first write error is kept, later bytes are dropped,
/// and [`FileSink::finish`] returns it.
struct FileSink<'a> {
    file: &'a mut std::fs::File,
    buf: Vec<u8>,
    error: Option<std::io::Error>,
}

impl FileSink<'_> {
    fn flush(&mut self) {
        if self.error.is_none() {
            self.error = self.file.write_all(&self.buf).err();
        }
        self.buf.clear();
    }

    fn finish(mut self) -> std::io::Result<()> {
        self.flush();
        self.error.map_or(Ok(()), Err)
    }
}

// SAFETY: `chunk_mut` hands out the buffer's spare capacity, never empty (a full buffer is
// flushed first), and `advance_mut` only counts bytes the caller initialized in it.
unsafe impl prost::bytes::BufMut for FileSink<'_> {
    fn remaining_mut(&self) -> usize {
        usize::MAX
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        let len = self.buf.len() + cnt;
        assert!(len <= self.buf.capacity(), "advanced past the chunk");
        // SAFETY: the caller initialized these `cnt` bytes of the spare capacity.
        unsafe { self.buf.set_len(len) };
    }

    fn chunk_mut(&mut self) -> &mut prost::bytes::buf::UninitSlice {
        if self.buf.len() == self.buf.capacity() {
            self.flush();
        }
        prost::bytes::buf::UninitSlice::uninit(self.buf.spare_capacity_mut())
    }
}

/// Moves large `raw_data` of a graph's initializers (subgraphs included) into `data`, 4 KiB
/// aligned, and points the tensors at it.
fn externalize(g: &mut proto::GraphProto, location: &str, min_bytes: usize, data: &mut Vec<u8>) {
    for t in &mut g.initializer {
        if t.raw_data.as_ref().is_some_and(|r| r.len() >= min_bytes) {
            let raw = t.raw_data.take().unwrap();
            data.resize(data.len().div_ceil(4096) * 4096, 0);
            let entry = |k: &str, v: String| proto::StringStringEntryProto { key: Some(k.into()), value: Some(v) };
            t.external_data = vec![entry("location", location.into()), entry("offset", data.len().to_string()), entry("length", raw.len().to_string())];
            t.data_location = Some(DataLocation::External as i32);
            data.extend_from_slice(&raw);
        }
    }
    for n in &mut g.node {
        for a in &mut n.attribute {
            if let Some(sub) = a.g.as_mut() {
                externalize(sub, location, min_bytes, data);
            }
            for sub in &mut a.graphs {
                externalize(sub, location, min_bytes, data);
            }
        }
    }
}

/// Creates `path` atomically: `write` fills a temporary file beside it, which is synced and
/// renamed over `path`; on any error the temporary file is removed and `path` is untouched.
fn write_atomic(path: &Path, write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> Result<(), OnnxError> {
    let io = |p: &Path, source| OnnxError::Io { path: p.to_path_buf(), source };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        write(&mut f)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path, e));
    }
    Ok(())
}

fn opsets(v: &[OpsetImport]) -> Vec<proto::OperatorSetIdProto> {
    v.iter().map(|o| proto::OperatorSetIdProto { domain: Some(o.domain.clone()), version: Some(o.version) }).collect()
}

fn props(v: &[(String, String)]) -> Vec<proto::StringStringEntryProto> {
    v.iter().map(|(k, v)| proto::StringStringEntryProto { key: Some(k.clone()), value: Some(v.clone()) }).collect()
}

fn opt(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

fn model_proto(m: &Model) -> proto::ModelProto {
    let mut mp = proto::ModelProto {
        ir_version: Some(m.ir_version),
        opset_import: opsets(&m.opset_imports),
        producer_name: opt(&m.producer_name),
        producer_version: opt(&m.producer_version),
        domain: opt(&m.domain),
        model_version: (m.model_version != 0).then_some(m.model_version),
        doc_string: opt(&m.doc_string),
        graph: Some(graph_proto(&m.graph)),
        metadata_props: props(&m.metadata_props),
        functions: m.functions.iter().map(function_proto).collect(),
        ..Default::default()
    };
    if let Ok(extra) = proto::ModelProto::decode(m.extra.as_slice()) {
        mp.training_info = extra.training_info;
        mp.configuration = extra.configuration;
    }
    mp
}

fn function_proto(f: &Function) -> proto::FunctionProto {
    let g = graph_proto(&f.body);
    proto::FunctionProto {
        name: Some(f.name.clone()),
        input: g.input.iter().map(|v| v.name.clone().unwrap_or_default()).collect(),
        output: g.output.iter().map(|v| v.name.clone().unwrap_or_default()).collect(),
        attribute: f.attribute_names.clone(),
        attribute_proto: f.attribute_defaults.iter().map(attribute_proto).collect(),
        node: g.node,
        doc_string: opt(&f.doc_string),
        opset_import: opsets(&f.opset_imports),
        domain: Some(f.domain.clone()),
        overload: opt(&f.overload),
        value_info: g.value_info,
        metadata_props: props(&f.metadata_props),
    }
}

/// Names for every value, inventing unique ones for anonymous values.
fn value_names(g: &Graph) -> Vec<String> {
    let len = g.values().map(|(id, _)| id.0 as usize + 1).max().unwrap_or(0);
    let mut names = vec![String::new(); len];
    let mut taken: std::collections::HashSet<String> = g.values().map(|(_, v)| v.name.clone()).collect();
    for (id, v) in g.values() {
        names[id.0 as usize] = if v.name.is_empty() {
            let mut k = id.0;
            let name = loop {
                let n = format!("qforge_value_{k}");
                if taken.insert(n.clone()) {
                    break n;
                }
                k += 1_000_000;
            };
            name
        } else {
            v.name.clone()
        };
    }
    names
}

fn value_info(g: &Graph, id: ValueId, names: &[String]) -> proto::ValueInfoProto {
    let v = g.value(id).expect("live value");
    proto::ValueInfoProto {
        name: Some(names[id.0 as usize].clone()),
        r#type: v.ty.as_ref().filter(|t| types::is_complete(t)).map(types::to_proto),
        doc_string: opt(&v.doc_string),
        metadata_props: props(&v.metadata_props),
    }
}

fn graph_proto(g: &Graph) -> proto::GraphProto {
    let names = value_names(g);
    let order = g.topo_order().unwrap_or_else(|_| g.nodes().map(|(id, _)| id).collect());
    let name_of = |v: &Option<ValueId>| v.map(|v| names[v.0 as usize].clone()).unwrap_or_default();
    let node = order.iter().map(|id| {
        let n = g.node(*id).expect("topological order lists live nodes");
        proto::NodeProto {
            input: n.inputs.iter().map(name_of).collect(),
            output: n.outputs.iter().map(name_of).collect(),
            name: opt(&n.name),
            op_type: Some(n.op_type.clone()),
            domain: opt(&n.domain),
            overload: opt(&n.overload),
            attribute: n.attrs.iter().map(attribute_proto).collect(),
            doc_string: opt(&n.doc_string),
            metadata_props: props(&n.metadata_props),
            device_configurations: vec![],
        }
    }).collect();
    let initializer = g.initializers().map(|(id, v)| {
        let mut t = tensor_to_proto(&names[id.0 as usize], v.initializer().unwrap());
        if v.kind() == qforge_ir::ValueKind::Initializer {
            t.doc_string = opt(&v.doc_string);
        }
        t
    }).collect();
    let mut gp = proto::GraphProto {
        node,
        name: opt(&g.name),
        initializer,
        doc_string: opt(&g.doc_string),
        input: g.inputs().iter().map(|v| value_info(g, *v, &names)).collect(),
        output: g.outputs().iter().map(|v| value_info(g, *v, &names)).collect(),
        value_info: g.values().filter(|(_, v)| v.in_value_info).map(|(id, _)| value_info(g, id, &names)).collect(),
        metadata_props: props(&g.metadata_props),
        ..Default::default()
    };
    if let Ok(extra) = proto::GraphProto::decode(g.extra.as_slice()) {
        gp.value_info.extend(extra.value_info);
        gp.quantization_annotation = extra.quantization_annotation;
    }
    gp
}

fn attribute_proto(a: &Attribute) -> proto::AttributeProto {
    use AttributeType as T;
    let mut p = proto::AttributeProto {
        name: Some(a.name.clone()),
        ref_attr_name: a.ref_attr_name.clone(),
        doc_string: opt(&a.doc_string),
        ..Default::default()
    };
    let kind = match &a.value {
        Attr::Float(_) => T::Float,
        Attr::Int(_) => T::Int,
        Attr::String(_) => T::String,
        Attr::Tensor(_) => T::Tensor,
        Attr::Graph(_) => T::Graph,
        Attr::SparseTensor(_) => T::SparseTensor,
        Attr::Type(_) => T::TypeProto,
        Attr::Floats(_) => T::Floats,
        Attr::Ints(_) => T::Ints,
        Attr::Strings(_) => T::Strings,
        Attr::Tensors(_) => T::Tensors,
        Attr::Graphs(_) => T::Graphs,
        Attr::SparseTensors(_) => T::SparseTensors,
        Attr::Types(_) => T::TypeProtos,
    };
    p.r#type = Some(kind as i32);
    if a.ref_attr_name.is_some() {
        return p;
    }
    match &a.value {
        Attr::Float(f) => p.f = Some(*f),
        Attr::Int(i) => p.i = Some(*i),
        Attr::String(s) => p.s = Some(s.clone()),
        Attr::Tensor(t) => p.t = Some(tensor_to_proto("", t)),
        Attr::Graph(g) => p.g = Some(graph_proto(g)),
        Attr::SparseTensor(b) => p.sparse_tensor = proto::SparseTensorProto::decode(b.as_slice()).ok(),
        Attr::Type(t) => p.tp = Some(types::to_proto(t)),
        Attr::Floats(v) => p.floats = v.clone(),
        Attr::Ints(v) => p.ints = v.clone(),
        Attr::Strings(v) => p.strings = v.clone(),
        Attr::Tensors(v) => p.tensors = v.iter().map(|t| tensor_to_proto("", t)).collect(),
        Attr::Graphs(v) => p.graphs = v.iter().map(graph_proto).collect(),
        Attr::SparseTensors(v) => p.sparse_tensors = v.iter().filter_map(|b| proto::SparseTensorProto::decode(b.as_slice()).ok()).collect(),
        Attr::Types(v) => p.type_protos = v.iter().map(types::to_proto).collect(),
    }
    p
}
