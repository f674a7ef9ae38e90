"""bench/benchmark_input.py: which Speed figure it takes from a real train.py log, a whole run of
the tool, and its refusals."""
import argparse
import csv
import os
import re
import shutil
import socket

import torch
from conftest import QUICK, ROOT, run_script

from bench.benchmark_input import (APEX_SPEED, PLAIN_NAME, TIMM_BENCHMARK_NAME, TIMM_BENCHMARK_SPEED, epoch_average,
                                   medians, planned_runs, refuse_misread_flag_strings, second_half_rate, setup)

TOOL = "bench/benchmark_input.py"


def test_the_figure_is_the_last_epochs_final_average(tmp_path):
    result = run_script("train.py", "synthetic", *QUICK, "--epochs", "3", "--lr-steps", "10",
                        "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    lines = [line for line in log.splitlines() if line.startswith("Epoch: [")]
    averages = {}  # epoch -> every interval line's average, in order
    for line in lines:
        epoch = int(line[len("Epoch: ["):line.index("]")])
        averages.setdefault(epoch, []).append(float(re.search(r"Speed [\d.]+ \(([\d.]+)\)", line).group(1)))
    assert sorted(averages) == [0, 1, 2] and all(len(values) > 1 for values in averages.values())
    for epoch, values in averages.items():
        assert epoch_average(APEX_SPEED, log, epoch) == values[-1]
    assert epoch_average(APEX_SPEED, log, 3) is None

    # The second half's rate from the averages, against the one from each interval's own Speed.
    last = [line for line in lines if line.startswith("Epoch: [2]")]
    steps = [int(re.search(r"\]\[(\d+)/", line).group(1)) for line in last]
    speeds = [float(re.search(r"Speed ([\d.]+) ", line).group(1)) for line in last]
    middle = max(k for k, step in enumerate(steps[:-1]) if step <= steps[-1] / 2)
    seconds_per_image = sum((steps[k] - steps[k - 1]) / speeds[k] for k in range(middle + 1, len(steps)))
    expected = (steps[-1] - steps[middle]) / seconds_per_image
    # second_half_rate rounds to 0.1 img/s; a busy machine runs this tiny model at ~40 img/s
    assert abs(second_half_rate(log, 2) - expected) <= 0.05 + 1e-3 * expected
    assert second_half_rate(log, 3) is None


def test_fewer_than_one_epoch_is_a_usage_error(tmp_path):
    result = run_script(TOOL, tmp_path, "--epochs", "0")
    assert result.returncode == 2
    assert "--epochs 0" in result.stderr and "at least one epoch" in result.stderr


def test_a_variant_given_twice_is_a_usage_error(tmp_path):
    result = run_script(TOOL, tmp_path, "--variants", "", "--stem-channels 4", "--stem-channels 4")
    assert result.returncode == 2
    assert "--variants" in result.stderr and "given twice" in result.stderr


def test_a_flag_string_opening_with_a_short_option_of_the_tool_is_a_usage_error(tmp_path):
    """argparse would read '-b 400' as the tool's own -b (batch 400 for every run) and end --variants
    there; refused with the long form to write instead, before any run or file."""
    for strings in (["--variants", "", "-b 400"], ["--train-args", "-a resnet18 --image-size 32"]):
        result = run_script(TOOL, tmp_path, *strings, "--out", tmp_path / "bench.csv", "--runs-dir", tmp_path / "runs")
        assert result.returncode == 2, result.stderr[-2000:]
        assert strings[-1] in result.stderr and "--batch-size 400" in result.stderr
        assert not (tmp_path / "bench.csv").exists() and not (tmp_path / "runs").exists()
    parser = argparse.ArgumentParser()  # the long forms pass
    parser.add_argument("-b", type=int)
    parser.add_argument("--variants", nargs="+")
    parser.add_argument("--out")
    refuse_misread_flag_strings(parser, ["--variants", "", "--batch-size 400", "--opt-level O2 --batch-size 400"])
    refuse_misread_flag_strings(parser, ["--variants", "", "--tune-kernels True", "--out", "x.csv"])


def test_a_lone_train_switch_among_the_variants_is_a_usage_error_naming_the_spelling_that_works(tmp_path, capsys):
    """argparse read the variant '--tune-kernels' as an option of the tool ("unrecognized
    arguments") once a device call had already started; refused at once with its spelling."""
    result = run_script(TOOL, tmp_path, "--variants", "", "--tune-kernels", "--out", tmp_path / "bench.csv",
                        "--runs-dir", tmp_path / "runs")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "'--tune-kernels' after --variants" in result.stderr and "('--tune-kernels True')" in result.stderr
    assert not (tmp_path / "bench.csv").exists() and not (tmp_path / "runs").exists()
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+")
    try:
        refuse_misread_flag_strings(parser, ["--variants", "--stem-channels=4"])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("'--stem-channels=4' among the variants was let through")
    assert "('--stem-channels 4')" in capsys.readouterr().err


def test_a_run_writes_a_row_per_configuration_and_round(tmp_path):
    """The tool end to end on random tensors (train.py synthetic, tiny), two rounds: the CSV holds
    per round the reference row (run where CUDA is, else saying why not) and the train.py row with
    the last epoch's average and its second half; the summary gives the train.py rows' median."""
    out = tmp_path / "bench.csv"
    result = run_script(TOOL, tmp_path, "--backends", "synthetic", "--compile", "False", "--workers", "0",
                        "-a", "resnet18", "-b", "16", "--opt-level", "O0", "--steps-per-epoch", "4", "--epochs", "2",
                        "--train-args", "--image-size 32 -p 1", "--out", out, "--timeout", "600", "--repeat", "2",
                        "--runs-dir", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [(row["backend"], row["round"]) for row in rows] == [("none", "1"), ("synthetic", "1"),
                                                                 ("none", "2"), ("synthetic", "2")]
    for plain, trained in (rows[:2], rows[2:]):
        if torch.cuda.is_available():
            assert float(plain["img_per_s"]) > 0 and float(trained["ratio_to_plain"]) > 0
        else:
            assert plain["img_per_s"] == "" and "no CUDA" in plain["note"] and trained["ratio_to_plain"] == ""
        assert float(trained["img_per_s"]) > 0 and float(trained["second_half_img_per_s"]) > 0
        assert trained["epochs"] == "2" and trained["note"] == ""
    speeds = [float(row["img_per_s"]) for row in rows[1::2]]
    summary = re.search(r"train\.py synthetic compile False: ([\d.]+) \(([\d.]+)-([\d.]+), 2 of 2 rounds\)",
                        result.stdout)
    assert summary, result.stdout[-2000:]
    expected = (sum(speeds) / 2, *sorted(speeds))  # the median of two, the lowest, the highest
    assert [float(value) for value in summary.groups()] == [round(value, 1) for value in expected]
    assert result.stdout.rstrip().splitlines()[-1] == f"=> written to {out}"


def test_medians_group_runs_by_configuration_and_hold_them_to_the_plain_median():
    def row(name, backend, compile_, speed, workers=8, decoder=""):
        return {"name": name, "backend": backend, "decoder": decoder, "workers": workers, "compile": compile_,
                "img_per_s": speed}
    rows = [row(PLAIN_NAME, "none", "True", 100.0, 0), row("train.py", "gpu", "True", 80.0, decoder="cuda"),
            row("train.py", "cpu", "True", 30.0), row(PLAIN_NAME, "none", "True", 110.0, 0),
            row("train.py", "gpu", "True", 90.0, decoder="cuda"), row("train.py", "cpu", "True", ""),
            row(PLAIN_NAME, "none", "True", 90.0, 0), row("train.py", "gpu", "True", 60.0, decoder="cuda"),
            row("train.py", "cpu", "True", 40.0), row("timm", "timm", "False", 20.0)]
    got = {key[1]: rest for key, *rest in medians(rows)}
    assert got["none"] == [100.0, 90.0, 110.0, 3, 1.0]
    assert got["gpu"] == [80.0, 60.0, 90.0, 3, 0.8]
    assert got["cpu"] == [35.0, 30.0, 40.0, 2, 0.35]  # a failed round is left out of the median
    assert got["timm"] == [20.0, 20.0, 20.0, 1, None]  # no plain reference without compile here
    assert [key[1] for key, *_ in medians(rows)] == ["none", "gpu", "cpu", "timm"]


def test_append_adds_rounds_to_the_csv_and_refuses_other_flags(tmp_path):
    """--append: a second invocation numbers its round on from the CSV's and gives medians over
    both; a file written with other flags, timed on another kind of device, or not by this tool, is
    refused before anything runs, and left as it was."""
    out = tmp_path / "bench.csv"
    flags = ["--backends", "synthetic", "--compile", "False", "--workers", "0", "-a", "resnet18", "-b", "16",
             "--opt-level", "O0", "--steps-per-epoch", "2", "--epochs", "1", "--train-args", "--image-size 32 -p 1",
             "--out", out, "--runs-dir", tmp_path, "--append"]
    for _ in range(2):
        result = run_script(TOOL, tmp_path, *flags)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [(row["backend"], row["round"]) for row in rows] == [("none", "1"), ("synthetic", "1"),
                                                                 ("none", "2"), ("synthetic", "2")]
    assert {row["host"] for row in rows} == {socket.gethostname()}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert {row["device"] for row in rows} == {device}
    assert {row["setup"] for row in rows} == {f"{tmp_path} -a resnet18 -b 16 --opt-level O0 --steps-per-epoch 2 "
                                              "--epochs 1 --train-args '--image-size 32 -p 1'"}
    speeds = sorted(float(row["img_per_s"]) for row in rows[1::2])
    assert f"train.py synthetic compile False: {sum(speeds) / 2:.1f} ({speeds[0]:.1f}-{speeds[1]:.1f}, " \
           "2 of 2 rounds)" in result.stdout
    assert "hosts" not in result.stdout

    written = out.read_bytes()
    other_steps = [("4" if flag == "2" and flags[k - 1] == "--steps-per-epoch" else flag)
                   for k, flag in enumerate(flags)]
    result = run_script(TOOL, tmp_path, *other_steps)
    assert result.returncode == 2 and "--steps-per-epoch 2" in result.stderr and "--steps-per-epoch 4" in result.stderr
    result = run_script(TOOL, tmp_path, *flags, "--compile", "True")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "differing: " in result.stderr and "train.py synthetic -j 0 compile True" in result.stderr
    assert out.read_bytes() == written
    # A machine asked for as one card can come as another: its rounds must not join the file's medians.
    other_card = written.decode().replace(f",{device},", ",NVIDIA H200,")
    out.write_text(other_card)
    result = run_script(TOOL, tmp_path, *flags)
    assert result.returncode == 2 and "timed on NVIDIA H200" in result.stderr and device in result.stderr
    assert out.read_text() == other_card
    out.write_text("round,img_per_s\n1,10\n")
    result = run_script(TOOL, tmp_path, *flags)
    assert result.returncode == 2 and "does not have this tool's columns" in result.stderr


def test_no_rounds_is_a_usage_error(tmp_path):
    result = run_script(TOOL, tmp_path, "--repeat", "0")
    assert result.returncode == 2 and "--repeat 0" in result.stderr


def test_other_code_runs_each_configuration_beside_this_copy(tmp_path):
    """--other-code DIR: the same train.py configuration from another copy of the project, right
    after this copy's in the round, as a row of its own named after the folder."""
    other = tmp_path / "before"
    other.mkdir()
    for name in ("train.py", "utils"):
        (shutil.copytree if name == "utils" else shutil.copy)(os.path.join(ROOT, name), other / name)
    out = tmp_path / "bench.csv"
    result = run_script(TOOL, tmp_path, "--backends", "synthetic", "--compile", "False", "--workers", "0",
                        "-a", "resnet18", "-b", "16", "--opt-level", "O0", "--steps-per-epoch", "2", "--epochs", "1",
                        "--train-args", "--image-size 32 -p 1", "--out", out, "--other-code", other,
                        "--runs-dir", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [row["name"] for row in rows] == [PLAIN_NAME, "train.py", "train.py (before)"]
    assert all(float(row["img_per_s"]) > 0 for row in rows[1:])
    assert {path.name for path in tmp_path.glob("bench-*")} == {"bench-synthetic--0-False",
                                                                  "bench-synthetic--0-False-before"}
    # each run's printed output is kept, named by round and row: the interval lines behind its figure
    logs = {path.name: path.read_text() for path in (tmp_path / "benchmark-logs").iterdir()}
    for name in ("r1-train.py-synthetic-j0-compile-False.log", "r1-train.py_before_-synthetic-j0-compile-False.log"):
        assert re.search(r"Epoch: \[0\]\[2/2\]\tTime", logs.pop(name))
    assert list(logs) == (["r1-plain_PyTorch_random_batch_on_the_GPU-none-j0-compile-False.log"]
                          if torch.cuda.is_available() else [])  # no CUDA: the reference is not run


def test_other_code_without_train_py_is_a_usage_error(tmp_path):
    result = run_script(TOOL, tmp_path, "--other-code", tmp_path)
    assert result.returncode == 2 and "no train.py there" in result.stderr


def test_relative_paths_are_the_callers_and_failed_runs_fail_the_tool(tmp_path):
    """DATA and --runs-dir typed relative to the caller's folder (the runs start in the project's):
    a missing folder is named by its absolute path, and a failed run makes the tool exit 1."""
    result = run_script(TOOL, "fake", "--backends", "cpu", "--compile", "False", "--workers", "0", "-a", "resnet18",
                        "-b", "4", "--steps-per-epoch", "1", "--epochs", "1", "--runs-dir", "runs", "--out", "b.csv",
                        cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert str(tmp_path / "fake") in result.stdout and "1 run(s) failed" in result.stderr
    assert (tmp_path / "b.csv").exists()  # --out too is the caller's


def test_variants_run_every_train_configuration_once_per_flag_string(tmp_path):
    """--variants '' '--stem-channels 4': each train.py configuration twice, the second with the flags,
    rows (and run folders) told apart by name; the plain reference once."""
    args = argparse.Namespace(
        data=str(tmp_path), arch="resnet50", batch_size=256, workers=[8], backends=["synthetic", "gpu"],
        decoders=["cuda"], compile=["reduce-overhead"], opt_level="O1", train_args="",
        variants=["", "--stem-channels 4"], train_crop_sizes=None, steps_per_epoch=40, epochs=2, timm_train=None,
        timm_benchmark=None, runs_dir=str(tmp_path), other_code=[])
    runs = planned_runs(args, cuda=True)
    train = [run for run in runs if run.kind == "train"]
    assert [run.kind for run in runs].count("plain") == 1 and len(train) == 4
    assert [run.name for run in train] == ["train.py", "train.py [--stem-channels 4]"] * 2
    for run in train:
        assert (run.command[-2:] == ["--output-dir", run.command[-1]]
                and ("--stem-channels" in run.command) == ("[" in run.name))
    assert len({run.command[-1] for run in train}) == 4  # each its own run folder
    assert setup(args).endswith("--variants '' '--stem-channels 4'")


def test_a_variants_flags_come_after_the_tools_own_so_a_variant_can_change_the_compile_mode(tmp_path):
    """--compile reduce-overhead --variants '--compile-mode max-autotune': argparse keeps the last
    value, so the variant's row compiles in max-autotune while the plain reference keeps
    reduce-overhead."""
    args = argparse.Namespace(
        data="synthetic", arch="resnet50", batch_size=400, workers=[8], backends=["synthetic"],
        decoders=["auto"], compile=["reduce-overhead"], opt_level="O2", train_args="",
        variants=["--tune-kernels True", "--compile-mode max-autotune"], train_crop_sizes=None, steps_per_epoch=40,
        epochs=2, timm_train=None, timm_benchmark=None, runs_dir=str(tmp_path), other_code=[])
    runs = planned_runs(args, cuda=True)
    plain = [run for run in runs if run.kind == "plain"]
    train = [run for run in runs if run.kind == "train"]
    assert len(plain) == 1 and plain[0].command[-1] == "reduce-overhead"
    tuned, autotuned = (run.command for run in train)
    assert tuned[tuned.index("--compile-mode") + 1] == "reduce-overhead" and "--tune-kernels" in tuned
    modes = [autotuned[i + 1] for i, arg in enumerate(autotuned) if arg == "--compile-mode"]
    assert modes == ["reduce-overhead", "max-autotune"]  # the last one is what train.py's argparse keeps


def test_timm_benchmarks_figure_is_its_closing_summary():
    """The figure of timm's benchmark.py is the train_samples_per_sec of its closing JSON (timed
    steps only), not an interval line's: read from the raw log of a real run on an H100."""
    log = open(os.path.join(ROOT, "docs", "results", "h100_timm_benchmark_train.log")).read()
    assert "Train [60/60]. 5835.22 samples/sec" in log
    assert [float(found) for found in TIMM_BENCHMARK_SPEED.findall(log)] == [5775.34]


def test_timm_benchmark_runs_beside_each_plain_reference(tmp_path):
    """--timm-benchmark: timm's --bench train once per --compile value, right after that value's
    plain reference, with this invocation's model (a timm/ prefix dropped), batch and precision,
    compiled in the same mode; on a machine without CUDA its row says it was not run."""
    script = str(tmp_path / "benchmark.py")
    args = argparse.Namespace(
        data=str(tmp_path), arch="timm/resnet50", batch_size=384, workers=[8], backends=["synthetic"],
        decoders=["auto"], compile=["False", "reduce-overhead", "True"], opt_level="O1", train_args="",
        variants=[""], train_crop_sizes=None, steps_per_epoch=40, epochs=2, timm_train=None, timm_benchmark=script,
        runs_dir=str(tmp_path), other_code=[])
    runs = planned_runs(args, cuda=True)
    assert [run.kind for run in runs[:6]] == ["plain", "timm-benchmark"] * 3
    timm = [run for run in runs if run.kind == "timm-benchmark"]
    assert [run.compile for run in timm] == args.compile and {run.name for run in timm} == {TIMM_BENCHMARK_NAME}
    for run in timm:
        assert run.command[1:8] == [script, "--model", "resnet50", "--bench", "train", "-b", "384"]
        assert "--amp" in run.command and "--channels-last" in run.command
        assert run.command[run.command.index("--num-bench-iter") + 1] == "40"
    assert "--torchcompile" not in timm[0].command
    assert timm[1].command[-3:] == ["--torchcompile", "--torchcompile-mode", "reduce-overhead"]
    assert timm[2].command[-1] == "--torchcompile"  # inductor's default mode

    args.opt_level, args.compile = "O0", ["False"]
    assert "--amp" not in planned_runs(args, cuda=True)[1].command  # fp32, as O0 trains
    without = planned_runs(args, cuda=False)
    assert [(run.kind, run.command) for run in without[:2]] == [("plain", None), ("timm-benchmark", None)]
    assert without[1].note.startswith("not run: no CUDA device here")


def test_a_timm_script_that_is_not_there_is_a_usage_error(tmp_path):
    for flag in ("--timm-benchmark", "--timm-train"):
        result = run_script(TOOL, tmp_path, flag, tmp_path / "benchmark.py", "--out", tmp_path / "b.csv")
        assert result.returncode == 2 and f"{flag} " in result.stderr and "no such file" in result.stderr
        assert not (tmp_path / "b.csv").exists()
