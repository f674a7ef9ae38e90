"""tools/benchmark_input.py: which Speed figure it takes from a real train.py log, a whole run of
the tool, and its refusals."""
import csv
import re

import torch

from conftest import QUICK, run_script
from tools.benchmark_input import APEX_SPEED, epoch_average, second_half_rate

TOOL = "tools/benchmark_input.py"


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
    assert abs(second_half_rate(log, 2) - expected) < 1e-3 * expected
    assert second_half_rate(log, 3) is None


def test_fewer_than_one_epoch_is_a_usage_error(tmp_path):
    result = run_script(TOOL, tmp_path, "--epochs", "0")
    assert result.returncode == 2
    assert "--epochs 0" in result.stderr and "at least one epoch" in result.stderr


def test_a_run_writes_a_row_per_configuration(tmp_path):
    """The tool end to end on random tensors (train.py synthetic, tiny): the CSV holds the
    reference row (run where CUDA is, else saying why not) and the train.py row with the last
    epoch's average and its second half."""
    out = tmp_path / "bench.csv"
    result = run_script(TOOL, tmp_path, "--backends", "synthetic", "--compile", "False", "--workers", "0",
                        "-a", "resnet18", "-b", "16", "--opt-level", "O0", "--steps-per-epoch", "4", "--epochs", "2",
                        "--train-args", "--image-size 32 -p 1", "--out", out, "--timeout", "600")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plain, trained = list(csv.DictReader(out.open()))
    assert plain["backend"] == "none" and trained["backend"] == "synthetic"
    if torch.cuda.is_available():
        assert float(plain["img_per_s"]) > 0 and float(trained["ratio_to_plain"]) > 0
    else:
        assert plain["img_per_s"] == "" and "no CUDA" in plain["note"] and trained["ratio_to_plain"] == ""
    assert float(trained["img_per_s"]) > 0 and float(trained["second_half_img_per_s"]) > 0
    assert trained["epochs"] == "2" and trained["note"] == ""
