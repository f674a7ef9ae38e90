"""--jpeg-decoder, --compile-mode and --tune-kernels: how they resolve, and the mistakes they refuse.

The decoders themselves run in tests/test_gpu_batches.py (marked gpu, both decoders)."""
import argparse
import os
import subprocess
import sys

import pytest
import torch
from conftest import QUICK, ROOT, TIMEOUT, subprocess_env
from test_train import usage_error  # noqa: F401  (fixture)

from utils.compiled import compile_model, eval_module, plain_module, resolve_compile, resolve_tune_kernels
from utils.data.gpu.decoders import HardwareJpeg, settle_jpeg_decoder
from utils.flags.specs import device_settings
from utils.run.errors import UsageError


def resolved(device_type, **flags):
    args = argparse.Namespace(arch="resnet18", data=None, data_backend="auto", channels_last=None, compile=False,
                              compile_mode="default", tune_kernels=False, jpeg_decoder="auto", deterministic=False,
                              aa="none")
    vars(args).update(flags)
    return device_settings(args, device_type)


def nvimgcodec_installed():
    try:
        import nvidia.nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return True


def test_auto_picks_nvjpeg_and_says_why():
    args = resolved("cuda")
    assert args.data_backend == "gpu" and args.jpeg_decoder == "cuda"
    assert "jpeg decoder cuda, auto: nvJPEG measured faster in training" in args.input_line


def test_deterministic_runs_are_told_what_nvjpeg_does_not_promise():
    """Under --deterministic auto prefers the hardware decoder; without one (no nvImageCodec here)
    it stays on nvJPEG and the start-up line says why and what that means; nvJPEG asked for with
    --deterministic says the same."""
    explicit = resolved("cuda", jpeg_decoder="cuda", deterministic=True)
    assert explicit.jpeg_decoder == "cuda"
    assert "--jpeg-decoder (--deterministic: nvJPEG's runs did not always repeat bit for bit" in explicit.input_line
    if not nvimgcodec_installed():
        auto = resolved("cuda", deterministic=True)
        assert auto.jpeg_decoder == "cuda"
        assert ("auto: no hardware decoder (nvImageCodec is not installed" in auto.input_line
                and "so nvJPEG even with --deterministic" in auto.input_line)


@pytest.mark.skipif(nvimgcodec_installed(), reason="checks the message when nvImageCodec is absent")
def test_hardware_decoder_without_nvimgcodec_is_a_usage_error():
    with pytest.raises(RuntimeError, match="not installed"):
        HardwareJpeg("cuda")
    with pytest.raises(UsageError, match="--jpeg-decoder hardware: .*pip install nvidia-nvimgcodec"):
        settle_jpeg_decoder("hardware", "cuda")


def test_cuda_decoder_asked_for_is_kept():
    assert resolved("cuda", jpeg_decoder="cuda").jpeg_decoder == "cuda"
    assert "jpeg decoder cuda, --jpeg-decoder" in resolved("cuda", jpeg_decoder="cuda").input_line


def test_jpeg_decoder_outside_the_gpu_backend_is_refused():
    with pytest.raises(UsageError, match="applies to the gpu data backend only.*cpu backend"):
        resolved("cpu", jpeg_decoder="hardware")
    with pytest.raises(UsageError, match="no input pipeline"):
        resolved("cuda", data="synthetic", jpeg_decoder="cuda")
    assert resolved("cpu").jpeg_decoder == "auto"  # left as it is: no decoder runs on the cpu backend


def test_flag_mistakes_exit_2(usage_error):  # noqa: F811
    if not torch.cuda.is_available():
        usage_error(["--jpeg-decoder", "hardware", *QUICK], "--jpeg-decoder hardware", "cpu backend")
    usage_error(["--compile-mode", "reduce-overhead", *QUICK], "--compile-mode reduce-overhead needs --compile")
    usage_error(["--jpeg-decoder", "nvdec", *QUICK], "invalid choice")


def test_compile_mode_reaches_torch_compile():
    backend, mode, note = resolve_compile(True, "max-autotune-no-cudagraphs")
    assert note is None and backend == "inductor"
    lines = []
    model = torch.nn.Linear(3, 2)
    compiled = compile_model(model, backend, lines.append, mode)
    assert plain_module(compiled) is model and compiled._eval_mode == "max-autotune-no-cudagraphs"
    # other backends take no mode: it is dropped rather than refused by torch.compile
    assert compile_model(model, "eager", lines.append, "reduce-overhead")._eval_mode is None


def test_tune_kernels_is_refused_where_it_cannot_work(usage_error):  # noqa: F811
    usage_error(["--tune-kernels", *QUICK], "--tune-kernels tunes the kernels inductor writes", "needs --compile")
    if not torch.cuda.is_available():
        usage_error(["--compile", "--tune-kernels", *QUICK], "for CUDA; on cpu it would change nothing")
    with pytest.raises(UsageError, match="which --deterministic rules out; drop one"):
        resolve_tune_kernels(True, "inductor", "cuda", deterministic=True)
    with pytest.raises(UsageError, match="compiles with backend aot_eager; drop --tune-kernels"):
        resolve_tune_kernels(True, "aot_eager", "cuda", deterministic=False)
    assert resolve_tune_kernels(True, "inductor", "cuda", deterministic=False) == (True, "")
    assert resolve_tune_kernels(False, False, "cpu", deterministic=True) == (False, "")
    dropped, note = resolve_tune_kernels(True, "aot_eager", "cuda", deterministic=False, typed=False)
    assert dropped is False and "compiles with backend aot_eager" in note
    settings = resolved("cuda", compile=True, tune_kernels=True)
    assert settings.tune_kernels and "torch.compile inductor, kernels tuned" in settings.input_line
    assert settings.as_flags()["tune_kernels"] is True  # what the checkpoint records


def test_tune_kernels_reaches_torch_compile_beside_the_modes_settings(monkeypatch):
    """torch.compile refuses a mode and options together, so a tuned compile passes the mode's own
    settings as options with the tuning added; the process-wide inductor config stays as it was,
    and validation's own compile (eval_module) takes the same settings."""
    calls, real = [], torch.compile

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    model = torch.nn.Linear(3, 2)
    lines = []
    compiled = compile_model(model, "inductor", lines.append, "reduce-overhead", tune_kernels=True)
    assert calls[-1]["mode"] is None
    assert calls[-1]["options"] == {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
    assert compiled._eval_options == calls[-1]["options"] and compiled._eval_mode is None  # what eval_module passes
    compile_model(model, "inductor", lines.append, "default", tune_kernels=True)
    assert calls[-1]["options"] == {"coordinate_descent_tuning": True} and calls[-1]["mode"] is None
    compile_model(model, "inductor", lines.append, "reduce-overhead")
    assert calls[-1]["mode"] == "reduce-overhead" and calls[-1]["options"] is None
    assert compile_model(model, "eager", lines.append, "default", tune_kernels=True)._eval_options is None
    assert torch._inductor.config.coordinate_descent_tuning is False
    # the forward under torch.compile, with the options in force, gives the eager values
    x = torch.randn(4, 3)
    tuned = compile_model(model, "inductor", lines.append, "default", tune_kernels=True)
    assert torch.allclose(tuned(x), model(x), atol=1e-6)
    assert "kernels tuned): first forward, compile included" in lines[-1]
    assert eval_module(tuned) is tuned  # compiled without DDP: validation runs it as it is


def test_a_resumed_runs_other_backend_is_kept_unless_accelerate_names_one(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    backend, _, note = resolve_compile("aot_eager", "default")  # from the checkpoint
    assert "backend aot_eager, as the resumed run" in note and backend == "aot_eager"
    with pytest.raises(UsageError, match="compiled with backend 'fx2trt_missing'.*--compile True"):
        resolve_compile("fx2trt_missing", "default")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")  # the launch's setting wins
    backend, _, _ = resolve_compile("aot_eager", "default")
    assert backend == "eager"


def test_accelerate_dynamo_mode_is_honoured(monkeypatch):
    """`accelerate launch --dynamo_backend inductor --dynamo_mode reduce-overhead` compiled in the
    default mode: ACCELERATE_DYNAMO_MODE was never read. It is now the mode unless --compile-mode
    is typed; a mode torch.compile does not know is a usage error."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "reduce-overhead")
    backend, mode, note = resolve_compile(False, "default")
    assert (backend, mode) == ("inductor", "reduce-overhead")
    assert "backend inductor, mode reduce-overhead, from Accelerate" in note
    compiled = compile_model(torch.nn.Linear(3, 2), backend, print, mode)
    assert compiled._eval_mode == "reduce-overhead"
    _, mode, _ = resolve_compile(True, "max-autotune")  # typed: it wins
    assert mode == "max-autotune"
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "turbo")
    with pytest.raises(UsageError, match="dynamo_mode 'turbo' is not a torch.compile mode"):
        resolve_compile(False, "default")


WORK_QUEUES_PROBE = """
import os, sys
from utils.flags.parser import build_parser
from utils.device import make_accelerator
from utils.flags.precedence import parse_args
make_accelerator(parse_args(build_parser("probe"), sys.argv[1:]))
print("queues", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
"""


@pytest.mark.parametrize("preset, expected", [(None, "32"), ("4", "4")])
def test_cuda_work_queues_widened_unless_the_user_set_them(preset, expected):
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if preset is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = preset
    result = subprocess.run([sys.executable, "-c", WORK_QUEUES_PROBE, *QUICK], capture_output=True, text=True,
                            env=subprocess_env(env), cwd=ROOT, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == f"queues {expected}"


def test_gpu_backend_line_names_narrow_work_queues(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    line = resolved("cuda", jpeg_decoder="cuda").input_line
    assert "CUDA_DEVICE_MAX_CONNECTIONS=4 from the environment" in line and "docs/speed.md" in line
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in resolved("cpu").input_line  # no decoder on the cpu backend
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in resolved("cuda", jpeg_decoder="cuda").input_line
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in resolved("cuda", jpeg_decoder="cuda").input_line
