"""Train and validation geometry: separate crop sizes, progressive resizing, repeated augmentation,
and the linear LR schedule (the time-to-accuracy flags), with real JPEG folders and real runs."""
import re
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import FINAL, QUICK, TINY, make_image_folder, run_script
from test_preemption import assert_same_weights, train_until

from utils.data.batches import RepeatedAugmentationSampler, ShardedEpochSampler, sharded_data
from utils.data.crops import train_box
from utils.data.folder import image_folder
from utils.data.sizes import TrainSizes
from utils.data.sources import DataSpec, folder_dataset_pair
from utils.engine import Schedule, learning_rate
from utils.flags.config import load_config
from utils.flags.parser import build_parser
from utils.flags.precedence import parse_args
from utils.flags.specs import data_spec, train_sizes
from utils.run.errors import UsageError

CPU = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1, is_main_process=True,
                      main_process_first=None)


def parsed(*argv):
    return parse_args(build_parser("test"), list(argv))


def geometry(*argv):
    spec = data_spec(parsed(*argv), backend="cpu", jpeg_decoder="cuda", channels_last=False)
    return spec.sizes, spec.val_geometry


# ----------------------------------------------------------------------------- the flags

def test_train_and_val_sizes_are_separate_and_image_size_fills_what_they_leave():
    assert geometry("digits") == (TrainSizes.fixed(32), (32, 36))  # the demo: 32 px, crop pct 0.875
    assert geometry("x", "--train-crop-size", "176", "--val-resize-size", "232") == (TrainSizes.fixed(176), (224, 232))
    assert geometry("x", "--image-size", "160", "--val-crop-size", "224") == (TrainSizes.fixed(160), (224, 256))
    assert geometry("x", "--val-crop-size", "256", "--crop-pct", "0.95") == (TrainSizes.fixed(224), (256, 269))
    sizes, _ = geometry("x", "--min-res", "160", "--max-res", "192", "--start-ramp", "11", "--end-ramp", "13",
                        "--epochs", "16")
    assert sizes == TrainSizes(160, 192, 11, 13, 32)


@pytest.mark.parametrize("argv,message", [
    (["--crop-pct", "0.9", "--val-resize-size", "232"], "--crop-pct and --val-resize-size both set"),
    (["--image-size", "200", "--train-crop-size", "176", "--val-crop-size", "224"], "--image-size sets nothing"),
    (["--train-crop-size", "176", "--min-res", "160", "--max-res", "192", "--start-ramp", "1", "--end-ramp", "3"],
     "--train-crop-size and progressive resizing"),
    (["--min-res", "160", "--max-res", "192"], "add --start-ramp, --end-ramp"),
    (["--min-res", "192", "--max-res", "160", "--start-ramp", "1", "--end-ramp", "3"], "is above --max-res"),
    (["--min-res", "160", "--max-res", "192", "--start-ramp", "3", "--end-ramp", "3"], "must come before"),
    (["--min-res", "160", "--max-res", "192", "--start-ramp", "89", "--end-ramp", "95"], "no epoch trains above"),
    (["--res-step", "16"], "--res-step rounds the sizes of progressive resizing"),
    (["--val-resize-size", "200", "--val-crop-size", "224"], "is below the validation crop"),
    (["--ra-sampler", "--ra-reps", "1"], "repeats nothing"),
])
def test_conflicting_geometry_is_a_usage_error_that_says_what_to_do(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parsed("x", *argv)


def test_a_typed_spelling_replaces_a_recipes_other_spelling(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("val-resize-size: 232\ntrain-crop-size: 176\nimage-size: 224\n")
    assert geometry("x", "--config", recipe) == (TrainSizes.fixed(176), (224, 232))
    # typed --crop-pct wins over the recipe's resize; typed --image-size over its train crop
    assert geometry("x", "--config", recipe, "--crop-pct", "0.5", "--image-size", "100") == \
        (TrainSizes.fixed(100), (100, 200))
    both = tmp_path / "both.yaml"
    both.write_text("val-resize-size: 232\ncrop-pct: 0.9\n")
    with pytest.raises(UsageError, match="give one"):  # one file giving both is refused as typing both is
        parsed("x", "--config", both)
    assert load_config(build_parser("t"), str(recipe))["val_resize_size"] == 232


def test_repeated_augmentation_flags():
    assert parsed("x").ra_reps == 1
    assert parsed("x", "--ra-sampler").ra_reps == 3  # torchvision's default repeats
    assert parsed("x", "--ra-sampler", "--ra-reps", "4").ra_reps == 4
    assert parsed("x", "--ra-reps", "4").ra_reps == 4


def test_synthetic_data_refuses_the_pipeline_only_flags(cache_dir, tmp_path):
    for flags in (["--ra-reps", "2"], ["--val-resize-size", "40"],
                  ["--min-res", "24", "--max-res", "32", "--start-ramp", "0", "--end-ramp", "1"]):
        result = run_script("train.py", "synthetic", *flags, "--epochs", "2", "--output-dir", tmp_path)
        assert result.returncode == 2 and "synthetic data is made on the device" in result.stderr, result.stderr


# ----------------------------------------------------------------------------- the size schedule

def ffcv_reference(epoch, low, high, start, end, step=32):
    """FFCV's get_resolution, written out with numpy as its train_imagenet.py does."""
    if epoch <= start:
        return low
    if epoch >= end:
        return high
    return int(np.round(np.interp([epoch], [start, end], [low, high])[0] / step)) * step


@pytest.mark.parametrize("low,high,start,end,step,epochs", [
    (160, 192, 11, 13, 32, 16), (160, 192, 65, 76, 32, 88), (128, 224, 2, 20, 32, 24), (16, 40, 1, 7, 4, 9)])
def test_size_of_each_epoch_is_ffcvs(low, high, start, end, step, epochs):
    sizes = TrainSizes(low, high, start, end, step)
    assert [sizes.size(e) for e in range(epochs)] == [ffcv_reference(e, low, high, start, end, step)
                                                      for e in range(epochs)]
    assert sizes.distinct(epochs)[0] == low and sizes.distinct(epochs)[-1] == high


def test_the_schedule_as_the_start_up_line_says_it():
    assert TrainSizes(160, 192, 11, 13).describe(16) == "160 px (epochs 0-11), 192 px (12-15)"
    assert TrainSizes(16, 24, 0, 2, 4).describe(4) == "16 px (epochs 0), 20 px (1), 24 px (2-3)"
    assert TrainSizes.fixed(176).describe(600) == "176 px"


def test_linear_schedule_is_ffcvs_triangle():
    """Warm up to the peak, then a straight line to --min-lr at the end."""
    schedule = Schedule(lr=0.5, epochs=10, lr_schedule="linear", warmup_epochs=2)
    lrs = [learning_rate(schedule, epoch, step, 4, 512) for epoch in range(10) for step in range(4)]
    peak = 0.5 * 512 / 256
    assert lrs[7] == pytest.approx(peak) and lrs[8] == pytest.approx(peak)  # the warmup's end, the line's start
    assert lrs[0] == pytest.approx(peak / 8)
    line = lrs[8:]
    steps = np.diff(line)
    assert np.allclose(steps, steps[0]) and steps[0] < 0  # straight, downwards
    assert line[-1] == pytest.approx(peak / 32)  # one step short of 0 at the last step
    floor = Schedule(lr=0.5, epochs=10, lr_schedule="linear", min_lr=0.1)
    assert learning_rate(floor, 9, 3, 4, 512) == pytest.approx(0.1 + (peak - 0.1) / 40)


# ----------------------------------------------------------------------------- both backends

def test_auto_backend_picks_the_cpu_workers_for_an_aa_policy():
    """The recipes with --aa (torchvision V2, RSB A3) run as shipped on CUDA: auto picks the cpu
    backend, whose workers run PIL policies, and says why; without --aa it stays gpu."""
    from utils.data.backend import choose_backend
    chosen = choose_backend("imagefolder", "auto", "auto", "cuda", pil_policy=True)
    assert chosen.backend == "cpu" and chosen.line.endswith("auto: --aa runs its PIL policy in the workers")
    assert choose_backend("imagefolder", "auto", "auto", "cuda").backend == "gpu"
    assert choose_backend("imagefolder", "auto", "auto", "cpu", pil_policy=True).line.endswith("auto: no CUDA")


@pytest.mark.parametrize("backend", ["cpu", "gpu"], ids=["cpu_backend", "gpu_backend_on_cpu_tensors"])
def test_both_backends_train_at_the_epochs_size_and_validate_at_their_own(tiny_folder, backend):
    """Progressive resizing through persistent loader workers: each epoch's batches come at that
    epoch's size although the workers were never told; validation keeps its own crop."""
    spec = DataSpec(data=tiny_folder, batch_size=4, workers=1, seed=3, image_size=20, train_sizes=TrainSizes(
        16, 24, 0, 2, 4), val_crop=28, val_resize=30, mean=(0.5,) * 3, std=(0.5,) * 3, backend=backend)
    train_set, val_set = folder_dataset_pair(spec, CPU, "imagefolder", train=True)
    data = sharded_data(train_set, val_set, 3, spec, CPU)
    for epoch, size in enumerate([16, 20, 24, 24]):
        data.set_epoch(epoch)
        shapes = {tuple(images.shape[1:]) for images, _ in data.train}
        assert shapes == {(3, size, size)}, (epoch, shapes)
    assert {tuple(images.shape[1:]) for images, _ in data.val} == {(3, 28, 28)}


def test_the_backends_crop_the_same_pixels_at_a_separate_val_geometry(tmp_path):
    """cpu (PIL Resize + CenterCrop) and gpu (the center box resampled) validation batches agree
    for a resize and crop set apart from each other."""
    root = make_image_folder(tmp_path / "f", classes=2, per_class=3, size=(48, 36))
    batches = {}
    for backend in ("cpu", "gpu"):
        spec = DataSpec(data=str(root), batch_size=3, workers=0, seed=0, image_size=16, val_crop=20, val_resize=26,
                        mean=(0.0,) * 3, std=(1 / 255,) * 3, backend=backend)
        data = sharded_data(*folder_dataset_pair(spec, CPU, "imagefolder", train=True), 2, spec, CPU)
        batches[backend] = torch.cat([images for images, _ in data.val])
    assert batches["cpu"].shape == (6, 3, 20, 20)
    assert (batches["cpu"] - batches["gpu"]).abs().max() <= 2  # levels: PIL's resize and ours round apart


# ----------------------------------------------------------------------------- repeated augmentation

@pytest.mark.parametrize("world,reps", [(1, 3), (2, 2), (4, 4), (3, 4)])
def test_repeated_augmentation_sampler_index_multiset_and_rank_split(world, reps):
    size, batch = 96, 4
    plain = [list(ShardedEpochSampler(size, batch, rank, world, seed=5)) for rank in range(world)]
    ranks = [list(RepeatedAugmentationSampler(size, batch, rank, world, seed=5, reps=reps)) for rank in range(world)]
    assert [len(r) for r in ranks] == [len(p) for p in plain]  # an epoch counts the split's size once
    keys = [key for rank in ranks for key in rank]
    assert len(set(keys)) == len(keys)  # no (image, copy) twice
    counts = np.bincount([index for index, _, _ in keys], minlength=size)
    assert counts.max() == reps and counts.sum() == len(keys)
    assert (counts == reps).sum() >= len(keys) // reps - 1  # all but the last image cut are there N times
    order = torch.randperm(size, generator=torch.Generator().manual_seed(5 * 1_000_003))
    expected = order.repeat_interleave(reps)[:len(keys)]
    dealt = [ranks[k % world][k // world][0] for k in range(len(keys))]
    assert dealt == expected.tolist()  # the shuffle, each image N times in a row, dealt to the ranks in turn
    if world >= reps:  # an image's copies on different ranks
        for rank, other in zip(ranks, ranks[1:]):
            assert [index for index, _, _ in rank] == [index for index, _, _ in other]


def test_repeated_copies_get_their_own_crops_and_the_first_keeps_the_plain_key():
    boxes = {train_box(0, 1, 7, 500, 375, 0.08, 0.5, repeat=r) for r in range(4)}
    assert len(boxes) == 4
    assert train_box(0, 1, 7, 500, 375, 0.08, 0.5, repeat=0) == train_box(0, 1, 7, 500, 375, 0.08, 0.5)


def test_repeated_augmentation_resumes_mid_epoch_at_the_same_place():
    whole = list(RepeatedAugmentationSampler(60, 4, 1, 2, seed=3, reps=3))
    sampler = RepeatedAugmentationSampler(60, 4, 1, 2, seed=3, reps=3)
    sampler.set_epoch(0, first_step=2)
    assert list(sampler) == whole[8:]
    sampler.set_epoch(1)
    assert list(sampler) != whole and len(list(sampler)) == len(whole)


def test_cpu_loader_gives_each_copy_its_own_crop(tiny_folder):
    spec = DataSpec(data=tiny_folder, batch_size=6, workers=0, seed=1, image_size=16, ra_reps=3,
                    mean=(0.5,) * 3, std=(0.5,) * 3)
    data = sharded_data(*folder_dataset_pair(spec, CPU, "imagefolder", train=True), 3, spec, CPU)
    assert isinstance(data.train_sampler, RepeatedAugmentationSampler)
    images, targets = next(iter(data.train))
    assert len(set(targets[:3].tolist())) == 1  # one image's three copies ...
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])  # ... cropped apart


# ----------------------------------------------------------------------------- real runs

def test_train_prints_the_geometry_and_the_checkpoint_carries_it_to_eval(cache_dir, tmp_path):
    result = run_script("train.py", *QUICK, "--epochs", "3", "--min-res", "24", "--max-res", "32", "--start-ramp",
                        "0", "--end-ramp", "2", "--res-step", "4", "--val-resize-size", "40", "--ra-reps", "2",
                        "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "=> train crop 24 px (epochs 0), 28 px (1), 32 px (2) | val resize 40 + center crop 32 | repeated " \
           "augmentation x2" in result.stdout
    printed = FINAL.findall(result.stdout)[-1]
    evaluated = run_script("eval.py", "--resume", tmp_path / "checkpoint.pth.tar", "-j", "0")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "resize 40 + center crop 32" in evaluated.stdout and FINAL.findall(evaluated.stdout) == [printed]
    # flags override the checkpoint: a typed --crop-pct replaces its --val-resize-size
    other = run_script("eval.py", "--resume", tmp_path / "checkpoint.pth.tar", "-j", "0", "--crop-pct", "0.5",
                       "--val-crop-size", "24")
    assert other.returncode == 0, other.stderr[-3000:]
    assert "resize 48 + center crop 24" in other.stdout


def test_mid_epoch_resume_under_progressive_resizing_and_repeats_is_bit_exact(cache_dir, tmp_path):
    flags = [*TINY, "-b", "16", "--steps-per-epoch", "4", "--epochs", "3", "--min-res", "24", "--max-res", "32",
             "--start-ramp", "0", "--end-ramp", "2", "--res-step", "4", "--ra-reps", "2", "--save-every-steps", "6"]
    straight = run_script("train.py", *flags, "--output-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = tmp_path / "stopped"
    rc, _, err = train_until(stopped, r"Epoch: \[1\]\[3/4\]", signal.SIGKILL, *flags)
    assert rc == -signal.SIGKILL, err[-3000:]
    state = torch.load(stopped / "checkpoint.pth.tar", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 2)  # inside the 28 px epoch
    resumed = run_script("train.py", *flags, "--output-dir", stopped, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(stopped / "checkpoint.pth.tar", tmp_path / "straight" / "checkpoint.pth.tar")


def test_train_sizes_spec_from_flags():
    assert train_sizes(parsed("x", "--train-crop-size", "176")) == TrainSizes.fixed(176)
    assert train_sizes(parsed("x", "--min-res", "160", "--max-res", "192", "--start-ramp", "1", "--end-ramp", "3",
                              "--res-step", "16")) == TrainSizes(160, 192, 1, 3, 16)


def test_val_set_of_its_own_geometry_is_read_through_image_folder(tmp_path):
    from utils.data.crops import val_transform
    root = make_image_folder(tmp_path / "g", classes=1, per_class=1, size=(60, 40), splits=("val",))
    image, _ = image_folder(str(root), "val", val_transform(24, 30))[0]
    assert image.size == (24, 24)


@pytest.mark.gpu
def test_gpu_backend_on_cuda_trains_at_two_sizes(tiny_folder):
    """nvJPEG and the CUDA resampling at the two sizes of a schedule: the batches come at each
    epoch's size, and match the same pipeline on CPU tensors (libjpeg-turbo's decode there, whose
    chroma upsampling differs from nvJPEG's by a few levels: mean difference under 2)."""
    got = {}
    for device in ("cuda", "cpu"):
        where = SimpleNamespace(device=torch.device(device), process_index=0, num_processes=1, is_main_process=True)
        spec = DataSpec(data=tiny_folder, batch_size=6, workers=1, seed=3, image_size=24,
                        train_sizes=TrainSizes(16, 24, 0, 1, 8), mean=(0.0,) * 3, std=(1 / 255,) * 3, backend="gpu",
                        channels_last=True)
        data = sharded_data(*folder_dataset_pair(spec, where, "imagefolder", train=True), 3, spec, where)
        for epoch in (0, 1):
            data.set_epoch(epoch)
            got[device, epoch] = torch.cat([images.float().cpu() for images, _ in data.train])
    for epoch, size in ((0, 16), (1, 24)):
        assert got["cuda", epoch].shape[1:] == (3, size, size)
        assert (got["cuda", epoch] - got["cpu", epoch]).abs().mean() < 2


@pytest.mark.gpu
def test_compiled_progressive_run_on_cuda_says_its_graphs(cache_dir, tmp_path):
    result = run_script("train.py", "--epochs", "3", "--steps-per-epoch", "5", "-b", "32", "--min-res", "24",
                        "--max-res", "32", "--start-ramp", "0", "--end-ramp", "2", "--res-step", "4", "--compile",
                        "--compile-mode", "reduce-overhead", "--opt-level", "O1", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.compile: 3 train sizes, one compiled graph each, CUDA graphs captured per size" in result.stdout
    assert "recompile" not in result.stderr.lower(), result.stderr[-3000:]  # no limit reached, no eager fallback
    assert len(FINAL.findall(result.stdout)) == 3
