"""train.py end to end on real JPEGs: the demo, log format, determinism, resume, usage errors."""
import os
import re

import pytest
import torch
from conftest import FINAL, HALF_QUICK, HALF_TINY, QUICK, make_image_folder, run_script

from utils.flags.parser import add_log_args, build_parser, idle_flag_notes, typed_dests
from utils.flags.precedence import parse_args
from utils.run.checkpoint import save_checkpoint
from utils.run.errors import exit_on_usage_error

APEX_LINE = re.compile(r"Epoch: \[(\d+)\]\[(\d+)/(\d+)\]\tTime [\d.]+ \([\d.]+\)\tSpeed [\d.]+ \([\d.]+\)\t"
                       r"Loss ([\d.]+) \([\d.]+\)\tPrec@1 ([\d.]+) \([\d.]+\)\tPrec@5 ([\d.]+) \([\d.]+\)")


def losses(stdout):
    """(epoch, step, loss, top1, top5) per Apex line: the parts that must repeat exactly."""
    return [m.groups() for m in APEX_LINE.finditer(stdout)]


@pytest.mark.first
def test_demo_ends_at_97_percent_and_saves_checkpoints(cache_dir, tmp_path):
    result = run_script("train.py", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    finals = [float(m.group(1)) for m in FINAL.finditer(result.stdout)]
    assert len(finals) == 12, result.stdout[-2000:]
    assert finals[-1] >= 97.0, finals  # the last epoch, not the best: the LR has decayed by then
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
    # -j 1: the loader worker processes must not bring randomness of their own. HALF_QUICK: bf16 on a
    # CPU (conftest.py says why not resnet18).
    runs = [run_script("train.py", "--deterministic", "--epochs", "2", "--output-dir", tmp_path / str(i),
                       "--opt-level", "O1", "--mixed-precision", "bf16", *HALF_QUICK, "-j", "1") for i in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = losses(runs[0].stdout), losses(runs[1].stdout)
    assert len(first) == 8
    assert first == second


@pytest.mark.parametrize("precision", [[*QUICK, "--opt-level", "O0"],
                                       [*HALF_QUICK, "--opt-level", "O2", "--mixed-precision", "bf16",
                                        "--loss-scale", "dynamic"]])
def test_resume_continues_bit_for_bit(cache_dir, tmp_path, precision):
    # One epoch, then resume for the second: momentum buffers, loss scale and RNG are all in play
    # after the first epoch, so a third epoch would check nothing more. bf16 with HALF_QUICK's
    # model (conftest.py says why).
    common = ["--deterministic", *precision]
    straight = run_script("train.py", "--epochs", "2", "--output-dir", tmp_path / "straight", *common)
    assert straight.returncode == 0, straight.stderr
    first = run_script("train.py", "--epochs", "1", "--output-dir", tmp_path / "split", *common)
    assert first.returncode == 0, first.stderr
    resumed = run_script("train.py", "--epochs", "2", "--output-dir", tmp_path / "split",
                         "--resume", tmp_path / "split" / "checkpoint.pth.tar", *common)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed" in resumed.stdout
    assert len(losses(resumed.stdout)) == 4
    assert losses(straight.stdout)[-4:] == losses(resumed.stdout)
    a = torch.load(tmp_path / "straight" / "checkpoint.pth.tar", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoint.pth.tar", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"])
    assert a["loss_scale"] == b["loss_scale"]


def one_error_line(code, stderr, *needles):
    """Exit code 2 and one `prog: error: ...` line (warnings aside) naming every needle; no traceback."""
    assert code == 2, (code, stderr[-2000:])
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and ": error: " in lines[0], stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def usage_error(capsys, cache_dir, tmp_path):
    """train.main(argv) in this process, through the same exit path as `python train.py`; checks
    one_error_line. In-process: a fresh interpreter per case cost ~10 s on a busy 2-core machine.
    (train.main's Accelerator shares the session's AcceleratorState: same settings, so allowed.)"""
    import train

    def check(argv, *needles):
        capsys.readouterr()  # drop what earlier cases printed
        with pytest.raises(SystemExit) as exited:
            # --output-dir: this process's working directory may be anywhere.
            exit_on_usage_error(lambda: train.main([*map(str, argv), "--output-dir", str(tmp_path / "out")]))
        one_error_line(exited.value.code, capsys.readouterr().err, *needles)
    return check


def test_usage_errors_exit_2_with_one_line(usage_error, tmp_path):
    usage_error(["--opt-level", "O4"], "unknown opt level")
    usage_error(["--loss-scale", "big"], "dynamic")
    usage_error(["--loss-scale", "-1"], "positive")
    usage_error(["--opt-level", "O1", "--keep-batchnorm-fp32", "True"], "O1")
    usage_error(["--channels-last", "maybe"], "True or False")
    usage_error([tmp_path / "nowhere"], "does not exist")
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    (empty / "val").mkdir()
    usage_error([empty], "no images")
    usage_error(["-a", "resnet5O"], "unknown architecture", "resnet50")
    usage_error(["-a", "inception_v3"], "inception_v3")
    small = make_image_folder(tmp_path / "small", classes=2, per_class=3)
    usage_error([small, "-b", "64", "--image-size", "32"], "lower --batch-size")


def test_bad_checkpoints_are_explained(usage_error, tmp_path):
    usage_error(["--resume", tmp_path / "missing.pth.tar"], "no checkpoint")
    truncated = tmp_path / "truncated.pth.tar"
    save_checkpoint({"epoch": 1, "arch": "resnet18", "state_dict": {"w": torch.ones(1000)},
                     "optimizer": {"state": {}, "param_groups": []}}, False, tmp_path)
    data = (tmp_path / "checkpoint.pth.tar").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    usage_error(["--resume", truncated], "truncated")
    usage_error(["--resume", tmp_path / "checkpoint.pth.tar"], "does not fit")


def broken_folder(root):
    """A tiny ImageFolder whose first training image is not a JPEG."""
    folder = make_image_folder(root, classes=2, per_class=8)
    with open(os.path.join(folder, "train", "class0", "0.jpg"), "wb") as handle:
        handle.write(b"not a jpeg")
    return folder


def test_unreadable_image_is_explained(usage_error, tmp_path):
    usage_error([broken_folder(tmp_path / "broken"), "--image-size", "32", "-b", "16", "-j", "0", "--epochs", "1"],
                "cannot read image", "0.jpg")


def test_usage_error_end_to_end_is_one_line_and_exit_2(tmp_path):
    """The real script in its own process, the error raised in a DataLoader worker (-j 1): the
    worker's traceback must be folded into one line and the exit code must be 2."""
    result = run_script("train.py", broken_folder(tmp_path / "broken"), "--image-size", "32", "-b", "16",
                        "-j", "1", "--epochs", "1", "--output-dir", tmp_path / "out")
    one_error_line(result.returncode, result.stderr, "train.py: error: ", "cannot read image", "0.jpg")


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
    assert parser.parse_args([]).channels_last is None  # resolved per device (utils.device.resolve_device_defaults)
    assert parser.parse_args(["--local-rank", "3"]).local_rank == 3
    assert parser.parse_args(["--local_rank", "1"]).local_rank == 1
    args = parser.parse_args(["--opt-level", "O2", "--keep-batchnorm-fp32", "False", "--loss-scale", "128.0",
                              "--sync_bn", "--wd", "5e-5", "-b", "32", "-j", "3", "--prof", "5"])
    assert (args.opt_level, args.keep_batchnorm_fp32, args.loss_scale) == ("O2", False, 128.0)
    assert args.sync_bn and args.weight_decay == 5e-5 and args.batch_size == 32 and args.workers == 3


@pytest.fixture(scope="module")
def one_epoch(cache_dir, tmp_path_factory):
    """One O0 epoch with two flags that have no effect there; shared by the tests below."""
    out = tmp_path_factory.mktemp("one_epoch")
    result = run_script("train.py", "--opt-level", "O0", "--loss-scale", "128", "--sync_bn", "--epochs", "1",
                        "--output-dir", out, *QUICK)
    assert result.returncode == 0, result.stderr
    return out, result


def test_typed_flags_a_run_cannot_use_are_named():
    """-e only evaluates and --prof stops after its window: flags typed for what they skip get one
    warning naming them; flags they use, and ordinary runs, get none."""
    parser = add_log_args(build_parser("train"))

    def notes(*argv):
        return idle_flag_notes(parser, parse_args(parser, list(argv)), typed_dests(parser, list(argv)))

    assert notes("-e", "--resume", "missing.pth.tar", "--lr", "5", "--mixup", "0.2", "-b", "16",
                 "--opt-level", "O2", "-j", "0") == [
        "-e only evaluates: --lr, --mixup have no effect here (eval.py refuses them)"]
    assert notes("-e", "--pretrained") == []
    assert notes("-e", "-b", "16") == ["-e without --resume or --pretrained evaluates freshly initialised weights"]
    assert notes("--prof", "0", "--model-ema", "--keep-checkpoints", "2", "--save-every-steps", "5") == [
        "--prof stops after its window and writes nothing (no validation, checkpoint or log): "
        "--keep-checkpoints, --model-ema, --save-every-steps have no effect here"]
    assert notes("--lr", "0.1", "--model-ema", "--keep-checkpoints", "2") == []
    assert notes("--resume", "missing.pth.tar", "--start-epoch", "1", "--epochs", "3") == [
        "--start-epoch has no effect with --resume: the run continues where the checkpoint stopped"]


def test_flags_with_no_effect_say_so(one_epoch, tiny_folder, tmp_path):
    _, result = one_epoch
    assert "--loss-scale 128.0 has no effect in fp32" in result.stderr
    assert "--sync_bn ignored" in result.stderr
    assert "precision: O0 fp32" in result.stdout and "loss scale none" in result.stdout
    # Real fp16 kernels on a CPU are slow: HALF_TINY's model, 2 steps and 18 val images rather than
    # the 359 digits.
    fp16 = run_script("train.py", tiny_folder, "--opt-level", "O2", "--epochs", "1", "--output-dir", tmp_path,
                      *HALF_TINY, "-b", "4", "--steps-per-epoch", "2")
    assert fp16.returncode == 0, fp16.stderr
    assert "fp16 on a machine without CUDA" in fp16.stderr
    assert "precision: O2 fp16 | weights half, BN fp32, master fp32 | loss scale dynamic (65536)" in fp16.stdout
    assert re.search(r"Skipped \d+\tScale \d+", fp16.stdout)


def test_evaluate_only(one_epoch):
    out, trained = one_epoch
    printed = FINAL.findall(trained.stdout)[-1]
    result = run_script("train.py", "-e", "--resume", out / "checkpoint.pth.tar", *QUICK, "-b", "8")
    assert result.returncode == 0, result.stderr
    assert FINAL.findall(result.stdout) == [printed]  # another batch size scores the same images
    assert "Epoch:" not in result.stdout
    assert "global batch" not in result.stderr  # -e trains nothing: no word on the LR a batch scales
