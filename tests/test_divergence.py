"""Non-finite numbers at every level: O0 and bf16 runs (no loss scale) skip and count a step whose
grads hold inf/NaN, as fp16 runs do; a run that keeps diverging stops with exit code 3 and one
line naming the step, the LR and the last good checkpoint, which it leaves as it was.

The divergence is real: a first epoch at the normal LR writes the good checkpoint, then a resume
of it with --lr 1e6 (and momentum 0.9) blows the digits model up within a few steps: ResNet-18 at
O0 (loss ~1e9, then ~1e17, then NaN) and HALF_ARCH at bf16 (loss ~4e8, then NaN; ResNet-18's bf16
convolutions crawl on a CPU, conftest.py).
"""
import hashlib
import re
import shutil

import pytest
import torch
from conftest import HALF_TINY, TINY, run_script
from test_precision import setup, snapshot, train_step

DIVERGED = re.compile(r"train\.py: stopped: training diverged at epoch (\d+), step (\d+)/(\d+) \(lr ([\d.e+]+)\): "
                      r"(.+); the last good checkpoint is (\S+) \(it was left as it was\)")
FLAGS = [*TINY, "-b", "16", "-p", "2"]
# For the bf16 runs. -p 1: the streak is read at log lines (Precision.divergence); with -p 2,
# HALF_ARCH's first NaN step (the 3rd) would show a streak of 4 at step 6 rather than 3.
HALF_FLAGS = [*HALF_TINY, "-b", "16", "-p", "1"]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def good_epoch(cache_dir, tmp_path_factory):
    """good_epoch(base_flags): the directory of one good epoch run with FLAGS or HALF_FLAGS (run
    once a module): checkpoint.pth.tar and model_best.pth.tar of a healthy run."""
    done = {}

    def good(base_flags):
        key = tuple(base_flags)
        if key not in done:
            out = tmp_path_factory.mktemp("good")
            result = run_script("train.py", *base_flags, "--steps-per-epoch", "4", "--epochs", "1",
                                "--output-dir", out)
            assert result.returncode == 0, result.stderr[-3000:]
            done[key] = out
        return done[key]
    return good


def diverge(good_epoch, tmp_path, base_flags, *flags):
    """Resume base_flags' good epoch with an absurd LR; returns (result, out dir, digests before)."""
    out = tmp_path / "run"
    shutil.copytree(good_epoch(base_flags), out)
    before = {name: digest(out / name) for name in ("checkpoint.pth.tar", "model_best.pth.tar")}
    result = run_script("train.py", *base_flags, "--epochs", "3", "--output-dir", out, "--lr", "1e6",
                        "--resume", out / "checkpoint.pth.tar", *flags)
    return result, out, before


def assert_left_intact(out, before):
    for name, sha in before.items():
        assert digest(out / name) == sha, f"{name} changed"
        state = torch.load(out / name, weights_only=True)  # and still loads, with finite weights
        assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())


@pytest.mark.parametrize("mixed_precision, base_flags", [("no", FLAGS), ("bf16", HALF_FLAGS)], ids=["no", "bf16"])
def test_nonfinite_steps_in_a_row_stop_the_run(good_epoch, tmp_path, mixed_precision, base_flags):
    result, out, before = diverge(good_epoch, tmp_path, base_flags, "--steps-per-epoch", "10",
                                  "--max-nonfinite-steps", "3", "--mixed-precision", mixed_precision)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    found = DIVERGED.search(result.stderr)
    assert found, result.stderr[-3000:]
    epoch, step, steps, lr, reason, path = found.groups()
    assert (epoch, steps, float(lr)) == ("1", "10", 1e6 * 16 / 256)
    assert "3 steps in a row had non-finite (inf/NaN) loss or gradients" in reason
    assert path == str(out / "checkpoint.pth.tar")
    # The skipped steps were counted and shown, at O0 and bf16 alike (no loss scale to show).
    skipped = [int(n) for n in re.findall(r"\tSkipped (\d+)$", result.stdout, flags=re.M)]
    assert skipped and skipped[-1] >= 3 and "Scale" not in result.stdout
    assert_left_intact(out, before)


def test_nonfinite_weights_are_never_saved(good_epoch, tmp_path):
    """Too few steps for the in-a-row limit (default 100): the epoch ends, and the NaN weights or
    BatchNorm statistics are found before the save, which does not happen."""
    result, out, before = diverge(good_epoch, tmp_path, FLAGS, "--steps-per-epoch", "4")
    assert result.returncode == 3, result.stderr[-3000:]
    found = DIVERGED.search(result.stderr)
    assert found and "hold inf/NaN" in found.group(5), result.stderr[-3000:]
    assert (found.group(1), found.group(2)) == ("1", "4")  # the last step run: epoch 1's 4th
    assert_left_intact(out, before)


# ---------------------------------------------------------------------------------------------
# The device-side check without a loss scale, in process

@pytest.mark.parametrize("level, dtype_name", [("O0", "no"), ("O1", "bf16"), ("O2", "bf16")])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_unscaled_levels_skip_and_count_nonfinite_steps(accelerator, level, dtype_name, poison):
    model, precision, optimizer = setup(level, dtype_name)
    assert precision.scaler is None and precision.loss_scale_value() is None
    train_step(model, precision, optimizer, accelerator)
    weights, momenta = snapshot(model, optimizer)
    train_step(model, precision, optimizer, accelerator, poison=poison)
    after_weights, after_momenta = snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(weights, after_weights))  # the step was skipped
    assert all(torch.equal(a, b) for a, b in zip(momenta, after_momenta))
    assert int(precision.skipped_steps()) == 1 and int(precision.guard.streak) == 1
    train_step(model, precision, optimizer, accelerator, poison=poison)
    assert int(precision.guard.streak) == 2 and precision.divergence(2) is not None
    assert precision.divergence(3) is None
    train_step(model, precision, optimizer, accelerator)  # a clean step trains and ends the streak
    assert not all(torch.equal(a, b) for a, b in zip(weights, snapshot(model, optimizer)[0]))
    assert int(precision.skipped_steps()) == 2 and int(precision.guard.streak) == 0
    state = precision.state_dict()
    assert (state["skipped"], state["streak"], state["scale"]) == (2, 0, None)


def test_unscaled_check_leaves_finite_grads_as_they_are():
    from utils.loss_scale import NonFiniteCheck

    grads = [torch.randn(5, 3), torch.randn(7)]
    copies = [g.clone() for g in grads]
    assert float(NonFiniteCheck(torch.device("cpu")).check(grads)) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(grads, copies))  # checked, not multiplied


def test_dynamic_scale_below_the_floor_is_divergence(accelerator):
    from utils.loss_scale import DYNAMIC_MIN_SCALE

    model, precision, optimizer = setup("O1", "fp16", loss_scale="dynamic")
    for _ in range(29):  # 2**16 halved 29 times: 2**-13, still above the floor
        train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    assert precision.divergence(1000) is None
    train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    assert float(precision.loss_scale_value()) < DYNAMIC_MIN_SCALE
    assert "dynamic loss scale fell" in precision.divergence(1000)


def test_weights_finite_sees_batchnorm_statistics_and_o2_masters():
    model, precision, _ = setup("O0", "no")
    assert precision.weights_finite(model)
    model.bn.running_var[0] = float("nan")
    assert not precision.weights_finite(model)
    model, precision, _ = setup("O2", "bf16")
    assert precision.weights_finite(model)
    with torch.no_grad():  # only the fp32 master: the half weight itself stays finite
        next(iter(precision.master_of.values()))[0].fill_(float("inf"))
    assert not precision.weights_finite(model)


def test_the_message_says_what_to_do_with_and_without_a_checkpoint():
    from utils.engine import diverged_message
    with_file = diverged_message("inf loss", 1, 6, 10, 0.5, "out/checkpoint.pth.tar")
    assert with_file.endswith("the last good checkpoint is out/checkpoint.pth.tar (it was left as it was); "
                              "resume from it with a lower --lr (or, at fp16, try bf16 or O0)")
    without = diverged_message("inf loss", 0, 3, 10, 0.5, None)
    assert "no checkpoint was written yet; start again with a lower --lr" in without
    assert "resume" not in without and "left as it was" not in without
