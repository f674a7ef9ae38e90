"""tools/benchmark_input.py: which Speed figure it takes from a real train.py log, and its refusals."""
import importlib.util
import os
import re

from conftest import QUICK, ROOT, run_script

TOOL = "tools/benchmark_input.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("benchmark_input", os.path.join(ROOT, TOOL))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    tool = load_tool()
    for epoch, values in averages.items():
        assert tool.epoch_average(tool.APEX_SPEED, log, epoch) == values[-1]
    assert tool.epoch_average(tool.APEX_SPEED, log, 3) is None


def test_fewer_than_one_epoch_is_a_usage_error(tmp_path):
    result = run_script(TOOL, tmp_path, "--epochs", "0")
    assert result.returncode == 2
    assert "--epochs 0" in result.stderr and "at least one epoch" in result.stderr
