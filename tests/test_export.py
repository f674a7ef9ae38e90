"""tools/export_safetensors.py: checkpoints of real train.py runs become safetensors files that the
bare torchvision / timm model loads with strict=True, in fp32, with the run's facts as metadata."""
import json
import os
import sys

import pytest
import torch
from conftest import HALF_ARCH, HALF_QUICK, ROOT, make_image_folder, run_command, run_script

from utils.run.checkpoint import save_checkpoint

TOOL = os.path.join(ROOT, "tools", "export_safetensors.py")
CPU = {"ACCELERATE_USE_CPU": "1"}


def export(*args):
    return run_script("tools/export_safetensors.py", *args)


@pytest.fixture(scope="module")
def torchvision_run(cache_dir, tmp_path_factory):
    """A torchvision model (HALF_ARCH: bf16 on a CPU, conftest.py) on the digits at O2 bf16: half
    weights in training, fp32 masters in the checkpoint."""
    out = tmp_path_factory.mktemp("tv")
    run = run_script("train.py", *HALF_QUICK, "--epochs", "1", "--opt-level", "O2", "--mixed-precision", "bf16",
                     "--output-dir", out, env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    return out / "checkpoint.pth.tar"


def test_torchvision_model_loads_the_export_strictly(torchvision_run, tmp_path):
    import safetensors
    import safetensors.torch
    import torchvision

    path = tmp_path / f"{HALF_ARCH}.safetensors"
    result = export(torchvision_run, path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "=> wrote" in result.stdout and f"{HALF_ARCH} (model weights, epoch 1, 10 classes)" in result.stdout
    tensors = safetensors.torch.load_file(path)
    model = torchvision.models.get_model(HALF_ARCH, num_classes=10)
    model.load_state_dict(tensors, strict=True)
    checkpoint = torch.load(torchvision_run, weights_only=True)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(tensors[key], value), key
    assert {v.dtype for v in tensors.values() if v.is_floating_point()} == {torch.float32}
    with safetensors.safe_open(path, "pt") as handle:
        meta = handle.metadata()
    assert (meta["arch"], meta["epoch"], meta["num_classes"], meta["opt_level"]) == (HALF_ARCH, "1", "10", "O2")
    assert json.loads(meta["classes"]) == [str(digit) for digit in range(10)] and meta["format"] == "pt"
    assert meta["weights"] == "model"


def test_ema_weights_export_on_request(torchvision_run, tmp_path):
    """--ema writes state_dict_ema (the --model-ema average), says so in the metadata, and is
    refused for a checkpoint without one."""
    import safetensors
    import safetensors.torch
    refused = export(torchvision_run, tmp_path / "none.safetensors", "--ema")
    assert refused.returncode == 2 and "holds no EMA weights" in refused.stderr
    checkpoint = torch.load(torchvision_run, weights_only=True)
    checkpoint["state_dict_ema"] = {key: value + 1 if value.is_floating_point() else value
                                    for key, value in checkpoint["state_dict"].items()}
    torch.save(checkpoint, tmp_path / "ema.pth.tar")
    result = export(tmp_path / "ema.pth.tar", tmp_path / "ema.safetensors", "--ema")
    assert result.returncode == 0, result.stderr[-3000:]
    tensors = safetensors.torch.load_file(tmp_path / "ema.safetensors")
    assert all(torch.equal(tensors[key], value.float() if value.is_floating_point() else value)
               for key, value in checkpoint["state_dict_ema"].items())
    with safetensors.safe_open(tmp_path / "ema.safetensors", "pt") as handle:
        assert handle.metadata()["weights"] == "ema"


def test_timm_model_loads_the_export_strictly(cache_dir, tmp_path):
    import safetensors.torch
    import timm

    folder = make_image_folder(tmp_path / "data", classes=3, per_class=4)
    out = tmp_path / "out"
    run = run_script("train.py", folder, "-a", "timm/test_resnet", "--image-size", "32", "-b", "4", "--epochs", "1",
                     "-j", "0", "--output-dir", out, env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    path = tmp_path / "test_resnet.safetensors"
    assert export(out / "checkpoint.pth.tar", path).returncode == 0
    model = timm.create_model("test_resnet", num_classes=3)
    model.load_state_dict(safetensors.torch.load_file(path), strict=True)
    trained = torch.load(out / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    assert torch.equal(model.fc.weight, trained["fc.weight"])


def test_ddp_and_compile_prefixes_are_stripped(torchvision_run, tmp_path):
    import safetensors.torch
    import torchvision

    state = torch.load(torchvision_run, weights_only=True)
    state["state_dict"] = {f"module._orig_mod.{key}": value for key, value in state["state_dict"].items()}
    save_checkpoint(state, False, tmp_path)
    path = tmp_path / "w.safetensors"
    assert export(tmp_path / "checkpoint.pth.tar", path).returncode == 0
    torchvision.models.get_model(HALF_ARCH, num_classes=10).load_state_dict(safetensors.torch.load_file(path),
                                                                            strict=True)


def test_tool_is_executable_and_refuses_in_one_line(tmp_path):
    with open(TOOL) as handle:
        assert handle.readline().startswith("#!") and os.access(TOOL, os.X_OK)
    for args, needle in [((tmp_path / "none.pth.tar", tmp_path / "w.safetensors"), "no checkpoint at"),
                         ((tmp_path / "none.pth.tar", tmp_path / "w.pt"), "should end in .safetensors"),
                         ((tmp_path / "none.pth.tar",), "the following arguments are required"),
                         ((tmp_path / "none.pth.tar", tmp_path / "dir.safetensors"), "it is a directory"),
                         ((tmp_path / "none.pth.tar", tmp_path / "file" / "w.safetensors"), "is a file, not a folder")]:
        (tmp_path / "dir.safetensors").mkdir(exist_ok=True)
        (tmp_path / "file").write_text("x")
        result = run_command([sys.executable, TOOL, *args])
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr
    assert not os.path.exists(tmp_path / "w.safetensors")
