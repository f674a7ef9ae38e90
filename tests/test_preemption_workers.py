"""SIGTERM to every process of a run, loader workers included, as Slurm sends it at a time limit,
on preemption or scancel: the run still writes its mid-epoch checkpoint and exits 143 (a worker
that died first would end it with "DataLoader worker exited unexpectedly" and no checkpoint),
leaves no worker behind, and resumes from that checkpoint. Real processes and real signals; the
signal goes out once the run has printed a given step's log line (no timing assumptions).
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TIMEOUT, run_script, subprocess_env
from test_preemption import STOPPED, no_traceback

# 18 train images, 2 a batch: 9 steps an epoch, every one logged; two loader workers.
WORKER_RUN = ["-a", "resnet18", "--image-size", "32", "-p", "1", "-b", "2", "-j", "2",
              "--data-backend", "cpu", "--epochs", "1"]


def train_then_signal_group(out, line_pattern, signum, *flags):
    """train.py in a session of its own; once a stdout line matches line_pattern, signum goes to
    every process of the session, as Slurm sends it. Returns (rc, stdout, stderr, process group).
    (test_preemption.run_until does the same but does not hand back the group to check.)"""
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *map(str, flags),
                                "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env(), cwd=ROOT, start_new_session=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if re.search(line_pattern, line):
            os.killpg(process.pid, signum)
            break
    try:
        rest, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, "".join(seen) + rest, err, process.pid


def group_gone(pgid, grace=60.0):
    """Whether every process of the group has exited, waiting up to grace seconds for stragglers
    (a worker notices its parent's exit within torch's 5 s status-check interval)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def test_sigterm_to_the_whole_group_saves_exits_143_and_resumes(cache_dir, tiny_folder, tmp_path):
    rc, out, err, pgid = train_then_signal_group(tmp_path, r"Epoch: \[0\]\[2/9\]", signal.SIGTERM,
                                                 tiny_folder, *WORKER_RUN)
    try:
        assert rc == 143, err[-3000:]
        no_traceback(err)
        assert "exited unexpectedly" not in err and "killed by signal" not in err, err[-3000:]
        stopped = STOPPED.search(out)
        assert stopped and stopped.group(1) == "SIGTERM", out[-3000:]
        state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
        assert state["mid_epoch"] and (state["epoch"], state["step"]) == (0, int(stopped.group(4)))
    finally:
        gone = group_gone(pgid)
        if not gone:
            os.killpg(pgid, signal.SIGKILL)  # no stray workers outlive the test
    assert gone, "a loader worker outlived the stopped run"

    resumed = run_script("train.py", tiny_folder, *WORKER_RUN, "--output-dir", tmp_path,
                         "--resume", tmp_path / "checkpoint.pth.tar")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1


# A main process with two loader workers set up as train.py sets them up. It takes SIGTERM as
# train.py does (a flag) and, when argv[2] is "1", waits for one; then it draws 3 more batches
# (the workers outlived the signal) and leaves the way argv[1] says, without shutting the loader
# down: "crash" raises, so the loader is still alive in the traceback at exit and
# multiprocessing's exit hook ends the workers with SIGTERM, then waits for them with no time
# limit; "sigkill" dies at once and leaves them orphans.
LOADER_SCRIPT = """
import os, signal, sys, torch
from utils.run.preemption import ignore_stop_signals_in_worker
loader = torch.utils.data.DataLoader(torch.arange(10 ** 6), batch_size=4, num_workers=2,
                                     persistent_workers=True, worker_init_fn=ignore_stop_signals_in_worker)
asked = []
signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
after = 0
for step, batch in enumerate(loader):
    if step == 2:
        print("ready", flush=True)
    after += bool(asked) or sys.argv[2] == "0"
    if after == 3 and sys.argv[1] == "crash":
        raise RuntimeError("the main process failed")
    if after == 3:
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("leave, code, group_sigterm", [("crash", 1, False), ("crash", 1, True),
                                                      ("sigkill", -signal.SIGKILL, True)])
def test_workers_end_with_a_main_process_that_fails(leave, code, group_sigterm):
    """Crash: with no signal before (where workers that swallowed any first SIGTERM hung the
    exit) and after a swallowed one. SIGKILL: the workers see their parent gone and exit."""
    process = subprocess.Popen([sys.executable, "-c", LOADER_SCRIPT, leave, str(int(group_sigterm))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env(), cwd=ROOT, start_new_session=True)
    try:
        assert process.stdout.readline() == "ready\n"
        if group_sigterm:
            os.killpg(process.pid, signal.SIGTERM)  # the workers swallow this one
        # A worker that swallowed the exit hook's SIGTERM too would hang this.
        _, err = process.communicate(timeout=TIMEOUT)
    finally:
        gone = group_gone(process.pid)
        if not gone:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == code, err[-3000:]
    assert "killed by signal" not in err and "exited unexpectedly" not in err, err[-3000:]
    assert leave != "crash" or "the main process failed" in err
    assert gone, "a loader worker outlived its main process"


def test_sigterm_while_validating_with_the_next_epoch_started_resumes_as_uninterrupted(cache_dir, tiny_folder,
                                                                                         tmp_path):
    """train.py starts epoch 1's loading before epoch 0 validates. A SIGTERM to every process
    then still saves the epoch's checkpoint, exits 143 and leaves no worker; resuming (epoch 1
    loaded the ordinary way) ends with the weights of a run that was never stopped (whose epoch 1
    was loaded early)."""
    run = [*WORKER_RUN[:-1], "2", "--deterministic"]  # --epochs 2
    straight = run_script("train.py", tiny_folder, *run, "--output-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    rc, out, err, pgid = train_then_signal_group(tmp_path / "split", r"Test: \[1/", signal.SIGTERM,
                                                 tiny_folder, *run)
    try:
        assert rc == 143, err[-3000:]
        no_traceback(err)
        assert "=> stopped by SIGTERM: saved" in out and "at the start of epoch 1;" in out, out[-3000:]
    finally:
        gone = group_gone(pgid)
        if not gone:
            os.killpg(pgid, signal.SIGKILL)
    assert gone, "a loader worker outlived the stopped run"
    resumed = run_script("train.py", tiny_folder, *run, "--output-dir", tmp_path / "split",
                         "--resume", tmp_path / "split" / "checkpoint.pth.tar")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "straight" / "checkpoint.pth.tar", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoint.pth.tar", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    assert all(torch.equal(a["state_dict"][key], value) for key, value in b["state_dict"].items())
