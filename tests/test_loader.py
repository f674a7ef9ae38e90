"""The cpu backend's loader pieces that set its per-image cost: RGB loading without a copy, the
one-copy collate, the per-sample seed, and the loader-only benchmark tool (bench/benchmark_loader.py)."""
import csv
import io

import numpy as np
import pytest
import torch
from conftest import make_image_folder, run_script
from PIL import Image
from torchvision.datasets.folder import pil_loader

from utils.data.batches import SeededSamples, fast_collate
from utils.data.crops import train_transform
from utils.data.folder import image_folder
from utils.data.image_files import as_rgb, rgb_loader


def odd_files(folder):
    """One file per mode a photo folder holds: RGB, grey and CMYK JPEG, PNG inside .JPEG, RGBA PNG."""
    rng = np.random.RandomState(1)
    rgb = Image.fromarray(rng.randint(0, 255, (30, 40, 3), dtype=np.uint8))
    files = {"rgb.JPEG": (rgb, "JPEG"), "grey.JPEG": (rgb.convert("L"), "JPEG"),
             "cmyk.JPEG": (rgb.convert("CMYK"), "JPEG"), "png_inside.JPEG": (rgb, "PNG"),
             "rgba.png": (rgb.convert("RGBA"), "PNG")}
    paths = []
    for name, (image, kind) in files.items():
        path = folder / name
        image.save(path, kind)
        paths.append(path)
    return paths


def test_rgb_loader_gives_torchvisions_pixels_for_every_mode(tmp_path):
    for path in odd_files(tmp_path):
        ours, theirs = rgb_loader(path), pil_loader(path)
        assert ours.mode == "RGB" and ours.size == theirs.size, path
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), path


def test_as_rgb_keeps_an_rgb_image_and_converts_the_rest():
    rgb = Image.new("RGB", (4, 3), (10, 20, 30))
    assert as_rgb(rgb) is rgb  # no copy: the crop makes a new image anyway
    grey = Image.new("L", (4, 3), 77)
    converted = as_rgb(grey)
    assert converted.mode == "RGB" and converted.getpixel((0, 0)) == (77, 77, 77)


def test_rgb_loader_reads_the_whole_file_before_closing_it(tmp_path):
    path = odd_files(tmp_path)[0]
    image = rgb_loader(path)
    path.unlink()  # PIL's lazy loading would need the file now; the loader must not
    assert np.asarray(image).shape == (30, 40, 3)


def test_fast_collate_equals_stacking_the_images():
    rng = np.random.RandomState(0)
    arrays = [rng.randint(0, 255, (5, 7, 3), dtype=np.uint8) for _ in range(4)]
    images, targets = fast_collate([(Image.fromarray(a), label) for label, a in enumerate(arrays)])
    assert images.dtype == torch.uint8 and images.shape == (4, 5, 7, 3)
    assert torch.equal(images, torch.from_numpy(np.stack(arrays)))
    assert targets.dtype == torch.int64 and targets.tolist() == [0, 1, 2, 3]


def test_fast_collate_refuses_images_of_different_sizes():
    with pytest.raises(ValueError):
        fast_collate([(Image.new("RGB", (4, 4)), 0), (Image.new("RGB", (5, 4)), 1)])


def test_each_sample_draws_the_same_torch_numbers_whatever_ran_before(tiny_folder):
    """--aa policies draw from torch's CPU generator after SeededSamples seeded it from
    (seed, epoch, index): the draws are the same in any order, and the same as seeding with
    torch.manual_seed (the seed function used before), so earlier runs' augmentations repeat."""
    draws = []

    def record(image):
        assert isinstance(image, Image.Image) and image.mode == "RGB"  # the policies take PIL images
        draws.append(torch.rand(2))
        return image

    samples = SeededSamples(image_folder(tiny_folder, "train", train_transform(16, 0.5, 0.5)), seed=3, extra=record)
    samples[(4, 1)]
    torch.rand(5)  # anything in between
    samples[(2, 1)]
    samples[(4, 1)]
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])
    torch.manual_seed(((3 * 1_000_003 + 1) * 10_000_019 + 4) % (2 ** 63))
    assert torch.equal(draws[0], torch.rand(2))


def test_a_sample_made_in_the_training_process_leaves_its_global_generators_alone(tiny_folder):
    """With -j 0 the samples are made in the training process, after the step seeded torch's,
    Python's and NumPy's generators for random erasing, mixup and dropout: making a sample (an
    --aa policy reseeds all three) must leave them where they were."""
    import random

    from utils.ingredients import augment_transform
    extra = augment_transform("rand-m9-mstd0.5", 16, (0.5,) * 3)
    samples = SeededSamples(image_folder(tiny_folder, "train", train_transform(16, 0.5, 0.5)), seed=3, extra=extra)

    def draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand()

    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    expected = draws()
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    samples[(4, 1)]
    assert draws() == expected


def test_loss_with_random_erasing_is_the_same_whatever_the_worker_count(tiny_folder, tmp_path):
    """--reprob draws its noise from torch's CPU generator after the step seeded it: -j 0, where
    the loader runs in the training process, printed other losses than -j 1."""
    def losses(workers):
        result = run_script("train.py", tiny_folder, "-a", "resnet18", "--image-size", "32", "-j", workers,
                            "-b", "4", "--epochs", "1", "--steps-per-epoch", "2", "-p", "1", "--reprob", "1.0",
                            "--output-dir", tmp_path / f"j{workers}", env={"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-2000:]
        lines = [line.split("Loss ")[1].split()[0] for line in result.stdout.splitlines() if line.startswith("Epoch:")]
        assert len(lines) == 2, result.stdout
        return lines

    assert losses(0) == losses(1)


def test_loader_benchmark_writes_a_row_per_loader(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=2, per_class=12, size=(64, 48), splits=("train",))
    out = tmp_path / "loader.csv"
    result = run_script("bench/benchmark_loader.py", data, "--workers", "0", "1", "-b", "4", "--batches", "5",
                        "--warmup", "1", "--rounds", "1", "--image-size", "32", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(row["loader"], row["workers"]) for row in rows] == [
        (name, workers) for workers in ("0", "1") for name in ("cpu", "timm", "gpu-workers")]
    assert all(float(row["img_per_s"]) > 0 for row in rows)
    assert {row["ratio_to_timm"] for row in rows if row["loader"] == "timm"} == {"1.0"}
    assert "loader,workers,img_per_s,ratio_to_timm" in result.stdout


def test_loader_benchmark_refuses_a_warmup_that_leaves_nothing(tmp_path):
    result = run_script("bench/benchmark_loader.py", tmp_path, "--batches", "3", "--warmup", "3")
    assert result.returncode == 2 and "--warmup 3 must be at least 1 and below --batches 3" in result.stderr


@pytest.mark.parametrize("flags, needle", [(["--rounds", "0"], "--rounds 0: at least 1"),
                                           (["-b", "64", "--loaders", "cpu", "-j", "0"], "fewer than one global batch"),
                                           (["--loaders", "cpu", "--missing"], None)])
def test_loader_benchmark_usage_errors_are_one_line(tiny_folder, tmp_path, flags, needle):
    data = tmp_path / "missing" if "--missing" in flags else tiny_folder
    flags = [flag for flag in flags if flag != "--missing"]
    result = run_script("bench/benchmark_loader.py", data, *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (needle or "does not exist") in result.stderr


def test_fake_imagenet_writes_what_it_says_and_refuses_to_mix_or_count_nothing(tmp_path):
    tool = "tools/make_fake_imagenet.py"
    made = run_script(tool, tmp_path / "fake", "--classes", "2", "--train-per-class", "1", "--val-per-class", "1",
                      "--width", "32", "--height", "32", "--jobs", "1")
    assert made.returncode == 0, made.stderr[-2000:]
    files = sorted(path.relative_to(tmp_path / "fake").parts[:2] for path in (tmp_path / "fake").rglob("*.JPEG"))
    assert len(files) == 4 and "wrote 4 files" in made.stdout
    again = run_script(tool, tmp_path / "fake", "--classes", "1")
    assert again.returncode == 2 and "is not an empty folder" in again.stderr
    for flag, value in (("--classes", "0"), ("--train-per-class", "-1"), ("--width", "0"), ("--jobs", "0")):
        refused = run_script(tool, tmp_path / "new", flag, value)
        assert refused.returncode == 2 and f"{flag} {value}: at least" in refused.stderr, refused.stderr
    assert not (tmp_path / "new").exists()
