"""Signals the way schedulers send them (issue 40): to every process of the job, more than once.

Each run starts in a session of its own (start_new_session), so its process group holds the run,
its loader workers and, under torchrun, the agent and both ranks; os.killpg then reaches them all,
as Slurm's signal to a job step does. Signals go out once the run has printed a given step's log
line, never after a fixed sleep; the gaps between repeats (0.05-0.3 s) are what a launcher that
repeats itself looks like. After each run: exit 143 (130 for SIGINT), the one stop line, a
checkpoint that loads, no traceback, no process of the group left; some runs are resumed.
A worker killed for good (SIGKILL, as the out-of-memory killer does) still leaves the main
process's checkpoint. The gpu backend's worker side and decode threads run here on the CPU
(its nvJPEG decode needs CUDA: tests/test_gpu_batches.py's gpu tests).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TIMEOUT, TINY, run_command, subprocess_env
from test_preemption import CPU, STOPPED, no_traceback, torchrun_command
from test_preemption_workers import group_gone

# digits, 8 a batch, 6 steps an epoch, a log line every step
DIGITS_RUN = [*TINY[:4], "-p", "1", "-b", "8", "--steps-per-epoch", "6", "--epochs", "2"]
REPEATS = (0.05, 0.3, 0.1)  # three SIGTERMs: 0.05 s apart, then 0.3 s
WORKER_TROUBLE = ("exited unexpectedly", "killed by signal", "Traceback")


def children(pid):
    """The pids of pid's child processes (every thread's), from /proc."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found += [int(child) for child in listing.read().split()]
        except FileNotFoundError:
            pass
    return found


def loader_workers(pid):
    """pid's DataLoader workers: its children running its own command line (forked), not a
    helper such as multiprocessing's resource tracker."""
    def cmdline(process):
        try:
            with open(f"/proc/{process}/cmdline", "rb") as text:
                return text.read()
        except FileNotFoundError:
            return None
    own = cmdline(pid)
    return [child for child in children(pid) if cmdline(child) == own]


def signal_after_line(command, line_pattern, send, env=None):
    """Start command in a session of its own; once a stdout line matches line_pattern, call
    send(pid). Returns (rc, stdout, stderr, pid); waits until every process of the group is gone
    (SIGKILLs stragglers, and fails, if some outlive it)."""
    process = subprocess.Popen([*map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env(env), cwd=ROOT, start_new_session=True)
    seen = []
    try:
        for line in process.stdout:
            seen.append(line)
            if re.search(line_pattern, line):
                send(process.pid)
                break
        rest, err = process.communicate(timeout=TIMEOUT)
    finally:
        gone = group_gone(process.pid)
        if not gone:
            os.killpg(process.pid, signal.SIGKILL)
    assert gone, "a process of the run outlived it"
    return process.returncode, "".join(seen) + rest, err, process.pid


def repeatedly(signum, gaps=REPEATS):
    """send() for signal_after_line: signum to the whole group, len(gaps) times, gaps apart."""
    def send(pid):
        for gap in gaps:
            os.killpg(pid, signum)
            time.sleep(gap)
    return send


def train(*flags):
    return [sys.executable, os.path.join(ROOT, "train.py"), *flags]


def assert_stopped(rc, out, err, code, name, path):
    """Exit code, one stop line naming the signal, no traceback or worker trouble, a checkpoint
    there that loads and sits where the line says. Returns the checkpoint."""
    assert rc == code, err[-3000:]
    no_traceback(err)
    assert not any(word in err for word in WORKER_TROUBLE), err[-3000:]
    lines = STOPPED.findall(out)
    assert len(lines) == 1 and lines[0][0] == name, out[-3000:]
    state = torch.load(path, weights_only=True)
    assert state["mid_epoch"] and (state["epoch"], state["step"]) == (int(lines[0][2]), int(lines[0][3]))
    return state


def resume_finishes(command, out, epochs=2, env=None):
    resumed = run_command([*command, "--output-dir", out, "--resume", out / "checkpoint.pth.tar"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["epoch"] == epochs


@pytest.mark.parametrize("workers", ["0", "2"])
def test_repeated_sigterm_to_the_group_saves_once_and_exits_143(cache_dir, tmp_path, workers):
    """The issue's case: with workers, the second SIGTERM killed a worker and then the save."""
    command = train(*DIGITS_RUN, "-j", workers, "--data-backend", "cpu")
    rc, out, err, _ = signal_after_line([*command, "--output-dir", tmp_path], r"Epoch: \[0\]\[2/6\]",
                                        repeatedly(signal.SIGTERM))
    assert_stopped(rc, out, err, 143, "SIGTERM", tmp_path / "checkpoint.pth.tar")
    assert err.count("received SIGTERM") == 1, err[-3000:]  # repeats this close are the same request
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pth.tar"]  # no temp file left
    if workers != "0":
        resume_finishes(command, tmp_path)


def test_repeated_sigint_to_the_group_saves_and_exits_130(cache_dir, tmp_path):
    """Ctrl-C pressed twice in quick succession (or by terminal and launcher both)."""
    command = train(*DIGITS_RUN, "-j", "2")
    rc, out, err, _ = signal_after_line([*command, "--output-dir", tmp_path], r"Epoch: \[0\]\[2/6\]",
                                        repeatedly(signal.SIGINT, (0.05, 0.1)))
    assert_stopped(rc, out, err, 130, "SIGINT", tmp_path / "checkpoint.pth.tar")


# train.py with the gpu backend's batches on the CPU: --data-backend gpu needs CUDA, so this sets
# the backend in the data spec after the flags were settled, and gives GpuBatches its CUDA
# default of two decode threads; it says what the run's train batches are.
GPU_BACKEND_ON_CPU = """
import sys
import train
from utils.data.gpu import pipeline
from utils.run.errors import exit_on_usage_error
plain_spec, plain_build, plain_init = train.data_spec, train.build_data, pipeline.GpuBatches.__init__
train.data_spec = lambda args, **settled: plain_spec(args, **{**settled, "backend": "gpu"})
pipeline.GpuBatches.__init__ = lambda self, loader, decoder, threads=None: plain_init(self, loader, decoder, 2)
def build_data(*args, **kwargs):
    data = plain_build(*args, **kwargs)
    print(f"train batches: {type(data.train).__name__}, {data.train.threads} decode threads, "
          f"{data.train.loader.num_workers} workers", flush=True)
    return data
train.build_data = build_data
sys.argv[0] = "train.py"
sys.exit(exit_on_usage_error(train.main))
"""


def test_repeated_sigterm_on_the_gpu_backends_cpu_path(cache_dir, tiny_folder, tmp_path):
    """Loader workers that pack bytes and two decode threads beside the training loop."""
    command = [sys.executable, "-c", GPU_BACKEND_ON_CPU, tiny_folder, "-a", "resnet18", "--image-size", "32", "-p",
               "1", "-b", "2", "-j", "2", "--epochs", "2", "--steps-per-epoch", "6"]
    rc, out, err, _ = signal_after_line([*command, "--output-dir", tmp_path], r"Epoch: \[0\]\[2/6\]",
                                        repeatedly(signal.SIGTERM))
    assert "train batches: GpuBatches, 2 decode threads, 2 workers" in out, out[-3000:]
    assert_stopped(rc, out, err, 143, "SIGTERM", tmp_path / "checkpoint.pth.tar")
    resume_finishes(command, tmp_path)


KILLED_WORKER_RUN = [*TINY[:4], "-p", "1", "-b", "4", "--steps-per-epoch", "40", "--epochs", "1", "-j", "2"]


def kill_workers_then(signum):
    """send(): SIGKILL every loader worker of the run (the out-of-memory killer's way), then
    signum (if any) to the main process alone."""
    def send(pid):
        workers = loader_workers(pid)
        assert len(workers) == 2, workers  # the train loader's (val's start with the next epoch)
        for worker in workers:
            os.kill(worker, signal.SIGKILL)
        if signum is not None:
            os.kill(pid, signum)
    return send


def test_a_killed_worker_then_sigterm_still_saves_from_the_main_process(cache_dir, tmp_path):
    command = train(*KILLED_WORKER_RUN)
    rc, out, err, _ = signal_after_line([*command, "--output-dir", tmp_path], r"Epoch: \[0\]\[2/40\]",
                                        kill_workers_then(signal.SIGTERM))
    assert rc == 143, err[-3000:]
    no_traceback(err)
    stopped = STOPPED.search(out)
    assert stopped and stopped.group(1) == "SIGTERM", out[-3000:]
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert state["mid_epoch"] and state["step"] == int(stopped.group(4))


def test_a_killed_worker_alone_stops_with_a_checkpoint_one_line_and_exit_1(cache_dir, tmp_path):
    """No signal at all: the loop meets the dead worker at the batch it waits for (torch's status
    check, not its SIGCHLD handler mid-step), saves the steps before and says why, then resumes."""
    command = train(*KILLED_WORKER_RUN)
    rc, out, err, _ = signal_after_line([*command, "--output-dir", tmp_path], r"Epoch: \[0\]\[2/40\]",
                                        kill_workers_then(None))
    assert rc == 1, err[-3000:]
    no_traceback(err)
    assert re.search(r"stopping: a data loader worker process died \(DataLoader worker \(pid\(s\) [\d, ]+\) "
                     r"exited unexpectedly\): killed from outside, or by the kernel's out-of-memory killer", err), err
    stopped = re.search(r"=> stopped because a data loader worker process died: saved (\S+) at epoch 0, step "
                        r"(\d+)/40; resume with: ", out)
    assert stopped, out[-3000:]
    state = torch.load(stopped.group(1), weights_only=True)
    assert state["mid_epoch"] and state["step"] == int(stopped.group(2)) >= 2
    resume_finishes(command, tmp_path, epochs=1)


# A reaper around torchrun: it adopts the ranks whatever becomes of torchrun (a child subreaper),
# ignores the group's SIGTERM itself, and writes every exit code it collected as one JSON line.
REAPER = """
import ctypes, json, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a handler, not SIG_IGN: torchrun inherits none
launcher = subprocess.Popen(sys.argv[1:])
codes = {}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    codes["torchrun" if pid == launcher.pid else str(pid)] = os.waitstatus_to_exitcode(status)
print("exit codes " + json.dumps(codes), file=sys.stderr, flush=True)
"""


def test_repeated_sigterm_to_a_torchrun_group_stops_both_ranks_with_one_checkpoint(cache_dir, tmp_path):
    """torchrun forwards the first SIGTERM to the ranks and waits for them; the second makes it
    leave at once with its own SignalException trace (torch's agent) and exit 1. The ranks,
    adopted by the reaper, still stop at one step, write one checkpoint and exit 143 each."""
    flags = [*TINY, "-p", "2", "-b", "8", "--steps-per-epoch", "8", "--epochs", "2", "-j", "1"]
    ranks = []

    def send(pid):
        launcher = children(pid)[0]
        ranks.extend(str(rank) for rank in children(launcher))
        repeatedly(signal.SIGTERM)(pid)

    rc, out, err, _ = signal_after_line([sys.executable, "-c", REAPER, *torchrun_command(*flags, "--output-dir",
                                                                                         tmp_path)],
                                        r"Epoch: \[0\]\[2/8\]", send, env=CPU)
    assert rc == 0, err[-3000:]
    codes = json.loads(re.search(r"exit codes (.+)", err).group(1))
    assert len(ranks) == 2 and [codes[rank] for rank in ranks] == [143, 143], (ranks, codes, err[-3000:])
    assert codes["torchrun"] == 1, codes  # torch's elastic agent: exit 1 after any SIGTERM
    assert "train.py\", line" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert not any(word in err for word in WORKER_TROUBLE[:2]), err[-3000:]
    lines = STOPPED.findall(out)
    assert len(lines) == 1 and lines[0][0] == "SIGTERM", out[-3000:]
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert (state["epoch"], state["step"]) == (0, int(lines[0][3])) and state["step"] % 2 == 0
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pth.tar"]  # one writer, no temp file
    resume_finishes(torchrun_command(*flags), tmp_path, env=CPU)


# ---------------------------------------------------------------------------------------------
# The pieces, with real signals where there is one to send

def test_a_repeated_sigterm_is_counted_never_fatal_and_a_person_still_can_insist(monkeypatch):
    from utils.run import preemption

    stop = preemption.StopOnSignal(announce=False)
    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    stop._handle(signal.SIGTERM, None)
    for later in (0.1, 5, 60, 600):  # a scheduler's warning, its time limit, a launcher's repeats
        clock[0] += later
        stop._handle(signal.SIGTERM, None)
    assert stop.repeats == 4 and stop.requested and stop.exit_code == 143
    clock[0] += preemption.DUPLICATE_SECONDS + 1
    with pytest.raises(SystemExit) as insisted:  # Ctrl-C after a scheduler's SIGTERM: a person
        stop._handle(signal.SIGINT, None)
    assert insisted.value.code == 130


def test_after_a_stop_later_signals_are_ignored_while_the_run_exits():
    """Real signals to this process: the handler takes the first, and once restored after the
    stop, a late SIGTERM neither stops the exit nor kills the process (SIG_IGN, not SIG_DFL)."""
    from utils.run.preemption import StopOnSignal

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopOnSignal(announce=False)
    try:
        with stop.installed():
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 60
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(0.01)
        assert stop.name == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN == signal.getsignal(signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # would end this test process under SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    unstopped = StopOnSignal(announce=False)
    with unstopped.installed():
        pass
    assert signal.getsignal(signal.SIGTERM) == before[0]  # no stop: the handlers as they were


# A loader as batch_loader makes it, in a process of its own: it reports torch's SIGCHLD handler
# (which must stay out) and then draws batches until told to stop on stdin, the workers having
# taken whatever signals the test sent the group meanwhile.
LOADER = """
import signal, sys, torch
from utils.data.batches import batch_loader
for signum in (signal.SIGTERM, signal.SIGINT):  # the main process lives on, as train.py's does
    signal.signal(signum, lambda signum, frame: None)
loader = batch_loader(torch.arange(10 ** 6), None, 4, 2, torch.device("cpu"), collate_fn=None)
batches = iter(loader)
next(batches), next(batches)  # one batch from each worker: both have run their worker_init_fn
print("sigchld", signal.getsignal(signal.SIGCHLD), flush=True)
for line in sys.stdin:
    next(batches)
    print("batch", flush=True)
"""


def test_workers_outlive_any_number_of_group_sigterms_and_sigints_and_end_with_their_loader():
    process = subprocess.Popen([sys.executable, "-c", LOADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == f"sigchld {signal.SIG_DFL}"  # torch's handler stayed out
        workers = loader_workers(process.pid)
        assert len(workers) == 2
        for signum in [signal.SIGTERM] * 5 + [signal.SIGINT] * 3:
            os.killpg(process.pid, signum)
            time.sleep(0.05)
        for _ in range(64):  # more batches than the workers had made ahead: they are still serving
            process.stdin.write("next\n")
            process.stdin.flush()
            assert process.stdout.readline() == "batch\n", process.stderr.read()[-3000:]
        assert sorted(loader_workers(process.pid)) == sorted(workers)
        _, err = process.communicate(timeout=TIMEOUT)  # stdin closed: the loader shuts its workers down
    finally:
        gone = group_gone(process.pid)
        if not gone:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err[-3000:]
    assert gone, "a worker outlived its loader"
    assert not any(word in err for word in WORKER_TROUBLE), err[-3000:]


def test_a_dead_worker_is_named_when_the_loader_starts_or_at_a_batch_and_other_errors_pass():
    from utils.run.errors import WorkerLost
    from utils.run.preemption import lost_workers_named

    dead = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")

    class Loader:
        def __init__(self, fail_at_start, error):
            self.fail_at_start, self.error = fail_at_start, error

        def __iter__(self):
            if self.fail_at_start:  # a persistent loader resuming its workers for the next epoch
                raise self.error
            yield 1
            raise self.error

    for at_start in (True, False):
        with pytest.raises(WorkerLost, match=r"worker process died \(DataLoader worker \(pid\(s\) 4242\) exited "
                                             r"unexpectedly\): killed from outside"):
            list(lost_workers_named(Loader(at_start, dead)))
        other = RuntimeError("CUDA error: out of memory")
        with pytest.raises(RuntimeError) as raised:
            list(lost_workers_named(Loader(at_start, other)))
        assert raised.value is other


def test_killed_workers_of_the_gpu_backends_cpu_path_end_in_one_line(cache_dir, tiny_folder, tmp_path):
    """The decode threads meet the dead worker and hand it to the loop: mid-epoch, the checkpoint
    and the stop line (exit 1); or, where the workers had already made the epoch's batches (9
    steps, 4 batches ahead a worker), the next epoch's start, after the epoch's checkpoint."""
    command = [sys.executable, "-c", GPU_BACKEND_ON_CPU, tiny_folder, "-a", "resnet18", "--image-size", "32", "-p",
               "1", "-b", "2", "-j", "2", "--epochs", "2"]
    rc, out, err, _ = signal_after_line([*command, "--output-dir", tmp_path], r"Epoch: \[0\]\[2/9\]",
                                        kill_workers_then(None))
    assert rc == 1, err[-3000:]
    no_traceback(err)
    # torch names the dead worker, or (when the kill lands while a batch is in transit) the
    # thread meets the broken connection (reset, or closed: EOFError) first: either way one line says which
    assert re.search(r"stopping: a data loader worker process died \((DataLoader worker \(pid\(s\)|its batch could "
                     r"not be handed over: (ConnectionResetError|EOFError))", err), err[-3000:]
    stopped = re.search(r"=> stopped because a data loader worker process died: saved \S+ at (epoch 0, step "
                        r"(\d)/9|the start of epoch 1);", out)
    assert stopped, out[-3000:]
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert (state["epoch"], state["step"]) == ((0, int(stopped.group(2))) if stopped.group(2) else (1, 0))
    resume_finishes(command, tmp_path)


def test_a_batch_whose_worker_died_before_handing_it_over_is_a_lost_worker_too():
    from utils.run.errors import WorkerLost
    from utils.run.preemption import lost_workers_named

    def batches(error):
        yield 1
        raise error

    with pytest.raises(WorkerLost, match=r"its batch could not be handed over: ConnectionResetError: "):
        list(lost_workers_named(batches(ConnectionResetError(104, "Connection reset by peer"))))
    own = ConnectionError("Caught ConnectionError in DataLoader worker process 0.")  # the dataset's own
    with pytest.raises(ConnectionError) as raised:
        list(lost_workers_named(batches(own)))
    assert raised.value is own
