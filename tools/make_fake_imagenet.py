"""Write an ImageNet-shaped JPEG ImageFolder (about 450x360, ~100 KB files) that a model can learn.

Each class has its own colour field and stripe pattern under noise, so the loss falls within a
few hundred steps; the files are decoded like real ImageNet JPEGs, so input pipelines are tested
at real cost.  python tools/make_fake_imagenet.py OUT --classes 100 --train-per-class 100
"""
import argparse
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image


def make_image(label, index, classes, size=(450, 360)):
    rng = np.random.RandomState(label * 100_003 + index)
    width, height = size
    hue = np.array([(label * 37) % 256, (label * 91) % 256, (label * 173) % 256], dtype=np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    period = 8 + (label % 13) * 3
    angle = (label % 7) * np.pi / 7
    stripes = 0.5 + 0.5 * np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
    image = hue[None, None, :] * (0.6 + 0.4 * stripes[..., None])
    image += rng.normal(0, 30, size=image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def write_class(job):
    root, split, label, count, classes = job
    folder = os.path.join(root, split, f"n{label:08d}")
    os.makedirs(folder, exist_ok=True)
    offset = 0 if split == "train" else 1_000_000
    for index in range(count):
        make_image(label, offset + index, classes).save(os.path.join(folder, f"{index:05d}.JPEG"), quality=85)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--val-per-class", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    jobs = [(args.out, "train", c, args.train_per_class, args.classes) for c in range(args.classes)]
    jobs += [(args.out, "val", c, args.val_per_class, args.classes) for c in range(args.classes)]
    with ProcessPoolExecutor(args.jobs) as pool:
        list(pool.map(write_class, jobs))


if __name__ == "__main__":
    main()
