"""Image calibration oracle: writes images with Pillow and what Pillow + numpy make of them.

    pil_images.py DIR

DIR/images/ gets PNG files (RGB of several sizes, grayscale, RGBA) and one JPEG, drawn from a
fixed seed (noise over smooth gradients); DIR/h64/ and DIR/w64/ get RGB PNG files 64 pixels
high or wide, for resizes along one axis. For each case below, DIR/<case>/ gets
preprocess.toml, copies of its images, and DIR/<case>.expected.npz: one array per image file name,
preprocessed with Pillow (Image.convert, Image.resize(..., Image.BILINEAR), crop) and numpy
(float32 arithmetic), laid out as the model input. Cases feed an input named "x".
"""

import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]

CASES = {
    # name: (toml, color, resize (h, w) | ("shorter", n) | None, crop (h, w) | None, normalize, layout)
    "shorter_crop_imagenet": (
        'resize_shorter = 64\ncenter_crop = [48, 56]\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]\n',
        "RGB", ("shorter", 64), (48, 56), (1 / 255, MEAN, STD), "nchw"),
    "exact_bgr_nhwc": (
        'color = "bgr"\nresize = [40, 72]\nscale = 1.0\nmean = [127.5]\nstd = [127.5]\nlayout = "nhwc"\n',
        "BGR", (40, 72), None, (1.0, [127.5] * 3, [127.5] * 3), "nhwc"),
    "gray_upscale": (
        'color = "gray"\nresize = [150, 90]\nmean = [0.5]\nstd = [0.5]\n',
        "L", (150, 90), None, (1 / 255, [0.5], [0.5]), "nchw"),
    "orientation": (
        'resize_shorter = 256\ncenter_crop = [224, 224]\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]\n',
        "RGB", ("shorter", 256), (224, 224), (1 / 255, MEAN, STD), "nchw"),
    "uint8_model_size": (
        '# sizes from the model input\n',
        "RGB", (33, 47), None, None, "nchw"),
    "width_only": ('resize = [64, 80]\n', "RGB", (64, 80), None, None, "nchw", "h64"),
    "height_only": ('resize = [90, 64]\n', "RGB", (90, 64), None, None, "nchw", "w64"),
}


def make_images(out: Path):
    rng = np.random.default_rng(20261126)
    out.mkdir(parents=True, exist_ok=True)
    for i, (h, w) in enumerate([(120, 160), (97, 61), (64, 64), (300, 211)]):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w)], axis=-1)
        img = np.clip(base + rng.normal(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img, "RGB").save(out / f"rgb{i}.png")
    gray = rng.integers(0, 256, size=(77, 130), dtype=np.uint8)
    Image.fromarray(gray, "L").save(out / "gray.png")
    rgba = rng.integers(0, 256, size=(50, 90, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(out / "alpha.png")
    photo = np.clip(np.stack([np.mgrid[0:180, 0:240][1] * 1.0] * 3, axis=-1) + rng.normal(0, 10, (180, 240, 3)), 0, 255)
    Image.fromarray(photo.astype(np.uint8), "RGB").save(out / "photo.jpg", quality=92)
    for name, sizes in [("h64", [(64, 30), (64, 100), (64, 64)]), ("w64", [(30, 64), (100, 64), (64, 64)])]:
        (out.parent / name).mkdir(exist_ok=True)
        for i, (h, w) in enumerate(sizes):
            img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(img, "RGB").save(out.parent / name / f"{name}_{i}.png")


def expected(path: Path, color, resize, crop, normalize, layout):
    img = Image.open(path)
    img = img.convert("L" if color == "L" else "RGB")
    if resize is not None:
        if resize[0] == "shorter":
            n = resize[1]
            w, h = img.size
            size = (w * n // h, n) if h <= w else (n, h * n // w)
        else:
            size = (resize[1], resize[0])
        img = img.resize(size, Image.BILINEAR)
    if crop is not None:
        w, h = img.size
        top, left = (h - crop[0]) // 2, (w - crop[1]) // 2
        img = img.crop((left, top, left + crop[1], top + crop[0]))
    a = np.asarray(img)
    if a.ndim == 2:
        a = a[:, :, None]
    if color == "BGR":
        a = a[:, :, ::-1]
    if normalize is not None:
        scale, mean, std = normalize
        a = (a.astype(np.float32) * np.float32(scale) - np.array(mean, np.float32)) / np.array(std, np.float32)
    if layout == "nchw":
        a = a.transpose(2, 0, 1)
    return np.ascontiguousarray(a[None])


def main():
    root = Path(sys.argv[1])
    make_images(root / "images")
    for name, (toml, color, resize, crop, normalize, layout, *source) in CASES.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "preprocess.toml").write_text(toml)
        arrays = {}
        for f in sorted((root / (source[0] if source else "images")).iterdir()):
            shutil.copy(f, d / f.name)
            arrays[f.name] = expected(f, color, resize, crop, normalize, layout)
        np.savez(root / f"{name}.expected.npz", **arrays)


if __name__ == "__main__":
    main()
