"""Hugging Face datasets as DATA: real datasets objects with Image features built from real JPEGs,
saved to disk, loaded through datasets, read from a local hub cache; trained on and evaluated."""
import contextlib
import io
import os
import re
import sys
import types

import numpy as np
import pytest
import torch
from conftest import make_image_folder, run_command, run_script
from PIL import Image as PILImage

from utils.data.sources import build_data
from utils.flags.parser import build_parser
from utils.flags.precedence import parse_args
from utils.flags.specs import data_spec
from utils.run.errors import UsageError

datasets = pytest.importorskip("datasets")
QUICK = ["--image-size", "24", "-b", "4", "-j", "0"]
FINAL_LINE = re.compile(r" \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A private datasets cache (datasets read HF_DATASETS_CACHE at import: patch its constant)."""
    path = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(path))
    return path


def folder_rows(split_dir):
    """The JPEG bytes and labels of an ImageFolder split, in torchvision ImageFolder's order."""
    images, labels = [], []
    classes = sorted(os.listdir(split_dir))
    for label, name in enumerate(classes):
        for filename in sorted(os.listdir(os.path.join(split_dir, name))):
            with open(os.path.join(split_dir, name, filename), "rb") as handle:
                images.append({"bytes": handle.read(), "path": None})
            labels.append(label)
    return images, labels, classes


def saved_dataset_dict(folder, out, splits=(("train", "train"), ("validation", "val")),
                       image_column="image", label_column="label"):
    """DatasetDict.save_to_disk of an ImageFolder's JPEGs, with Image and ClassLabel features."""
    parts = {}
    for name, split in splits:
        images, labels, classes = folder_rows(os.path.join(folder, split))
        features = datasets.Features({image_column: datasets.Image(),
                                      label_column: datasets.ClassLabel(names=classes)})
        parts[name] = datasets.Dataset.from_dict({image_column: images, label_column: labels}, features=features)
    datasets.DatasetDict(parts).save_to_disk(str(out))
    return str(out)


def loaders(data_arg, *flags, train=True, accelerator=None):
    from accelerate import Accelerator

    args = parse_args(build_parser("t"), [data_arg, *QUICK, *flags])
    spec = data_spec(args, backend="cpu", jpeg_decoder="auto", channels_last=False)  # as a CPU run settles them
    return build_data(spec, accelerator or Accelerator(cpu=True), train=train)


def batches(loader):
    return [(images.clone(), targets.clone()) for images, targets in loader]


def test_saved_and_loaded_datasets_give_the_imagefolder_batches(tmp_path, hf_cache):
    """Same JPEGs, same decode, same seeded crops: bit-identical batches whichever way they come."""
    folder = make_image_folder(tmp_path / "folder", classes=3, per_class=5)
    saved = saved_dataset_dict(folder, tmp_path / "saved")
    reference = loaders(folder)
    reference.set_epoch(1)
    expected_train, expected_val = batches(reference.train), batches(reference.val)
    assert len(expected_train) == 3 and sum(len(t) for _, t in expected_val) == 15
    for source in (saved, "hf:" + saved, "hf:" + folder):  # the last through datasets' imagefolder
        data = loaders(source)
        data.set_epoch(1)
        assert (data.num_classes, data.val_size, data.classes) == (3, 15, reference.classes), source
        for (a, ta), (b, tb) in zip(expected_train + expected_val, batches(data.train) + batches(data.val)):
            assert torch.equal(a, b) and torch.equal(ta, tb), source


def test_train_then_evaluate_on_a_saved_dataset_with_its_own_names(cache_dir, tmp_path):
    """Split and column names other than the usual ones, given by flags; then -e on the checkpoint."""
    folder = make_image_folder(tmp_path / "folder", classes=3, per_class=6)
    saved = saved_dataset_dict(folder, tmp_path / "saved", splits=(("fit", "train"), ("holdout", "val")),
                               image_column="picture", label_column="category")
    out = tmp_path / "out"
    names = ["--train-split", "fit", "--val-split", "holdout", "--image-column", "picture"]
    trained = run_script("train.py", saved, *names, *QUICK, "--epochs", "2", "--output-dir", out,
                         env={"HF_HOME": str(tmp_path / "hf")})
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"on {saved} | 3 classes" in trained.stdout
    finals = FINAL_LINE.findall(trained.stdout)
    assert len(finals) == 2
    evaluated = run_script("train.py", saved, *names, *QUICK, "-e", "--resume", out / "checkpoint.pth.tar",
                           env={"HF_HOME": str(tmp_path / "hf")})
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert FINAL_LINE.findall(evaluated.stdout) == finals[-1:]


def cache_as_hub_download(folder, cache, repo_id):
    """Put a dataset in the datasets cache where load_dataset(repo_id) leaves a hub download:
    <cache>/<owner>___<name>/default/0.0.0/<commit>/<name>-<split>.arrow plus dataset_info.json."""
    from datasets.load import dataset_module_factory, get_dataset_builder_class

    module = dataset_module_factory(folder)  # the imagefolder builder for these files
    data_files = module.builder_configs_parameters.builder_configs[0].data_files
    name = repo_id.split("/")[-1]
    builder = get_dataset_builder_class(module, dataset_name=name)(
        cache_dir=str(cache), dataset_name=name, repo_id=repo_id, config_name="default",
        data_files=data_files, hash="0123456789abcdef")
    builder.download_and_prepare()
    owner_dir = os.path.join(cache, repo_id.replace("/", "___"))
    (config_dir,) = os.listdir(owner_dir)  # local files give "default-<hash>"; a hub download "default"
    os.rename(os.path.join(owner_dir, config_dir), os.path.join(owner_dir, "default"))


def test_hub_dataset_from_the_local_cache_never_touches_the_network(tmp_path, hf_cache, monkeypatch):
    from huggingface_hub import constants

    from utils.data.hf import load_splits

    folder = make_image_folder(tmp_path / "folder", classes=2, per_class=3)
    cache_as_hub_download(folder, hf_cache, "someone/tiny-images")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as on a machine with network:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)         # we switch it off ourselves
    splits = load_splits("hf:someone/tiny-images")
    assert sorted(splits) == ["train", "validation"] and len(splits["validation"]) == 6
    assert isinstance(splits["train"].features["image"], datasets.Image)
    assert datasets.config.HF_HUB_OFFLINE is False  # put back afterwards
    data = loaders("hf:someone/tiny-images", "-b", "2")
    assert (data.num_classes, data.val_size) == (2, 6)
    with pytest.raises(UsageError) as missing:
        load_splits("hf:someone/not-cached")
    message = str(missing.value)
    assert "not in the local datasets cache" in message and "never downloads" in message
    assert "datasets.load_dataset('someone/not-cached')" in message


def labelled_rows(count, first_label=0, mode="RGB"):
    """count tiny JPEGs; row i has label first_label + i, so every row can be traced."""
    images = []
    for i in range(count):
        pixels = np.full((20, 20, 3), 10 * i, dtype=np.uint8)
        buffer = io.BytesIO()
        PILImage.fromarray(pixels).convert(mode).save(buffer, format="JPEG")
        images.append({"bytes": buffer.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": images, "label": list(range(first_label, first_label + count))},
                                      features=features)


def fake_rank(rank, world):
    """What build_data asks of an Accelerator, for rank `rank` of `world` processes."""
    return types.SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"),
                                 main_process_first=contextlib.nullcontext)


def test_processes_share_train_rows_and_count_every_val_row_once(tmp_path):
    path = str(tmp_path / "ranks")
    datasets.DatasetDict({"train": labelled_rows(10), "val": labelled_rows(7)}).save_to_disk(path)
    seen_train, seen_val = [], []
    for rank in range(2):
        data = loaders(path, "-b", "2", accelerator=fake_rank(rank, 2))
        assert (data.num_classes, data.val_size) == (10, 7)  # no ClassLabel: the largest label + 1
        data.set_epoch(0)
        seen_train.append([int(t) for _, targets in data.train for t in targets])
        seen_val += [int(t) for _, targets in data.val for t in targets]
    assert sorted(seen_val) == list(range(7))  # 7 rows over 2 processes: no padding, no duplicates
    assert len(seen_train[0]) == len(seen_train[1]) == 4  # 10 rows cut to whole global batches of 4
    assert not set(seen_train[0]) & set(seen_train[1])


def test_grey_images_become_rgb_and_a_single_split_serves_evaluation(tmp_path):
    path = str(tmp_path / "grey")
    labelled_rows(5, mode="L").save_to_disk(path)  # a single Dataset, not a DatasetDict
    assert loaders(path, "--val-split", "data", train=False).val_size == 5
    data = loaders(path, train=False)  # only evaluating, one split: that split is the val split
    images, _ = next(iter(data.val))
    assert images.shape == (4, 3, 24, 24)
    with pytest.raises(UsageError, match="none called train; name one with --train-split"):
        loaders(path, "--val-split", "data")


def test_datasets_mistakes_are_explained(tmp_path, hf_cache):
    folder = make_image_folder(tmp_path / "folder", classes=2, per_class=4)
    saved = saved_dataset_dict(folder, tmp_path / "saved")
    cases = [
        ((saved, "--val-split", "test"), "--val-split 'test': .* has the splits train, validation"),
        ((saved, "--image-column", "photo"), "--image-column 'photo' is not a column"),
        ((saved, "--image-column", "label"), "holds ClassLabel.*not images"),
        ((saved, "--train-split", "validation"), "both name 'validation'"),
        ((folder, "--label-column", "label"), "--label-column applies to Hugging Face datasets"),
        (("hf:" + str(tmp_path / "nowhere"),), "does not exist"),
        (("hf:",), "names nothing"),
        (("hf:" + str(tmp_path / "folder" / "train" / "class0" / "0.jpg"),), "is a file"),
        (("hf:" + str(tmp_path / "empty"),), "cannot load .* with datasets"),
    ]
    (tmp_path / "empty").mkdir()
    for argv, pattern in cases:
        with pytest.raises(UsageError, match=pattern):
            loaders(*argv)
    strings = str(tmp_path / "strings")
    rows = labelled_rows(4)
    datasets.DatasetDict({"train": rows, "validation": rows.cast_column("label", datasets.Value("string"))}
                         ).save_to_disk(strings)
    with pytest.raises(UsageError, match="not integer class ids"):
        loaders(strings)
    unlabelled = str(tmp_path / "unlabelled")
    datasets.DatasetDict({"train": labelled_rows(4), "validation": labelled_rows(4, first_label=-1)}
                         ).save_to_disk(unlabelled)
    with pytest.raises(UsageError, match="unlabelled rows"):
        loaders(unlabelled)


def test_an_unreadable_image_row_names_the_row(tmp_path):
    path = str(tmp_path / "broken")
    rows = labelled_rows(8)
    broken = rows.cast_column("image", datasets.Image(decode=False)).map(
        lambda row, i: {"image": {"bytes": b"not a jpeg" if i == 3 else row["image"]["bytes"], "path": None}},
        with_indices=True).cast_column("image", datasets.Image())
    datasets.DatasetDict({"train": broken, "validation": rows}).save_to_disk(path)
    data = loaders(path)
    with pytest.raises(UsageError, match="cannot read image 3 of split 'train'"):
        batches(data.train)


def test_without_the_datasets_package_other_sources_still_run(tmp_path):
    """The GPU machines have no `datasets`: ImageFolder training must not import it, and asking
    for a datasets source must say what to install."""
    folder = make_image_folder(tmp_path / "folder", classes=2, per_class=4)
    code = ("import sys; sys.modules['datasets'] = None\n"  # import datasets -> ImportError
            "import train\n"
            f"train.main([{folder!r}, '--epochs', '1', '-j', '0', '-b', '4', '--image-size', '16', "
            f"'--output-dir', {str(tmp_path / 'out')!r}])\n"
            "from utils.run.errors import UsageError\n"
            "try:\n"
            f"    train.main(['hf:{folder}', '-j', '0'])\n"
            "except UsageError as err:\n"
            "    print('usage error:', err)\n")
    result = run_command([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    assert FINAL_LINE.search(result.stdout)
    assert "usage error:" in result.stdout and "pip install datasets" in result.stdout


def test_an_image_column_stored_undecoded_is_decoded_here(tmp_path):
    """Image(decode=False) hands rows over as {"bytes", "path"}: read the same pixels as the
    decoded column gives."""
    path, plain = str(tmp_path / "raw"), str(tmp_path / "plain")
    rows = labelled_rows(8)
    rows.save_to_disk(plain)
    rows.cast_column("image", datasets.Image(decode=False)).save_to_disk(path)
    got, want = loaders(path, train=False), loaders(plain, train=False)
    for (a, la), (b, lb) in zip(batches(got.val), batches(want.val)):
        assert torch.equal(a, b) and torch.equal(la, lb)
