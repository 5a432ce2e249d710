"""Writes PyTorch observer reference values for qforge's observer tests.

    python scripts/oracle/torch_observers.py crates/quant/tests/fixtures/torch_observers.json

Needs torch (not part of the project's test venv: the output is committed).
* "cases": a MinMaxObserver fed one tensor; the observed range and `calculate_qparams()`
  exactly (float32 scale as its bit pattern).
* "histograms": a HistogramObserver (2048 bins) fed one tensor; its histogram, range, and the
  range chosen by `_non_linear_param_search()` (PyTorch's L2 search).
"""
import json
import sys

import numpy as np
import torch
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver

DTYPES = {"u8": torch.quint8, "s8": torch.qint8}
rng = np.random.default_rng(20261122)
cases = []
ranges = [(0.0, 0.0), (0.0, 6.0), (-1.0, 1.0), (-3.5, 0.25), (-1e-9, 1e-9), (2.0, 3.0), (-7.0, -2.0),
          (-1e6, 3e5), (-0.1, 12.0)]
ranges += [tuple(sorted(rng.normal(0, s, 2).tolist())) for s in (0.01, 1.0, 100.0) for _ in range(6)]
for lo, hi in ranges:
    for qtype, dtype in DTYPES.items():
        for qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            for reduce_range in (False, True):
                for quant_range in (None, (-127, 127) if qtype == "s8" else (0, 127)):
                    if qscheme == torch.per_tensor_symmetric and reduce_range and dtype == torch.quint8:
                        continue
                    kwargs = dict(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
                    if quant_range:
                        kwargs.update(quant_min=quant_range[0], quant_max=quant_range[1])
                    obs = MinMaxObserver(**kwargs)
                    obs(torch.tensor([lo, hi], dtype=torch.float32))
                    scale, zp = obs.calculate_qparams()
                    cases.append({
                        "qtype": qtype,
                        "symmetric": qscheme == torch.per_tensor_symmetric,
                        "reduce_range": reduce_range,
                        "quant_range": list(quant_range) if quant_range else None,
                        "min": float(obs.min_val), "max": float(obs.max_val),
                        "qmin": obs.quant_min, "qmax": obs.quant_max,
                        "scale": int(np.array(scale.item(), dtype=np.float32).view(np.uint32)),
                        "zero_point": int(zp.item()),
                    })
histograms = []
gen = torch.Generator().manual_seed(7)
samples = {
    "normal": torch.randn(20000, generator=gen),
    "normal_with_outliers": torch.cat([torch.randn(20000, generator=gen), torch.tensor([40.0, -25.0])]),
    "relu": torch.relu(torch.randn(20000, generator=gen) * 3.0),
    "laplace": torch.distributions.Laplace(0.0, 1.0).sample((20000,)),
    "uniform": torch.rand(20000, generator=gen) * 5.0 - 1.0,
    "bimodal": torch.cat([torch.randn(10000, generator=gen) - 4.0, torch.randn(10000, generator=gen) * 0.5 + 3.0]),
}
for name, x in samples.items():
    for dtype in (torch.quint8, torch.qint8):
        obs = HistogramObserver(bins=2048, dtype=dtype)
        obs(x)
        lo, hi = obs._non_linear_param_search()
        histograms.append({
            "name": name, "dtype": "u8" if dtype == torch.quint8 else "s8", "dst_nbins": obs.dst_nbins,
            "min": float(obs.min_val), "max": float(obs.max_val),
            "counts": [float(c) for c in obs.histogram.tolist()],
            "search_min": float(lo), "search_max": float(hi),
        })
json.dump({"torch": torch.__version__, "cases": cases, "histograms": histograms}, open(sys.argv[1], "w"))
print(f"{len(cases)} qparams cases, {len(histograms)} histograms from torch {torch.__version__}")
