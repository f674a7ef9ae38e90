"""The image sources DATA names: ImageFolder directories, the digits demo and synthetic tensors
(Hugging Face datasets are utils/hf_data.py's), turned into batches by utils/batches.py.

build_data picks the source from DATA (utils.cli.source_kind) and returns a utils.batches.Data.
"""
import os

import torch
from torchvision import datasets as tv_datasets

from .batches import IMAGENET_MEAN, IMAGENET_STD, Data, sharded_data, train_transform, val_transform
from .cli import source_kind
from .digits import ensure_digits
from .errors import UsageError
from .hf_data import build_hf_data, reject_dataset_flags

SYNTHETIC_STEPS = 100
SYNTHETIC_VAL_STEPS = 10
SYNTHETIC_CLASSES = 1000


def check_image_folder(path, splits=("train", "val")):
    """Clear messages for the usual ImageFolder layout mistakes. Evaluation needs val/ only."""
    if not os.path.isdir(path):
        raise UsageError(f"data directory {path!r} does not exist; give an ImageFolder root holding "
                         "train/ and val/, or leave DATA out for the digits demo")
    for split in splits:
        split_dir = os.path.join(path, split)
        if not os.path.isdir(split_dir):
            raise UsageError(f"{path!r} has no {split}/ folder; the layout is DATA/train/<class>/*.jpg "
                             "and DATA/val/<class>/*.jpg")


class SafeImageFolder(tv_datasets.ImageFolder):
    """ImageFolder whose unreadable images fail with the file's name and the fix."""

    def __getitem__(self, index):
        path = self.samples[index][0]
        try:
            return super().__getitem__(index)
        except (OSError, ValueError, SyntaxError) as err:
            raise UsageError(f"cannot read image {path!r} ({err}); remove or replace that file") from None


def image_folder(path, split, transform):
    split_dir = os.path.join(path, split)
    try:
        return SafeImageFolder(split_dir, transform=transform)
    except (FileNotFoundError, RuntimeError) as err:
        raise UsageError(f"{split_dir!r} holds no images in class folders ({err}); the layout is "
                         f"DATA/{split}/<class>/*.jpg") from None


class SyntheticBatches:
    """Random normalised images and labels made once on the device and replayed (GPU-bound runs)."""

    def __init__(self, steps, batch_size, image_size, num_classes, device, channels_last, seed):
        generator = torch.Generator(device=device).manual_seed(seed)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.images = torch.randn(batch_size, 3, image_size, image_size, device=device,
                                  generator=generator).contiguous(memory_format=memory_format)
        self.targets = torch.randint(0, num_classes, (batch_size,), device=device, generator=generator)
        self.steps = steps

    def set_epoch(self, epoch):
        pass

    def __len__(self):
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.targets


def build_data(args, accelerator, mean=None, std=None, train=True):
    """Loaders for the source in args.data, sharded over the accelerator's processes.

    mean/std default to args.mean/args.std: the model's own (a timm model's data config) or
    ImageNet's, set by utils.setup.parse_args.
    """
    mean = mean or getattr(args, "mean", None) or IMAGENET_MEAN
    std = std or getattr(args, "std", None) or IMAGENET_STD
    device = accelerator.device
    kind = source_kind(args.data)
    if kind == "datasets":  # `datasets` itself is imported only now: it is optional
        return build_hf_data(args, accelerator, mean, std, train)
    reject_dataset_flags(args, kind)
    if kind == "synthetic":
        classes = args.num_classes or SYNTHETIC_CLASSES
        steps = args.steps_per_epoch or SYNTHETIC_STEPS
        make = lambda n, seed: SyntheticBatches(n, args.batch_size, args.image_size, classes, device,
                                                args.channels_last, seed)
        val = make(SYNTHETIC_VAL_STEPS, args.seed + 1)
        return Data(make(steps, args.seed), val, classes,
                    SYNTHETIC_VAL_STEPS * args.batch_size * accelerator.num_processes)

    if kind == "digits":
        with accelerator.main_process_first():
            root = ensure_digits()
    else:
        root = args.data
        check_image_folder(root, ("train", "val") if train else ("val",))
    val_set = image_folder(root, "val", val_transform(args.image_size, args.crop_pct, args.interpolation))
    train_set = None
    if train:
        train_set = image_folder(root, "train", train_transform(args.image_size, args.min_scale, args.hflip,
                                                                args.interpolation))
        if train_set.classes != val_set.classes:
            raise UsageError(f"train/ and val/ in {root!r} hold different class folders "
                             f"({len(train_set.classes)} vs {len(val_set.classes)}); they must match")
    return sharded_data(train_set, val_set, len(val_set.classes), args, accelerator, mean, std)
