"""Reference for `qforge inspect --json`, computed with the `onnx` package.

    python scripts/oracle/onnx_inspect.py MODEL.onnx

Prints JSON with the op histogram over the graph and all subgraphs (ops outside the default
domain as `domain::op`), the inputs that have no initializer and the outputs (name, lower-case
ONNX element type, dims as int / symbol / null), the node count and the parameter count
(initializer elements plus `Constant` node `value` tensors, subgraphs included).
"""
import json
import sys
from collections import Counter

import numpy as np
import onnx


def walk(graph, ops, params):
    for init in graph.initializer:
        params[0] += int(np.prod(init.dims, dtype=np.int64))
    for node in graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        ops[key] += 1
        for attr in node.attribute:
            if node.op_type == "Constant" and node.domain == "" and attr.name == "value":
                params[0] += int(np.prod(attr.t.dims, dtype=np.int64))
            if attr.type == onnx.AttributeProto.GRAPH:
                walk(attr.g, ops, params)
            for g in attr.graphs:
                walk(g, ops, params)


def describe(vi):
    t = vi.type.tensor_type
    dtype = onnx.TensorProto.DataType.Name(t.elem_type).lower() if t.elem_type else None
    shape = None
    if t.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
                 for d in t.shape.dim]
    return {"name": vi.name, "dtype": dtype, "shape": shape}


def main(path):
    model = onnx.load(path, load_external_data=False)
    ops, params = Counter(), [0]
    walk(model.graph, ops, params)
    inits = {i.name for i in model.graph.initializer}
    print(json.dumps({
        "ops": dict(sorted(ops.items())),
        "nodes": sum(ops.values()),
        "parameters": params[0],
        "inputs": [describe(i) for i in model.graph.input if i.name not in inits],
        "outputs": [describe(o) for o in model.graph.output],
        "opsets": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
    }))


if __name__ == "__main__":
    main(sys.argv[1])
