#!/usr/bin/env python3
"""Write an ImageNet-shaped JPEG ImageFolder that a model can learn, with ImageNet's file statistics.

Files: about 500x375 (size and aspect jittered, portrait ones too), quality 90, about 110 KB on
average like ImageNet's train JPEGs, with photo-like content: a smooth colour field, class
shapes, multi-scale texture and sensor noise. Each class has its own palette, stripe direction
and period and shape kind, so the loss falls within a few hundred steps. A few files are the
odd kinds ImageNet holds (grayscale JPEGs, CMYK JPEGs, a PNG named .JPEG), so the input
pipelines' fallbacks run too. Deterministic: the same flags write the same bytes. OUT must be a
new or empty folder (never mixed into, never replaced: remove an old one yourself); one that cannot
take files is refused before any image is made, and a full disk midway is one line and exit code 4.

    python tools/make_fake_imagenet.py OUT --classes 100 --train-per-class 500 --jobs 8
"""
import argparse
import io
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere, yet import the project's utils
from utils.run.errors import WriteError, exit_on_usage_error  # noqa: E402
from utils.run.files import atomic_write, check_output_folder  # noqa: E402

ODD_KINDS = ("grayscale", "cmyk", "png")


def image_size(rng, width, height, jitter):
    """ImageNet-like: most landscape 4:3 near width x height, a quarter portrait, sizes +-jitter."""
    scale = 1 + rng.uniform(-jitter, jitter)
    aspect = rng.choice([4 / 3, 4 / 3, 3 / 2, 1.0, 5 / 4])
    w = int(width * scale)
    h = max(32, int(w / aspect * (height * 4 / 3) / width))
    return (h, w) if rng.rand() < 0.25 else (w, h)


def texture(rng, height, width, cells, amplitude):
    """Value noise: a coarse random grid bilinearly upsampled (cheap, smooth, photo-like)."""
    grid = rng.normal(0, amplitude, size=(cells + 2, cells + 2, 3)).astype(np.float32)
    grid = np.asarray(Image.fromarray(grid[..., 0]).resize((width, height), Image.BILINEAR))[..., None] \
        + rng.normal(0, amplitude / 3, size=(1, 1, 3)).astype(np.float32)
    return grid


def make_image(label, index, classes, size=(500, 375), jitter=0.2, seed=0):
    """One RGB image of class `label`: palette, stripes and shape kind depend on the class only."""
    rng = np.random.RandomState((seed * 1_000_003 + label * 100_003 + index) % 2 ** 32)
    width, height = image_size(rng, *size, jitter)
    palette = np.array([(label * 37) % 256, (label * 91) % 256, (label * 173) % 256], dtype=np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    period = 8 + (label % 13) * 3
    angle = (label % 7) * np.pi / 7 + rng.uniform(-0.15, 0.15)
    stripes = 0.5 + 0.5 * np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period + rng.uniform(0, 6.3))
    light = 0.7 + 0.3 * (xx / width * rng.uniform(-1, 1) + yy / height * rng.uniform(-1, 1))
    image = palette * (0.55 + 0.35 * stripes[..., None]) * light[..., None]
    image += 60 * _shape_mask(rng, label, xx, yy, width, height)[..., None] * (rng.rand(3) - 0.5)
    for cells, amplitude in ((4, 25), (16, 14), (64, 8)):
        image += texture(rng, height, width, cells, amplitude)
    # Grain, mostly in brightness as in photos (colour varies slowly): it makes files ~110 KB at q90.
    image += rng.normal(0, 26, size=(height, width, 1)) + rng.normal(0, 6, size=image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def _shape_mask(rng, label, xx, yy, width, height):
    """A class-dependent shape (disc, box or ring) at a random place: an 'object' to find."""
    cx, cy = rng.uniform(0.25, 0.75) * width, rng.uniform(0.25, 0.75) * height
    radius = rng.uniform(0.15, 0.35) * min(width, height)
    kind = label % 3
    if kind == 0:
        return (((xx - cx) ** 2 + (yy - cy) ** 2) < radius ** 2).astype(np.float32)
    if kind == 1:
        return ((abs(xx - cx) < radius) & (abs(yy - cy) < radius * 0.6)).astype(np.float32)
    distance = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2)
    return (abs(distance - radius) < radius * 0.2).astype(np.float32)


def encode(image, kind, quality):
    """JPEG bytes of the image; the odd kinds as ImageNet has them."""
    buffer = io.BytesIO()
    if kind == "png":  # a PNG under a .JPEG name (ImageNet's n02105855_2933.JPEG)
        image.save(buffer, format="PNG", compress_level=1)
    elif kind == "cmyk":
        image.convert("CMYK").save(buffer, format="JPEG", quality=quality)
    elif kind == "grayscale":
        image.convert("L").save(buffer, format="JPEG", quality=quality)
    else:
        image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def odd_kind(number, odd_every):
    """Files 0, 1, 2 of every odd_every in a split are grayscale, CMYK, PNG (0 turns them off)."""
    if odd_every and number % odd_every < len(ODD_KINDS):
        return ODD_KINDS[number % odd_every]
    return None


def write_class(job):
    root, split, label, count, args = job
    folder = os.path.join(root, split, f"n{label:08d}")  # made by the first atomic_write
    offset = 0 if split == "train" else 1_000_000
    total = 0
    for index in range(count):
        image = make_image(label, offset + index, args.classes, (args.width, args.height), args.size_jitter,
                           args.seed)
        data = encode(image, odd_kind(label * count + index, args.odd_every), args.quality)
        atomic_write(os.path.join(folder, f"{index:05d}.JPEG"), data)  # no half-written image on a full disk
        total += len(data)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write OUT/train/<class>/*.JPEG and OUT/val/<class>/*.JPEG into")
    parser.add_argument("--classes", type=int, default=100, help="number of classes (default: 100)")
    parser.add_argument("--train-per-class", type=int, default=100, help="train images a class (default: 100)")
    parser.add_argument("--val-per-class", type=int, default=10, help="val images a class (default: 10)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes (default: all cores)")
    parser.add_argument("--width", type=int, default=500, help="typical width (default: 500)")
    parser.add_argument("--height", type=int, default=375, help="typical height (default: 375)")
    parser.add_argument("--size-jitter", type=float, default=0.2, help="relative size jitter (default: 0.2)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default: 90)")
    parser.add_argument("--odd-every", type=int, default=1000,
                        help="of every N files in a split, one grayscale, one CMYK, one PNG-in-.JPEG "
                             "(default: 1000; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="content seed (default: 0)")
    args = parser.parse_args()
    for flag, value, low in (("--classes", args.classes, 1), ("--train-per-class", args.train_per_class, 1),
                             ("--val-per-class", args.val_per_class, 1), ("--jobs", args.jobs, 1),
                             ("--width", args.width, 16), ("--height", args.height, 16),
                             ("--quality", args.quality, 1), ("--odd-every", args.odd_every, 0)):
        if value < low:
            parser.error(f"{flag} {value}: at least {low}")
    if not 0 <= args.size_jitter < 1:
        parser.error(f"--size-jitter {args.size_jitter}: from 0 up to (not including) 1")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        parser.error(f"{args.out!r} exists and is not an empty folder: new files would mix with what it holds; "
                     "give a new folder (or remove that one)")
    check_output_folder(args.out, "OUT")  # made, and a probe file proves it takes files (as root too)
    jobs = [(args.out, "train", c, args.train_per_class, args) for c in range(args.classes)]
    jobs += [(args.out, "val", c, args.val_per_class, args) for c in range(args.classes)]
    try:
        with ProcessPoolExecutor(args.jobs) as pool:
            total = sum(pool.map(write_class, jobs))
    except WriteError as err:  # a full disk midway: one line, exit 4 (the images written so far stay)
        raise WriteError(err.path, err.error, f"; {args.out} holds part of the images: remove it, free "
                                              "space, and run again") from None
    files = args.classes * (args.train_per_class + args.val_per_class)
    print(f"wrote {files} files, {total / max(files, 1) / 1024:.0f} KB on average, into {args.out}")


if __name__ == "__main__":
    exit_on_usage_error(main)
