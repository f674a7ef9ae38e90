"""What every test file shares: thread and time limits, the subprocess runner, tiny-data builders."""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `pytest` (not `python -m pytest`) does not put the working directory there
    sys.path.insert(0, ROOT)

from warm_launcher import warm_run  # noqa: E402 (tests/ is on sys.path, as for every test file's "from conftest import")

# One thread per process unless the caller asks for more: on a busy 2-core machine a process
# whose OpenMP threads spin waiting for each other runs up to 10x slower, and the tiny models
# the tests train gain nothing from a second thread. A 2-process gloo run gets 1 per process.
THREADS = os.environ.get("OMP_NUM_THREADS", "1")
# Seconds any test subprocess may run. The longest (the 12-epoch digits demo) took ~100 s on a
# busy 2-core machine; 18x that lets a far busier one finish, and a hung process still fails the
# test rather than hanging CI.
TIMEOUT = 1800

# The smallest honest training run on the digits: resnet18 on 32 px crops, no loader processes,
# a log line every step. QUICK adds a batch and 4 steps an epoch.
TINY = ["-a", "resnet18", "--image-size", "32", "-j", "0", "-p", "1"]
QUICK = [*TINY, "-b", "16", "--steps-per-epoch", "4"]
# The same for runs in bf16/fp16 on the CPU. Without AVX-512 (the 2-core CI machine) torch runs
# resnet18's half-precision convolutions through aten::_slow_conv2d_*: ~8 s a batch-16 training
# step and ~13 s a digits validation, 35x fp32. torchvision's shufflenet_v2_x0_5 takes 0.3 s a
# step there and still has BatchNorm, so what O2/O3 and --keep-batchnorm-fp32 do to it is tested.
HALF_ARCH = "shufflenet_v2_x0_5"
HALF_TINY = ["-a", HALF_ARCH, *TINY[2:]]
HALF_QUICK = [*HALF_TINY, "-b", "16", "--steps-per-epoch", "4"]
# The validation summary line every script prints (Apex's format): top-1, top-5.
FINAL = re.compile(r" \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: minutes long; left out of the default run (pytest.ini), run with -m slow")
    config.addinivalue_line("markers", "first: one of the longest tests, started before the rest (see below)")
    import torch
    torch.set_num_threads(int(THREADS))  # the in-process tests, for the reason above
    # A suite started in the background of a non-interactive shell (`.ci/run &` in a script)
    # inherits SIGINT ignored, and so would every run it starts: a Ctrl-C a test sends to a run
    # before the run installs its own handler would be dropped, and the run end as if never
    # interrupted. Tests stand for a user at a terminal, where Ctrl-C has its default action.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    # The longest tests go first: started last, the 3-minute demo kept one xdist worker busy alone
    # after the other had run out of tests (CI's wall time is what the 15-minute budget counts).
    items.sort(key=lambda item: "first" not in item.keywords)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private cache so the digits folder the tests use is written by the tests."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["IMAGENET_AMP_CACHE"] = str(path)
    return path


def make_image_folder(root, classes=3, per_class=6, size=(40, 30), splits=("train", "val"), seed=0):
    """Real JPEGs in ImageFolder layout: root/<split>/<class>/<n>.jpg, each class its own colour."""
    rng = np.random.RandomState(seed)
    for split in splits:
        for label in range(classes):
            folder = os.path.join(root, split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            for index in range(per_class):
                base = np.zeros((size[1], size[0], 3), dtype=np.uint8)
                base[..., label % 3] = 180
                noise = rng.randint(0, 60, size=base.shape).astype(np.uint8)
                Image.fromarray(base + noise).save(os.path.join(folder, f"{index}.jpg"), quality=90)
    return str(root)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A read-only 3-class ImageFolder (6 train + 6 val JPEGs a class) shared by the whole session."""
    return make_image_folder(tmp_path_factory.mktemp("tiny_folder"))


def subprocess_env(env=None, threads=None):
    """os.environ plus `env`, with the thread limits set wherever neither of them set one."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        full_env.setdefault(name, str(threads or THREADS))
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    return full_env


def run_command(command, env=None, cwd=None, timeout=TIMEOUT):
    """Any command in a process of its own with the test limits; returns CompletedProcess (text).
    `python SCRIPT.py ...` runs in a child of a warm interpreter that has the libraries imported
    already (tests/warm_launcher.py: the same process semantics without the ~9 s of imports) where
    the environment allows, else in a fresh interpreter."""
    full_env = subprocess_env(env)
    done = warm_run(command, full_env, cwd or ROOT, timeout, base_env=subprocess_env())
    if done is not None:
        return done
    return subprocess.run([*map(str, command)], capture_output=True, text=True, env=full_env,
                          cwd=cwd or ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def leave_together(code=0):
    """End a rank of a probe run under torchrun: every rank waits for the others, then exits
    without the process group's C++ teardown (utils.run.errors.leave, as the scripts do). A rank
    leaving while gloo's threads still served another aborted it ("terminate called without an
    active exception"), even after a barrier and Accelerator.end_training (CI, 2026-12-04).
    Whatever the probe wrote must be closed before."""
    import torch.distributed as dist

    from utils.run.errors import leave
    dist.barrier()
    leave(code)


def run_script(script, *args, env=None, cwd=None, timeout=TIMEOUT):
    """Run one of the project's scripts in a fresh process; returns CompletedProcess."""
    return run_command([sys.executable, os.path.join(ROOT, script), *args], env=env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def evaluate(cache_dir):
    """eval.py's main() in this process (no interpreter start-up per call), on one thread."""
    import importlib
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    script = importlib.import_module("eval")
    yield lambda *argv: script.main([str(a) for a in argv])
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def accelerator():
    """One Accelerator for the whole session: Accelerate allows one state per process."""
    from accelerate import Accelerator
    return Accelerator(mixed_precision="no")


def build_sgd(params, lr, momentum, weight_decay):
    """A test's optimizer: fused SGD (it honours the on-device found_inf flag), with momentum
    buffers made up front.

    The fused kernel starts a momentum buffer from the first grad it applies; if that first step
    is an overflow skip, the buffer would be left uninitialised. Zero buffers are equivalent
    (momentum*0 + grad) and keep a skipped first step harmless.
    """
    import torch  # conftest stays import-light: torch only where a test builds an optimizer

    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, fused=True)
    if momentum:
        for param in params:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return optimizer
