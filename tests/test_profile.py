"""profile.py: the --prof window, the phase table, --trace, --benchmark, and the NVTX/cudaProfiler calls."""
import csv
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, run_script

from utils.profiling import DATA_RANGE, WAIT_RANGE, NvtxWindow, PhaseProfiler, WallClock, format_waits_and_gc
from utils.run.errors import exit_on_usage_error

TINY = ["-a", "resnet18", "--image-size", "16"]
PHASES = ["data wait", "host-to-device", "forward", "backward", "optimizer step", "other"]
LOOP_RANGES = [DATA_RANGE, "forward", "backward", "optimizer.step()"]


def load_profile_script():
    """profile.py as a module under another name (the name 'profile' is the stdlib's)."""
    spec = importlib.util.spec_from_file_location("profile_script", os.path.join(ROOT, "profile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def phase_table(stdout):
    """{label: mean ms} for the phase rows, plus 'sum of phases' and 'measured step'."""
    rows = {}
    for line in stdout.splitlines():
        match = re.match(r"^(data wait|host-to-device|forward|backward|optimizer step|other|"
                         r"sum of phases|measured step)\s+(-?[\d.]+)\s+(-?[\d.]+)%", line)
        if match:
            rows[match.group(1)] = float(match.group(2))
    return rows


@pytest.fixture(scope="module")
def digits_profile(cache_dir, tmp_path_factory):
    """One --prof 3 run on the digits demo with a trace: 3 warm-up steps, a window of 2."""
    out = tmp_path_factory.mktemp("profile")
    trace = out / "trace.json"
    result = run_script("profile.py", *TINY, "-b", "8", "-j", "1", "-p", "1", "--prof", "3",
                        "--prof-steps", "2", "--trace", trace, "--output-dir", out, timeout=300)
    return result, trace


def test_prof_exits_cleanly_after_the_window(digits_profile):
    result, _ = digits_profile
    assert result.returncode == 0, result.stderr
    # -p 1 logs every step the loop ran: the 3 warm-up steps and the 2 of the window, no more.
    steps = re.findall(r"^Epoch: \[0\]\[(\d+)/\d+\]", result.stdout, flags=re.M)
    assert [int(s) for s in steps] == [1, 2, 3, 4, 5]
    assert "=> ran 5 steps" in result.stdout
    assert "Traceback" not in result.stderr


def test_phase_table_adds_up_to_the_step(digits_profile):
    result, _ = digits_profile
    rows = phase_table(result.stdout)
    assert set(PHASES) <= set(rows), result.stdout
    # each phase once: -p 1 makes every step a print step, which takes the next batch ahead of its
    # sync (outside the data range); that early take must not become a phase row of its own
    table = result.stdout[result.stdout.index("=> phases"):]
    rows_each = [len(re.findall(rf"^{label}\s+-?[\d.]+\s+-?[\d.]+%", table, flags=re.M)) for label in PHASES]
    assert rows_each == [1] * len(PHASES), table
    assert all(rows[label] >= 0 for label in PHASES)
    assert rows["forward"] > 0 and rows["backward"] > 0 and rows["optimizer step"] > 0
    total = sum(rows[label] for label in PHASES)
    assert abs(total - rows["measured step"]) <= 0.10 * rows["measured step"], result.stdout
    assert re.search(r"^throughput: [\d.]+ img/s", result.stdout, flags=re.M)
    assert "peak GPU memory:" in result.stdout
    assert "precision: O0 fp32" in result.stdout
    # the window is steps 3-4: the longest wait names one of them
    assert re.search(r"^data wait per step: median [\d.]+ ms, longest [\d.]+ ms \(step [34]\); \d of 2 steps",
                     result.stdout, flags=re.M), result.stdout
    assert re.search(r"^Python garbage collection in the window: (none|\d+ collection)", result.stdout, flags=re.M)
    if not torch.cuda.is_available():
        assert "NVTX" in result.stderr and "cudaProfiler" in result.stderr and "CUDA-event" in result.stderr


def test_trace_holds_the_named_ranges_of_the_window(digits_profile):
    result, trace = digits_profile
    assert result.returncode == 0, result.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert set(LOOP_RANGES + [WAIT_RANGE]) <= names
    bodies = sorted(name for name in names if name and name.startswith("Body of iteration"))
    assert bodies == ["Body of iteration 3", "Body of iteration 4"]


def test_benchmark_sweeps_every_opt_level_and_layout_by_default():
    script = load_profile_script()
    args = script.build_profile_parser().parse_args(["--benchmark"])
    assert script.benchmark_configs(args) == [(level, layout) for level in ("O0", "O1", "O2", "O3")
                                              for layout in (False, True)]


def test_benchmark_writes_one_row_per_config(cache_dir, tmp_path):
    # Two levels (fp32, and half weights with fp32 masters) keep it quick; the sweep is the same code.
    out = tmp_path / "bench.csv"
    result = run_script("profile.py", "--benchmark", "synthetic", *TINY, "-b", "2", "--num-classes", "10",
                        "--prof", "0", "--prof-steps", "1", "--mixed-precision", "bf16",
                        "--benchmark-levels", "O0,O2", "--benchmark-csv", out, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(out) as handle:
        rows = list(csv.DictReader(handle))
    configs = [(row["opt_level"], row["dtype"], row["channels_last"]) for row in rows]
    assert configs == [("O0", "fp32", "False"), ("O0", "fp32", "True"), ("O2", "bf16", "False"),
                       ("O2", "bf16", "True")]
    assert all(float(row["img_per_s"]) > 0 and float(row["ms_per_step"]) > 0 for row in rows)
    assert rows[0]["ratio"] == "1.000"
    for row in rows:  # the printed table has the same rows
        assert re.search(rf"^{row['opt_level']}\s+{row['dtype']}\s+{row['channels_last']}\s+[\d.]+",
                         result.stdout, flags=re.M)


def record_cuda_calls(monkeypatch, calls, call_through):
    """Record NVTX pushes/pops and cudaProfilerStart/Stop (calling the real ones on a GPU)."""
    real_push, real_pop, real_cudart = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop, torch.cuda.cudart

    class Cudart:
        def cudaProfilerStart(self):
            calls.append(("start",))
            if call_through:
                real_cudart().cudaProfilerStart()

        def cudaProfilerStop(self):
            calls.append(("stop",))
            if call_through:
                real_cudart().cudaProfilerStop()

    monkeypatch.setattr(torch.cuda.nvtx, "range_push",
                        lambda name: (calls.append(("push", name)), call_through and real_push(name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: (calls.append(("pop",)), call_through and real_pop()))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    if not call_through:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)


def check_nvtx_calls(calls, start, length, total, inner):
    """Apex's pattern: a 'Body of iteration i' range around each step's ranges, cudaProfilerStart
    just before the body of step `start`, cudaProfilerStop after the body of step start+length-1."""
    calls = [tuple(call) for call in calls]
    assert calls.count(("start",)) == 1 and calls.count(("stop",)) == 1
    assert calls[calls.index(("start",)) + 1] == ("push", f"Body of iteration {start}")
    assert calls[-1] == ("stop",)  # nothing after the window: the run ended there
    bodies = [call[1] for call in calls if call[0] == "push" and call[1].startswith("Body of iteration")]
    assert bodies == [f"Body of iteration {i}" for i in range(total)]
    depth, steps = 0, []
    for call in calls:
        if call[0] == "push":
            if depth == 0:
                steps.append([])
            elif depth == 1:
                steps[-1].append(call[1])
            depth += 1
        elif call[0] == "pop":
            depth -= 1
            assert depth >= 0
    assert depth == 0
    assert steps == [inner] * total
    assert start + length == total


@pytest.mark.parametrize("hook", [NvtxWindow, PhaseProfiler])
def test_nvtx_window_calls_and_counts_across_epochs(monkeypatch, hook):
    """The hooks driven like the loop drives them, with epochs of 3 steps and a window of 2..4."""
    calls = []
    record_cuda_calls(monkeypatch, calls, call_through=False)
    phases = hook(2, 3, nvtx=True) if hook is NvtxWindow else hook(2, 3, nvtx=True, clock=WallClock())
    done = False
    for epoch in range(3):
        for step in range(3):  # the loop's own step restarts each epoch
            phases.begin_step(step)
            with phases.range(DATA_RANGE):
                with phases.range(WAIT_RANGE):
                    pass
            for name in LOOP_RANGES[1:]:
                with phases.range(name):
                    pass
            if phases.end_step(step):
                done = True
                break
        if done:
            break
    assert phases.finished and (epoch, step) == (1, 1)
    check_nvtx_calls(calls, start=2, length=3, total=5, inner=LOOP_RANGES)
    if hook is PhaseProfiler:
        labels = [label for label, _ in phases.times.phases]
        assert labels == PHASES and phases.times.steps == 3


def test_phase_profiler_finds_the_long_wait_and_the_collections_of_the_window():
    """One slow batch among quick ones, and a collection inside the window and one after it."""
    phases = PhaseProfiler(1, 4, nvtx=False, clock=WallClock())
    for step in range(6):
        phases.begin_step(step)
        with phases.range(DATA_RANGE):
            with phases.range(WAIT_RANGE):
                if step == 3:
                    time.sleep(0.25)
        for name in LOOP_RANGES[1:]:
            with phases.range(name):
                if step == 2 and name == "forward":
                    gc.collect()
        if phases.end_step(step):
            break
    gc.collect()  # after the window: not counted
    times = phases.times
    assert step == 4 and len(times.data_waits) == 4
    assert max(range(4), key=times.data_waits.__getitem__) == 2 and times.data_waits[2] >= 240
    assert [generation for generation, _ in times.gc_pauses].count(2) == 1
    assert phases._time_gc not in gc.callbacks
    lines = format_waits_and_gc(times)
    assert re.match(r"data wait per step: median [\d.]+ ms, longest 2\d\d\.\d+ ms \(step 3\); [1-4] of 4 steps "
                    r"waited over 1 ms: steps? [\d ]*3", lines[0]), lines
    assert re.match(r"Python garbage collection in the window: \d+ collection\(s\) \(gen0 \d+, gen1 \d+, gen2 1\), "
                    r"[\d.]+ ms in all", lines[1]), lines
    assert len(lines) == 2  # on the wall clock the host's wait is the data wait: not printed twice
    dying = PhaseProfiler(0, 4, nvtx=False, clock=WallClock())
    dying.begin_step(0)  # the window opens, then the run dies inside it (profile.py --benchmark: out of memory)
    assert dying._time_gc in gc.callbacks
    dying.stop_timing_gc()
    assert dying._time_gc not in gc.callbacks


def test_a_batch_taken_ahead_of_a_print_steps_sync_is_no_phase_and_no_steps_wait():
    """The loop takes the batch after a print step early, outside the data range (its wait range
    is then not nested): the table keeps one 'data wait' row, and the per-step waits stay with
    their steps: the step whose batch was taken ahead waited 0. (Sleeps of 0.2 s and more, so
    a busy machine's pauses in the quick steps stay far below what is asserted.)"""
    phases = PhaseProfiler(0, 4, nvtx=False, clock=WallClock())
    for step in range(4):
        phases.begin_step(step)
        with phases.range(DATA_RANGE):
            if step != 2:  # step 2's batch was taken during step 1
                with phases.range(WAIT_RANGE):
                    time.sleep(0.2 if step == 3 else 0)
        with phases.range("forward"):
            pass
        if step == 1:
            with phases.range(WAIT_RANGE):  # the early take, as TimedLoader records it
                time.sleep(0.5)
        phases.end_step(step)
    times = phases.times
    assert [label for label, _ in times.phases] == ["data wait", "host-to-device", "forward", "other"]
    assert len(times.data_waits) == 4 and times.data_waits[2] == 0.0 and times.data_waits[3] >= 199
    assert max(times.data_waits[:2]) < 199  # the early take's 500 ms is in step 1's 'other'
    assert dict(times.phases)["other"] * 4 >= 499


class GpuLikeClock(WallClock):
    """The wall clock under another name: how the table tells a GPU clock from the host's."""
    name = "a clock off the host"


def test_host_time_taking_each_batch_is_listed_beside_the_waits_and_the_slow_steps_named():
    """With a clock that is not the host's (CUDA events on a GPU), the host's own time taking each
    batch gets a line of its own; the steps over the threshold are named, and a long list is cut.
    (A 100 ms threshold and 0.2 s sleeps: a busy machine's pauses in the quick steps stay below.)"""
    phases = PhaseProfiler(0, 20, nvtx=False, clock=GpuLikeClock())
    slow_steps = {2, 5, 6, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18}
    for step in range(20):
        phases.begin_step(step)
        with phases.range(DATA_RANGE):
            time.sleep(0.2 if step in slow_steps else 0)
        if phases.end_step(step):
            break
    lines = format_waits_and_gc(phases.times, long_ms=100, listed=12)
    assert len(phases.times.host_waits) == 20 and min(phases.times.host_waits[k] for k in slow_steps) >= 199
    assert lines[0].startswith("data wait per step:") and lines[0].endswith(
        "13 of 20 steps waited over 100 ms: steps 2 5 6 8 9 11 12 13 14 15 16 17 ..."), lines
    assert lines[1].startswith("host taking the batch per step: median") and " 13 of 20 steps took over 100 ms" in lines[1]
    assert lines[2].startswith("Python garbage collection in the window")


@pytest.mark.gpu
def test_nvtx_and_cuda_profiler_calls_on_the_gpu(cache_dir, tmp_path):
    """profile.py itself on the GPU, its NVTX and cudaProfiler calls recorded through a hook."""
    harness = tmp_path / "harness.py"
    harness.write_text(f"""
import json, runpy, sys
sys.path.insert(0, {ROOT!r})
import pytest, torch
sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
from test_profile import record_cuda_calls
calls = []
with pytest.MonkeyPatch.context() as monkeypatch:
    record_cuda_calls(monkeypatch, calls, call_through=True)
    sys.argv = ["profile.py"] + sys.argv[1:]
    try:
        runpy.run_path({os.path.join(ROOT, 'profile.py')!r}, run_name="__main__")
    finally:
        print("CALLS " + json.dumps(calls))
""")
    result = run_script(str(harness), "synthetic", *TINY, "-b", "8", "--num-classes", "10", "--prof", "3",
                        "--prof-steps", "2", "--opt-level", "O1", "--output-dir", tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    calls = json.loads(result.stdout.split("CALLS ", 1)[1])
    check_nvtx_calls(calls, start=3, length=2, total=5, inner=LOOP_RANGES)
    rows = phase_table(result.stdout)
    assert abs(sum(rows[label] for label in PHASES) - rows["measured step"]) <= 0.10 * rows["measured step"]
    assert re.search(r"peak GPU memory: [\d.]+ GiB", result.stdout)


def test_help_lists_the_profile_flags_with_defaults():
    text = load_profile_script().build_profile_parser().format_help()
    for flag, default in [("--prof", "100"), ("--prof-steps", "10"), ("--trace", "none"),
                          ("--benchmark-csv", "benchmark.csv in --output-dir"),
                          ("--benchmark-levels", "O0,O1,O2,O3"), ("--benchmark-channels-last", "False,True")]:
        assert flag in text
        assert f"default: {default}" in " ".join(text.split()), flag
    assert "--benchmark " in text


def test_prof_is_on_by_default():
    args = load_profile_script().build_profile_parser().parse_args([])
    assert (args.prof, args.prof_steps) == (100, 10)


@pytest.mark.parametrize("argv, message", [
    (["-e"], "-e/--evaluate"),
    (["--benchmark-csv", "x.csv"], "only applies with --benchmark"),
    (["--benchmark", "--opt-level", "O2"], "--benchmark-levels"),
    (["--benchmark", "--channels-last"], "--benchmark-channels-last"),
    (["--benchmark", "--channels-last", "False"], "--benchmark-channels-last"),
    (["--benchmark", "--keep-batchnorm-fp32", "True"], "--benchmark sweeps O1 too (--benchmark-levels), and there"),
    (["--benchmark", "--trace", "t.json"], "cannot be combined"),
    (["--trace", "/no/such/folder/t.json"], "does not exist"),
    (["--trace", os.path.join(ROOT, "README.md", "t.json")], "does not exist"),
    (["--prof", "-1"], "argument --prof: expected an integer >= 0"),
    (["--prof-steps", "0"], "argument --prof-steps: expected a positive integer"),
    (["--benchmark-levels", "O4"], "unknown opt level 'O4'"),
    (["synthetic", *TINY, "-b", "2", "--epochs", "1", "--prof", "100", "--steps-per-epoch", "0"],
     "needs 110 training steps"),
])
def test_usage_errors_exit_2_with_one_line(cache_dir, capsys, argv, message):
    """main(argv) in this process, through the exit path `python profile.py` takes."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        exit_on_usage_error(lambda: load_profile_script().main(argv))
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert ": error: " in lines[0] and message in lines[0], lines[0]


def test_a_diverging_run_exits_3_naming_the_step(cache_dir, capsys):
    """--max-nonfinite-steps in profile.py: the run stops as train.py's does (exit 3, one line
    naming the step), not with a window report of steps that never ran."""
    capsys.readouterr()
    argv = ["-a", "resnet18", "--image-size", "32", "-j", "0", "-p", "1", "-b", "8", "--steps-per-epoch", "6",
            "--epochs", "1", "--prof", "2", "--prof-steps", "2", "--lr", "1e30", "--max-nonfinite-steps", "1"]
    with pytest.raises(SystemExit) as exited:
        exit_on_usage_error(lambda: load_profile_script().main(argv))
    captured = capsys.readouterr()
    assert exited.value.code == 3, captured.err[-2000:]
    assert "training diverged at epoch" in captured.err and "Traceback" not in captured.err
    assert "done" not in captured.out  # no "=> ran N steps; window steps ... done"


def test_usage_error_end_to_end_exits_2_without_traceback(cache_dir):
    result = run_script("profile.py", "-e", timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("profile.py: error: ") and "-e/--evaluate does not apply" in last, last
    assert "Traceback" not in result.stderr


def test_the_stdlib_profile_module_still_imports_from_here():
    """torch imports cProfile, which imports the stdlib `profile`; with this folder first on
    sys.path (any script run from it) that import finds profile.py, which must hand it over."""
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); import torchvision, cProfile, profile, sysconfig; "
            "assert profile.__file__.startswith(sysconfig.get_path('stdlib')), profile.__file__; "
            "cProfile.run('sum(range(10))')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


def test_flags_profile_py_has_no_use_for_are_named():
    script = load_profile_script()
    parser = script.build_profile_parser()

    def notes(*argv):
        return script.idle_flag_notes(parser.parse_args(list(argv)), script.typed_dests(parser, list(argv)))

    assert notes("--output-dir", "out", "--crop-pct", "0.5") == [
        "--crop-pct, --output-dir: profile.py runs no validation and, without --benchmark, writes no files; "
        "they have no effect here"]
    assert notes("--benchmark", "--output-dir", "out") == []  # the CSV goes there
    assert notes("--benchmark", "--crop-pct", "0.5")[0].startswith("--crop-pct: ")
    assert notes("--prof", "5") == []
    # --resume auto (resolved to the file it found in --output-dir) used --output-dir
    assert notes("--resume", os.path.join("out", "checkpoint.pth.tar"), "--output-dir", "out") == []


def test_a_trace_or_csv_never_replaces_a_training_runs_file(cache_dir, capsys, tmp_path):
    (tmp_path / "checkpoint.pth.tar").write_bytes(b"weights")
    (tmp_path / "summary.csv").write_text("epoch\n0\n")
    for argv in (["--trace", tmp_path / "checkpoint.pth.tar"],
                 ["--benchmark", "--benchmark-csv", tmp_path / "summary.csv"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            exit_on_usage_error(lambda: load_profile_script().main([str(arg) for arg in argv]))
        assert exited.value.code == 2 and "a training run's file" in capsys.readouterr().err
    assert (tmp_path / "checkpoint.pth.tar").read_bytes() == b"weights"
    assert (tmp_path / "summary.csv").read_text() == "epoch\n0\n"
