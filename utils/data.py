"""Data: sources (ImageFolder, digits, synthetic), transforms, sharding, collate and prefetch.

Batches leave the workers as uint8 NHWC tensors (no ToTensor, no float on the CPU); the
prefetcher moves them to the device on a side stream and converts and normalises them there.
Augmentation is a pure function of (seed, epoch, sample index), so runs repeat exactly and a
resumed run sees the same crops as an uninterrupted one, whatever the worker or process count.
"""
import math
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torchvision import datasets as tv_datasets
from torchvision import transforms

from .errors import UsageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SYNTHETIC_STEPS = 100
SYNTHETIC_VAL_STEPS = 10
SYNTHETIC_CLASSES = 1000

# Defaults that depend on the source; a flag given on the command line always wins. mean and std
# are no flags: they come from the model (utils.models.model_data_config) or these defaults.
SOURCE_DEFAULTS = {
    "digits": dict(epochs=12, batch_size=64, image_size=32, min_scale=0.35, hflip=0.0, workers=2),
    "default": dict(epochs=90, batch_size=256, image_size=224, min_scale=0.08, hflip=0.5, workers=4,
                    crop_pct=0.875, interpolation="bilinear", mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)),
}


def source_kind(data):
    """'digits', 'synthetic', 'datasets' (hf:NAME, hf:DIR or a save_to_disk directory; see
    utils/hf_data.py) or 'imagefolder' for the DATA argument."""
    from .hf_data import is_saved_dataset

    if data in (None, "digits"):
        return "digits"
    if data == "synthetic":
        return "synthetic"
    if data.startswith("hf:") or is_saved_dataset(data):
        return "datasets"
    return "imagefolder"


def apply_source_defaults(args, model_config=None):
    """Fill flags left at None: first the digits demo's own sizes (digits is small and grey), then
    the model's data config (a timm model's input size, crop pct, interpolation, mean/std), then the
    ImageNet defaults."""
    layers = [SOURCE_DEFAULTS["digits"]] if source_kind(args.data) == "digits" else []
    for defaults in layers + [model_config or {}, SOURCE_DEFAULTS["default"]]:
        for name, value in defaults.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
                if name == "workers":  # the default never asks for more workers than there are cores
                    args.workers = min(value, len(os.sched_getaffinity(0)))
    return args


def cache_dir():
    root = os.environ.get("IMAGENET_AMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "imagenet-amp")
    return root


def ensure_digits(root=None):
    """Write scikit-learn's handwritten digits once as a JPEG ImageFolder; return its root.

    1,797 real 8x8 scans, upscaled to 32x32 and split 80/20 with a fixed seed. Written into a
    temporary folder and renamed into place, so concurrent processes never see half a dataset.
    """
    root = root or os.path.join(cache_dir(), "digits-v1")
    if os.path.isdir(os.path.join(root, "val")):
        return root
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    n_val = len(order) // 5
    os.makedirs(os.path.dirname(root), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".digits-", dir=os.path.dirname(root))
    for rank, index in enumerate(order):
        split = "val" if rank < n_val else "train"
        label = int(digits.target[index])
        folder = os.path.join(tmp, split, str(label))
        os.makedirs(folder, exist_ok=True)
        pixels = (digits.images[index] * (255.0 / 16.0)).astype(np.uint8)
        image = Image.fromarray(pixels, mode="L").resize((32, 32), Image.BICUBIC).convert("RGB")
        image.save(os.path.join(folder, f"{index:04d}.jpg"), quality=95)
    try:
        os.replace(tmp, root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def train_transform(image_size, min_scale, hflip, interpolation="bilinear"):
    mode = transforms.InterpolationMode(interpolation)
    steps = [transforms.RandomResizedCrop(image_size, scale=(min_scale, 1.0), interpolation=mode)]
    if hflip > 0:
        steps.append(transforms.RandomHorizontalFlip(hflip))
    return transforms.Compose(steps)


def val_transform(image_size, crop_pct, interpolation="bilinear"):
    mode = transforms.InterpolationMode(interpolation)
    return transforms.Compose([transforms.Resize(int(math.floor(image_size / crop_pct)), interpolation=mode),
                               transforms.CenterCrop(image_size)])


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


class SeededSamples(torch.utils.data.Dataset):
    """Seeds the augmentation RNG from (seed, epoch, index) before each sample is transformed."""

    def __init__(self, dataset, seed):
        self.dataset = dataset
        self.seed = seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, epoch = key
        torch.manual_seed(((self.seed * 1_000_003 + epoch) * 10_000_019 + index) % (2 ** 63))
        return self.dataset[index]


class ShardedEpochSampler(torch.utils.data.Sampler):
    """One shuffled pass per epoch, shared by all ranks and split without duplicates.

    The permutation comes from (seed, epoch); it is cut to a whole number of global batches
    (drop_last, as for training) and rank r takes every world-th sample. Yields (index, epoch)
    so SeededSamples can seed the augmentation in whichever worker process serves it.
    """

    def __init__(self, size, batch_size, rank, world, seed):
        self.size, self.rank, self.world, self.seed = size, rank, world, seed
        self.global_batch = batch_size * world
        self.epoch = 0
        if size < self.global_batch:
            raise UsageError(f"the train split has {size} images, fewer than one global batch of "
                             f"{self.global_batch} ({batch_size} per process x {world}); lower "
                             "--batch-size")

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return (self.size // self.global_batch) * self.global_batch // self.world

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        usable = (self.size // self.global_batch) * self.global_batch
        for index in order[:usable][self.rank::self.world].tolist():
            yield index, self.epoch


def fast_collate(batch):
    """Stack PIL images into one uint8 NHWC tensor; labels into int64."""
    images = torch.from_numpy(np.stack([np.asarray(image, dtype=np.uint8) for image, _ in batch]))
    targets = torch.tensor([target for _, target in batch], dtype=torch.int64)
    return images, targets


class DevicePrefetcher:
    """Iterates a uint8 NHWC loader and yields normalised float NCHW batches on the device.

    On CUDA the copy and normalisation of batch i+1 run on a side stream while batch i trains;
    record_stream tells the caching allocator the main stream still uses the tensors.
    """

    def __init__(self, loader, device, mean, std, channels_last):
        self.loader = loader
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor([m * 255 for m in mean], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in std], device=device).view(1, 3, 1, 1)
        self.cuda = device.type == "cuda"

    def __len__(self):
        return len(self.loader)

    def _to_device(self, images, targets):
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        images = images.permute(0, 3, 1, 2).float().contiguous(memory_format=self.memory_format)
        images = images.sub_(self.mean).div_(self.std)
        return images, targets

    def __iter__(self):
        if not self.cuda:
            for images, targets in self.loader:
                yield self._to_device(images, targets)
            return
        stream = torch.cuda.Stream()
        pending = None
        for images, targets in self.loader:
            with torch.cuda.stream(stream):
                batch = self._to_device(images, targets)
            if pending is not None:
                yield pending
            torch.cuda.current_stream().wait_stream(stream)
            for tensor in batch:
                tensor.record_stream(torch.cuda.current_stream())
            pending = batch
        if pending is not None:
            yield pending


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


@dataclass
class Data:
    train: object          # iterable of (images, targets) on the device; has set_epoch
    val: object
    num_classes: int
    val_size: int          # images in the whole val split (all ranks together)
    train_sampler: object = None
    classes: list = None   # class names in label order, where the source has them (eval.py checks them)

    def set_epoch(self, epoch):
        if self.train_sampler is not None:
            self.train_sampler.set_epoch(epoch)


def _loader(dataset, sampler, args, device):
    workers = args.workers
    return torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=fast_collate, pin_memory=device.type == "cuda", drop_last=False,
        persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None)


def build_data(args, accelerator, mean=None, std=None, train=True):
    """Loaders for the source in args.data, sharded over the accelerator's processes.

    mean/std default to args.mean/args.std: the model's own (a timm model's data config) or
    ImageNet's, set by utils.setup.parse_args.
    """
    mean = mean or getattr(args, "mean", None) or IMAGENET_MEAN
    std = std or getattr(args, "std", None) or IMAGENET_STD
    device = accelerator.device
    kind = source_kind(args.data)
    if kind == "datasets":
        from .hf_data import build_hf_data  # imports `datasets` only now: it is optional
        return build_hf_data(args, accelerator, mean, std, train)
    from .hf_data import reject_dataset_flags
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


def sharded_data(train_set, val_set, num_classes, args, accelerator, mean, std):
    """Data over map-style datasets of (PIL image, label), shared by every image source.

    Training: one seeded shuffle per epoch split over the processes (ShardedEpochSampler).
    Validation: rank r takes every world-th image, no padding, so every image counts once.
    train_set None (evaluation only) builds the val loader alone.
    """
    device = accelerator.device
    rank, world = accelerator.process_index, accelerator.num_processes
    val_loader = _loader(val_set, list(range(rank, len(val_set), world)), args, device)
    val = DevicePrefetcher(val_loader, device, mean, std, args.channels_last)
    train_loader, sampler = None, None
    if train_set is not None:
        sampler = ShardedEpochSampler(len(train_set), args.batch_size, rank, world, args.seed)
        train_loader = DevicePrefetcher(_loader(SeededSamples(train_set, args.seed), sampler, args, device),
                                        device, mean, std, args.channels_last)
    return Data(train_loader, val, num_classes, len(val_set), sampler, getattr(val_set, "classes", None))
