"""Input transformations that make a domain: the feature-shift half of non-IID data.

A *recipe* is a string `name` or `name:parameter`, e.g. `rotate:90`, `tint:red`,
`gaussian_noise:3`; the recipe itself is the domain's name in metrics
(`personal/acc/domain=rotate:90`). Transformations act on a block of images (N, C, H, W) scaled
to [0, 1] and draw any randomness from the generator they are given, so the same seed gives the
same images. `rayfl.data.domains` applies them once, when the federation is built.

Two families (`rayfl ls partitioners` lists them): parameterised transformations, and
corruptions at severities 1-5 of CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019,
github.com/hendrycks/robustness, `make_cifar_c.py`), whose severity constants are followed.
Deviations: `brightness` scales a pixel's RGB by the ratio HSV's value gains (the same as
adding to V), `impulse_noise` salts and peppers each value independently (scikit-image's
`s&p`), `elastic_transform` is Simard et al. (2003)'s smoothed random field with rayfl's own
strengths (CIFAR-10-C adds an affine part). MNIST-C (Mu & Gilmer 2019)'s affine corruptions
are `rotate`, `shear` and `scale`. The corruptions left out are listed in docs/data.md.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from rayfl.errors import ConfigError, suggest

Transform = Callable[[np.ndarray, Any, np.random.Generator], np.ndarray]


@dataclass(frozen=True)
class Recipe:
    """One transformation: its function, the kind of its parameter and one line of help."""

    fn: Transform
    param: str  # "none", "number", "colour" or "severity" (an integer 1-5)
    help: str
    rgb: bool = False  # its output has three channels (the federation's images become RGB)


TRANSFORMS: dict[str, Recipe] = {}

# RGB weights of `tint`: each channel is scaled by the colour's component.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.25, 0.25),
    "green": (0.25, 1.0, 0.25),
    "blue": (0.25, 0.25, 1.0),
    "yellow": (1.0, 1.0, 0.25),
    "cyan": (0.25, 1.0, 1.0),
    "magenta": (1.0, 0.25, 1.0),
}


def _register(
    name: str, param: str, help: str, rgb: bool = False
) -> Callable[[Transform], Transform]:
    def wrap(fn: Transform) -> Transform:
        TRANSFORMS[name] = Recipe(fn, param, help, rgb)
        return fn

    return wrap


def parse(recipe: str, key: str = "data.domains.transforms") -> tuple[str, Any]:
    """(name, parameter) of a recipe string, checked; a ConfigError names `key` and the fix."""
    if not isinstance(recipe, str) or not recipe:
        raise ConfigError(f"{key}: {recipe!r} is not a recipe; write e.g. rotate:90 or blur:1.5")
    name, _, raw = recipe.partition(":")
    if name not in TRANSFORMS:
        raise ConfigError(
            f"{key}: unknown transformation {name!r}{suggest(name, TRANSFORMS)}; "
            f"see `rayfl ls partitioners` for the list"
        )
    kind = TRANSFORMS[name].param
    if kind == "none":
        if raw:
            raise ConfigError(f"{key}: {name} takes no parameter (write {name}, not {recipe})")
        return name, None
    if not raw:
        raise ConfigError(f"{key}: {name} needs a parameter ({TRANSFORMS[name].help})")
    if kind == "colour":
        if raw not in COLOURS:
            raise ConfigError(
                f"{key}: unknown colour {raw!r}{suggest(raw, COLOURS)}; choose one of "
                f"{', '.join(COLOURS)}"
            )
        return name, raw
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key}: {recipe}: {raw!r} is not a number") from None
    if kind == "severity":
        if value not in (1, 2, 3, 4, 5):
            raise ConfigError(f"{key}: {recipe}: the severity must be an integer 1-5")
        return name, int(value)
    if not np.isfinite(value):
        raise ConfigError(f"{key}: {recipe}: the parameter must be finite")
    return name, value


def needs_rgb(recipes: list[str] | tuple[str, ...]) -> bool:
    """Whether any recipe makes three-channel images."""
    return any(TRANSFORMS[parse(r)[0]].rgb for r in recipes)


def apply(recipe: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`x` (N, C, H, W) float32 in [0, 1] transformed by `recipe`; a new float32 array."""
    name, param = parse(recipe)
    out = TRANSFORMS[name].fn(np.asarray(x, dtype=np.float32), param, rng)
    return np.asarray(out, dtype=np.float32)


def describe() -> list[str]:
    """One line per transformation: `name:PARAM  help`."""
    shown = {"none": "", "number": ":X", "colour": ":COLOUR", "severity": ":1-5"}
    rows = [(f"{n}{shown[r.param]}", r.help) for n, r in TRANSFORMS.items()]
    width = max(len(r[0]) for r in rows)
    return [f"  {a.ljust(width)}  {b}" for a, b in rows]


# --------------------------------------------------------------------------- helpers


def _affine(x: np.ndarray, matrix: np.ndarray, order: int = 1) -> np.ndarray:
    """Resample every image with the 2x2 map `matrix` about its centre (zero outside)."""
    from scipy import ndimage

    h, w = x.shape[-2:]
    centre = np.array([(h - 1) / 2, (w - 1) / 2])
    full = np.eye(4)
    full[2:, 2:] = matrix
    offset = np.zeros(4)
    offset[2:] = centre - matrix @ centre
    return ndimage.affine_transform(x, full, offset=offset, order=order, mode="constant")


def _gaussian(x: np.ndarray, sigma: float) -> np.ndarray:
    from scipy import ndimage

    return ndimage.gaussian_filter(x, sigma=(0, 0, sigma, sigma), mode="nearest")


def _each_image(x: np.ndarray, fn: Callable[[Any], Any]) -> np.ndarray:
    """Apply a PIL function to every (C, H, W) image; grey and RGB only."""
    out = np.empty_like(x)
    u8 = np.clip(np.rint(x * 255), 0, 255).astype(np.uint8)
    for i, img in enumerate(u8):
        mode = "L" if img.shape[0] == 1 else "RGB"
        pil = Image.fromarray(img[0] if mode == "L" else img.transpose(1, 2, 0), mode)
        arr = np.asarray(fn(pil), dtype=np.float32) / 255.0
        out[i] = arr[None] if mode == "L" else arr.transpose(2, 0, 1)
    return out


# --------------------------------------------------------------------------- transformations


@_register("identity", "none", "the base data, unchanged")
def identity(x: np.ndarray, _: Any, rng: np.random.Generator) -> np.ndarray:
    return x.copy()


@_register("rotate", "number", "rotate by X degrees counter-clockwise (multiples of 90 exact)")
def rotate(x: np.ndarray, degrees: float, rng: np.random.Generator) -> np.ndarray:
    if float(degrees) % 90 == 0:
        return np.ascontiguousarray(np.rot90(x, k=int(degrees // 90) % 4, axes=(2, 3)))
    t = np.deg2rad(degrees)
    # output (row, col) reads input at R(-t) about the centre; rows grow downwards
    matrix = np.array([[np.cos(t), np.sin(t)], [-np.sin(t), np.cos(t)]])
    return _affine(x, matrix)


@_register("tint", "colour", f"colour the images ({', '.join(COLOURS)}); grey becomes RGB", True)
def tint(x: np.ndarray, colour: str, rng: np.random.Generator) -> np.ndarray:
    rgb = np.repeat(x, 3, axis=1) if x.shape[1] == 1 else x
    return rgb * np.asarray(COLOURS[colour], dtype=np.float32)[None, :, None, None]


@_register("invert", "none", "1 - x: bright strokes on dark become dark on bright")
def invert(x: np.ndarray, _: Any, rng: np.random.Generator) -> np.ndarray:
    return 1.0 - x


@_register("blur", "number", "Gaussian blur of standard deviation X pixels")
def blur(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return _gaussian(x, sigma)


@_register("shear", "number", "horizontal shear: row r shifts by X * (r - centre) pixels")
def shear(x: np.ndarray, amount: float, rng: np.random.Generator) -> np.ndarray:
    return _affine(x, np.array([[1.0, 0.0], [amount, 1.0]]))


@_register("scale", "number", "zoom by factor X about the centre (X < 1 shrinks)")
def scale(x: np.ndarray, factor: float, rng: np.random.Generator) -> np.ndarray:
    if factor <= 0:
        raise ConfigError(f"data.domains.transforms: scale:{factor} needs a factor > 0")
    return _affine(x, np.eye(2) / factor)


@_register("noise", "number", "add Gaussian noise of standard deviation X (pixels in [0, 1])")
def noise(x: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    return x + rng.normal(scale=abs(std), size=x.shape).astype(np.float32)


# --------------------------------------------------------------------------- CIFAR-10-C recipes


def _severity(name: str, values: tuple[Any, ...], help: str) -> Callable[[Transform], Transform]:
    """Register a corruption whose function takes the severity's constant."""

    def wrap(fn: Transform) -> Transform:
        def at(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
            return np.clip(fn(x, values[severity - 1], rng), 0.0, 1.0)

        TRANSFORMS[name] = Recipe(at, "severity", help)
        return fn

    return wrap


@_severity("gaussian_noise", (0.04, 0.06, 0.08, 0.09, 0.10), "CIFAR-10-C Gaussian noise")
def gaussian_noise(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return x + rng.normal(scale=c, size=x.shape)


@_severity("shot_noise", (500, 250, 100, 75, 50), "CIFAR-10-C shot (Poisson) noise")
def shot_noise(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return rng.poisson(np.clip(x, 0, 1) * c) / c


@_severity("impulse_noise", (0.01, 0.02, 0.03, 0.05, 0.07), "CIFAR-10-C salt-and-pepper noise")
def impulse_noise(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    u = rng.random(x.shape)
    return np.where(u < c / 2, 0.0, np.where(u < c, 1.0, x))


@_severity("speckle_noise", (0.06, 0.1, 0.12, 0.16, 0.2), "CIFAR-10-C speckle noise")
def speckle_noise(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return x + x * rng.normal(scale=c, size=x.shape)


@_severity("gaussian_blur", (0.4, 0.6, 0.7, 0.8, 1.0), "CIFAR-10-C Gaussian blur")
def gaussian_blur(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return _gaussian(x, c)


@_severity(
    "defocus_blur",
    ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),
    "CIFAR-10-C defocus blur (an anti-aliased disk kernel)",
)
def defocus_blur(x: np.ndarray, c: tuple[float, float], rng: np.random.Generator) -> np.ndarray:
    from scipy import ndimage

    radius, alias = c
    r = np.arange(-8, 9)
    xx, yy = np.meshgrid(r, r)
    disk = (xx**2 + yy**2 <= radius**2).astype(np.float64)
    disk = ndimage.gaussian_filter(disk / disk.sum(), alias, truncate=1.0 / alias)
    kernel = (disk / disk.sum())[None, None]
    return ndimage.convolve(x, kernel, mode="reflect")


@_severity(
    "zoom_blur",
    tuple(np.arange(1, top, 0.01) for top in (1.06, 1.11, 1.16, 1.21, 1.26)),
    "CIFAR-10-C zoom blur (mean of centre zooms)",
)
def zoom_blur(x: np.ndarray, c: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = x.copy()
    for factor in c:
        out += _affine(x, np.eye(2) / factor)
    return out / (len(c) + 1)


@_severity("contrast", (0.75, 0.5, 0.4, 0.3, 0.15), "CIFAR-10-C contrast (towards each mean)")
def contrast(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    means = x.mean(axis=(1, 2, 3), keepdims=True)
    return (x - means) * c + means


@_severity("brightness", (0.05, 0.1, 0.15, 0.2, 0.3), "CIFAR-10-C brightness (HSV value up)")
def brightness(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    v = x.max(axis=1, keepdims=True)
    gain = np.minimum(v + c, 1.0) / np.maximum(v, 1e-6)
    return np.where(v > 0, x * gain, c)


@_severity("pixelate", (0.95, 0.9, 0.85, 0.75, 0.65), "CIFAR-10-C pixelate (box down and up)")
def pixelate(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    h, w = x.shape[-2:]
    small = (max(1, int(w * c)), max(1, int(h * c)))
    return _each_image(
        x, lambda im: im.resize(small, Image.Resampling.BOX).resize((w, h), Image.Resampling.BOX)
    )


@_severity("jpeg_compression", (80, 65, 58, 50, 40), "CIFAR-10-C JPEG at quality 80..40")
def jpeg_compression(x: np.ndarray, quality: int, rng: np.random.Generator) -> np.ndarray:
    def jpeg(im: Any) -> Any:
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
        return Image.open(io.BytesIO(buf.getvalue())).convert(im.mode)

    return _each_image(x, jpeg)


@_severity(
    "elastic_transform",
    (10.0, 20.0, 30.0, 40.0, 50.0),
    "elastic distortion (Simard et al. 2003), a fresh smooth field per image",
)
def elastic_transform(x: np.ndarray, alpha: float, rng: np.random.Generator) -> np.ndarray:
    from scipy import ndimage

    n, c, h, w = x.shape
    field = rng.uniform(-1, 1, size=(2, n, 1, h, w))
    field = ndimage.gaussian_filter(field, sigma=(0, 0, 0, 4.0, 4.0), mode="constant") * alpha
    grid = np.indices(x.shape, dtype=np.float64)
    grid[2] += field[0]
    grid[3] += field[1]
    return ndimage.map_coordinates(x, grid, order=1, mode="reflect")


def plasma_fractal(n: int, size: int, decay: float, rng: np.random.Generator) -> np.ndarray:
    """`n` diamond-square height maps of `size` x `size` (a power of two) in [0, 1], each
    octave's random amplitude divided by `decay` (CIFAR-10-C's `plasma_fractal`, batched)."""
    m = np.zeros((n, size, size))
    step, wibble = size, 100.0

    def jitter(a: np.ndarray) -> np.ndarray:
        return a / 4 + wibble * rng.uniform(-wibble, wibble, a.shape)

    while step >= 2:
        half = step // 2
        corners = m[:, ::step, ::step]
        squares = corners + np.roll(corners, -1, axis=1)
        squares = squares + np.roll(squares, -1, axis=2)
        m[:, half::step, half::step] = jitter(squares)
        centres, corners = m[:, half::step, half::step], m[:, ::step, ::step]
        m[:, ::step, half::step] = jitter(
            centres + np.roll(centres, 1, axis=1) + corners + np.roll(corners, -1, axis=2)
        )
        m[:, half::step, ::step] = jitter(
            centres + np.roll(centres, 1, axis=2) + corners + np.roll(corners, -1, axis=1)
        )
        step, wibble = half, wibble / decay
    m -= m.min(axis=(1, 2), keepdims=True)
    return m / np.maximum(m.max(axis=(1, 2), keepdims=True), 1e-12)


@_severity(
    "fog",
    ((0.2, 3.0), (0.5, 3.0), (0.75, 2.5), (1.0, 2.0), (1.5, 1.75)),
    "CIFAR-10-C fog (a plasma fractal added, contrast lowered)",
)
def fog(x: np.ndarray, c: tuple[float, float], rng: np.random.Generator) -> np.ndarray:
    n, _, h, w = x.shape
    size = 1 << max(1, int(np.ceil(np.log2(max(h, w)))))
    haze = plasma_fractal(n, size, c[1], rng)[:, None, :h, :w]
    top = x.max(axis=(1, 2, 3), keepdims=True)
    return (x + c[0] * haze) * top / (top + c[0])
