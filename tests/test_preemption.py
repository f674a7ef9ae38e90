"""Preemption with real processes and real signals: SIGTERM/SIGINT mid-epoch write a resumable
checkpoint and exit 143/130 without a traceback; --resume continues at the next step and, under
--deterministic, ends with the same weights as a run that was never stopped; --save-every-steps
writes the same kind of checkpoint; a 2-process gloo run stopped by SIGTERM through torchrun
stops every rank at one step, and resumes on 2 processes to the uninterrupted run's weights.

The signal is sent once the run has printed a given step's log line (no timing assumptions): a
stop lands after the step in progress (one process) or at the next --print-freq boundary (several).
"""
import csv
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import QUICK, ROOT, TIMEOUT, TINY, run_command, run_script, subprocess_env

BIN = os.path.dirname(sys.executable)
# mobilenet_v3_small has dropout: the resumed run must draw the same dropout masks.
DROPOUT_RUN = ["-a", "mobilenet_v3_small", "--image-size", "32", "-j", "0", "-p", "1", "-b", "16",
               "--deterministic"]
STOPPED = re.compile(r"=> stopped by (SIG\w+): saved (\S+) at epoch (\d+), step (\d+)/(\d+); resume with: (.+)")


def run_until(command, line_pattern, signum, env=None, group=False):
    """Start command, send signum once a stdout line matches line_pattern; return (rc, stdout, stderr).
    group=True sends it to the whole process group, as Ctrl-C in a terminal does (loader workers too)."""
    process = subprocess.Popen([*map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env(env), cwd=ROOT, start_new_session=group)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if re.search(line_pattern, line):
            if group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)
            break
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, "".join(seen) + out, err


def train_until(out, line_pattern, signum, *flags, group=False):
    return run_until([sys.executable, os.path.join(ROOT, "train.py"), *flags, "--output-dir", out],
                     line_pattern, signum, group=group)


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a, b):
    a, b = weights(a), weights(b)
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def no_traceback(text):
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    result = run_script("train.py", *DROPOUT_RUN, "--steps-per-epoch", "6", "--epochs", "2", "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_sigterm_mid_epoch_then_resume_equals_uninterrupted(uninterrupted, tmp_path):
    rc, out, err = train_until(tmp_path, r"Epoch: \[0\]\[2/6\]", signal.SIGTERM, *DROPOUT_RUN,
                               "--steps-per-epoch", "6", "--epochs", "2")
    assert rc == 143, err[-3000:]
    no_traceback(err)
    stopped = STOPPED.search(out)
    assert stopped, out[-3000:]
    name, path, epoch, step, steps, command = stopped.groups()
    # The step in progress when the signal came (3, later on a busy machine) finished; nothing more.
    assert (name, epoch, steps) == ("SIGTERM", "0", "6") and 3 <= int(step) <= 6, stopped.group(0)
    assert path == str(tmp_path / "checkpoint.pth.tar") and not (tmp_path / "model_best.pth.tar").exists()
    assert "received SIGTERM" in err
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step"], state["mid_epoch"]) == (0, int(step), True)
    assert f"--resume {path}" in command and command.startswith("python ")

    resumed = run_script("train.py", *DROPOUT_RUN, "--steps-per-epoch", "6", "--epochs", "2",
                         "--output-dir", tmp_path, "--resume", path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at epoch 0, step {step}" in resumed.stdout
    first = re.search(r"Epoch: \[0\]\[(\d+)/6\]", resumed.stdout)
    if int(step) < 6:  # continues at the next step, not at the start of the epoch
        assert int(first.group(1)) == int(step) + 1, resumed.stdout[-3000:]
    else:  # stopped after the epoch's last step: validation and the epoch's checkpoint come first
        assert first is None
    assert_same_weights(tmp_path / "checkpoint.pth.tar", uninterrupted / "checkpoint.pth.tar")
    assert_same_rows(tmp_path, uninterrupted)


def test_sigint_exits_130_without_traceback_and_resumes(cache_dir, tmp_path):
    # With loader workers too: Ctrl-C reaches them as well, and they must leave stopping to the main process.
    flags = [*TINY, "-b", "16", "--steps-per-epoch", "8", "--epochs", "1", "-j", "2"]
    rc, out, err = train_until(tmp_path, r"Epoch: \[0\]\[2/8\]", signal.SIGINT, *flags, group=True)
    assert rc == 130, err[-3000:]
    no_traceback(err)
    assert "exited unexpectedly" not in err
    assert STOPPED.search(out).group(1) == "SIGINT"
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert state["mid_epoch"] and 2 < state["step"] <= 8
    resumed = run_script("train.py", *flags, "--output-dir", tmp_path, "--resume", tmp_path / "checkpoint.pth.tar")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert state["step"] == 8 or re.search(r"Epoch: \[0\]\[8/8\]", resumed.stdout)
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1


def test_sigint_around_the_start_of_training_exits_130_without_traceback(cache_dir, tmp_path):
    """Ctrl-C just as training starts: before the loop's handler is in place (a one-line message)
    or just after (a checkpoint); either way exit 130 and no traceback."""
    rc, out, err = train_until(tmp_path, r"^precision: ", signal.SIGINT, *QUICK, "--epochs", "1")
    assert rc == 130, err[-3000:]
    no_traceback(err)
    assert "interrupted (Ctrl-C) outside the training steps" in err or STOPPED.search(out), out + err


def test_save_every_steps_writes_mid_epoch_checkpoints_that_resume(uninterrupted, tmp_path):
    """--save-every-steps 4 over 2 epochs of 6: a checkpoint at step 4 of epoch 0. Copy it when
    the log shows step 5 (it was written before), stop the run, and resume the copy."""
    stopped_at = tmp_path / "run"
    rc, out, err = train_until(stopped_at, r"Epoch: \[0\]\[5/6\]", signal.SIGKILL, *DROPOUT_RUN,
                               "--steps-per-epoch", "6", "--epochs", "2", "--save-every-steps", "4")
    assert rc == -signal.SIGKILL  # killed hard: only what --save-every-steps wrote is there
    state = torch.load(stopped_at / "checkpoint.pth.tar", weights_only=True)
    assert (state["epoch"], state["step"], state["mid_epoch"]) == (0, 4, True)
    assert not (stopped_at / "model_best.pth.tar").exists()
    resumed = run_script("train.py", *DROPOUT_RUN, "--steps-per-epoch", "6", "--epochs", "2",
                         "--output-dir", stopped_at, "--resume", stopped_at / "checkpoint.pth.tar",
                         "--save-every-steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"Epoch: \[0\]\[5/6\]", resumed.stdout) and not re.search(r"Epoch: \[0\]\[4/6\]", resumed.stdout)
    assert_same_weights(stopped_at / "checkpoint.pth.tar", uninterrupted / "checkpoint.pth.tar")
    assert_same_rows(stopped_at, uninterrupted)


def assert_same_rows(resumed, straight):
    """summary.csv of a run resumed mid-epoch equals an uninterrupted run's: the resumed epoch's
    row covers the steps before the checkpoint too (it carried them)."""
    resumed_rows, straight_rows = (list(csv.DictReader(open(folder / "summary.csv"))) for folder in
                                   (resumed, straight))
    assert len(resumed_rows) == len(straight_rows) == 2
    for column in ("train_loss", "train_top1", "top1", "val_loss"):
        for got, want in zip(resumed_rows, straight_rows):
            assert float(got[column]) == pytest.approx(float(want[column]), rel=1e-9, abs=1e-9), column


def test_mid_epoch_resume_refuses_another_global_batch(cache_dir, tmp_path):
    rc, _, err = train_until(tmp_path, r"Epoch: \[0\]\[2/6\]", signal.SIGTERM, *TINY, "-b", "16",
                             "--steps-per-epoch", "6", "--epochs", "1")
    assert rc == 143, err[-3000:]
    result = run_script("train.py", *TINY, "-b", "8", "--epochs", "1", "--output-dir", tmp_path,
                        "--resume", tmp_path / "checkpoint.pth.tar")
    assert result.returncode == 2
    assert "global batch" in result.stderr and "resume with a global batch of 16" in result.stderr
    no_traceback(result.stderr)


# ---------------------------------------------------------------------------------------------
# 2 processes (gloo on the CPU), started by torchrun, which forwards SIGTERM to both ranks

TWO_PROC = [*TINY, "-p", "2", "-b", "8", "--steps-per-epoch", "8", "--epochs", "2", "--deterministic"]
CPU = {"ACCELERATE_USE_CPU": "1"}


def torchrun_command(*args):
    return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2",
            os.path.join(ROOT, "train.py"), *args]


@pytest.mark.first
def test_two_process_sigterm_stops_every_rank_at_one_step_and_resumes(cache_dir, tmp_path):
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    rc, out, err = run_until(torchrun_command(*TWO_PROC, "--output-dir", stopped), r"Epoch: \[0\]\[2/8\]",
                             signal.SIGTERM, env=CPU)
    assert rc != 0
    # torchrun prints its own SignalException trace; no frame of ours (no rank crashed, none hung).
    assert "train.py\", line" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = STOPPED.findall(out)
    assert len(lines) == 1, out[-3000:]  # one writer, one message
    _, path, epoch, step, steps, command = lines[0]
    assert (epoch, steps) == ("0", "8") and int(step) % 2 == 0  # on a --print-freq 2 boundary
    assert err.count("received SIGTERM") == 1  # the main process announces it; rank 1 stays quiet
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step"], state["global_batch"]) == (0, int(step), 16)
    assert sorted(os.listdir(stopped)) == ["checkpoint.pth.tar"]  # no temp file of a second writer

    resumed = run_command(torchrun_command(*TWO_PROC, "--output-dir", stopped, "--resume", path), env=CPU)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert int(step) == 8 or re.search(rf"Epoch: \[0\]\[{int(step) + 2}/8\]", resumed.stdout)
    whole = run_command(torchrun_command(*TWO_PROC, "--output-dir", straight), env=CPU)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_same_weights(stopped / "checkpoint.pth.tar", straight / "checkpoint.pth.tar")


def test_a_signal_to_one_rank_only_stops_every_rank_by_its_name(cache_dir, tmp_path):
    """SIGTERM to rank 1 alone (a node's share of a job, or a kill by hand): rank 0, which got no
    signal, still names it in the stop line and exits 143 like rank 1, at the same step. Ranks are
    started by hand with torchrun's environment, so each one's exit code is its own."""
    from test_distributed import free_port
    port, ranks = free_port(), []
    for rank in range(2):
        env = subprocess_env({**CPU, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                              "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
        ranks.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *TWO_PROC,
                                       "--output-dir", str(tmp_path)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env))
    seen = []
    try:
        for line in ranks[0].stdout:  # rank 0 prints the log lines; then the signal goes to rank 1
            seen.append(line)
            if re.search(r"Epoch: \[0\]\[2/8\]", line):
                ranks[1].send_signal(signal.SIGTERM)
                break
        outputs = [process.communicate(timeout=TIMEOUT) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    out = "".join(seen) + outputs[0][0]
    assert [process.returncode for process in ranks] == [143, 143], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    stopped = STOPPED.search(out)
    assert stopped and stopped.group(1) == "SIGTERM", out[-3000:]
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["mid_epoch"]


def test_the_agreed_signal_is_theirs_or_sigterm_when_they_differ():
    from utils.run.preemption import agreed_signal
    assert agreed_signal(0, 0) is None
    assert agreed_signal(1, signal.SIGINT) == signal.SIGINT
    assert agreed_signal(2, 2 * signal.SIGTERM) == signal.SIGTERM
    assert agreed_signal(2, signal.SIGINT + signal.SIGTERM) == signal.SIGTERM


# ---------------------------------------------------------------------------------------------
# In-process pieces

def test_sampler_starts_mid_epoch_at_the_same_place_of_the_same_shuffle():
    from utils.data.batches import ShardedEpochSampler

    for world in (1, 2, 4):
        whole = [list(ShardedEpochSampler(100, 8 // world, rank, world, seed=3)) for rank in range(world)]
        for rank in range(world):
            sampler = ShardedEpochSampler(100, 8 // world, rank, world, seed=3)
            sampler.set_epoch(0, first_step=5)
            assert list(sampler) == whole[rank][5 * (8 // world):]
            assert len(sampler) == len(whole[rank])  # the epoch's length, not what is left of it
            sampler.set_epoch(1)
            assert len(list(sampler)) == len(whole[rank])


def test_resume_command_replaces_resume_and_drops_overwrite():
    from utils.run.preemption import resume_command

    argv = ["train.py", "--overwrite", "--resume", "old.tar", "-b", "8", "--resume=x", "data dir"]
    assert resume_command("out/checkpoint.pth.tar", argv) == \
        "python train.py -b 8 'data dir' --resume out/checkpoint.pth.tar"


def test_resume_command_names_the_output_dir_and_knows_abbreviated_flags():
    """A --resume DIR run writes into DIR without --output-dir typed: the command says where;
    argparse's abbreviations (--overwr for --overwrite) are dropped or replaced like the flags."""
    from utils.flags.parser import add_log_args, build_parser
    from utils.run.preemption import resume_command

    options = add_log_args(build_parser("train"))._option_string_actions
    argv = ["train.py", "d", "--overwr", "--resu", "runs/a", "--output-d=x", "--lr", "0.2"]
    assert resume_command("runs/a/checkpoint.pth.tar", argv, output_dir="runs/a", option_strings=options) == \
        "python train.py d --lr 0.2 --output-dir runs/a --resume runs/a/checkpoint.pth.tar"


def test_a_duplicate_signal_is_the_same_request_and_a_later_one_stops_at_once(monkeypatch):
    from utils.run import preemption

    stop = preemption.StopOnSignal(announce=False)
    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # terminal and launcher both delivered it
    assert stop.requested and stop.exit_code == 130
    clock[0] += preemption.DUPLICATE_SECONDS + 1
    with pytest.raises(SystemExit) as stopped:
        stop._handle(signal.SIGTERM, None)
    assert stopped.value.code == 143


def test_a_stopped_prof_run_saves_nothing(cache_dir, tmp_path):
    rc, out, err = train_until(tmp_path, r"Epoch: \[0\]\[2/10\]", signal.SIGTERM, *QUICK, "--steps-per-epoch", "10",
                               "--prof", "0")
    assert rc == 143, err[-3000:]
    no_traceback(err)
    assert "=> stopped by SIGTERM during the --prof run (it saves nothing)" in out
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script", ["train.py", "eval.py", "profile.py"])
def test_ctrl_c_while_the_scripts_import_ends_them_without_a_traceback(script):
    """-X importtime writes a line as each module finishes importing; SIGINT goes out at the first
    of torch's, so it lands inside the imports every time, whatever the machine's speed."""
    process = subprocess.Popen([sys.executable, "-X", "importtime", os.path.join(ROOT, script)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                               cwd=ROOT)
    seen = []
    for line in process.stderr:
        seen.append(line)
        if re.search(r"\|\s+torch\.", line):
            process.send_signal(signal.SIGINT)
            break
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode in (-signal.SIGINT, 130), "".join(seen)[-2000:] + err[-2000:]
    no_traceback(err)
