"""Builds examples/tiny_cnn.onnx, the small model the README runs on a fresh machine:
Conv-Relu-MaxPool-Conv-Relu-GlobalAveragePool-Flatten-Gemm-Softmax on a 1x3x32x32 image,
with seeded random weights.

    python scripts/make_example.py examples/tiny_cnn.onnx

It also writes examples/tiny_cnn_calib.npz beside the model: 8 seeded calibration images,
stacked as x [8, 1, 3, 32, 32] (one sample per index).
"""
import os
import sys

import numpy as np
import onnx
from onnx import helper as h
from onnx import numpy_helper as nh

rng = np.random.default_rng(0)


def w(name, *shape):
    return nh.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)


inits = [w("c1.w", 8, 3, 3, 3), w("c1.b", 8), w("c2.w", 16, 8, 3, 3), w("c2.b", 16), w("fc.w", 10, 16), w("fc.b", 10)]
nodes = [
    h.make_node("Conv", ["x", "c1.w", "c1.b"], ["c1"], name="/features/conv1/Conv", pads=[1, 1, 1, 1]),
    h.make_node("Relu", ["c1"], ["r1"], name="/features/relu1/Relu"),
    h.make_node("MaxPool", ["r1"], ["p1"], name="/features/pool/MaxPool", kernel_shape=[2, 2], strides=[2, 2]),
    h.make_node("Conv", ["p1", "c2.w", "c2.b"], ["c2"], name="/features/conv2/Conv", pads=[1, 1, 1, 1]),
    h.make_node("Relu", ["c2"], ["r2"], name="/features/relu2/Relu"),
    h.make_node("GlobalAveragePool", ["r2"], ["g"], name="/head/GlobalAveragePool"),
    h.make_node("Flatten", ["g"], ["f"], name="/head/Flatten"),
    h.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="/head/fc/Gemm", transB=1),
    h.make_node("Softmax", ["logits"], ["probs"], name="/head/Softmax", axis=1),
]
graph = h.make_graph(nodes, "tiny_cnn", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 32, 32])],
                     [h.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, ["N", 10])], inits)
model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], producer_name="qforge-example")
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, sys.argv[1])
calib = rng.uniform(-1, 1, size=(8, 1, 3, 32, 32)).astype(np.float32)
np.savez(os.path.join(os.path.dirname(sys.argv[1]), "tiny_cnn_calib.npz"), x=calib)
