"""The run directory (args.yaml, summary.csv, curves.png), TensorBoard through Accelerate, and a
progress bar that appears on terminals only."""
import csv
import fcntl
import glob
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import types

import pytest
import yaml
from conftest import ROOT, TIMEOUT, run_command, run_script, subprocess_env
from PIL import Image

from utils.flags.parser import add_log_args, build_parser
from utils.flags.precedence import parse_args
from utils.logs import SUMMARY_COLUMNS, Progress, RunLog, tracker_kwargs
from utils.run.errors import UsageError

FINAL = re.compile(r" \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)")
EPOCH_END = re.compile(r"Epoch: \[(\d+)\]\[(\d+)/\2\].*\tLoss [\d.]+ \(([\d.]+)\)")
APEX_LINE = re.compile(r"Epoch: \[\d+\]\[\d+/\d+\]\tTime [\d.]+ \([\d.]+\)\tSpeed [\d.]+ \([\d.]+\)\t"
                       r"Loss [\d.]+ \([\d.]+\)\tPrec@1 [\d.]+ \([\d.]+\)\tPrec@5 [\d.]+ \([\d.]+\)")
# --warmup-epochs 5: the LR column then shows the warmup (runs this short get none by default)
DEMO = ["--steps-per-epoch", "2", "-b", "16", "-j", "0", "--warmup-epochs", "5"]


def read_summary(path):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


def test_run_directory_after_a_short_demo_and_a_resume(cache_dir, tmp_path):
    out = tmp_path / "run"
    result = run_script("train.py", "--epochs", "2", *DEMO, "--output-dir", out, "--log-with", "tensorboard")
    assert result.returncode == 0, result.stderr[-3000:]
    # Not a terminal: plain lines only, no bar redraws in what a log file would get.
    assert "\r" not in result.stdout + result.stderr and "img/s" not in result.stderr

    settings = yaml.safe_load((out / "args.yaml").read_text())
    assert settings["arch"] == "resnet18" and settings["epochs"] == 2
    assert (settings["batch_size"], settings["image_size"], settings["crop_pct"]) == (16, 32, 0.875)
    assert settings["output_dir"] == str(out) and settings["log_with"] == "tensorboard"
    assert settings["mean"] == [0.485, 0.456, 0.406]
    # What ran, not the flags' None: the recipe, the data's classes, the built-in demo data.
    assert (settings["opt_level"], settings["mixed_precision"]) == ("O0", "no")
    assert (settings["num_classes"], settings["data"]) == (10, "digits")

    columns, rows = read_summary(out / "summary.csv")
    assert tuple(columns) == SUMMARY_COLUMNS
    assert [row["epoch"] for row in rows] == ["0", "1"]
    finals = FINAL.findall(result.stdout)
    assert [(f"{float(r['top1']):.3f}", f"{float(r['top5']):.3f}") for r in rows] == finals
    epoch_ends = EPOCH_END.findall(result.stdout)
    assert [f"{float(r['train_loss']):.4f}" for r in rows] == [loss for _, _, loss in epoch_ends]
    # lr 0.1 x 16/256, warmed up over 5 epochs of 2 steps: (1 + step + epoch x 2) / 10 at the last step
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.00625 * 2 / 10, 0.00625 * 4 / 10])
    assert all(float(r["img_per_s"]) > 0 and float(r["val_loss"]) > 0 for r in rows)
    assert [(r["skipped_steps"], r["loss_scale"]) for r in rows] == [("0", ""), ("0", "")]  # O0: no scaling

    with Image.open(out / "curves.png") as picture:
        assert picture.format == "PNG" and picture.size == (1000, 400)
        picture.verify()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert glob.glob(str(out / "runs" / "imagenet-amp" / "events.out.tfevents.*"))
    events = EventAccumulator(str(out / "runs" / "imagenet-amp"))
    events.Reload()
    top1 = [(e.step, round(e.value, 3)) for e in events.Scalars("val/top1")]
    assert top1 == [(0, round(float(rows[0]["top1"]), 3)), (1, round(float(rows[1]["top1"]), 3))]
    assert {"train/loss", "val/loss", "val/top5", "lr", "img_per_s"} <= set(events.Tags()["scalars"])

    resumed = run_script("train.py", "--epochs", "3", *DEMO, "--output-dir", out,
                         "--resume", out / "checkpoint.pth.tar")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, after = read_summary(out / "summary.csv")
    assert [row["epoch"] for row in after] == ["0", "1", "2"] and after[:2] == rows
    assert yaml.safe_load((out / "args.yaml").read_text())["start_epoch"] == 2


def test_a_run_resumed_into_a_new_directory_keeps_the_earlier_rows(cache_dir, tmp_path):
    """--resume OLD/checkpoint.pth.tar --output-dir NEW: NEW/summary.csv (and curves.png) still
    cover the whole run, taking the epochs before the resumed one from OLD/summary.csv."""
    old, new = tmp_path / "old", tmp_path / "new"
    first = run_script("train.py", "--epochs", "1", *DEMO, "--output-dir", old)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_script("train.py", "--epochs", "2", "--resume", old / "checkpoint.pth.tar", "--output-dir", new)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, before = read_summary(old / "summary.csv")
    _, after = read_summary(new / "summary.csv")
    assert [row["epoch"] for row in after] == ["0", "1"] and after[0] == before[0]


# train.py with its process killed (os._exit: no cleanup) right after the second checkpoint write.
KILLED_AFTER_SECOND_SAVE = """
import os, sys
sys.path.insert(0, {root!r})
import train
saved = []
def save_then_die(*args, **kwargs):
    train_save(*args, **kwargs)
    saved.append(1)
    if len(saved) == 2:
        os._exit(9)
train_save, train.save_checkpoint = train.save_checkpoint, save_then_die
train.main({argv!r})
"""


def test_a_kill_just_after_a_checkpoint_loses_no_summary_row(cache_dir, tmp_path):
    """The epoch's summary.csv row is written before its checkpoint: a run killed between the two
    resumes after that epoch, and the row must already be there (it was lost for good)."""
    out = tmp_path / "run"
    argv = ["--epochs", "3", *DEMO, "--output-dir", str(out)]
    killed = run_command([sys.executable, "-c", KILLED_AFTER_SECOND_SAVE.format(root=ROOT, argv=argv)])
    assert killed.returncode == 9, killed.stderr[-3000:]
    resumed = run_script("train.py", "--resume", out, "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 2" in resumed.stdout  # the second checkpoint (after epoch 1) was on disk
    _, rows = read_summary(out / "summary.csv")
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]


def run_on_terminal(argv, stdout=None):
    """Run a command with stderr (and stdout unless given) on a pseudo-terminal of 120 columns;
    returns (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    child = subprocess.Popen(argv, stdout=stdout or slave, stderr=slave, cwd=ROOT, env=subprocess_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child exited and closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return child.wait(timeout=TIMEOUT), b"".join(chunks).decode(errors="replace")


def test_a_bar_on_the_terminal_and_clean_lines_in_the_log_file(cache_dir, tmp_path):
    """python train.py > train.log on a terminal: the bar stays on the terminal, the file gets the
    Apex lines and nothing else."""
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
        code, terminal = run_on_terminal([sys.executable, os.path.join(ROOT, "train.py"), "--epochs", "1",
                                          *DEMO, "-p", "1", "--output-dir", str(tmp_path)], stdout=log)
    assert code == 0, terminal[-3000:]
    assert "Epoch 0:" in terminal and "img/s" in terminal and "Test:" in terminal  # tqdm's bars
    logged = log_path.read_text()
    assert len(APEX_LINE.findall(logged)) == 2 and FINAL.search(logged)
    assert "\r" not in logged and "img/s" not in logged


def test_lines_print_above_the_bar_never_inside_it():
    """Both streams on one terminal: each line is written after the bar was cleared (\\r + blanks
    + \\r) and ends its own row; the bar is redrawn under it."""
    code = ("import time, types\n"
            "from utils.logs import Progress\n"
            "progress = Progress(types.SimpleNamespace(is_main_process=True, is_local_main_process=True))\n"
            "progress.begin(30, 'Epoch 0')\n"
            "for i in range(3):\n"
            "    progress.advance(10); time.sleep(0.02); progress.print(f'Epoch: [0][{i + 1}/3] line')\n"
            "progress.end()\n"
            "progress.print('after the bar')\n")
    status, terminal = run_on_terminal([sys.executable, "-c", code])
    assert status == 0, terminal
    for i in range(3):
        assert re.search(rf"\r +\rEpoch: \[0\]\[{i + 1}/3\] line\r\n", terminal), terminal
    assert terminal.count("Epoch 0:") >= 3 and terminal.endswith("after the bar\r\n")


def test_missing_tracker_packages_are_usage_errors():
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    parser = add_log_args(build_parser("t"))
    for choice in ("wandb", "all"):
        args = parse_args(parser, ["--log-with", choice])
        with pytest.raises(UsageError, match="pip install wandb.*WANDB_MODE=offline"):
            tracker_kwargs(args.log_with, args.output_dir)
    assert tracker_kwargs("none", ".") == {}
    assert tracker_kwargs("tensorboard", ".")["log_with"] == ["tensorboard"]


def test_only_the_main_process_writes_and_only_after_an_epoch(tmp_path):
    args = parse_args(add_log_args(build_parser("t")), ["--output-dir", str(tmp_path / "run")])
    rank1 = types.SimpleNamespace(is_main_process=False, is_local_main_process=False)
    run_log = RunLog(rank1, args.output_dir, vars(args))
    run_log.epoch(0, None, None, None)
    run_log.finish()
    assert not os.path.exists(tmp_path / "run")
    assert not Progress(rank1).enabled
    # A run that stops before its first epoch ends (say, at an unreadable image) leaves no files.
    main = types.SimpleNamespace(is_main_process=True, is_local_main_process=True)
    RunLog(main, args.output_dir, vars(args)).finish()
    assert not os.path.exists(tmp_path / "run")


def test_loss_scaling_figures_reach_the_csv_and_the_trackers(tmp_path):
    from utils.meters import EpochResult

    args = parse_args(add_log_args(build_parser("t")), ["--output-dir", str(tmp_path)])
    logged = []
    main = types.SimpleNamespace(is_main_process=True, is_local_main_process=True,
                                 log=lambda values, step: logged.append((step, values)))
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.05}])
    run_log = RunLog(main, args.output_dir, vars(args))
    train = EpochResult(2.5, 10.0, 50.0, 64, 2.0, 32.0, skipped_steps=3, loss_scale=32768.0)
    val = EpochResult(2.0, 20.0, 60.0, 359, 1.0, 359.0)
    run_log.epoch(0, train, val, optimizer)
    _, rows = read_summary(tmp_path / "summary.csv")
    assert rows == [{"epoch": "0", "train_loss": "2.5", "train_top1": "10", "val_loss": "2", "top1": "20",
                     "top5": "60", "lr": "0.05", "img_per_s": "32", "skipped_steps": "3",
                     "loss_scale": "32768", "ema_top1": "", "ema_top5": ""}]  # no --model-ema
    assert logged == [(0, {"train/loss": 2.5, "train/top1": 10.0, "val/loss": 2.0, "val/top1": 20.0,
                           "val/top5": 60.0, "lr": 0.05, "img_per_s": 32.0, "skipped_steps": 3,
                           "loss_scale": 32768.0})]
    assert os.path.exists(tmp_path / "args.yaml") and os.path.exists(tmp_path / "curves.png")
