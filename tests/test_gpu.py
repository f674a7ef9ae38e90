"""fp16 paths on a CUDA GPU (skipped without CUDA): the shim on real half kernels, and train.py."""
import re

import pytest
import torch
from conftest import FINAL, QUICK, build_sgd, run_script
from test_precision import TinyNet, train_step
from test_train import losses

from utils.compiled import compile_model, plain_module
from utils.precision import Precision, resolve_precision

pytestmark = pytest.mark.gpu



def cuda_setup(level, keep_bn=None, loss_scale=None, channels_last=False):
    recipe, _ = resolve_precision(level, keep_bn, loss_scale, "fp16", None)
    torch.manual_seed(0)
    model = TinyNet().cuda()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    precision = Precision(recipe, model, "cuda")
    optimizer = build_sgd(precision.optimizer_params(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return model, precision, optimizer


def step(model, precision, optimizer, accelerator, poison=None):
    return train_step(model, precision, optimizer, accelerator, poison, device="cuda")


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_fp16_levels_train_skip_and_scale_on_cuda(accelerator, level, channels_last):
    model, precision, optimizer = cuda_setup(level, loss_scale="dynamic", channels_last=channels_last)
    precision.scaler.growth_interval = 2
    out = step(model, precision, optimizer, accelerator)
    # O1 logits come out of autocast in fp16; O2/O3 hand back fp32 logits.
    assert out.dtype == (torch.float16 if level == "O1" else torch.float32)
    weights = [p.detach().clone() for p in model.parameters()]
    step(model, precision, optimizer, accelerator, poison=float("inf"))
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert int(precision.skipped_steps()) == 1 and float(precision.loss_scale_value()) == 32768.0
    step(model, precision, optimizer, accelerator)
    step(model, precision, optimizer, accelerator)
    assert float(precision.loss_scale_value()) == 65536.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if level == "O2":
        for param, master in precision.master_of.items():
            assert torch.equal(param.detach(), master.detach().half())


def test_o3_keep_bn_and_static_scale_on_cuda(accelerator):
    model, precision, optimizer = cuda_setup("O3", keep_bn=True)
    assert model.bn.weight.dtype == torch.float32 and model.conv.weight.dtype == torch.float16
    step(model, precision, optimizer, accelerator, poison=float("nan"))
    step(model, precision, optimizer, accelerator)
    assert float(precision.loss_scale_value()) == 1.0 and int(precision.skipped_steps()) == 1


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_train_py_fp16_on_gpu(cache_dir, tmp_path, level):
    result = run_script("train.py", "--opt-level", level, "--channels-last", "True", "--epochs", "2",
                        "--output-dir", tmp_path, *QUICK)
    assert result.returncode == 0, result.stderr
    assert f"precision: {level} fp16" in result.stdout
    assert re.search(r"Skipped \d+\tScale [\d.e+]+", result.stdout)
    assert len(FINAL.findall(result.stdout)) == 2
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state["state_dict"].values() if v.is_floating_point())


def test_deterministic_gpu_runs_repeat_and_resume_exactly(cache_dir, tmp_path):
    # The gpu backend's default decoder under --deterministic: the hardware one where nvImageCodec
    # is installed, else nvJPEG (whose runs did not always repeat while other processes decoded on
    # the same GPU: docs/speed.md).
    common = ["--deterministic", "--opt-level", "O2", "--data-backend", "gpu", *QUICK]
    runs = [run_script("train.py", "--epochs", "2", "--output-dir", tmp_path / str(i), *common) for i in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert losses(runs[0].stdout) == losses(runs[1].stdout) and len(losses(runs[0].stdout)) == 8
    resumed = run_script("train.py", "--epochs", "3", "--output-dir", tmp_path / "0",
                         "--resume", tmp_path / "0" / "checkpoint.pth.tar", *common)
    straight = run_script("train.py", "--epochs", "3", "--output-dir", tmp_path / "s", *common)
    assert resumed.returncode == 0 and straight.returncode == 0, resumed.stderr + straight.stderr
    assert losses(straight.stdout)[-4:] == losses(resumed.stdout)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_bf16_levels_with_loss_scale_on_cuda(accelerator, level):
    """bf16 grads with a loss scale (O3's default static 1.0): torch's fused unscale kernel has
    no bf16 CUDA version, so the portable path must take over."""
    recipe, _ = resolve_precision(level, None, 1.0, "bf16", None)
    torch.manual_seed(0)
    model = TinyNet().cuda()
    precision = Precision(recipe, model, "cuda")
    optimizer = build_sgd(precision.optimizer_params(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    step(model, precision, optimizer, accelerator, poison=float("inf"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    step(model, precision, optimizer, accelerator)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert int(precision.skipped_steps()) == 1 and float(precision.loss_scale_value()) == 1.0


@pytest.mark.parametrize("level, dtype_name", [("O1", "fp16"), ("O2", "bf16")])
def test_sigterm_mid_epoch_then_resume_is_bit_exact_on_gpu(cache_dir, tmp_path, level, dtype_name):
    """Preemption on the GPU: SIGTERM mid-epoch, --resume, and the final weights equal an
    uninterrupted run's bit for bit (O1 fp16 carries its dynamic loss scale across the stop)."""
    import signal

    from test_preemption import DROPOUT_RUN, STOPPED, assert_same_weights, train_until

    flags = [*DROPOUT_RUN, "--opt-level", level, "--mixed-precision", dtype_name, "--steps-per-epoch", "6",
             "--epochs", "2"]
    straight = run_script("train.py", *flags, "--output-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    rc, out, err = train_until(tmp_path / "stopped", r"Epoch: \[0\]\[2/6\]", signal.SIGTERM, *flags)
    assert rc == 143 and "Traceback" not in err, err[-3000:]
    _, path, epoch, step, _, _ = STOPPED.search(out).groups()
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step"]) == (0, int(step)) and state["opt_level"] == level
    resumed = run_script("train.py", *flags, "--output-dir", tmp_path / "stopped", "--resume", path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(tmp_path / "stopped" / "checkpoint.pth.tar", tmp_path / "straight" / "checkpoint.pth.tar")
    final = torch.load(tmp_path / "stopped" / "checkpoint.pth.tar", weights_only=True)
    expected = torch.load(tmp_path / "straight" / "checkpoint.pth.tar", weights_only=True)
    assert final["loss_scale"] == expected["loss_scale"]


@pytest.mark.parametrize("level, dtype_name", [("O1", "fp16"), ("O2", "bf16")])
def test_compiled_training_on_gpu(cache_dir, tmp_path, level, dtype_name):
    """--compile at O1 fp16 and O2 bf16 on the gpu input backend: trains, validates, and saves
    plain (uncompiled) checkpoint keys; the compile time is printed once."""
    result = run_script("train.py", "--opt-level", level, "--mixed-precision", dtype_name, "--compile",
                        "--epochs", "1", "--output-dir", tmp_path, *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gpu backend" in result.stdout and "channels_last on" in result.stdout
    assert result.stdout.count("torch.compile (inductor): first forward") == 1
    assert len(FINAL.findall(result.stdout)) == 1
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    assert not any("_orig_mod" in key for key in state)


def compiled_training(accelerator, level, dtype_name, device="cuda", steps=6, tune_kernels=False):
    """TinyNet built the way train.py builds its model (Precision, Accelerate's prepare, then the
    project's compile_model) and trained `steps` steps on one fixed batch, which it should learn.
    Returns the compiled model, its weights before training, the losses and the log lines."""
    recipe, _ = resolve_precision(level, None, None, dtype_name, "--mixed-precision")
    torch.manual_seed(0)
    model = TinyNet().to(device)
    precision = Precision(recipe, model, device)
    optimizer = build_sgd(precision.optimizer_params(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    log = []
    model = compile_model(model, "inductor", log.append, tune_kernels=tune_kernels)
    before = {k: v.detach().clone() for k, v in plain_module(model).state_dict().items()}
    torch.manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16, device=device), torch.randint(0, 4, (8,), device=device)
    losses = []
    for _ in range(steps):
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        precision.backward(loss, accelerator)
        precision.step(optimizer)
        precision.zero_grad(model, optimizer)
        losses.append(loss.item())
    return model, precision, before, losses, log


def test_tuned_kernels_are_tuned_and_train_on_gpu(accelerator, monkeypatch):
    """--tune-kernels: inductor's coordinate descent tuner runs on the compiled model's Triton
    kernels (counted where inductor calls it, with its caches off so nothing is served tuned from
    an earlier compile), and the tuned model trains; untuned, the tuner never runs."""
    from torch._inductor.runtime import triton_heuristics
    tuner, calls = triton_heuristics.CachingAutotuner.coordinate_descent_tuning, []

    def counted(self, *args, **kwargs):
        calls.append(getattr(self, "inductor_meta", {}).get("kernel_name"))
        return tuner(self, *args, **kwargs)

    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "coordinate_descent_tuning", counted)
    for cache in ("fx_graph_cache", "autotune_local_cache"):
        monkeypatch.setattr(torch._inductor.config, cache, False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    torch._dynamo.reset()
    compiled_training(accelerator, "O1", "fp16", steps=2)
    assert calls == []
    torch._dynamo.reset()
    model, precision, before, losses, log = compiled_training(accelerator, "O1", "fp16", tune_kernels=True)
    assert len(calls) >= 3, calls  # the forward's and the backward's kernels at least
    assert len(log) == 1 and "torch.compile (inductor, kernels tuned): first forward" in log[0]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert torch._inductor.config.coordinate_descent_tuning is False  # only that compile was tuned


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_compiled_steps_at_every_level_and_dtype_on_gpu(accelerator, level, dtype_name):
    """A few torch.compile'd training steps at each opt level in fp16 and bf16, in process: the
    loss stays finite and falls, the weights move, and the plain module's keys (what checkpoints
    hold) carry no `_orig_mod.` prefix although the compiled wrapper's do."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # no graphs cached by earlier cases: each case compiles its own
    counters.clear()
    model, precision, before, losses, log = compiled_training(accelerator, level, dtype_name)
    # Dynamo really captured a graph (a model it gives up on would run eagerly and pass the rest).
    assert counters["stats"]["unique_graphs"] >= 1
    assert len(log) == 1 and "torch.compile (inductor): first forward" in log[0]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    after = plain_module(model).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if after[k].is_floating_point())
    assert all(key.startswith("_orig_mod.") for key in model.state_dict())
    assert set(after) == set(TinyNet().state_dict()) and not any("_orig_mod" in key for key in after)
    saved = precision.fp32_state_dict(plain_module(model))  # what train.py writes into a checkpoint
    assert not any("_orig_mod" in key for key in saved)
    assert all(v.dtype == torch.float32 for v in saved.values() if v.is_floating_point())
