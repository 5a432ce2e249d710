"""Export torchvision architectures to ONNX with calibration and evaluation images, for
`bench/sqnr_vs_ort.py`.

    .venv-bench/bin/pip install torchvision onnxscript scikit-image
    .venv-bench/bin/python bench/torchvision_export.py OUT_DIR resnet18,convnext_tiny,... [--dynamo]
    PYTHONPATH=../shared .venv-bench/bin/python bench/sqnr_vs_ort.py OUT_DIR/resnet18.onnx \
        OUT_DIR/resnet18_calib.npz OUT_DIR/resnet18_eval.npz WORK qf= ortmm=ort:minmax

No model hub is reachable here, so the weights are torchvision's random initialization (seed
0); BatchNormalization statistics are then set by running 48 crops of scikit-image's
photographs in training mode, so activations have the spread of a trained network's. This
tests coverage (every op and graph pattern torchvision's exporters emit) and how far each
quantizer's output is from float, not task accuracy. Some heads start at zero (ViT's), so
their output is zero and its SQNR undefined.

Inputs: crops of 224x224 (299x299 for inception_v3), ImageNet-normalized; 32 for calibration
(`NAME_calib.npz`), 16 for evaluation (`NAME_eval.npz`), each array `[N, 1, 3, H, W]` (one
feed per row). Segmentation models (`torchvision.models.segmentation`) export their `out`
map. `--dynamo` uses the dynamo exporter (opset 18, needs onnxscript) and names the model
`NAME_dyn.onnx`; the default is the TorchScript exporter at opset 17.
"""
import argparse
from pathlib import Path

import numpy as np
import torch
import torchvision
from skimage import data

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "cat"]
MEAN = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
STD = torch.tensor([0.229, 0.224, 0.225])[:, None, None]


def photos():
    out = []
    for name in PHOTOS:
        a = getattr(data, name)()
        if a.ndim == 2:
            a = np.stack([a] * 3, -1)
        out.append(a[..., :3])
    return out


def crops(images, count, size, rng):
    """`count` square crops (side up to twice `size`) resized to `size`, normalized."""
    res = []
    for i in range(count):
        a = images[i % len(images)]
        h, w = a.shape[:2]
        s = min(h, w, size * 2)
        y, x = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
        t = torch.from_numpy(np.ascontiguousarray(a[y:y + s, x:x + s])).permute(2, 0, 1)[None].float() / 255
        t = torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear", antialias=True)
        res.append((t - MEAN) / STD)
    return torch.cat(res)


class MainOutput(torch.nn.Module):
    """The model with a dict output (segmentation) reduced to its `out` entry."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        y = self.model(x)
        return y["out"] if isinstance(y, dict) else y


def build(name):
    kwargs = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
    if hasattr(torchvision.models, name):
        return getattr(torchvision.models, name)(weights=None, **kwargs)
    return getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("models", help="comma-separated torchvision model names")
    ap.add_argument("--dynamo", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = photos()
    for name in args.models.split(","):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        size = 299 if name == "inception_v3" else 224
        model = build(name)
        x = crops(images, 48, size, rng)
        model.train()
        with torch.no_grad():
            for b in range(0, 48, 8):
                model(x[b:b + 8])
        model.eval()
        path = out / f"{name}{'_dyn' if args.dynamo else ''}.onnx"
        torch.onnx.export(MainOutput(model), x[:1], str(path), input_names=["x"], output_names=["y"],
                          dynamo=args.dynamo, opset_version=18 if args.dynamo else 17)
        np.savez(out / f"{name}_calib.npz", x=x[:32, None].numpy())
        np.savez(out / f"{name}_eval.npz", x=x[32:48, None].numpy())
        print(f"exported {path}", flush=True)


if __name__ == "__main__":
    main()
