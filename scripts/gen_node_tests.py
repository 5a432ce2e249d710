"""Writes the ONNX backend node tests (the operator conformance suite of the `onnx` package)
in the standard layout: OUT/<test>/model.onnx and OUT/<test>/test_data_set_<i>/{input,output}_<j>.pb,
and copies beside them the small model tests the `onnx` wheel ships in that layout
(`pytorch-converted`: PyTorch modules such as Conv1d/Conv3d/GLU/PReLU exported at old opsets,
`pytorch-operator`, `simple`).

    python scripts/gen_node_tests.py OUT

(`backend-test-tools generate-data` of onnx 1.23 writes only the model tests, not these.)
"""
import os
import shutil
import sys
import warnings

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.backend.test.case import node as node_cases

out = sys.argv[1]
warnings.simplefilter("ignore")
np.seterr(all="ignore")
written = 0
for case in node_cases.collect_testcases(None):
    d = os.path.join(out, case.name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "model.onnx"), "wb") as f:
        f.write(case.model.SerializeToString())
    graph = case.model.graph
    for i, (inputs, outputs) in enumerate(case.data_sets or []):
        ds = os.path.join(d, f"test_data_set_{i}")
        os.makedirs(ds, exist_ok=True)
        for prefix, values, infos in (("input", inputs, graph.input), ("output", outputs, graph.output)):
            for j, value in enumerate(values):
                info = infos[j]
                if info.type.HasField("sequence_type"):
                    proto = numpy_helper.from_list(value, info.name)
                elif info.type.HasField("optional_type"):
                    proto = numpy_helper.from_optional(value, info.name)
                elif info.type.HasField("map_type"):
                    proto = numpy_helper.from_dict(value, info.name)
                elif isinstance(value, TensorProto):
                    proto = value
                else:
                    proto = numpy_helper.from_array(np.asarray(value), info.name)
                with open(os.path.join(ds, f"{prefix}_{j}.pb"), "wb") as f:
                    f.write(proto.SerializeToString())
    written += 1
data = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
for suite in ("pytorch-converted", "pytorch-operator", "simple"):
    for name in sorted(os.listdir(os.path.join(data, suite))):
        if not os.path.exists(os.path.join(out, name)):
            shutil.copytree(os.path.join(data, suite, name), os.path.join(out, name))
            written += 1
print(f"setup: {written} node tests in {out}")
