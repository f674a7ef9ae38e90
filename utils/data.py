"""The image sources DATA names: ImageFolder directories, the digits demo and synthetic tensors
(Hugging Face datasets are utils/hf_data.py's), turned into batches by utils/batches.py.

build_data picks the source from DATA (utils.cli.source_kind) and returns a utils.batches.Data.
"""
import os
import stat
import sys

import torch
from torchvision import datasets as tv_datasets
from torchvision.datasets.folder import IMG_EXTENSIONS

from .batches import (IMAGENET_MEAN, IMAGENET_STD, Data, rgb_loader, sharded_data, train_transform,
                      val_transform)
from .cli import source_kind
from .crops import CpuTrainCrop
from .digits import ensure_digits
from .errors import UnreadableInput, UsageError
from .hf_data import build_hf_data, reject_dataset_flags
from .image_files import UNREADABLE_IMAGE, rgb_pixels

SYNTHETIC_STEPS = 100
SYNTHETIC_VAL_STEPS = 10
SYNTHETIC_CLASSES = 1000


def check_image_folder(path, splits=("train", "val")):
    """Clear messages for the usual ImageFolder layout mistakes. Evaluation needs val/ only."""
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise UsageError(f"data directory {path!r} {what}; give an ImageFolder root holding "
                         "train/ and val/, or leave DATA out for the digits demo")
    for split in splits:
        split_dir = os.path.join(path, split)
        if not os.path.isdir(split_dir):
            parent = os.path.dirname(os.path.abspath(path))
            # DATA/train given for DATA: the commonest slip, so name the folder meant
            above = (f" (give {parent!r}, the folder above it)" if os.path.basename(os.path.normpath(path))
                     in ("train", "val") and all(os.path.isdir(os.path.join(parent, s)) for s in splits) else "")
            raise UsageError(f"{path!r} has no {split}/ folder{above}; the layout is DATA/train/<class>/*.jpg "
                             "and DATA/val/<class>/*.jpg")


SHOWN_SKIPS = 10  # paths a skip warning names; the count covers the rest


def scan_class_folders(directory, class_to_idx, extensions=IMG_EXTENSIONS):
    """ImageFolder's (path, class index) samples, in torchvision's order, from folders as found on
    real disks; returns (samples, skipped) with skipped a list of (path, reason).

    torchvision's make_dataset walks with os.walk(followlinks=True): a link back up the tree makes
    it walk in circles (each image counted once per lap until paths grow too long), a file reached
    twice through links counts twice, and a FIFO named x.jpg is kept and blocks the worker that
    opens it forever. Here links to folders are still followed, but every real folder is walked
    once and every real file (device, inode) counted once; only regular files are kept (stat does
    not open a FIFO); and everything left out is named rather than silently dropped.
    """
    skipped = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not entry.is_dir():  # ImageFolder takes class folders only
            skipped.append((entry.path, "not a class folder"))
    def identity(path):
        info = os.stat(path)
        return info.st_dev, info.st_ino

    # The split folder and every class folder belong to themselves: a link from one class into
    # the split or another class (a loop up the tree, or another class's images) is not followed.
    reserved = {identity(directory)} | {identity(os.path.join(directory, name)) for name in class_to_idx}
    walked_dirs, first_path = {}, {}
    samples = []
    for target_class in sorted(class_to_idx):
        files_by_root = {}
        class_root = os.path.join(directory, target_class)
        stack = [class_root]
        while stack:
            folder = stack.pop()
            try:
                key = identity(folder)
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError as err:
                skipped.append((folder, f"cannot list it: {err.strerror}"))
                continue
            if key in walked_dirs or (key in reserved and folder != class_root):
                skipped.append((folder, f"the same folder as {walked_dirs[key]}" if key in walked_dirs
                                else "a link to the split folder or another class folder"))
                continue
            walked_dirs[key] = folder
            names = files_by_root.setdefault(folder, [])
            for entry in reversed(entries):  # the stack pops them in name order
                try:
                    is_dir = entry.is_dir()  # follows links, as torchvision does
                except OSError:
                    is_dir = False
                if is_dir:
                    stack.append(entry.path)
                else:
                    names.append(entry.name)
        # torchvision's order: folders sorted by path, files by name within each
        for root in sorted(files_by_root):
            for name in sorted(files_by_root[root]):
                path = os.path.join(root, name)
                if not name.lower().endswith(tuple(extensions)):
                    skipped.append((path, "not an image file name"))
                    continue
                try:
                    info = os.stat(path)
                except OSError as err:
                    skipped.append((path, f"a broken link ({err.strerror})"
                                    if os.path.islink(path) else err.strerror))
                    continue
                if not stat.S_ISREG(info.st_mode):
                    skipped.append((path, "not a regular file (a FIFO, socket or device)"))
                    continue
                key = (info.st_dev, info.st_ino)
                if key in first_path:
                    skipped.append((path, f"the same file as {first_path[key]}"))
                    continue
                first_path[key] = path
                samples.append((path, class_to_idx[target_class]))
    found = {index for _, index in samples}
    empty = [name for name in sorted(class_to_idx) if class_to_idx[name] not in found]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        # A class folder that is a link to another one holds that class's images: name the link.
        why = dict(skipped)
        links = [f"{name} is {why[os.path.join(directory, name)]}" for name in empty[:5]
                 if os.path.join(directory, name) in why]
        raise FileNotFoundError(f"no images in the class folder(s) {shown}"
                                + (f" ({'; '.join(links)})" if links else
                                   f"; images end in {', '.join(extensions)}"))
    return samples, skipped


def skipped_message(where, skipped, limit=SHOWN_SKIPS):
    """One warning naming what a scan left out: up to limit paths with their reason, and the count."""
    shown = "; ".join(f"{path} ({reason})" for path, reason in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"{where}: skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'}: {shown}{more}"


class SafeImageFolder(tv_datasets.ImageFolder):
    """ImageFolder whose unreadable images fail with the file's name and the fix, and whose
    folder walk survives link loops, duplicate links and FIFOs (scan_class_folders)."""

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        # An instance method in place of torchvision's staticmethod: DatasetFolder.__init__ calls
        # it through self, and the skipped entries are kept for build_data's warning.
        samples, self.skipped = scan_class_folders(directory, class_to_idx, extensions or IMG_EXTENSIONS)
        return samples

    def __getitem__(self, index):
        path = self.samples[index][0]
        try:
            return super().__getitem__(index)
        except UNREADABLE_IMAGE as err:
            raise UnreadableInput(f"cannot read image {path!r} ({err}); remove or replace that file") from None


def image_folder(path, split, transform):
    """SafeImageFolder of path/split. The cpu backend's train crop (CpuTrainCrop) takes tensors
    (rgb_pixels); torchvision's validation transforms take PIL images (rgb_loader)."""
    split_dir = os.path.join(path, split)
    loader = rgb_pixels if isinstance(transform, CpuTrainCrop) else rgb_loader
    try:
        return SafeImageFolder(split_dir, transform=transform, loader=loader)
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
    for dataset in (train_set, val_set):
        if dataset is not None and dataset.skipped and accelerator.is_main_process:
            print(f"warning: {skipped_message(dataset.root, dataset.skipped)}", file=sys.stderr, flush=True)
    if train:
        if train_set.classes != val_set.classes:
            raise UsageError(f"train/ and val/ in {root!r} hold different class folders "
                             f"({len(train_set.classes)} vs {len(val_set.classes)}); they must match")
    return sharded_data(train_set, val_set, len(val_set.classes), args, accelerator, mean, std)
