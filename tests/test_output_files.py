"""Every file every script writes (issue 40, items 3-5): the atomic helpers turn any OSError on the
way into one WriteError (exit 4); every output path is checked at start-up (exit 2, before the
work), also as root, where mode bits mean nothing; no tool replaces a file the user has without
--overwrite; a cache variable naming a file, an unwritable folder or a full disk is one line
naming the variable.

Real faults only: a file where a folder is expected, an immutable folder (chattr +i as root, mode
0555 otherwise), and RLIMIT_FSIZE in the child (SIGXFSZ ignored, so write() fails with EFBIG as a
full disk's write fails with ENOSPC)."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import QUICK, ROOT, TIMEOUT, make_image_folder, subprocess_env

from utils.run.errors import EXIT_USAGE, EXIT_WRITE_FAILED, WriteError
from utils.run.files import atomic_directory, atomic_export, atomic_write, copy_atomic, folder_write_problem

USER_BYTES = b"the user's own file\n"
KINETO_LOG = re.compile(r"(USDT|ERROR|WARNING|INFO):\d{4}-\d\d-\d\d ")  # torch.profiler's C++ log, any trace
PROFILE = ["--prof", "1", "--prof-steps", "1", *QUICK]  # profile.py: a window that fits 4 steps


def run(script, *args, env=None, cwd=None, file_limit=None):
    """A script in a fresh process; file_limit: the largest file it may write (RLIMIT_FSIZE)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))
    command = [sys.executable, *([os.path.join(ROOT, script)] if script != "-c" else ["-c"]), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=subprocess_env(env), cwd=cwd or ROOT,
                          timeout=TIMEOUT, preexec_fn=limit if file_limit else None)


def one_line(result, code, *needles):
    """Exit code, one `prog: error: ...` line (warnings aside) naming every needle, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith("warning:") and not KINETO_LOG.match(line)]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert ": error: " in lines[0], lines[0]
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


def user_file(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(USER_BYTES)
    return path


def no_temp_files(folder):
    return not [name for name in os.listdir(folder) if name.startswith(".tmp-")]


@pytest.fixture
def locked(tmp_path):
    """A folder no process can create a file in, root included: chattr +i (root ignores mode bits),
    or mode 0555 for a user that is not root. Skipped where neither works."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif shutil.which("chattr") is None or subprocess.run(["chattr", "+i", folder], capture_output=True).returncode:
        pytest.skip("running as root, and chattr +i does not work here (no chattr, or a filesystem "
                    "without the immutable flag): root could write into any other folder")
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", folder], check=True)
    else:
        folder.chmod(0o755)


@pytest.fixture(scope="module")
def checkpoint(cache_dir, tmp_path_factory):
    """One step of a real train.py run on the digits: a checkpoint for eval.py and the export."""
    out = tmp_path_factory.mktemp("run") / "run"
    result = run("train.py", "--epochs", "1", *QUICK[:-1], "1", "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "checkpoint.pth.tar"


# --- 3. the mechanism: every OSError on the way is one WriteError ------------------------------

HELPERS = {
    "atomic_write": lambda path: atomic_write(path, b"new", fsync=True),
    "atomic_export": lambda path: atomic_export(path, lambda tmp: open(tmp, "wb").write(b"new")),
    "copy_atomic": lambda path: copy_atomic(__file__, path),
}


@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_a_file_on_the_way_and_a_locked_folder_are_write_errors(helper, tmp_path, locked):
    """makedirs (a folder on the way is a file), mkstemp (a folder that takes no file): both were
    raw tracebacks; now WriteError naming the file, and nothing left behind."""
    blocker = user_file(tmp_path / "a_file")
    for path in (blocker / "out.bin", blocker / "sub" / "out.bin", locked / "out.bin"):
        with pytest.raises(WriteError, match=f"could not write {path}: "):
            HELPERS[helper](str(path))
    assert blocker.read_bytes() == USER_BYTES and not os.listdir(locked)


def test_a_locked_or_blocked_atomic_directory_is_a_write_error(tmp_path, locked):
    blocker = user_file(tmp_path / "a_file")
    for path in (blocker / "built", locked / "built"):
        with pytest.raises(WriteError, match=f"could not write {path}: "):
            with atomic_directory(str(path), advice="; advice"):
                pass
    with pytest.raises(WriteError) as caught:  # the folder is there as a file: the rename fails
        with atomic_directory(str(blocker)) as tmp:
            open(os.path.join(tmp, "x"), "w").close()
    assert caught.value.path == str(blocker) and blocker.read_bytes() == USER_BYTES
    assert no_temp_files(tmp_path)


FULL_DISK = """
import os, sys
from utils.run.errors import WriteError
from utils.run.files import atomic_directory, atomic_export, atomic_write
folder = sys.argv[1]
big = b"x" * 100_000
def fill_folder(path):
    with atomic_directory(path) as tmp:
        open(os.path.join(tmp, "big"), "wb").write(big)
for name, write in (("w.bin", lambda p: atomic_write(p, big, fsync=True)),
                    ("e.json", lambda p: atomic_export(p, lambda tmp: open(tmp, "wb").write(big))),
                    ("d", fill_folder)):
    try:
        write(os.path.join(folder, name))
        print(name, "written")
    except WriteError as err:
        print(name, "WriteError", err.errno, err.path == os.path.join(folder, name))
"""


def test_a_full_disk_in_every_helper_is_a_write_error_and_keeps_the_old_file(tmp_path):
    for name in ("w.bin", "e.json"):
        user_file(tmp_path / name)
    result = run("-c", FULL_DISK, tmp_path, file_limit=10_000)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == [f"{name} WriteError 27 True" for name in ("w.bin", "e.json", "d")]
    for name in ("w.bin", "e.json"):
        assert (tmp_path / name).read_bytes() == USER_BYTES
    assert sorted(os.listdir(tmp_path)) == ["e.json", "w.bin"]  # no temp file, no half-built folder


def test_the_write_probe_sees_what_root_cannot_write(tmp_path, locked):
    """Mode bits say root may write anywhere; the probe creates a real file. train.py's
    --output-dir check uses the same probe."""
    assert folder_write_problem(str(tmp_path)) is None and os.listdir(tmp_path) == ["locked"]
    assert "cannot create a file in" in folder_write_problem(str(locked))
    if os.geteuid() == 0:
        assert os.stat(locked).st_mode & 0o200  # what a mode-bit check would have believed
    result = run("train.py", "--output-dir", locked, *QUICK)
    one_line(result, EXIT_USAGE, f"--output-dir {str(locked)!r} is not writable")


# --- eval.py -------------------------------------------------------------------------------------

def test_eval_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, locked):
    """The refusal comes from the command line's check, before the checkpoint is even read (it
    does not exist here): no evaluation ends in a PermissionError traceback any more."""
    blocker = user_file(tmp_path / "a_file")
    for flag, path in (("--predictions", locked / "p.csv"), ("--results-file", locked / "r.json"),
                       ("--predictions", blocker / "p.csv")):
        result = run("eval.py", "--resume", tmp_path / "none.pth.tar", flag, path)
        one_line(result, EXIT_USAGE, flag, path)
        assert "no checkpoint" not in result.stderr
    assert blocker.read_bytes() == USER_BYTES and not os.listdir(locked)


def test_eval_refuses_to_replace_results_or_predictions_without_overwrite(checkpoint, tmp_path):
    results, predictions = user_file(tmp_path / "r.json"), user_file(tmp_path / "p.csv")
    for flag, path in (("--results-file", results), ("--predictions", predictions)):
        result = run("eval.py", "--resume", checkpoint, flag, path, "-j", "0")
        one_line(result, EXIT_USAGE, flag, path, "--overwrite")
        assert "Loss" not in result.stdout  # before any work
    assert results.read_bytes() == predictions.read_bytes() == USER_BYTES
    result = run("eval.py", "--resume", checkpoint, "--results-file", results, "-j", "0", "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(results.read_text())["images"] > 0


def test_eval_predictions_on_a_full_disk_are_one_line_exit_4(checkpoint, tmp_path):
    """The digits' predictions CSV (~40 KB) cannot be written under a 16 KB file limit: after the
    evaluation, one line and exit 4, and the user's earlier file (--overwrite) is as it was."""
    predictions = user_file(tmp_path / "p.csv")
    result = run("eval.py", "--resume", checkpoint, "--predictions", predictions, "-j", "0", "--overwrite",
                 file_limit=16_000)
    one_line(result, EXIT_WRITE_FAILED, f"could not write {predictions}: File too large (EFBIG)")
    assert " * Loss" in result.stdout  # it evaluated, then the write failed
    assert predictions.read_bytes() == USER_BYTES and no_temp_files(tmp_path)


# --- profile.py ----------------------------------------------------------------------------------

def test_profile_outputs_are_checked_for_writability_and_existing_files(tmp_path, locked):
    trace, csv_file = user_file(tmp_path / "t.json"), user_file(tmp_path / "b.csv")
    cases = [(["--trace", locked / "t.json"], "--trace", "cannot create a file in"),
             (["--trace", trace], "--trace", "--overwrite"),
             (["--benchmark", "--benchmark-csv", locked / "b.csv"], "--benchmark-csv", "cannot create a file in"),
             (["--benchmark", "--benchmark-csv", csv_file], "--benchmark-csv", "--overwrite"),
             (["--benchmark", "--output-dir", locked], "--benchmark-csv", "cannot create a file in")]
    for argv, *needles in cases:
        one_line(run("profile.py", *argv, *PROFILE), EXIT_USAGE, *needles)
    assert trace.read_bytes() == csv_file.read_bytes() == USER_BYTES and not os.listdir(locked)


def test_profile_refuses_every_ranks_existing_trace(tmp_path):
    """Under several processes each writes name.rankN.json: every one is checked on every rank."""
    user_file(tmp_path / "t.rank1.json")
    result = run("profile.py", "--trace", tmp_path / "t.json", *PROFILE, env={"WORLD_SIZE": "2"})
    one_line(result, EXIT_USAGE, "t.rank1.json", "--overwrite")


def test_profile_trace_on_a_full_disk_is_one_line_exit_4(cache_dir, tmp_path):
    """Kineto writes the trace itself and only logs a failed write: the file's end is checked, so
    a cut-off trace is the one line and exit 4, not a broken file published with exit 0. Without
    the limit, --overwrite replaces the file with a whole trace that names itself, not its temp file."""
    trace = user_file(tmp_path / "t.json")
    result = run("profile.py", "--trace", trace, "--overwrite", *PROFILE, file_limit=4_000)
    one_line(result, EXIT_WRITE_FAILED, f"could not write {trace}: torch.profiler wrote only part of the trace")
    assert trace.read_bytes() == USER_BYTES and no_temp_files(tmp_path)
    result = run("profile.py", "--trace", trace, "--overwrite", *PROFILE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(trace.read_text())["traceName"] == str(trace) and no_temp_files(tmp_path)


# --- tools/export_safetensors.py -----------------------------------------------------------------

def test_export_refuses_an_existing_file_and_replaces_it_with_overwrite(checkpoint, tmp_path):
    out = user_file(tmp_path / "w.safetensors")
    result = run("tools/export_safetensors.py", checkpoint, out)
    one_line(result, EXIT_USAGE, out, "already exists", "--overwrite")
    assert out.read_bytes() == USER_BYTES
    result = run("tools/export_safetensors.py", checkpoint, out, "--overwrite")
    assert result.returncode == 0, result.stderr
    import safetensors.torch
    assert safetensors.torch.load_file(out)


def test_export_into_a_locked_folder_is_refused_before_reading_and_a_full_disk_is_exit_4(checkpoint, tmp_path,
                                                                                          locked):
    result = run("tools/export_safetensors.py", tmp_path / "none.pth.tar", locked / "w.safetensors")
    one_line(result, EXIT_USAGE, locked / "w.safetensors", "cannot create a file in")  # not "no checkpoint"
    out = user_file(tmp_path / "w.safetensors")
    result = run("tools/export_safetensors.py", checkpoint, out, "--overwrite", file_limit=100_000)
    one_line(result, EXIT_WRITE_FAILED, f"could not write {out}: File too large (EFBIG)")
    assert out.read_bytes() == USER_BYTES and no_temp_files(tmp_path)


# --- tools/opt_level_sweep.py, tools/make_fake_imagenet.py ---------------------------------------

def test_sweep_refuses_an_earlier_sweeps_files_and_unwritable_out_dirs(tmp_path, locked):
    table = user_file(tmp_path / "sweep" / "opt_level_sweep.csv")
    run_file = user_file(tmp_path / "sweep2" / "O0" / "summary.csv")
    blocker = user_file(tmp_path / "a_file")
    for out_dir, needle in ((table.parent, "opt_level_sweep.csv"), (run_file.parent.parent, "O0"),
                            (blocker, "is a file, not a directory"), (locked, "is not writable"),
                            (blocker / "sub", "cannot create it")):
        result = run("tools/opt_level_sweep.py", "digits", "--configs", "O0", "--out-dir", out_dir)
        one_line(result, EXIT_USAGE, "--out-dir", needle)
    assert table.read_bytes() == run_file.read_bytes() == blocker.read_bytes() == USER_BYTES
    assert os.listdir(table.parent) == ["opt_level_sweep.csv"] and not os.listdir(locked)


def test_fake_imagenet_checks_its_folder_first_and_a_full_disk_is_exit_4(tmp_path, locked):
    tool = "tools/make_fake_imagenet.py"
    small = ["--classes", "2", "--train-per-class", "2", "--val-per-class", "1", "--jobs", "1"]
    blocker = user_file(tmp_path / "a_file")
    one_line(run(tool, blocker / "fake", *small), EXIT_USAGE, "OUT", "cannot create it")
    one_line(run(tool, locked / "fake", *small), EXIT_USAGE, "OUT", "cannot create it")
    result = run(tool, tmp_path / "fake", *small, file_limit=20_000)  # its ~110 KB images do not fit
    one_line(result, EXIT_WRITE_FAILED, "File too large (EFBIG)", f"{tmp_path / 'fake'} holds part of the images")
    assert not [name for _, _, files in os.walk(tmp_path / "fake") for name in files]  # no half image


# --- bench/ --------------------------------------------------------------------------------------

def test_bench_out_files_are_never_replaced_unasked_and_must_be_writable(tmp_path, locked):
    out = user_file(tmp_path / "bench.csv")
    data = make_image_folder(tmp_path / "data", classes=2, per_class=2, splits=("train",))
    for script, argv, needle in (
            ("bench/benchmark_input.py", [data, "--out", out], "--overwrite"),
            ("bench/benchmark_input.py", [data, "--out", locked / "b.csv"], "cannot create a file in"),
            ("bench/benchmark_input.py", [data, "--out", tmp_path / "b.csv", "--runs-dir", locked], "--runs-dir"),
            ("bench/benchmark_loader.py", [data, "--out", out], "--overwrite"),
            ("bench/benchmark_loader.py", [data, "--out", locked / "b.csv"], "cannot create a file in")):
        one_line(run(script, *argv), EXIT_USAGE, "--out" if needle != "--runs-dir" else needle, needle)
    assert out.read_bytes() == USER_BYTES and not os.listdir(locked)


# --- 5. environment paths ------------------------------------------------------------------------

def test_a_cache_variable_naming_a_file_or_a_locked_folder_is_one_line_naming_it(tmp_path, locked):
    blocker = user_file(tmp_path / "a_file")
    for env, needles in (({"IMAGENET_AMP_CACHE": blocker}, ["IMAGENET_AMP_CACHE=", "is a file, not a directory"]),
                         ({"IMAGENET_AMP_CACHE": blocker / "sub"}, ["IMAGENET_AMP_CACHE=", repr(str(blocker))]),
                         ({"IMAGENET_AMP_CACHE": locked}, ["IMAGENET_AMP_CACHE=", "is not writable"]),
                         ({"IMAGENET_AMP_CACHE": "", "XDG_CACHE_HOME": blocker},
                          ["XDG_CACHE_HOME=", "set IMAGENET_AMP_CACHE (or fix XDG_CACHE_HOME)"])):
        result = run("train.py", "--output-dir", tmp_path / "run", *QUICK, env={k: str(v) for k, v in env.items()})
        one_line(result, EXIT_USAGE, *needles, "to a directory you can write to")
    assert blocker.read_bytes() == USER_BYTES and not os.listdir(locked)


def test_a_full_disk_under_the_cache_is_exit_4_naming_the_variable(checkpoint, tmp_path):
    """The digits' JPEGs (0.8-1.2 KB each) cannot be written under a 500-byte file limit: one line,
    exit 4, naming IMAGENET_AMP_CACHE, and no half-built digits folder is left to be taken as whole.
    eval.py, which writes nothing before its data (train.py's lock file may not fit the limit)."""
    cache = tmp_path / "cache"
    result = run("eval.py", "--resume", checkpoint, "-j", "0", env={"IMAGENET_AMP_CACHE": str(cache)},
                 file_limit=500)
    one_line(result, EXIT_WRITE_FAILED, f"could not write {cache / 'digits-v1'}", "File too large (EFBIG)",
             "set IMAGENET_AMP_CACHE to a directory on a disk with room")
    assert os.listdir(cache) == []


def test_a_torch_home_naming_a_file_is_the_missing_weights_line(tmp_path):
    """TORCH_HOME is only read (--pretrained's local weights, never downloaded): naming a file, the
    weights are not found under it, and the one line says so and names TORCH_HOME."""
    blocker = user_file(tmp_path / "a_file")
    result = run("eval.py", "--pretrained", "-a", "resnet18", env={"TORCH_HOME": str(blocker)})
    one_line(result, EXIT_USAGE, f"no local weights for resnet18 at {blocker}", "TORCH_HOME")
    assert blocker.read_bytes() == USER_BYTES
