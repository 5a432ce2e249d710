"""Reference shape inference: ONNX's own (`onnx.shape_inference.infer_shapes`, with data
propagation), on a model whose value_info has been stripped.

    python scripts/oracle/onnx_shapes.py MODEL.onnx

Prints JSON {value name: {"elem": lower-case type or null, "shape": [int | str | null] or null}}
for every value of the main graph that ONNX infers.
"""
import json
import sys

import onnx
from onnx import shape_inference

model = onnx.load(sys.argv[1], load_external_data=False)
del model.graph.value_info[:]
inferred = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
out = {}
for vi in inferred.graph.value_info:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        continue
    shape = None
    if t.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None) for d in t.shape.dim]
    out[vi.name] = {"elem": onnx.TensorProto.DataType.Name(t.elem_type).lower() if t.elem_type else None, "shape": shape}
print(json.dumps(out))
