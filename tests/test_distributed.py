"""Distributed correctness on the CPU: real 2-process DDP over gloo, started the way a GPU node is.

`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2` runs train.py / eval.py in two processes with
a real process group (`accelerate launch --cpu --num_processes 2` would start only one). Checked:
global batch and LR scaling, Speed over all processes, no training sample drawn twice in an
epoch, one checkpoint writer and one log, --resume across process counts, identical weights on
every rank, the exact val count, and metrics equal to a 1-process run where they must be.
Also: every accelerate_configs/*.yaml is accepted by `accelerate launch` and starts what it says.

Run as a script (`torchrun ... tests/test_distributed.py probe OUT.json TRAIN-FLAGS...`), this
file is also the probe that looks inside the ranks, which train.py's output cannot show.
"""
import csv
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

# As a torchrun script too: tests/ is then sys.path[0], and conftest puts ROOT on sys.path.
from conftest import FINAL, HALF_TINY, ROOT, TIMEOUT, TINY, leave_together, run_command, subprocess_env

BIN = os.path.dirname(sys.executable)
EPOCH_LINE = re.compile(r"Epoch: \[(\d+)\]\[(\d+)/(\d+)\]\tTime ([\d.]+) \([\d.]+\)\tSpeed ([\d.]+) ")
EVAL_TAIL = re.compile(r" \* Loss ([\d.]+) Images (\d+) Speed")
DIGITS_VAL = 359  # 1,797 // 5: prime, so it divides by no process count x batch


# Every process on the CPU (also on a GPU machine), with conftest's thread limit per process.
CPU = {"ACCELERATE_USE_CPU": "1"}


def torchrun(script, *args, nproc=2):
    """script under `torchrun --standalone` (a free rendezvous port) on gloo CPU processes."""
    return run_command([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", nproc,
                        os.path.join(ROOT, script), *args], env=CPU)


def python(script, *args):
    """One process on the CPU, like one of the torchrun ones."""
    return run_command([sys.executable, os.path.join(ROOT, script), *args], env=CPU)


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def finals(stdout):
    return [(float(a), float(b)) for a, b in FINAL.findall(stdout)]


# ---------------------------------------------------------------------------------------------
# Runs shared by the tests below (module scope: each runs once).

@pytest.fixture(scope="module")
def two_proc_run(cache_dir, tmp_path_factory):
    """Epoch 0 on 2 processes, batch 8 each (global 16); --sync_bn must explain itself on CPU."""
    out = tmp_path_factory.mktemp("ddp2")
    run = ok(torchrun("train.py", *TINY, "-b", "8", "--steps-per-epoch", "3", "--epochs", "1",
                      "--sync_bn", "--output-dir", out))
    return out, run


@pytest.fixture(scope="module")
def resumed_on_one(two_proc_run, tmp_path_factory):
    """The 2-process checkpoint resumed on 1 process (batch 16: the same global batch)."""
    saved, _ = two_proc_run
    out = tmp_path_factory.mktemp("resumed1")
    run = ok(python("train.py", *TINY, "-b", "16", "--steps-per-epoch", "3", "--epochs", "2",
                    "--resume", saved / "checkpoint.pth.tar", "--output-dir", out))
    return out, run


# ---------------------------------------------------------------------------------------------
# train.py on 2 processes

def test_global_batch_lr_and_speed_count_all_processes(two_proc_run):
    _, run = two_proc_run
    assert "2 process(es) on cpu | global batch 16 | lr 0.00625" in run.stdout, run.stdout[:2000]
    lines = EPOCH_LINE.findall(run.stdout)
    assert [(e, s, n) for e, s, n, _, _ in lines] == [("0", "1", "3"), ("0", "2", "3"), ("0", "3", "3")]
    for _, _, _, seconds, speed in lines:
        # Speed is the global batch over the step time, not one process's share of it.
        assert abs(float(speed) * float(seconds) - 16) <= 16 * 0.02 + float(speed) * 0.0005, (speed, seconds)


def test_one_writer_and_one_log(two_proc_run):
    out, run = two_proc_run
    assert len(finals(run.stdout)) == 1, run.stdout  # the main process prints; rank 1 does not
    assert run.stdout.count("precision: O0") == 1
    assert sorted(os.path.basename(p) for p in glob.glob(str(out / "*.pth.tar"))) == \
        ["checkpoint.pth.tar", "model_best.pth.tar"]
    assert not glob.glob(str(out / ".tmp*")), "a second writer left a temp file behind"
    with open(out / "summary.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 1  # one row for the one epoch, not one per rank


def test_sync_bn_says_why_it_is_off_on_cpu(two_proc_run):
    _, run = two_proc_run
    notes = [line for line in run.stderr.splitlines() if "--sync_bn" in line]
    assert len(notes) == 1, run.stderr[-3000:]  # once, from the main process
    assert "SyncBatchNorm needs CUDA" in notes[0] and "cpu" in notes[0]


def test_sync_bn_is_explained_wherever_it_is_off(capsys):
    from utils.device import want_sync_bn

    def accelerator(device, processes):
        return SimpleNamespace(device=SimpleNamespace(type=device), num_processes=processes, is_main_process=True)

    args = SimpleNamespace(sync_bn=True)
    assert not want_sync_bn(args.sync_bn, accelerator("cpu", 2))
    assert "SyncBatchNorm needs CUDA devices (this run is on cpu)" in capsys.readouterr().err
    assert not want_sync_bn(args.sync_bn, accelerator("cuda", 1))
    assert "only one process" in capsys.readouterr().err
    assert want_sync_bn(args.sync_bn, accelerator("cuda", 2))
    assert not want_sync_bn(False, accelerator("cuda", 2))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("level, keep_bn, bn_dtype", [("O2", None, "float32"), ("O3", None, "bfloat16"),
                                                      ("O3", True, "float32")])
def test_sync_bn_layers_follow_the_recipe(level, keep_bn, bn_dtype):
    """SyncBatchNorm (converted before the recipe is applied, as build_training_state does) is a
    BatchNorm to the O2/O3 cast: fp32 with half inputs at O2, as --keep-batchnorm-fp32 says at O3."""
    import torch
    import torchvision

    from utils.precision import Precision, resolve_precision

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torchvision.models.resnet18(num_classes=10))
    recipe, _ = resolve_precision(level, keep_bn, None, "bf16", "--mixed-precision")
    precision = Precision(recipe, model, "cpu")
    sync = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    assert len(sync) == 20
    assert {str(p.dtype) for m in sync for p in m.parameters()} == {f"torch.{bn_dtype}"}
    assert {str(m.running_mean.dtype) for m in sync} == {f"torch.{bn_dtype}"}
    assert model.conv1.weight.dtype == torch.bfloat16
    assert bool(precision.master_of) == (level == "O2")


def test_resume_on_another_process_count(resumed_on_one):
    out, run = resumed_on_one
    assert "resumed" in run.stdout and "at epoch 1" in run.stdout
    assert "1 process(es) on cpu | global batch 16 | lr 0.00625" in run.stdout
    assert [line[0] for line in EPOCH_LINE.findall(run.stdout)] == ["1", "1", "1"]
    import torch
    state = torch.load(out / "checkpoint.pth.tar", weights_only=True)
    assert state["epoch"] == 2 and state["args"]["batch_size"] == 16


def test_eval_on_two_processes_counts_every_image_once(two_proc_run):
    """The 2-process run's printed top-1 == eval.py on 1 process == eval.py on 2 processes, over
    all 359 images (train.py then validated with rank 0's BatchNorm statistics on both ranks)."""
    out, run = two_proc_run
    printed = finals(run.stdout)[-1]
    one = ok(python("eval.py", "--resume", out / "checkpoint.pth.tar", "-j", "0", "-b", "32"))
    two = ok(torchrun("eval.py", "--resume", out / "checkpoint.pth.tar", "-j", "0", "-b", "32"))
    for result in (one, two):
        assert finals(result.stdout) == [printed], (printed, result.stdout[-1500:])
        assert EVAL_TAIL.search(result.stdout).group(2) == str(DIGITS_VAL)
    # Same images, same weights: the loss agrees too (up to float summation order).
    losses = [float(EVAL_TAIL.search(r.stdout).group(1)) for r in (one, two)]
    assert abs(losses[0] - losses[1]) < 1e-3, losses
    assert "2 process(es)" in two.stdout and two.stdout.count(" * Prec@1") == 1


# ---------------------------------------------------------------------------------------------
# Inside the ranks (the probe at the bottom of this file)

def test_ranks_hold_identical_weights_and_disjoint_samples(cache_dir, tmp_path):
    """O2 bf16 on 2 processes: after training steps every rank holds the same half weights,
    fp32 masters and (after validate) BatchNorm statistics; ranks draw disjoint samples that
    make up exactly the batches a 1-process run with the global batch would draw. (HALF_TINY:
    bf16 on a CPU, conftest.py.)"""
    from utils.data.batches import ShardedEpochSampler

    out = tmp_path / "probe.json"
    ok(torchrun(__file__, "probe", out, *HALF_TINY, "-b", "8", "--steps-per-epoch", "3", "--epochs", "1",
                "--warmup-epochs", "5", "--opt-level", "O2", "--mixed-precision", "bf16"))
    probe = json.loads(out.read_text())
    assert probe["world"] == 2
    for key in ("params", "masters", "buffers_after_val"):
        assert len(set(probe[key])) == 1, f"{key} differ across ranks"
    assert probe["masters"][0] != hashlib.sha256(b"").hexdigest(), "O2 made no master weights"
    assert probe["val_count"] == probe["val_size"] == DIGITS_VAL
    # The LR of the epoch's last step: set from the global batch (16) each step, not stepped per
    # process. Apex's formula: 0.1 x 16/256, warmup (1 + step) / (5 epochs x 3 steps) at step 2.
    assert probe["last_lr"] == pytest.approx(0.1 * 16 / 256 * 3 / 15)

    first, second = probe["seen"]
    assert not set(first) & set(second), "a training sample was drawn by both ranks"
    one = ShardedEpochSampler(probe["train_size"], 16, 0, 1, seed=0)
    one.set_epoch(0)
    single = [index for index, _ in one]
    for step in range(len(first) // 8):
        union = set(first[step * 8:(step + 1) * 8]) | set(second[step * 8:(step + 1) * 8])
        assert union == set(single[step * 16:(step + 1) * 16]), f"global batch {step} differs"


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_sampler_never_repeats_a_sample_in_an_epoch(world):
    from utils.data.batches import ShardedEpochSampler

    size, batch = 1000, 16
    shards = []
    for rank in range(world):
        sampler = ShardedEpochSampler(size, batch, rank, world, seed=3)
        sampler.set_epoch(5)
        shards.append([index for index, _ in sampler])
    drawn = [index for shard in shards for index in shard]
    assert len(drawn) == len(set(drawn)) == (size // (batch * world)) * batch * world
    assert len({len(shard) for shard in shards}) == 1  # every rank runs the same number of steps


# ---------------------------------------------------------------------------------------------
# accelerate_configs/*.yaml through `accelerate launch`

CONFIGS = os.path.join(ROOT, "accelerate_configs")


def resolved_launch(config, *launch_args):
    """What `accelerate launch --config_file CONFIG LAUNCH_ARGS script.py --opt-level O1` starts,
    worked out by accelerate's own launch code (which rejects unknown yaml keys) up to the point
    where it would start the processes: (torchrun's arguments or None for one process, the
    environment the processes get)."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
    from accelerate.utils.launch import _filter_args

    argv = ["--config_file", os.path.join(CONFIGS, config), *launch_args, "script.py", "--opt-level", "O1"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.multi_gpu and not args.cpu:
        env = prepare_multi_gpu_env(args)
        torchrun_args = _filter_args(args, distrib_run.get_args_parser(), [
            "--training_script", args.training_script, "--training_script_args", args.training_script_args])
        return torchrun_args, env
    command, env = prepare_simple_launcher_cmd_env(args)
    assert command[-3:] == ["script.py", "--opt-level", "O1"]
    return None, env


def test_every_config_is_accepted_with_the_promised_layout():
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.yaml")))
    assert names == ["1gpu.yaml", "2gpu.yaml", "8gpu.yaml", "cpu.yaml", "multinode.yaml"]
    for name in ("1gpu.yaml", "cpu.yaml"):
        torchrun_args, env = resolved_launch(name)
        assert torchrun_args is None, name  # one process, no torchrun
        assert env["ACCELERATE_USE_CPU"] == str(name == "cpu.yaml"), name
    for name, processes in (("2gpu.yaml", "2"), ("8gpu.yaml", "8")):
        torchrun_args, env = resolved_launch(name)
        assert (torchrun_args.nproc_per_node, torchrun_args.nnodes) == (processes, "1:1"), name
        assert torchrun_args.training_script_args == ["--opt-level", "O1"]
    port = str(free_port())
    for name, env in [(name, resolved_launch(name)[1]) for name in names]:
        # 'no': the yaml leaves the dtype open; --opt-level picks the recipe (fp16 unless bf16 asked).
        assert env["ACCELERATE_MIXED_PRECISION"] == "no", name
    # multinode: the yaml's rank and placeholder address, then both given on the command line.
    torchrun_args, _ = resolved_launch("multinode.yaml", "--main_process_port", port)
    assert (torchrun_args.nnodes, torchrun_args.nproc_per_node, torchrun_args.node_rank) == ("2", "8", 0)
    assert torchrun_args.rdzv_endpoint == f"main-node.invalid:{port}"
    torchrun_args, _ = resolved_launch("multinode.yaml", "--machine_rank", "1", "--main_process_ip", "10.1.2.3",
                                       "--num_machines", "4", "--num_processes", "32")
    assert (torchrun_args.nnodes, torchrun_args.nproc_per_node, torchrun_args.node_rank) == ("4", "8", 1)
    assert torchrun_args.rdzv_endpoint == "10.1.2.3:29500"


# One os.write per line: a pipe write that small is atomic, so the two ranks' lines never interleave.
SHOW_ENV = "import os, sys\nline = f\"RANK {os.environ['RANK']} WORLD {os.environ['WORLD_SIZE']} " \
           "ARGS {' '.join(sys.argv[1:])}\\n\"\nos.write(1, line.encode())\n"


def test_2gpu_config_starts_two_processes(tmp_path):
    """A real `accelerate launch` of 2gpu.yaml. The launched script only reports what it was
    handed and touches no GPU, so this runs on a CPU machine too."""
    script = tmp_path / "show_env.py"
    script.write_text(SHOW_ENV)
    env = subprocess_env()
    env.pop("ACCELERATE_USE_CPU", None)
    result = ok(subprocess.run([os.path.join(BIN, "accelerate"), "launch", "--config_file",
                                os.path.join(CONFIGS, "2gpu.yaml"), str(script), "--opt-level", "O1"],
                               capture_output=True, text=True, env=env, timeout=TIMEOUT))
    assert sorted(re.findall(r"RANK (\d) WORLD (\d) ARGS (.*)", result.stdout)) == \
        [("0", "2", "--opt-level O1"), ("1", "2", "--opt-level O1")]


def test_a_gpu_config_where_cuda_is_missing_is_refused_before_anything_is_written(tmp_path):
    """2gpu.yaml where CUDA is missing or broken (hidden here): torchrun starts two processes, and
    Accelerate, finding no GPU, would leave each to train alone on the CPU, the whole data, into
    the same --output-dir. train.py refuses: one message saying how to get what was meant."""
    env = subprocess_env({"CUDA_VISIBLE_DEVICES": ""})
    env.pop("ACCELERATE_USE_CPU", None)
    out = tmp_path / "out"
    result = subprocess.run([os.path.join(BIN, "accelerate"), "launch", "--config_file",
                             os.path.join(CONFIGS, "2gpu.yaml"), os.path.join(ROOT, "train.py"), *TINY,
                             "--steps-per-epoch", "2", "--epochs", "1", "--output-dir", str(out)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=TIMEOUT)
    assert result.returncode != 0, result.stdout[-2000:]
    message = "train.py: error: started as 2 processes (WORLD_SIZE=2), but Accelerate joined none of them"
    assert result.stderr.count(message) == 1, result.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=1 torchrun" in result.stderr and "accelerate_configs/cpu.yaml" in result.stderr
    assert "Epoch: [" not in result.stdout
    assert not out.exists() or not any(out.iterdir())


def test_processes_accelerate_joined_pass_and_others_name_the_cause(monkeypatch):
    from utils.device import check_processes_joined
    from utils.run.errors import UsageError
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_processes_joined(4)  # torchrun's 4 processes in one run: nothing to say
    monkeypatch.delenv("WORLD_SIZE")
    check_processes_joined(1)  # python train.py
    monkeypatch.setenv("WORLD_SIZE", "4")
    import torch
    cause = "LOCAL_RANK is not set" if torch.cuda.is_available() else "no CUDA device is usable here"
    with pytest.raises(UsageError, match=f"started as 4 processes .*joined none of them.*{cause}"):
        check_processes_joined(1)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # mpirun: Accelerate joins it on CPUs only
    with pytest.raises(UsageError, match=r"started as 2 processes \(OMPI_COMM_WORLD_SIZE=2\)"):
        check_processes_joined(1)
    check_processes_joined(2)


def test_more_processes_on_a_node_than_gpus_are_refused(monkeypatch):
    """8gpu.yaml on a 2-GPU machine: Accelerate would put 4 processes on each GPU, which NCCL
    refuses only later and obscurely. (The GPUs are pretended here; the real launch is below.)"""
    import torch

    from utils.device import check_gpus_per_node
    from utils.run.errors import UsageError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UsageError, match=r"started 8 processes on this node \(LOCAL_WORLD_SIZE=8\), but it has "
                                         r"2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\).*--num_processes 2"):
        check_gpus_per_node()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    check_gpus_per_node()  # CPU processes: no GPU needed
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_gpus_per_node()  # one process per GPU


@pytest.mark.gpu
def test_more_processes_than_gpus_stop_at_once_with_one_message(tmp_path):
    """A real torchrun with one process more than this machine's GPUs."""
    import torch
    env = subprocess_env()
    env.pop("ACCELERATE_USE_CPU", None)
    processes = torch.cuda.device_count() + 1
    out = tmp_path / "out"
    result = subprocess.run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(processes),
                             os.path.join(ROOT, "train.py"), *TINY, "--steps-per-epoch", "2", "--epochs", "1",
                             "--output-dir", str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=TIMEOUT)
    assert result.returncode != 0, result.stdout[-2000:]
    assert result.stderr.count(f"train.py: error: started {processes} processes on this node") == 1, \
        result.stderr[-3000:]
    assert not out.exists() or not any(out.iterdir())


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# The probe, run by torchrun in every rank.

def _digest(tensors):
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def probe(out_path, argv):
    """Train an epoch and validate with the project's own pieces, then report from every rank."""
    import torch
    import torch.distributed as dist

    from utils.data.sources import build_data
    from utils.device import make_accelerator
    from utils.engine import Watch, train_one_epoch, validate
    from utils.flags.parser import build_parser
    from utils.flags.precedence import parse_args
    from utils.flags.specs import data_spec, device_settings, precision_flags, training_loop, training_specs
    from utils.training_state import build_training_state

    args = parse_args(build_parser("probe"), argv)
    accelerator, plan, _ = make_accelerator(precision_flags(args), args.deterministic)
    device = device_settings(args, accelerator.device.type)
    data = build_data(data_spec(args, backend=device.data_backend, jpeg_decoder=device.jpeg_decoder,
                                channels_last=device.channels_last), accelerator)
    model_spec, optimizer_spec, _ = training_specs(args, channels_last=device.channels_last, compile=device.compile)
    state = build_training_state(model_spec, optimizer_spec, accelerator, plan, data.num_classes)
    model, optimizer, precision = state.model, state.optimizer, state.precision
    criterion = torch.nn.CrossEntropyLoss()
    data.set_epoch(0)
    seen = [index for index, _ in data.train_sampler]  # what this rank's loader draws in epoch 0
    quiet = Watch(log=lambda *_: None)
    train_one_epoch(state, data, 0, training_loop(args, criterion), quiet)
    module = accelerator.unwrap_model(model)
    params = _digest(module.parameters())
    masters = _digest(precision.master_of.values())
    result = validate(model, data, precision, accelerator, print_freq=args.print_freq, criterion=criterion,
                      watch=quiet)
    report = {"params": params, "masters": masters, "buffers_after_val": _digest(module.buffers()),
              "seen": seen}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if accelerator.is_main_process:
        merged = {key: [rank[key] for rank in gathered] for key in report}
        merged.update(world=dist.get_world_size(), val_count=result.count, val_size=data.val_size,
                      train_size=data.train_sampler.size, last_lr=optimizer.param_groups[0]["lr"])
        with open(out_path, "w") as handle:
            json.dump(merged, handle)
    leave_together()


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "probe":
    probe(sys.argv[2], sys.argv[3:])


def run_ranks(argv, tmp_path, preexec_by_rank=None):
    """train.py's 2 ranks started by hand with torchrun's environment, so that each one's exit
    code and stderr are its own (torchrun would kill one when the other fails). Returns
    [(returncode, stderr)] by rank."""
    port, ranks = free_port(), []
    for rank in range(2):
        env = subprocess_env({**CPU, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                              "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
        ranks.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *map(str, argv)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                                      preexec_fn=(preexec_by_rank or {}).get(rank)))
    try:
        return [(process.returncode, process.communicate(timeout=TIMEOUT)[1]) for process in ranks
                for _ in [process.wait(timeout=TIMEOUT)]]
    finally:
        for process in ranks:
            process.kill()


def test_an_image_only_one_rank_reads_stops_every_rank_with_one_message(tmp_path):
    """val/class0/1.jpg is index 1 of val: rank 1's alone. Rank 1 names the file and exits 2;
    rank 0, whose next collective fails, says so in one line and exits 2 too: no traceback."""
    from conftest import make_image_folder
    data = make_image_folder(tmp_path / "data")
    with open(os.path.join(data, "val", "class0", "1.jpg"), "w") as handle:
        handle.write("not a picture")
    results = run_ranks([data, *TINY, "-b", "4", "--epochs", "1", "--steps-per-epoch", "2",
                         "--output-dir", tmp_path / "out"], tmp_path)
    assert [code for code, _ in results] == [2, 2], [err[-2000:] for _, err in results]
    both = results[0][1] + results[1][1]
    assert "Traceback" not in both, both[-3000:]
    assert both.count("error: cannot read image") == 1 and "class0/1.jpg" in results[1][1]
    assert "another process of this run failed (its error is above)" in results[0][1]


def test_a_usage_error_every_rank_meets_is_printed_once(tmp_path):
    results = run_ranks([*TINY, "-a", "no_such_net", "--output-dir", tmp_path / "out"], tmp_path)
    assert [code for code, _ in results] == [2, 2]
    assert (results[0][1] + results[1][1]).count("error:") == 1 and "no_such_net" in results[0][1]


def test_a_failed_write_on_rank_0_stops_rank_1_without_a_traceback(tmp_path):
    """Rank 0 may write files of at most 1 MB (RLIMIT_FSIZE, SIGXFSZ ignored: write() fails with
    EFBIG as a full disk's ENOSPC would), so its checkpoint fails: exit 4 with the one line. Rank 1
    (which would have finished with exit 0 on its own) fails at the run's last barrier and says
    so in one line; ranks started by hand keep the group's store in rank 0, so it cannot read
    rank 0's code there and exits 1 (under torchrun the agent keeps the store)."""
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, 2 ** 20))

    results = run_ranks([*TINY, "-b", "8", "--epochs", "1", "--steps-per-epoch", "2", "--output-dir", tmp_path / "out"],
                        tmp_path, preexec_by_rank={0: small_files})
    assert [code for code, _ in results] == [4, 1], [err[-2000:] for _, err in results]
    both = results[0][1] + results[1][1]
    assert "Traceback" not in both and both.count("error: could not write") == 1, both[-3000:]
    assert "another process of this run failed" in results[1][1]
