"""Where each image is cropped: the crop box and flip as a pure function of (seed, epoch, index).

Both input backends draw from here, so the cpu backend (CpuTrainCrop in the loader workers) and the gpu
backend (nvJPEG + batched resampling, utils/data/gpu/) train on the same boxes. The sources build
their datasets' transforms here too (train_transform, val_transform). A box is
(top, left, height, width, flip) in source pixels. train_box follows torchvision's
RandomResizedCrop.get_params (10 tries, then the centre fallback) and RandomHorizontalFlip,
but draws from a private random.Random seeded from (seed, epoch, index): no global RNG, so
the box does not depend on which worker or process serves the sample, nor on what ran before.
"""
import math
import random

import numpy as np
import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from utils.data.sizes import train_sizes_of

RATIO = (3 / 4, 4 / 3)


def sample_rng(seed, epoch, index, repeat=0):
    """A generator private to one sample. A str seed is hashed with SHA-512 by random.Random,
    so nearby keys give unrelated streams and the result does not depend on PYTHONHASHSEED.
    repeat: which of an image's copies in a repeated-augmentation epoch (the first keeps the key
    of a run without repeats)."""
    return random.Random(f"{seed}:{epoch}:{index}" + (f":{repeat}" if repeat else ""))


def train_box(seed, epoch, index, width, height, min_scale, hflip, ratio=RATIO, repeat=0):
    """RandomResizedCrop(scale=(min_scale, 1), ratio) + flip with probability hflip, as ints.

    Returns (top, left, height, width, flip). The flip is drawn after the box, always, so the
    box stream does not depend on hflip.
    """
    rng = sample_rng(seed, epoch, index, repeat)
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    box = None
    for _ in range(10):
        target_area = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            box = (rng.randint(0, height - h), rng.randint(0, width - w), h, w)
            break
    if box is None:
        box = _fallback_box(width, height, ratio)
    flip = rng.random() < hflip
    return (*box, flip)


def _fallback_box(width, height, ratio):
    """torchvision's centre crop after 10 misses: the whole image, clamped to the ratio range."""
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_size(width, height, short):
    """torchvision Resize(short) output (width, height): short side = short, long side truncated."""
    if width <= height:
        return short, int(short * height / width)
    return int(short * width / height), short


def val_resize(crop_size, crop_pct):
    """timm's --crop-pct as torchvision's resize size: the short side Resize gives."""
    return int(math.floor(crop_size / crop_pct))


def center_box(width, height, crop_size, resize_size):
    """The source-pixel box (floats) that Resize(resize_size) + CenterCrop(crop_size) covers:
    (top, left, height, width, False).

    Resampling this box to crop_size x crop_size with the kernel clipped at the image edge (as
    PIL's resize does) gives the validation transform's pixels; the box reaches outside the image
    only when crop_size > resize_size, where CenterCrop pads with zeros.
    """
    new_w, new_h = resized_size(width, height, resize_size)
    crop_top = int(round((new_h - crop_size) / 2.0))
    crop_left = int(round((new_w - crop_size) / 2.0))
    sy, sx = new_h / height, new_w / width
    return crop_top / sy, crop_left / sx, crop_size / sy, crop_size / sx, False


class TrainBoxes:
    """train_box with the run's settings bound: boxes(width, height, epoch, index, repeat), and
    size(epoch), the side the box is resized to (sizes: a TrainSizes or one size)."""

    def __init__(self, seed, min_scale, hflip, sizes, ratio=RATIO):
        self.seed, self.min_scale, self.hflip, self.ratio = seed, min_scale, hflip, ratio
        self.sizes = train_sizes_of(sizes)

    def __call__(self, width, height, epoch, index, repeat=0):
        return train_box(self.seed, epoch, index, width, height, self.min_scale, self.hflip, self.ratio, repeat)

    def size(self, epoch):
        return self.sizes.size(epoch)


class CenterBoxes:
    """center_box with the run's settings bound; the same signatures as TrainBoxes."""

    def __init__(self, crop_size, resize_size):
        self.crop_size, self.resize_size = crop_size, resize_size

    def __call__(self, width, height, epoch, index, repeat=0):
        return center_box(width, height, self.crop_size, self.resize_size)

    def size(self, epoch):
        return self.crop_size


class CpuTrainCrop:
    """The cpu backend's train transform: the shared box (train_box), then crop, resize and flip.

    crop(image, seed, epoch, index, repeat) -> uint8 (S, S, 3) tensor, S the epoch's size (sizes: a
    TrainSizes or one size), rows x columns x
    RGB, from a uint8 HWC RGB tensor (utils.data.image_files.rgb_pixels) or an RGB PIL image (Hugging
    Face rows). Bilinear and bicubic resize with torch's antialiased uint8 kernels: on the 2-core
    development machine 0.31 ms for a 224-px crop of a 500x375 photo where PIL's resize took
    0.85-0.92 ms (a third of a worker's time per image, the JPEG decode most of the rest), with
    pixels within one level of PIL's (bicubic's overshoot, clipped at other points, up to 8).
    Nearest keeps PIL's resize: torch's nearest picks other source pixels than PIL's.
    """

    def __init__(self, sizes, min_scale, hflip, interpolation="bilinear", ratio=RATIO):
        self.sizes = train_sizes_of(sizes)
        self.min_scale, self.hflip, self.ratio = min_scale, hflip, ratio
        self.mode = InterpolationMode(interpolation)

    def box(self, image, seed, epoch, index, repeat=0):
        height, width = image.shape[:2] if torch.is_tensor(image) else image.size[::-1]
        return train_box(seed, epoch, index, width, height, self.min_scale, self.hflip, self.ratio, repeat)

    def __call__(self, image, seed, epoch, index, repeat=0):
        top, left, height, width, flip = self.box(image, seed, epoch, index, repeat)
        size = [self.sizes.size(epoch)] * 2
        if self.mode == InterpolationMode.NEAREST:
            image = Image.fromarray(image.numpy()) if torch.is_tensor(image) else image
            image = F.resized_crop(image, top, left, height, width, size, interpolation=self.mode)
            return torch.from_numpy(np.array(F.hflip(image) if flip else image))
        # The crop is copied out once, rows x columns x RGB: as (1, 3, h, w) that is the
        # channels_last layout the uint8 kernels want.
        if torch.is_tensor(image):
            region = image[top:top + height, left:left + width].contiguous()
        else:
            region = torch.from_numpy(np.array(np.asarray(image)[top:top + height, left:left + width]))
        out = torch.nn.functional.interpolate(region.permute(2, 0, 1).unsqueeze(0), size=size,
                                              mode=self.mode.value, antialias=True)[0].permute(1, 2, 0)
        return out.flip(1) if flip else out


def train_transform(sizes, min_scale, hflip, interpolation="bilinear"):
    """RandomResizedCrop + flip whose box and flip are drawn from (seed, epoch, index) by train_box,
    the same boxes the gpu backend crops, resized to the epoch's size (sizes: a TrainSizes or one
    size). utils.data.batches.SeededSamples calls it with that key."""
    return CpuTrainCrop(sizes, min_scale, hflip, interpolation)


def val_transform(crop_size, resize_size, interpolation="bilinear"):
    """Resize(resize_size) + CenterCrop(crop_size) on PIL images (center_box is the box it covers,
    for the gpu backend)."""
    mode = transforms.InterpolationMode(interpolation)
    return transforms.Compose([transforms.Resize(resize_size, interpolation=mode), transforms.CenterCrop(crop_size)])
