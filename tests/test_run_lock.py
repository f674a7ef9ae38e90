"""One run owns its --output-dir while it runs (issue 40, item 1): the lock in utils/run/lock.py.

Real processes throughout: runs started at the same moment into one fresh directory (one trains,
the other is refused naming it), a live holder refusing --resume auto and --overwrite, kill -9
mid-epoch and the requeue that takes the dead run's lock over, locks of another host (stale and
fresh), the lock gone after every way a run ends, and a 2-process gloo run whose main process
holds it. Waits are on events (a log line, a file), never on a machine's speed.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import QUICK, ROOT, TIMEOUT, TINY, run_script, subprocess_env
from test_train import one_error_line

from utils.run import lock as run_lock
from utils.run.errors import (
    EXIT_DIVERGED,
    EXIT_USAGE,
    EXIT_WRITE_FAILED,
    Diverged,
    UsageError,
    WriteError,
    exit_on_usage_error,
)
from utils.run.lock import LOCK_NAME, STALE_SECONDS, take_lock, this_machine

RUN_FILES = ("checkpoint.pth.tar", "model_best.pth.tar", "summary.csv", "args.yaml", "curves.png")
IN_USE = "is in use by another run"
TWO_STEPS = ["--epochs", "1", *QUICK, "--steps-per-epoch", "2"]
LONG = [*TINY, "-b", "16", "--epochs", "1", "--steps-per-epoch", "12"]  # stopped by the test before its end


def lock_of(out):
    """The record in out's lock, or None without one."""
    path = os.path.join(out, LOCK_NAME)
    return json.load(open(path)) if os.path.exists(path) else None


def wait_until(condition, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Watched:
    """A process whose stdout a thread collects, so a test can wait for a line without a pipe filling up."""

    def __init__(self, command, env=None, **popen):
        self.process = subprocess.Popen([*map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, cwd=ROOT, env=subprocess_env(env), **popen)
        self.lines, self.err = [], []
        self._threads = [threading.Thread(target=self._read, args=(self.process.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.process.stderr, self.err), daemon=True)]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(stream, into):
        for line in stream:
            into.append(line)

    @property
    def pid(self):
        return self.process.pid

    def wait_for(self, pattern):
        wait_until(lambda: any(re.search(pattern, line) for line in self.lines) or self.process.poll() is not None,
                   pattern)
        assert any(re.search(pattern, line) for line in self.lines), self.output()

    def finish(self):
        """(exit code, stdout, stderr) once it ends."""
        try:
            self.process.wait(timeout=TIMEOUT)
        finally:
            self.process.kill()
        for thread in self._threads:
            thread.join(timeout=60)
        return self.process.returncode, "".join(self.lines), "".join(self.err)

    def output(self):
        return "".join(self.lines)[-3000:] + "".join(self.err)[-3000:]


# A process that holds a lock through the module until its stdin closes.
HOLDER = f"""
import sys
sys.path.insert(0, {ROOT!r})
from utils.run.lock import take_lock
lock, lines = take_lock(sys.argv[1], command="the holder")
print("held", *lines, flush=True)
sys.stdin.read()
lock.release()
"""


class Holder:
    def __init__(self, out):
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=subprocess_env())
        assert self.process.stdout.readline().startswith("held")
        self.pid = self.process.pid

    def release(self):
        self.process.stdin.close()
        assert self.process.wait(timeout=TIMEOUT) == 0


@pytest.fixture
def train_main(capsys, cache_dir):
    """train.main(argv) in this process through the scripts' exit path: (exit code, stdout, stderr).
    In-process: no atexit runs after it, so a lock gone afterwards went in train.main's finally."""
    import train

    def call(argv):
        capsys.readouterr()
        try:
            code = exit_on_usage_error(lambda: train.main([*map(str, argv)])) or 0
        except SystemExit as exited:
            code = exited.code
        seen = capsys.readouterr()
        return code, seen.out, seen.err
    return call


@pytest.fixture(scope="module")
def finished_run(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    result = run_script("train.py", *TWO_STEPS, "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(RUN_FILES)  # the lock went with the run
    return out


def snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if (folder / name).is_file()}


# --- two runs at once ----------------------------------------------------------------------------

# train.py with its imports done, waiting for the file `go`: two of these start the run together.
RACER = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
ready, go = sys.argv[1], sys.argv[2]
sys.argv = ["train.py", *sys.argv[3:]]
import train
from utils.run.errors import exit_on_usage_error
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.002)
sys.exit(exit_on_usage_error(train.main))
"""


def test_two_runs_started_at_once_into_one_fresh_directory(cache_dir, tmp_path):
    """A job submitted twice: both start together (their imports done, then one signal to go), so
    both reach the check at the same moment. One trains; the other exits 2 naming it and writes
    nothing; the directory holds the winner's run alone."""
    out, go = tmp_path / "run", tmp_path / "go"
    racers = [Watched([sys.executable, "-c", RACER, tmp_path / f"ready{seed}", go, *TWO_STEPS, "--seed", seed,
                       "--output-dir", out]) for seed in (1, 2)]
    wait_until(lambda: all((tmp_path / f"ready{seed}").exists() for seed in (1, 2)), "both racers ready")
    go.touch()
    results = [racer.finish() for racer in racers]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, EXIT_USAGE], [racer.output() for racer in racers]
    winner = next(index for index, (code, _, _) in enumerate(results) if code == 0)
    loser = results[1 - winner]
    one_error_line(loser[0], loser[2], IN_USE, f"pid {racers[winner].pid} on {socket.gethostname()}", "since")
    assert "Epoch: [" not in loser[1] and "Epoch: [0][2/2]" in results[winner][1]
    assert sorted(os.listdir(out)) == sorted(RUN_FILES)  # no lock left, no trace of the loser
    import torch
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["args"]["seed"] == winner + 1


# The lock module alone, in many processes at once: exactly one gets it (fresh, or a stale one's).
TAKER = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
from utils.run.errors import UsageError
from utils.run.lock import take_lock
out, go = sys.argv[1], sys.argv[2]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
try:
    lock, lines = take_lock(out, command="a taker")
except UsageError as err:
    print("refused", err, flush=True)
    sys.exit(2)
print("won", *lines, flush=True)
sys.stdin.read()
lock.release()
"""


@pytest.mark.parametrize("left", ["nothing", "a dead run's lock"])
def test_of_many_processes_taking_the_lock_at_once_exactly_one_gets_it(tmp_path, left):
    out, go = tmp_path / "run", tmp_path / "go"
    out.mkdir()
    if left != "nothing":
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (out / LOCK_NAME).write_text(json.dumps({**this_machine(), "pid": dead.pid, "since": time.time(),
                                                 "token": "x"}))
    takers = [subprocess.Popen([sys.executable, "-c", TAKER, out, go], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=subprocess_env()) for _ in range(6)]
    try:
        assert all(taker.stdout.readline() == "ready\n" for taker in takers)
        go.touch()
        said = {taker.pid: taker.stdout.readline() for taker in takers}
        winners = [pid for pid, line in said.items() if line.startswith("won")]
        assert len(winners) == 1, said
        assert lock_of(out)["pid"] == winners[0]
        for pid, line in said.items():
            assert pid in winners or (line.startswith("refused") and f"pid {winners[0]} " in line), line
        if left != "nothing":
            assert f"took over the lock of pid {dead.pid} on {socket.gethostname()}" in said[winners[0]]
            assert "(that process is gone)" in said[winners[0]]
    finally:
        for taker in takers:
            taker.stdin.close()
            taker.wait(timeout=TIMEOUT)
    assert os.listdir(out) == []  # the winner released it; no take-over directory left behind


# --- a live run's directory: every kind of start is refused, -e is not ----------------------------

def test_a_live_holder_refuses_resume_auto_and_overwrite_and_a_fresh_start(train_main, finished_run, tmp_path):
    before = snapshot(finished_run)
    holder = Holder(finished_run)
    try:
        for flags in (["--resume", "auto"], ["--overwrite"], [], ["--resume", finished_run / "checkpoint.pth.tar"]):
            code, out, err = train_main([*TWO_STEPS, "--epochs", "2", "--output-dir", finished_run, *flags])
            one_error_line(code, err, IN_USE, f"pid {holder.pid} on {socket.gethostname()}", "the holder",
                           "choose another --output-dir")
            assert "Epoch: [" not in out
        assert lock_of(finished_run)["pid"] == holder.pid  # a refused run leaves the holder's lock alone
        # -e writes nothing, so it takes no lock and may evaluate beside a live run
        code, out, err = train_main(["-e", "--resume", finished_run / "checkpoint.pth.tar", *QUICK,
                                     "--output-dir", finished_run])
        assert code == 0 and " * Prec@1 " in out, err
    finally:
        holder.release()
    after = snapshot(finished_run)
    assert after == before, sorted(after)  # the holder's release removed its lock; nothing else changed


# --- a run that died: its lock is taken over --------------------------------------------------------

def test_sigterm_releases_the_lock_and_kill_9_leaves_one_that_resume_auto_takes_over(cache_dir, tmp_path):
    out = tmp_path / "run"
    train = [sys.executable, os.path.join(ROOT, "train.py"), *LONG, "--output-dir", out]
    run = Watched(train)
    run.wait_for(r"Epoch: \[0\]\[1/12\]")
    held = lock_of(out)
    assert (held["pid"], held["host"]) == (run.pid, socket.gethostname())
    assert "train.py" in held["command"] and held["started"]
    run.process.send_signal(signal.SIGTERM)
    code, stdout, _ = run.finish()
    assert code == 143, run.output()
    assert "=> stopped by SIGTERM" in stdout and lock_of(out) is None

    requeued = Watched([*train, "--resume", "auto"])  # from the checkpoint SIGTERM saved
    requeued.wait_for(r"Epoch: \[0\]\[\d+/12\]")
    requeued.process.kill()  # kill -9: no finally, no atexit
    assert requeued.finish()[0] == -signal.SIGKILL
    assert lock_of(out)["pid"] == requeued.pid  # left behind

    last = run_script("train.py", *LONG, "--output-dir", out, "--resume", "auto")
    assert last.returncode == 0, last.stderr[-3000:]
    assert (f"=> took over the lock of pid {requeued.pid} on {socket.gethostname()} in {out} (that process is gone)"
            in last.stdout.splitlines())
    assert "=> resumed" in last.stdout and lock_of(out) is None


def record(host, **more):
    return {"host": host, "pid": 4242, "since": time.time(), "started": "2026-01-01 00:00:00+00:00",
            "command": "python train.py", "token": "t", **more}


@pytest.mark.parametrize("owner,stale_after,reason", [
    (record("node-elsewhere"), STALE_SECONDS, "not refreshed for 11 min"),
    # this hostname in another pid namespace (a container beside this one): pids say nothing there
    (record(socket.gethostname(), pidns="pid:[1]", boot=this_machine()["boot"]), STALE_SECONDS,
     "not refreshed for 11 min"),
    # this hostname before a reboot: whatever ran then is gone, however fresh the lock
    (record(socket.gethostname(), boot="an earlier boot"), None, "that host has restarted since"),
    (None, STALE_SECONDS, "it was unreadable"),
])
def test_a_lock_the_pid_check_cannot_see_is_taken_over_only_once_stale(train_main, tmp_path, owner, stale_after,
                                                                       reason):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(owner) if owner else "half a lock")
    if stale_after is not None:  # fresh: refused, naming its owner
        code, _, err = train_main([*TWO_STEPS, "--output-dir", tmp_path, "/no/such/data"])
        one_error_line(code, err, *([IN_USE, "pid 4242 on " + owner["host"]] if owner else ["names no owner"]))
        assert path.read_text() == (json.dumps(owner) if owner else "half a lock")
        old = time.time() - stale_after - 60
        os.utime(path, (old, old))
    lock, lines = take_lock(str(tmp_path))
    try:
        whose = f"pid 4242 on {owner['host']}" if owner else "a run this lock does not name"
        assert len(lines) == 1 and lines[0].startswith(f"=> took over the lock of {whose} in {tmp_path} ("), lines
        assert reason in lines[0], lines
        assert lock_of(tmp_path)["pid"] == os.getpid()
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def test_pids_of_this_machine_are_judged_by_what_runs_under_them_now(tmp_path):
    """A live pid holds its lock; a zombie, a pid reused by a process started after the lock (a
    requeued container's train.py often gets the same small pid), or this process's own pid in an
    earlier process's lock do not."""
    path = tmp_path / LOCK_NAME
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: run_lock._process(zombie.pid)[0] == "Z", "a zombie")  # ended, not reaped yet
        cases = [(sleeper.pid, time.time(), None), (zombie.pid, time.time(), "that process has ended"),
                 (sleeper.pid, time.time() - 3600, "its pid is another process's now"),
                 (os.getpid(), time.time(), "this one has its pid now")]
        for pid, since, reason in cases:
            path.write_text(json.dumps({**this_machine(), "pid": pid, "since": since, "token": "earlier"}))
            if reason is None:
                with pytest.raises(UsageError, match=f"{IN_USE}: pid {pid} on "):
                    take_lock(str(tmp_path))
                continue
            lock, lines = take_lock(str(tmp_path))
            lock.release()
            assert len(lines) == 1 and f"took over the lock of pid {pid} " in lines[0] and reason in lines[0], lines
    finally:
        sleeper.stdin.close()
        sleeper.wait(timeout=TIMEOUT)
        zombie.wait(timeout=TIMEOUT)
    assert os.listdir(tmp_path) == []  # each taker released its lock; no take-over directory left


def test_the_owner_refreshes_its_lock_and_never_removes_one_that_is_not_its_own(monkeypatch, capfd, tmp_path):
    monkeypatch.setattr(run_lock, "REFRESH_SECONDS", 0.05)
    lock, _ = take_lock(str(tmp_path))
    path = tmp_path / LOCK_NAME
    try:
        os.utime(path, (1, 1))
        wait_until(lambda: os.stat(path).st_mtime > 1, "a refresh")
        path.write_text(json.dumps(record("node-elsewhere")))  # taken over as stale by another host's run
        wait_until(lambda: "is no longer this run's lock" in capfd.readouterr().err, "the warning")
    finally:
        lock.release()
    assert json.loads(path.read_text())["host"] == "node-elsewhere"  # theirs: left in place


# --- every way out of a run releases it ------------------------------------------------------------

@pytest.mark.parametrize("raised,code", [
    (UsageError("a usage error found after the lock"), EXIT_USAGE),
    (Diverged("diverged at epoch 0"), EXIT_DIVERGED),
    (WriteError("x", OSError(28, "No space left on device")), EXIT_WRITE_FAILED),
    (RuntimeError("an unexpected error"), None),
], ids=["usage", "diverged", "write", "crash"])
def test_the_lock_goes_with_every_exit_of_the_main_process(train_main, monkeypatch, tmp_path, raised, code):
    import train
    held = []

    def fail(*args, **kwargs):
        held.append(lock_of(tmp_path))
        raise raised
    monkeypatch.setattr(train, "build_data", fail)  # the first thing after the output directory
    if code is None:
        with pytest.raises(RuntimeError, match="an unexpected error"):
            train_main([*TWO_STEPS, "--output-dir", tmp_path])
    else:
        assert train_main([*TWO_STEPS, "--output-dir", tmp_path])[0] == code
    assert held[0]["pid"] == os.getpid()  # it was held when the error came
    assert lock_of(tmp_path) is None


def test_a_refusal_after_the_lock_releases_it(train_main, finished_run):
    code, _, err = train_main([*TWO_STEPS, "--output-dir", finished_run])  # holds a run: refused after the lock
    one_error_line(code, err, "already holds a run")
    assert lock_of(finished_run) is None


# --- several processes: the main process holds it ---------------------------------------------------

def ranks(port, *flags):
    """train.py as the two ranks torchrun would start (by hand, so each rank's exit code is its own)."""
    return [Watched([sys.executable, os.path.join(ROOT, "train.py"), *flags],
                    env={"ACCELERATE_USE_CPU": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
            for rank in range(2)]


def test_under_two_processes_the_main_one_holds_it_and_a_second_run_is_refused_by_both(cache_dir, tmp_path):
    """The first run is paused (SIGSTOP) once it trains, so it holds the lock however long the
    second takes to start; then it goes on and is stopped by SIGTERM, as a scheduler would."""
    from test_distributed import free_port
    out = tmp_path / "run"
    first = ranks(free_port(), *TINY, "-b", "8", "--epochs", "1", "--output-dir", out)
    try:
        first[0].wait_for(r"Epoch: \[0\]\[1/")
        for rank in first:
            rank.process.send_signal(signal.SIGSTOP)
        assert lock_of(out)["pid"] == first[0].pid  # rank 0's, not rank 1's
        second = [rank.finish() for rank in ranks(free_port(), *TWO_STEPS, "--resume", "auto", "--output-dir", out)]
        one_error_line(second[0][0], second[0][2], IN_USE, f"pid {first[0].pid} on {socket.gethostname()}")
        assert second[1][0] == EXIT_USAGE and "error" not in second[1][2] and "Traceback" not in second[1][2]
        assert lock_of(out)["pid"] == first[0].pid
        for rank in first:
            rank.process.send_signal(signal.SIGCONT)
            rank.process.send_signal(signal.SIGTERM)
        ended = [rank.finish() for rank in first]
    finally:
        for rank in first:
            rank.process.kill()
    assert [code for code, _, _ in ended] == [143, 143], [rank.output() for rank in first]
    assert lock_of(out) is None and (out / "checkpoint.pth.tar").exists()
