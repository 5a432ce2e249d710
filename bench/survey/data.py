"""Deterministic input generators for the survey models.

Photographs come from scikit-image's bundled sample images (random crops, scales and flips),
speech from a synthetic source-filter model (glottal pulse train through moving formant
resonators, syllable envelopes, pauses, fricative onsets, coloured background noise at 5-35 dB
SNR, sometimes clipped), text and tables are rendered in the DejaVu fonts. Every generator takes
its random generator from the caller, so a seed fixes the whole data set.
"""
from __future__ import annotations

import glob
import warnings

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont
from scipy.signal import lfilter

SR = 16000
VOWELS = [(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410),
          (440, 1020, 2240), (660, 1720, 2410), (490, 1350, 1690)]
FONTS = [f for f in sorted(glob.glob("/usr/share/fonts/truetype/dejavu/DejaVu*.ttf")) if "Math" not in f]
PHOTOS = ["astronaut", "camera", "cat", "chelsea", "coffee", "rocket", "retina", "hubble_deep_field",
          "immunohistochemistry", "brick", "grass", "gravel", "moon", "coins", "clock", "colorwheel",
          "stereo_motorcycle", "page", "text", "logo"]
_POOL: list = []


def _skdata():
    warnings.filterwarnings("ignore")
    import skimage.data

    return skimage.data


def photo_pool():
    if not _POOL:
        for n in PHOTOS:
            a = getattr(_skdata(), n)()
            if isinstance(a, tuple):
                _POOL.extend(np.asarray(x) for x in a[:2])
                continue
            a = np.asarray(a)
            if a.ndim == 2:
                a = np.stack([a] * 3, -1)
            _POOL.append(a[..., :3].astype(np.uint8))
    return _POOL


def lfw_subset():
    """200 grey 25x25 crops in [0, 1]: 100 faces, then 100 non-faces."""
    return _skdata().lfw_subset()


def crop(rng, h, w):
    """Random crop (scale 0.35-1, random flip) of a random photo, resized to h x w RGB uint8."""
    pool = photo_pool()
    p = pool[rng.randint(0, len(pool) - 1)]
    H, W = p.shape[:2]
    s = rng.uniform(0.35, 1.0)
    ch, cw = max(8, int(H * s)), max(8, int(W * s))
    ar = w / h
    if cw / ch > ar:
        cw = int(ch * ar)
    else:
        ch = int(cw / ar)
    y, x = rng.randint(0, H - ch), rng.randint(0, W - cw)
    a = np.asarray(Image.fromarray(p[y:y + ch, x:x + cw]).resize((w, h), Image.BILINEAR))
    if rng.random() < 0.5:
        a = a[:, ::-1]
    return np.ascontiguousarray(a)


def _reson(x, f, bw):
    r = np.exp(-np.pi * bw / SR)
    th = 2 * np.pi * f / SR
    return lfilter([1 - r], [1, -2 * r * np.cos(th), r * r], x)


def speechlike(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """Speech-like float32 audio at 16 kHz, peak 0.1-0.95."""
    n = int(seconds * SR)
    out = np.zeros(n)
    t = 0
    speech_frac = rng.uniform(0.3, 0.9)
    f0base = rng.uniform(90, 240)
    while t < n:
        if rng.random() < speech_frac:
            L = min(int(rng.uniform(0.12, 0.35) * SR), n - t)
            if L < 64:
                break
            f0 = f0base * (1 + 0.15 * np.sin(np.linspace(0, rng.uniform(1, 4), L))) * (1 + 0.01 * rng.standard_normal())
            src = (np.cumsum(f0 / SR) % 1.0) - 0.5
            src += 0.02 * rng.standard_normal(L)
            v = VOWELS[rng.integers(len(VOWELS))]
            y = sum(_reson(src, f * rng.uniform(0.9, 1.1), 80 + 40 * k) * (0.5 ** k) for k, f in enumerate(v))
            seg = y * np.sin(np.linspace(0, np.pi, L)) ** rng.uniform(0.5, 2)
            if rng.random() < 0.3:
                m = min(L, int(0.06 * SR))
                seg[:m] += lfilter([1, -0.95], [1], rng.standard_normal(m)) * 0.05
            out[t:t + L] += seg / (np.max(np.abs(seg)) + 1e-9) * rng.uniform(0.2, 0.8)
            t += L
        else:
            t += int(rng.uniform(0.1, 0.6) * SR)
    noise = lfilter([1], [1, -rng.uniform(0, 0.95)], rng.standard_normal(n))
    snr = rng.uniform(5, 35)
    ps = np.mean(out ** 2) + 1e-9
    noise *= np.sqrt(ps / (10 ** (snr / 10)) / (np.mean(noise ** 2) + 1e-12))
    x = out + noise
    if rng.random() < 0.3:
        x = np.clip(x * rng.uniform(1, 3), -0.6, 0.6)
    x = x / (np.max(np.abs(x)) + 1e-9) * rng.uniform(0.1, 0.95)
    return x.astype(np.float32)


def captcha(rng, text):
    """Captcha-like line: rotated glyphs on a light background, strokes, dots, sometimes blurred."""
    fonts = [f for f in FONTS if "ExtraLight" not in f]
    font = ImageFont.truetype(rng.choice(fonts), rng.randint(34, 46))
    w = 30 + 28 * len(text) + rng.randint(0, 30)
    img = Image.new("RGB", (w, 64), tuple(rng.randint(180, 255) for _ in range(3)))
    dr = ImageDraw.Draw(img)
    x = rng.randint(5, 15)
    for ch in text:
        col = tuple(rng.randint(0, 110) for _ in range(3))
        ci = Image.new("RGBA", (60, 64), (0, 0, 0, 0))
        ImageDraw.Draw(ci).text((8, 4), ch, font=font, fill=col + (255,))
        ci = ci.rotate(rng.uniform(-20, 20), resample=Image.BICUBIC)
        img.paste(ci, (x - 8, rng.randint(-6, 6)), ci)
        x += int(font.size * 0.62) + rng.randint(-3, 3)
    for _ in range(rng.randint(1, 4)):
        dr.line([(rng.randint(0, w), rng.randint(0, 64)), (rng.randint(0, w), rng.randint(0, 64))],
                fill=tuple(rng.randint(60, 200) for _ in range(3)), width=rng.randint(1, 2))
    for _ in range(rng.randint(50, 200)):
        dr.point((rng.randint(0, w - 1), rng.randint(0, 63)), fill=tuple(rng.randint(0, 255) for _ in range(3)))
    img = img.crop((0, 0, min(w, x + 12), 64))
    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    return img


def glyphs_on_photo(rng, alphabet):
    """BGR photo crop (one of four sizes) with 3-6 large stroked glyphs drawn on it."""
    h, w = rng.choice([(160, 344), (200, 300), (416, 416), (150, 400)])
    im = Image.fromarray(crop(rng, h, w))
    dr = ImageDraw.Draw(im)
    for _ in range(rng.randint(3, 6)):
        font = ImageFont.truetype(rng.choice(FONTS), rng.randint(24, 44))
        dr.text((rng.randint(0, w - 40), rng.randint(0, h - 45)), rng.choice(alphabet), font=font,
                fill=tuple(rng.randint(0, 255) for _ in range(3)), stroke_width=rng.randint(0, 2),
                stroke_fill=tuple(rng.randint(0, 255) for _ in range(3)))
    return np.asarray(im)[:, :, ::-1]


def table(rng):
    """RGB image of a 2-8 x 2-5 table, ruled or not, optional shaded header row."""
    rows, cols = rng.randint(2, 9), rng.randint(2, 6)
    cw = [rng.randint(60, 160) for _ in range(cols)]
    rh = rng.randint(24, 40)
    W, H = sum(cw) + 20, rows * rh + 20
    im = Image.new("RGB", (W, H), (255, 255, 255))
    dr = ImageDraw.Draw(im)
    font = ImageFont.truetype(rng.choice(FONTS), rng.randint(11, 16))
    lines = rng.random() < 0.7
    y = 10
    for r in range(rows):
        x = 10
        if r == 0 and rng.random() < 0.5:
            dr.rectangle([10, y, W - 10, y + rh], fill=(220, 220, 235))
        for c in range(cols):
            if lines:
                dr.rectangle([x, y, x + cw[c], y + rh], outline=(0, 0, 0))
            txt = "".join(rng.choice("abcdefghij0123456789 ") for _ in range(rng.randint(2, cw[c] // 9)))
            dr.text((x + 4, y + 5), txt, font=font, fill=(0, 0, 0))
            x += cw[c]
        if not lines and r == 0:
            dr.line([10, y + rh, W - 10, y + rh], fill=(0, 0, 0))
        y += rh
    return np.asarray(im)
