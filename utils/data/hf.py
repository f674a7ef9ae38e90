"""Hugging Face `datasets` as DATA: hub datasets from the local cache, save_to_disk directories,
and directories that datasets.load_dataset reads (an imagefolder, parquet files, ...).

How DATA picks this source (utils.data.sources.source_kind):
  hf:NAME  a hub dataset, e.g. hf:ILSVRC/imagenet-1k or hf:cifar10, read from the local datasets
           cache (HF_HOME, HF_DATASETS_CACHE). Never downloaded: offline is the normal case on
           clusters, and a name that is not cached is a usage error that says how to cache it.
  hf:DIR   DIR through datasets.load_dataset(DIR): an imagefolder (DIR/train/<class>/*.jpg and
           DIR/val/<class>/*.jpg become the splits train and validation), or parquet/arrow files.
  DIR      a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk (recognised by
           its dataset_dict.json, or state.json + dataset_info.json); hf:DIR works for it too.

Rows become the same (PIL image, label) samples as the ImageFolder path (hf_dataset_pair): decoded
and augmented in the DataLoader workers, then build_data hands them to the same seeded sharding,
uint8 collate and device prefetch (utils.data.batches.sharded_data), so DDP sharding and exact
validation counts come along unchanged.
`datasets` is imported only when such a source is used: machines without it run everything else.
"""
import contextlib
import os
import sys

import torch

from utils.data.crops import train_transform, val_transform
from utils.data.image_files import UNREADABLE_IMAGE, as_rgb
from utils.run.errors import UnreadableInput, UsageError, first_line

VAL_SPLIT_NAMES = ("validation", "val", "valid")  # "test" is left out: hub test splits are often unlabelled
LABEL_COLUMN_NAMES = ("label", "labels", "target")


def is_saved_dataset(path):
    """True for a directory written by Dataset.save_to_disk / DatasetDict.save_to_disk."""
    if not isinstance(path, str) or not os.path.isdir(path):
        return False
    has = lambda name: os.path.isfile(os.path.join(path, name))
    return has("dataset_dict.json") or (has("state.json") and has("dataset_info.json"))


def reject_dataset_flags(spec, kind):
    """The datasets flags do nothing for other sources; say so rather than ignore them.
    spec: the utils.data.sources.DataSpec, whose datasets fields must then all be None."""
    given = (("--train-split", spec.train_split), ("--val-split", spec.val_split),
             ("--image-column", spec.image_column), ("--label-column", spec.label_column))
    for flag, value in given:
        if value is not None:
            raise UsageError(f"{flag} applies to Hugging Face datasets (DATA = hf:NAME, hf:DIR or a "
                             f"save_to_disk directory), not to {kind} data; drop it")


def _import_datasets(data):
    try:
        import datasets
    except ImportError:
        raise UsageError(f"DATA {data!r} is read with the Hugging Face datasets package, which is not "
                         "installed: pip install datasets (or use an ImageFolder directory)") from None
    if not sys.stderr.isatty():  # no datasets progress bars in log files
        datasets.disable_progress_bars()
    return datasets


@contextlib.contextmanager
def offline(datasets):
    """Hub access off while loading. huggingface_hub and datasets read HF_HUB_OFFLINE when they are
    imported (accelerate and timm import huggingface_hub early), so setting the environment variable
    now would do nothing: switch the constants they consult at call time, then put them back."""
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _load_hub_name(datasets, name):
    try:
        with offline(datasets):
            return datasets.load_dataset(name)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        raise UsageError(
            f"hub dataset {name!r} is not in the local datasets cache ({datasets.config.HF_DATASETS_CACHE}); "
            "this script never downloads. Cache it once where there is network, with the same HF_HOME: "
            f"python -c \"import datasets; datasets.load_dataset('{name}')\", then copy HF_HOME here; "
            f"or pass a save_to_disk directory ({first_line(err)})") from None


def load_splits(data):
    """{split name: datasets.Dataset} for DATA (hf:NAME, hf:DIR or a save_to_disk directory)."""
    datasets = _import_datasets(data)
    spec = data[len("hf:"):] if data.startswith("hf:") else data
    if not spec:
        raise UsageError("DATA 'hf:' names nothing; use hf:NAME (a cached hub dataset) or hf:DIR")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.count("/") > 1
    path = os.path.expanduser(spec)
    try:
        if is_saved_dataset(path):
            loaded = datasets.load_from_disk(path)
        elif os.path.isdir(path):
            with offline(datasets):
                loaded = datasets.load_dataset(path)
        elif os.path.exists(path):
            raise UsageError(f"{path!r} is a file; hf:DIR takes a directory (an imagefolder, data files, "
                             "or one written by save_to_disk)")
        elif looks_like_path:
            raise UsageError(f"data directory {path!r} does not exist")
        else:
            loaded = _load_hub_name(datasets, spec)
    except UsageError:
        raise
    except Exception as err:  # empty folder, unreadable arrow files, a dataset needing a config name, ...
        raise UsageError(f"cannot load {data!r} with datasets: {first_line(err)}") from None
    if isinstance(loaded, datasets.Dataset):  # a single saved split
        return {str(loaded.split) if loaded.split else "data": loaded}
    return dict(loaded)


def pick_split(splits, wanted, candidates, flag, data):
    """The split named by the flag, else the first candidate name present."""
    if wanted is not None:
        if wanted not in splits:
            raise UsageError(f"{flag} {wanted!r}: {data!r} has the splits {', '.join(splits)}")
        return wanted
    for name in candidates:
        if name in splits:
            return name
    raise UsageError(f"{data!r} has the splits {', '.join(splits)}, none called "
                     f"{' or '.join(candidates)}; name one with {flag}")


def find_columns(features, image_column, label_column, where):
    """(image column, label column): named by the flags, else found from the features."""
    import datasets

    columns = ", ".join(features)
    if image_column is None:
        image_column = next((n for n, f in features.items() if isinstance(f, datasets.Image)), None)
        if image_column is None:
            raise UsageError(f"{where} has no column of images (columns: {columns}); name it with "
                             "--image-column, or cast it with ds.cast_column(NAME, datasets.Image())")
    elif image_column not in features:
        raise UsageError(f"--image-column {image_column!r} is not a column of {where} (columns: {columns})")
    if not isinstance(features[image_column], datasets.Image):
        raise UsageError(f"column {image_column!r} of {where} holds {features[image_column]}, not images; "
                         "cast it with ds.cast_column(NAME, datasets.Image()) and save_to_disk again")
    if label_column is None:
        found = [n for n, f in features.items() if isinstance(f, datasets.ClassLabel)]
        found += [n for n in LABEL_COLUMN_NAMES if n in features]
        if not found:
            raise UsageError(f"{where} has no label column (columns: {columns}); name it with --label-column")
        label_column = found[0]
    elif label_column not in features:
        raise UsageError(f"--label-column {label_column!r} is not a column of {where} (columns: {columns})")
    feature = features[label_column]
    if not (isinstance(feature, datasets.ClassLabel) or
            (isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint")))):
        raise UsageError(f"column {label_column!r} of {where} holds {feature}, not integer class ids; "
                         "map it with ds.class_encode_column(NAME) and save_to_disk again")
    return image_column, label_column


def count_classes(named_splits, label_column, data, train_name=None):
    """The number of classes: ClassLabel's, else the largest label + 1. Also refuses rows marked
    unlabelled (-1, as in the hub's ImageNet test split) and class lists that differ by split."""
    import datasets

    features = [split.features[label_column] for split in named_splits.values()]
    if all(isinstance(f, datasets.ClassLabel) for f in features):
        if len({tuple(f.names) for f in features}) > 1:
            raise UsageError(f"the splits {', '.join(named_splits)} of {data!r} have different class "
                             f"lists in {label_column!r}; they must match")
        num_classes = features[0].num_classes
    else:
        num_classes = None
    largest = -1
    for name, split in named_splits.items():
        if num_classes is not None and name == train_name:
            continue  # ClassLabel vouches for the train split; reading 1.28M labels buys nothing
        labels = split.unique(label_column)
        if labels and min(labels) < 0:
            raise UsageError(f"split {name!r} of {data!r} has unlabelled rows ({label_column} = "
                             f"{min(labels)}); pick a labelled split")
        largest = max([largest, *labels])
    return num_classes if num_classes is not None else largest + 1


class HFImages(torch.utils.data.Dataset):
    """Rows of a datasets split as (transformed RGB PIL image, label), as ImageFolder gives them.

    Only the two columns are read; the Image feature decodes the bytes in the DataLoader worker
    that asks for the row. The arrow table is memory-mapped, so workers share it, not copy it.
    """

    def __init__(self, split, image_column, label_column, transform, where):
        self.rows = split.select_columns([image_column, label_column]).with_format(None)
        self.image_column, self.label_column = image_column, label_column
        # Class names in label order when a ClassLabel gives them, as ImageFolder's .classes
        self.classes = getattr(split.features[label_column], "names", None)
        self.transform = transform
        self.where = where

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        try:
            row = self.rows[index]
            image = row[self.image_column]
            if image is None:
                raise ValueError("the row has no image")
            if isinstance(image, dict):  # an Image(decode=False) column: {"bytes": ..., "path": ...}
                image = undecoded_image(image)
            image = as_rgb(image)  # grey, CMYK or RGBA images, as ImageFolder's loader does
        except UNREADABLE_IMAGE as err:
            raise UnreadableInput(f"cannot read image {index} of {self.where} ({first_line(err)}); fix or "
                                  "drop that row") from None
        return (image if self.transform is None else self.transform(image)), row[self.label_column]


def undecoded_image(cell):
    """The PIL image of an Image(decode=False) cell: its bytes, else the file at its path."""
    import io

    from PIL import Image
    if cell.get("bytes"):
        return Image.open(io.BytesIO(cell["bytes"]))
    if cell.get("path"):
        return Image.open(cell["path"])
    raise ValueError("the row's image holds neither bytes nor a path")


def hf_dataset_pair(spec, accelerator, train=True):
    """(train set or None, val set, number of classes) of HFImages for a Hugging Face datasets
    source (see the module docstring). spec: the utils.data.sources.DataSpec."""
    data = spec.data
    with accelerator.main_process_first():  # load_dataset writes its cache once; the others read it
        splits = load_splits(data)
    # Only evaluating a dataset that has one split (e.g. a saved val set): that split is the val split.
    only = list(splits) if not train and spec.val_split is None and len(splits) == 1 else []
    val_name = pick_split(splits, spec.val_split, only or VAL_SPLIT_NAMES, "--val-split", data)
    named = {val_name: splits[val_name]}
    if train:
        train_name = pick_split(splits, spec.train_split, ("train",), "--train-split", data)
        if train_name == val_name:
            raise UsageError(f"--train-split and --val-split both name {val_name!r}; validate on "
                             "another split")
        named = {train_name: splits[train_name], **named}
    columns = None
    for name, split in named.items():
        found = find_columns(split.features, spec.image_column, spec.label_column,
                             f"split {name!r} of {data!r}")
        if columns not in (None, found):
            raise UsageError(f"the splits of {data!r} keep images and labels in different "
                             f"columns ({columns} vs {found}); name them with --image-column and --label-column")
        columns = found
    num_classes = count_classes(named, columns[1], data, train_name if train else None)
    interpolation = spec.interpolation
    val_set = HFImages(splits[val_name], *columns, val_transform(*spec.val_geometry, interpolation),
                       f"split {val_name!r} of {data!r}")
    train_set = None
    if train:
        train_set = HFImages(splits[train_name], *columns,
                             train_transform(spec.sizes, spec.min_scale, spec.hflip, interpolation),
                             f"split {train_name!r} of {data!r}")
    return train_set, val_set, num_classes
