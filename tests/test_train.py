"""train.py end to end on real JPEGs: the demo, log format, determinism, resume, usage errors."""
import os
import re

import pytest
import torch

from conftest import make_image_folder, run_script
from utils.checkpoint import save_checkpoint
from utils.cli import build_parser

APEX_LINE = re.compile(r"Epoch: \[(\d+)\]\[(\d+)/(\d+)\]\tTime [\d.]+ \([\d.]+\)\tSpeed [\d.]+ \([\d.]+\)\t"
                       r"Loss ([\d.]+) \([\d.]+\)\tPrec@1 ([\d.]+) \([\d.]+\)\tPrec@5 ([\d.]+) \([\d.]+\)")
FINAL = re.compile(r" \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)")
QUICK = ["--image-size", "32", "-b", "16", "--steps-per-epoch", "4", "-j", "1", "-p", "1"]


def losses(stdout):
    """(epoch, step, loss, top1, top5) per Apex line: the parts that must repeat exactly."""
    return [m.groups() for m in APEX_LINE.finditer(stdout)]


def test_demo_reaches_95_percent_and_saves_checkpoints(cache_dir, tmp_path):
    result = run_script("train.py", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    finals = [float(m.group(1)) for m in FINAL.finditer(result.stdout)]
    assert len(finals) == 12, result.stdout[-2000:]
    assert finals[-1] >= 95.0, finals
    assert losses(result.stdout), "no Apex-format training lines"
    best = torch.load(tmp_path / "model_best.pth.tar", weights_only=True)
    last = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert last["epoch"] == 12 and last["arch"] == "resnet18" and last["opt_level"] == "O0"
    assert best["best_prec1"] == pytest.approx(max(finals), abs=5e-4)  # printed with 3 decimals
    assert last["best_prec1"] == best["best_prec1"]
    assert not any(k.startswith("module.") for k in last["state_dict"])
    assert all(v.dtype == torch.float32 for v in last["state_dict"].values() if v.is_floating_point())
    assert isinstance(last["args"], dict) and last["args"]["arch"] == "resnet18"
    assert "optimizer" in last and "loss_scale" in last


def test_deterministic_runs_repeat_exactly(cache_dir, tmp_path):
    runs = [run_script("train.py", "--deterministic", "--epochs", "2", "--output-dir", tmp_path / str(i),
                       "--opt-level", "O1", "--mixed-precision", "bf16", *QUICK) for i in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = losses(runs[0].stdout), losses(runs[1].stdout)
    assert len(first) == 8
    assert first == second


@pytest.mark.parametrize("precision", [["--opt-level", "O0"],
                                       ["--opt-level", "O2", "--mixed-precision", "bf16", "--loss-scale", "dynamic"]])
def test_resume_continues_bit_for_bit(cache_dir, tmp_path, precision):
    common = ["--deterministic", *QUICK, *precision]
    straight = run_script("train.py", "--epochs", "3", "--output-dir", tmp_path / "straight", *common)
    assert straight.returncode == 0, straight.stderr
    first = run_script("train.py", "--epochs", "2", "--output-dir", tmp_path / "split", *common)
    assert first.returncode == 0, first.stderr
    resumed = run_script("train.py", "--epochs", "3", "--output-dir", tmp_path / "split",
                         "--resume", tmp_path / "split" / "checkpoint.pth.tar", *common)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed" in resumed.stdout
    assert losses(straight.stdout)[-4:] == losses(resumed.stdout)
    a = torch.load(tmp_path / "straight" / "checkpoint.pth.tar", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoint.pth.tar", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"])
    assert a["loss_scale"] == b["loss_scale"]


def usage_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stdout[-500:], result.stderr[-2000:])
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_usage_errors_exit_2_with_one_line(cache_dir, tmp_path):
    usage_error(run_script("train.py", "--opt-level", "O4"), "unknown opt level")
    usage_error(run_script("train.py", "--loss-scale", "big"), "dynamic")
    usage_error(run_script("train.py", "--loss-scale", "-1"), "positive")
    usage_error(run_script("train.py", "--opt-level", "O1", "--keep-batchnorm-fp32", "True"), "O1")
    usage_error(run_script("train.py", "--channels-last", "maybe"), "True or False")
    usage_error(run_script("train.py", tmp_path / "nowhere"), "does not exist")
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    (empty / "val").mkdir()
    usage_error(run_script("train.py", empty), "no images")
    usage_error(run_script("train.py", "-a", "resnet5O"), "unknown architecture", "resnet50")
    usage_error(run_script("train.py", "-a", "inception_v3"), "inception_v3")
    small = make_image_folder(tmp_path / "small", classes=2, per_class=3)
    usage_error(run_script("train.py", small, "-b", "64", "--image-size", "32"), "lower --batch-size")


def test_bad_checkpoints_and_images_are_explained(cache_dir, tmp_path):
    usage_error(run_script("train.py", "--resume", tmp_path / "missing.pth.tar"), "no checkpoint")
    truncated = tmp_path / "truncated.pth.tar"
    save_checkpoint({"epoch": 1, "arch": "resnet18", "state_dict": {"w": torch.ones(1000)}}, False, tmp_path)
    data = (tmp_path / "checkpoint.pth.tar").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    usage_error(run_script("train.py", "--resume", truncated), "truncated")
    usage_error(run_script("train.py", "--resume", tmp_path / "checkpoint.pth.tar"), "does not fit")
    folder = make_image_folder(tmp_path / "broken", classes=2, per_class=8)
    with open(os.path.join(folder, "train", "class0", "0.jpg"), "wb") as handle:
        handle.write(b"not a jpeg")
    usage_error(run_script("train.py", folder, "--image-size", "32", "-b", "16", "-j", "0", "--epochs", "1"),
                "cannot read image", "0.jpg")


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint({"epoch": 1, "arch": "a", "state_dict": {}}, True, tmp_path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        save_checkpoint({"epoch": 2, "arch": "a", "state_dict": {}, "x": Unpicklable()}, True, tmp_path)
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1
    assert torch.load(tmp_path / "model_best.pth.tar", weights_only=True)["epoch"] == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pth.tar", "model_best.pth.tar"]


def test_apex_spellings_parse():
    parser = build_parser("t")
    assert parser.parse_args(["--channels-last", "False"]).channels_last is False
    assert parser.parse_args(["--channels-last", "True"]).channels_last is True
    assert parser.parse_args(["--channels-last"]).channels_last is True
    assert parser.parse_args([]).channels_last is False
    assert parser.parse_args(["--local-rank", "3"]).local_rank == 3
    assert parser.parse_args(["--local_rank", "1"]).local_rank == 1
    args = parser.parse_args(["--opt-level", "O2", "--keep-batchnorm-fp32", "False", "--loss-scale", "128.0",
                              "--sync_bn", "--wd", "5e-5", "-b", "32", "-j", "3", "--prof", "5"])
    assert (args.opt_level, args.keep_batchnorm_fp32, args.loss_scale) == ("O2", False, 128.0)
    assert args.sync_bn and args.weight_decay == 5e-5 and args.batch_size == 32 and args.workers == 3


def test_flags_with_no_effect_say_so(cache_dir, tmp_path):
    result = run_script("train.py", "--opt-level", "O0", "--loss-scale", "128", "--sync_bn", "--epochs", "1",
                        "--output-dir", tmp_path, *QUICK)
    assert result.returncode == 0, result.stderr
    assert "--loss-scale 128.0 has no effect in fp32" in result.stderr
    assert "--sync_bn ignored" in result.stderr
    assert "precision: O0 fp32" in result.stdout and "loss scale none" in result.stdout
    fp16 = run_script("train.py", "--opt-level", "O2", "--epochs", "1", "--output-dir", tmp_path, *QUICK)
    assert fp16.returncode == 0, fp16.stderr
    assert "fp16 on a machine without CUDA" in fp16.stderr
    assert "precision: O2 fp16 | weights half, BN fp32, master fp32 | loss scale dynamic (65536)" in fp16.stdout
    assert re.search(r"Skipped \d+\tScale \d+", fp16.stdout)


def test_evaluate_only(cache_dir, tmp_path):
    trained = run_script("train.py", "--epochs", "1", "--output-dir", tmp_path, *QUICK)
    assert trained.returncode == 0, trained.stderr
    printed = FINAL.findall(trained.stdout)[-1]
    result = run_script("train.py", "-e", "--resume", tmp_path / "checkpoint.pth.tar", *QUICK)
    assert result.returncode == 0, result.stderr
    assert FINAL.findall(result.stdout) == [printed]
    assert "Epoch:" not in result.stdout
