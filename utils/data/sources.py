"""DATA to batches: DataSpec (what the data path reads), which source DATA names (an ImageFolder,
a Hugging Face dataset, the digits demo, synthetic tensors), and build_data, which reads the
source's dataset pair and hands it to the batch path (utils.data.batches.sharded_data)."""
import os
import sys
from dataclasses import dataclass

from utils.data.batches import IMAGENET_MEAN, IMAGENET_STD, Data, sharded_data
from utils.data.crops import train_transform, val_resize, val_transform
from utils.data.digits import ensure_digits
from utils.data.folder import check_image_folder, image_folder, skipped_message
from utils.data.hf import hf_dataset_pair, reject_dataset_flags
from utils.data.sizes import TrainSizes
from utils.data.synthetic import SYNTHETIC_CLASSES, SYNTHETIC_STEPS, SYNTHETIC_VAL_STEPS, SyntheticBatches
from utils.run.errors import UsageError


@dataclass(frozen=True)
class DataSpec:
    """Everything the data path reads, resolved once at the scripts' edge (utils.flags.specs.data_spec).

    The defaults are the ImageNet ones, for callers that build a spec by hand (tests, tools)."""
    data: str | None             # DATA as given: None or 'digits', 'synthetic', hf:..., a folder
    batch_size: int              # per process
    workers: int                 # loader worker processes per process
    seed: int
    image_size: int              # the training and the validation crop, unless the next three say otherwise
    crop_pct: float = 0.875      # validation: Resize(val crop / crop_pct), then CenterCrop, unless val_resize is set
    train_sizes: TrainSizes | None = None  # training crop size per epoch (None: image_size)
    val_crop: int | None = None  # validation crop (None: image_size)
    val_resize: int | None = None  # validation's Resize of the short side (None: from crop_pct)
    ra_reps: int = 1             # repeated augmentation: copies of each image an epoch (1: none)
    min_scale: float = 0.08      # training: RandomResizedCrop's smallest area fraction
    hflip: float = 0.5           # training: flip probability
    interpolation: str = "bilinear"
    aa: str = "none"             # --aa policy (cpu backend only)
    mean: tuple = IMAGENET_MEAN  # normalisation, 0..1 scale
    std: tuple = IMAGENET_STD
    channels_last: bool = False  # the batches' memory format
    num_classes: int | None = None  # synthetic data's classes (None: SYNTHETIC_CLASSES)
    steps_per_epoch: int = 0     # synthetic data's steps an epoch (0: SYNTHETIC_STEPS)
    train_split: str | None = None   # the Hugging Face datasets fields; None for other sources
    val_split: str | None = None
    image_column: str | None = None
    label_column: str | None = None
    backend: str = "cpu"         # "cpu" or "gpu" (utils.data.backend.choose_backend); "none" for synthetic
    jpeg_decoder: str = "cuda"   # the gpu backend's: "cuda" or "hardware"

    @property
    def sizes(self):
        """The training crop size of each epoch (a TrainSizes)."""
        return self.train_sizes or TrainSizes.fixed(self.image_size)

    @property
    def val_geometry(self):
        """(crop, resize): validation's Resize(resize) + CenterCrop(crop)."""
        crop = self.val_crop or self.image_size
        return crop, self.val_resize or val_resize(crop, self.crop_pct)

    def describe(self, epochs):
        """The start-up line's words for the crops: the training size(s) by epoch, validation's
        resize and crop, repeated augmentation."""
        crop, resize = self.val_geometry
        words = [f"train crop {self.sizes.describe(epochs)}", f"val resize {resize} + center crop {crop}"]
        if self.ra_reps > 1:
            words.append(f"repeated augmentation x{self.ra_reps}")
        return " | ".join(words)


def source_kind(data):
    """'digits', 'synthetic', 'datasets' (hf:NAME, hf:DIR or a save_to_disk directory; see
    utils/data/hf.py) or 'imagefolder' for the DATA argument."""
    from utils.data.hf import is_saved_dataset

    if data in (None, "digits"):
        return "digits"
    if data == "synthetic":
        return "synthetic"
    if data.startswith("hf:") or is_saved_dataset(data):
        return "datasets"
    return "imagefolder"


def absolute_data(data):
    """DATA as a checkpoint stores it: a folder (hf:DIR too) as an absolute path, so that eval.py
    or a resume started from another working directory reads the same data, not a namesake there;
    names (digits, synthetic, hf:NAME of the hub cache) as they are."""
    if data in (None, "digits", "synthetic"):
        return data
    prefix, path = ("hf:", data[3:]) if data.startswith("hf:") else ("", data)
    return prefix + os.path.abspath(path) if path and os.path.exists(path) else data


def build_data(spec, accelerator, train=True):
    """Loaders for the source spec.data names, sharded over the accelerator's processes: the
    source's (train, val) dataset pair through the cpu or gpu batch path to the device. train
    False reads the val split only. spec: a DataSpec."""
    kind = source_kind(spec.data)
    if kind == "datasets":  # `datasets` itself is imported only now: it is optional
        train_set, val_set, num_classes = hf_dataset_pair(spec, accelerator, train)
        return sharded_data(train_set, val_set, num_classes, spec, accelerator)
    reject_dataset_flags(spec, kind)
    if kind == "synthetic":
        return synthetic_data(spec, accelerator)
    train_set, val_set = folder_dataset_pair(spec, accelerator, kind, train)
    return sharded_data(train_set, val_set, len(val_set.classes), spec, accelerator)


def synthetic_data(spec, accelerator):
    """Data of random batches made once on the device (no input pipeline)."""
    classes = spec.num_classes or SYNTHETIC_CLASSES
    steps = spec.steps_per_epoch or SYNTHETIC_STEPS
    make = lambda n, size, seed: SyntheticBatches(n, spec.batch_size, size, classes, accelerator.device,
                                                  spec.channels_last, seed)
    val = make(SYNTHETIC_VAL_STEPS, spec.val_geometry[0], spec.seed + 1)
    return Data(make(steps, spec.sizes.min_res, spec.seed), val, classes,
                SYNTHETIC_VAL_STEPS * spec.batch_size * accelerator.num_processes)


def folder_dataset_pair(spec, accelerator, kind, train):
    """(train set or None, val set) of SafeImageFolders for an ImageFolder DATA or the digits demo
    (written once, by the main process first); the skipped entries are warned about once."""
    if kind == "digits":
        with accelerator.main_process_first():
            root = ensure_digits()
    else:
        root = spec.data
        check_image_folder(root, ("train", "val") if train else ("val",))
    val_set = image_folder(root, "val", val_transform(*spec.val_geometry, spec.interpolation))
    train_set = None
    if train:
        train_set = image_folder(root, "train", train_transform(spec.sizes, spec.min_scale, spec.hflip,
                                                                spec.interpolation))
    for dataset in (train_set, val_set):
        if dataset is not None and dataset.skipped and accelerator.is_main_process:
            print(f"warning: {skipped_message(dataset.root, dataset.skipped)}", file=sys.stderr, flush=True)
    if train and train_set.classes != val_set.classes:
        raise UsageError(f"train/ and val/ in {root!r} hold different class folders "
                         f"({len(train_set.classes)} vs {len(val_set.classes)}); they must match")
    return train_set, val_set
