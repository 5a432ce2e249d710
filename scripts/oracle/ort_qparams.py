"""Reference scale/zero-point from ONNX Runtime's quantizer (`quant_utils.compute_scale_zp`).

    python scripts/oracle/ort_qparams.py CASES.json

CASES.json is a list of {"qtype": "u8|s8|u16|s16|u4|s4", "symmetric": bool, "reduce_range": bool,
"min": float, "max": float}. Prints a JSON list of {"qmin", "qmax", "scale" (float32 as its bit
pattern), "zero_point"}, computed the way ORT's `quantize_static` does for a calibrated range.
"""
import json
import sys

import numpy as np
from onnx import TensorProto
from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType

QTYPES = {"u8": TensorProto.UINT8, "s8": TensorProto.INT8, "u16": TensorProto.UINT16,
          "s16": TensorProto.INT16, "u4": TensorProto.UINT4, "s4": TensorProto.INT4}

out = []
for case in json.load(open(sys.argv[1])):
    qmin, qmax = get_qmin_qmax_for_qType(QTYPES[case["qtype"]], reduce_range=case["reduce_range"],
                                         symmetric=case["symmetric"])
    zp, scale = compute_scale_zp(np.array(case["min"], dtype=np.float32), np.array(case["max"], dtype=np.float32),
                                 qmin, qmax, symmetric=case["symmetric"])
    out.append({"qmin": int(qmin), "qmax": int(qmax),
                "scale": int(np.array(scale, dtype=np.float32).view(np.uint32)), "zero_point": int(zp)})
print(json.dumps(out))
