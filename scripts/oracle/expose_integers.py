"""Writes a copy of a model in which every integer tensor a node produces from run-time data
(uint8, int8, int32: quantized activations and integer accumulators) is also a graph output,
so an engine's intermediate integer results can be compared with another's.

    python scripts/oracle/expose_integers.py MODEL.onnx OUT.onnx

Prints the exposed names as a JSON list. Types come from ONNX shape inference, and for
ONNX Runtime's com.microsoft QLinear operators (which shape inference does not know) from the
type of their output zero point.
"""
import json
import sys

import onnx
from onnx import TensorProto, helper

# Input index of the output zero point of each com.microsoft QLinear operator.
OUTPUT_ZERO_POINT = {"QLinearAdd": 7, "QLinearMul": 7, "QLinearSigmoid": 4, "QLinearLeakyRelu": 4,
                     "QLinearGlobalAveragePool": 4, "QLinearAveragePool": 4, "QLinearConcat": 1, "QGemm": 8}
INTEGER = (TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32)

src, dst = sys.argv[1:3]
m = onnx.shape_inference.infer_shapes(onnx.load(src))
g = m.graph
types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output) + list(g.input)}
init = {i.name: i.data_type for i in g.initializer}
for n in g.node:
    k = OUTPUT_ZERO_POINT.get(n.op_type) if n.domain == "com.microsoft" else None
    if k is not None and len(n.input) > k and n.input[k] in init:
        types[n.output[0]] = init[n.input[k]]
outputs = {o.name for o in g.output}
# Values computed from constants alone (weights quantized at run time) are left alone:
# exposing them would keep an engine from folding them into the integer operators.
constant = set(init) | {i.name for i in g.input if i.name in init}
for n in g.node:
    if all(i in constant for i in n.input if i) and n.op_type != "RandomNormal":
        constant.update(o for o in n.output if o)
exposed = [o for n in g.node for o in n.output if o and types.get(o) in INTEGER and o not in constant]
for o in exposed:
    if o not in outputs:
        g.output.append(helper.make_tensor_value_info(o, types[o], None))
onnx.save(m, dst)
print(json.dumps(exposed))
