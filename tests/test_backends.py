"""The input backends and the device-dependent defaults: --data-backend, channels_last, --compile.

The gpu backend's own pieces (header routing, packing, batched resampling) are tested in
tests/test_gpu_batches.py; here: both backends are built from the same boxes, and the flags
resolve and refuse as the README says.
"""
import argparse

import pytest
import torch
from conftest import QUICK, run_script
from PIL import Image
from test_train import usage_error  # noqa: F401  (fixture)

from utils.data.batches import SeededSamples
from utils.data.crops import TrainBoxes, train_transform, val_transform
from utils.data.folder import image_folder
from utils.data.gpu.packing import ByteSamples
from utils.data.image_files import rgb_pixels
from utils.data.sources import DataSpec
from utils.flags.specs import device_settings


def test_both_backends_draw_the_same_box_for_every_sample(tiny_folder):
    cpu = SeededSamples(image_folder(tiny_folder, "train", train_transform(24, 0.1, 0.5)), seed=7)
    gpu = ByteSamples(image_folder(tiny_folder, "train", None).samples, TrainBoxes(7, 0.1, 0.5, 24))
    flips = set()
    for epoch in (0, 3):
        for index in range(len(cpu)):
            path = cpu.dataset.samples[index][0]
            with Image.open(path) as image:
                cpu_box = cpu.crop.box(image, 7, epoch, index)
            gpu_box = gpu[(index, epoch)][2]
            assert tuple(gpu_box) == tuple(cpu_box), (path, epoch)
            flips.add(cpu_box[4])
    assert flips == {True, False}  # the flip is drawn, not fixed
    image, _ = cpu[(0, 0)]
    assert image.shape == (24, 24, 3) and image.dtype == torch.uint8  # rows x columns x RGB, as collated


def logged_rgb_pixels(log_path, path):
    """The cpu backend's loader, noting each path it opens (in worker processes: into a file)."""
    with open(log_path, "a") as log:
        log.write(path + "\n")
    return rgb_pixels(path)


def test_starting_an_epoch_sets_the_workers_going_on_its_first_batches(tiny_folder, tmp_path):
    """Data.start_epoch (train.py calls it before validating) has the loader workers reading
    the epoch's first batch before any batch is asked for; the batches are that epoch's."""
    import functools
    import time
    from types import SimpleNamespace

    from utils.data.batches import sharded_data
    log_path = tmp_path / "opened.txt"
    train_set = image_folder(tiny_folder, "train", train_transform(24, 0.1, 0.5))
    train_set.loader = functools.partial(logged_rgb_pixels, str(log_path))
    val_set = image_folder(tiny_folder, "val", val_transform(24, 27))
    spec = DataSpec(data=None, batch_size=4, workers=1, seed=3, image_size=24, mean=(0.5,) * 3, std=(0.5,) * 3)
    accel = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1)
    data = sharded_data(train_set, val_set, 3, spec, accel)
    batches = data.start_epoch(2)
    deadline = time.monotonic() + 120  # waits for the worker; no speed is asserted
    while len(log_path.read_text().splitlines() if log_path.exists() else []) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    first = [index for index, _ in list(data.train_sampler)[:4]]
    opened = log_path.read_text().splitlines()[:4] if log_path.exists() else []
    assert opened == [train_set.samples[index][0] for index in first]  # before next(): epoch 2's first batch
    images, targets = next(batches)
    assert targets.tolist() == [train_set.samples[index][1] for index in first]
    assert images.shape == (4, 3, 24, 24)
    batches.close()


def test_starting_an_epoch_forks_the_val_workers_first_and_validation_uses_them(tiny_folder):
    """The first start_epoch starts validation's loader (its workers fork) before the next
    epoch's batches: forking beside the gpu backend's decode threads hung a CUDA run. The
    validation that follows reads that started iterator; later ones start their own."""
    from types import SimpleNamespace

    from utils.data.batches import sharded_data
    train_set = image_folder(tiny_folder, "train", train_transform(24, 0.1, 0.5))
    val_set = image_folder(tiny_folder, "val", val_transform(24, 27))
    spec = DataSpec(data=None, batch_size=4, workers=1, seed=3, image_size=24, mean=(0.5,) * 3, std=(0.5,) * 3)
    accel = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1)
    data = sharded_data(train_set, val_set, 3, spec, accel)
    val_loader = data.val.loader
    assert val_loader._iterator is None  # no val workers before the first epoch ends
    batches = data.start_epoch(1)
    val_workers = val_loader._iterator._workers
    assert val_workers and all(worker.is_alive() for worker in val_workers)
    started = data.val_batches()
    assert sum(len(targets) for _, targets in started) == len(val_set)
    again = data.val_batches()
    assert again is not started and sum(len(targets) for _, targets in again) == len(val_set)
    assert val_loader._iterator._workers == val_workers  # persistent: nothing forked again
    data.start_epoch(2).close()
    assert data.val_batches() is not None and val_loader._iterator._workers == val_workers
    batches.close()


def test_gpu_batches_start_their_loader_and_hand_over_in_the_callers_thread():
    """iter(GpuBatches) iterates its loader (a DataLoader forks its workers there) in the
    thread that asked, never in a decode thread, at every thread count; with threads, each
    batch is handed over (ordered with the step's stream) in that thread too, as it is taken."""
    import threading
    from types import SimpleNamespace

    from utils.data.gpu.pipeline import GpuBatches

    class Recorded:
        def __init__(self):
            self.threads = []

        def __iter__(self):
            self.threads.append(threading.current_thread())
            return iter(range(5))

        def __len__(self):
            return 5

    handed_over_in = []

    def hand_over(staged):  # must run in the thread that takes the batch (it orders the step's stream)
        handed_over_in.append(threading.current_thread())
        return staged[0]

    decoder = SimpleNamespace(cuda=False, decode_stage=lambda item: (item,), hand_over=hand_over,
                              resample_ahead=lambda item: (item * 10, None, None))
    for threads in (0, 1, 2):
        loader = Recorded()
        handed_over_in.clear()
        batches = iter(GpuBatches(loader, decoder if threads else (lambda item: item * 10), threads=threads))
        assert loader.threads == [threading.current_thread()], threads
        assert list(batches) == [0, 10, 20, 30, 40], threads
        assert handed_over_in == ([threading.current_thread()] * 5 if threads else []), threads


def resolved(device_type, **flags):
    args = argparse.Namespace(arch="resnet18", data=None, data_backend="auto", channels_last=None, compile=False,
                              compile_mode="default", tune_kernels=False, jpeg_decoder="auto", deterministic=False,
                              aa="none")
    vars(args).update(flags)
    return device_settings(args, device_type)


def test_auto_picks_by_device_and_source():
    assert resolved("cuda").data_backend == "gpu"
    assert resolved("cpu").data_backend == "cpu"
    assert resolved("cuda", data="hf:cifar10").data_backend == "cpu"  # decoded in the workers
    assert resolved("cuda", data="synthetic").data_backend == "none"
    assert resolved("cuda", aa="ta_wide").data_backend == "cpu"  # its PIL policy runs in the workers
    line = resolved("cuda").input_line
    assert "gpu backend" in line and "channels_last on" in line


def test_choose_backend_says_what_it_chose_and_refuses_what_cannot_run(monkeypatch):
    from utils.data.backend import InputBackend, choose_backend
    from utils.run.errors import UsageError

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    gpu = choose_backend("imagefolder", "auto", "auto", "cuda")
    assert (gpu.backend, gpu.jpeg_decoder) == ("gpu", "cuda")
    assert gpu.line == ("=> input: gpu backend (nvJPEG batch decode + crops on the GPU; jpeg decoder cuda, "
                        "auto: nvJPEG measured faster in training), auto: ImageFolder data on CUDA")
    assert choose_backend("imagefolder", "auto", "auto", "cpu") == InputBackend(
        "cpu", "auto", "=> input: cpu backend (decode + crops in workers), auto: no CUDA")
    assert choose_backend("datasets", "auto", "auto", "cuda").line.endswith(
        ", auto: Hugging Face datasets are decoded in the workers")
    assert choose_backend("synthetic", "auto", "auto", "cuda").line == (
        "=> input: none backend, synthetic tensors are made on the device")
    for call, words in [(("imagefolder", "gpu", "auto", "cpu"), "no CUDA device"),
                        (("datasets", "gpu", "auto", "cuda"), "reads ImageFolder files"),
                        (("synthetic", "cpu", "auto", "cuda"), "synthetic data has no input pipeline"),
                        (("imagefolder", "cpu", "cuda", "cuda"), "--jpeg-decoder cuda applies to the gpu")]:
        with pytest.raises(UsageError, match=words):
            choose_backend(*call)


def test_channels_last_defaults_on_for_convolutions_on_cuda_only():
    assert resolved("cuda").channels_last is True
    assert resolved("cpu").channels_last is False
    assert resolved("cuda", arch="vit_b_16").channels_last is True   # its patch embedding is a Conv2d
    assert resolved("cuda", channels_last=False).channels_last is False  # --channels-last False wins
    assert "(--channels-last)" in resolved("cuda", channels_last=False).input_line


def test_backend_flag_mistakes_are_usage_errors(usage_error):  # noqa: F811
    if not torch.cuda.is_available():
        usage_error(["--data-backend", "gpu", *QUICK], "--data-backend gpu", "no CUDA")
    usage_error(["synthetic", "--data-backend", "cpu", *QUICK], "synthetic data has no input pipeline")
    usage_error(["--data-backend", "tpu", *QUICK], "invalid choice")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_startup_line_and_compiled_training_with_plain_checkpoint_keys(tiny_folder, tmp_path):
    out = tmp_path / "run"
    result = run_script("train.py", tiny_folder, *QUICK, "--steps-per-epoch", "2", "--epochs", "1",
                        "--compile", "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "=> input: cpu backend (decode + crops in workers), auto: no CUDA | channels_last off" in result.stdout
    assert "torch.compile (inductor): first forward, compile included, took" in result.stdout
    assert result.stdout.count("torch.compile (inductor): first forward") == 1  # printed once
    state = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=True)["state_dict"]
    assert not any("_orig_mod" in key or key.startswith("module.") for key in state)
    import torchvision
    torchvision.models.resnet18(num_classes=3).load_state_dict(state)  # strict: an uncompiled model takes it
    evaluated = run_script("eval.py", "--resume", out / "checkpoint.pth.tar", "--compile", "-j", "0")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "torch.compile (inductor)" in evaluated.stdout


def test_accelerate_eager_dynamo_backend_is_honoured_once(tiny_folder, tmp_path):
    """`accelerate launch --dynamo_backend eager` (ACCELERATE_DYNAMO_BACKEND=EAGER) is a backend
    torch.compile takes; it was refused as "not a torch.compile backend here" because torch lists
    its debug-tagged backends only when asked. It compiles once, by this script, in train.py and
    eval.py, and the checkpoint keeps plain keys."""
    out = tmp_path / "run"
    env = {"ACCELERATE_DYNAMO_BACKEND": "EAGER"}
    result = run_script("train.py", tiny_folder, *QUICK, "--steps-per-epoch", "2", "--epochs", "1",
                        "--output-dir", out, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.compile with backend eager, from Accelerate's dynamo_backend setting" in result.stderr
    assert result.stdout.count("torch.compile (eager): first forward") == 1
    state = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=True)["state_dict"]
    assert not any("_orig_mod" in key for key in state)
    evaluated = run_script("eval.py", "--resume", out / "checkpoint.pth.tar", "-j", "0", env=env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "torch.compile (eager): first forward" in evaluated.stdout
    # Resumed without that setting, the run keeps its backend (it went on with inductor before).
    resumed = run_script("train.py", tiny_folder, *QUICK, "--steps-per-epoch", "2", "--epochs", "2",
                         "--resume", out, "-j", "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "torch.compile with backend eager, as the resumed run was compiled" in resumed.stderr + resumed.stdout
    assert resumed.stdout.count("torch.compile (eager): first forward") == 1
    assert "torch.compile (inductor)" not in resumed.stdout
