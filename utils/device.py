"""The device side of start-up: the Accelerator and the precision plan, determinism, CUDA work
queues, the launcher checks, and the flags whose value depends on the device (DeviceSettings)."""
import os
import sys
from typing import NamedTuple

import torch

from utils.data.gpu.decoders import CUDA_WORK_QUEUES
from utils.models import has_2d_convolutions
from utils.precision import cpu_fp16_note, requested_mixed_precision, resolve_precision
from utils.run.errors import UsageError


class PrecisionFlags(NamedTuple):
    """The Apex precision flags as typed (None: not given): --opt-level, --keep-batchnorm-fp32,
    --loss-scale, and --mixed-precision (Accelerate's setting fills it in make_accelerator)."""
    opt_level: str = None
    keep_batchnorm_fp32: bool = None
    loss_scale: object = None
    mixed_precision: str = None


def set_determinism(deterministic):
    """--deterministic: repeatable kernels (cuDNN, cuBLAS and torch's own); else cudnn.benchmark."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # warn_only: a few backward kernels (e.g. adaptive average pooling) are only flagged, and
        # torch names them in a warning rather than stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.backends.cudnn.benchmark = True


def widen_cuda_work_queues():
    """Set CUDA_DEVICE_MAX_CONNECTIONS before this process creates its CUDA context (it is read
    then), unless the environment already says."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_WORK_QUEUES)


def make_accelerator(flags, deterministic=False, **accelerator_kwargs):
    """An Accelerator that leaves precision to our plan, and the resolved plan with its notes.
    flags: PrecisionFlags.

    Accelerate's mixed_precision (flag, config or environment) only picks the half dtype; the
    Accelerator itself runs with mixed_precision='no' so it adds no autocast or GradScaler of its own.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    widen_cuda_work_queues()
    check_gpus_per_node()
    mixed_precision, source = requested_mixed_precision(flags.mixed_precision)
    plan, notes = resolve_precision(flags.opt_level, flags.keep_batchnorm_fp32, flags.loss_scale,
                                    mixed_precision, source)
    set_determinism(deterministic)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False)
    # accelerator_kwargs: e.g. the trackers of train.py's --log-with (utils.logs.tracker_kwargs).
    # dynamo_backend "no": we compile ourselves, once (utils/compiled.py), whatever the config says.
    accelerator = Accelerator(mixed_precision="no", dynamo_backend="no", kwargs_handlers=[ddp],
                              **accelerator_kwargs)
    check_processes_joined(accelerator.num_processes)
    note = cpu_fp16_note(plan, accelerator.device.type)
    if note:
        notes.append(note)
    return accelerator, plan, notes


class DeviceSettings(NamedTuple):
    """The flags whose value this device settles (utils.flags.specs.device_settings makes it):
    the memory format, the data backend and its JPEG decoder, the torch.compile backend (False:
    none), mode and --tune-kernels; the start-up line that says so, and a note for the user or None."""
    channels_last: bool
    data_backend: str
    jpeg_decoder: str
    compile: object
    compile_mode: str
    input_line: str
    note: str = None
    tune_kernels: bool = False

    def as_flags(self):
        """As the run's settings record them (checkpoint "args", args.yaml)."""
        return {"channels_last": self.channels_last, "data_backend": self.data_backend,
                "jpeg_decoder": self.jpeg_decoder, "compile": self.compile, "compile_mode": self.compile_mode,
                "tune_kernels": self.tune_kernels}


def settle_channels_last(channels_last, arch, device_type):
    """--channels-last as given, or by default on CUDA for models with 2-D convolutions (it speeds
    them up there; elsewhere not). Returns (the choice, its part of the start-up line)."""
    if channels_last is None:
        chosen = device_type == "cuda" and has_2d_convolutions(arch)
        return chosen, f"channels_last {'on' if chosen else 'off'} (default on {device_type})"
    return channels_last, f"channels_last {'on' if channels_last else 'off'} (--channels-last)"


def check_gpus_per_node():
    """A usage error when the launcher started more processes on this node than it has GPUs (an
    8gpu.yaml on a 2-GPU machine): Accelerate would put several processes on one GPU (local rank
    modulo the GPU count), which NCCL refuses with a less helpful error once they first talk.
    Every process of the node meets it alike, before any work."""
    from accelerate.utils import parse_flag_from_env
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if per_node < 2 or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if per_node > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"started {per_node} processes on this node (LOCAL_WORLD_SIZE={per_node}), but it has "
                         f"{gpus} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                         + f": one process per GPU; launch {gpus} a node (accelerate launch --num_processes "
                         f"{gpus} on one machine, {gpus} x machines on several; torchrun --nproc_per_node {gpus})")


def check_processes_joined(joined):
    """A usage error when the launcher started more processes (WORLD_SIZE, or mpirun's size) than
    Accelerate joined into one run. Accelerate joins torchrun's processes only on CUDA (or with
    ACCELERATE_USE_CPU=1), and mpirun's only on CPUs; elsewhere each process would train alone,
    the whole data set, into the same --output-dir. That is what a GPU config such as
    accelerate_configs/2gpu.yaml does on a machine where CUDA is missing or broken."""
    # torchrun's variable, then MPI's (mpirun), which Accelerate also reads
    name = next((name for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
                 if os.environ.get(name)), "WORLD_SIZE")
    launched = int(os.environ.get(name) or 1)
    if launched <= joined:
        return
    if torch.cuda.is_available():
        why = "LOCAL_RANK is not set; start the processes with torchrun or accelerate launch"
    else:
        why = ("no CUDA device is usable here (torch.cuda.is_available() is False): on a GPU machine, "
               "check nvidia-smi and that torch is a CUDA build; for DDP on CPUs, set ACCELERATE_USE_CPU=1 "
               "(ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N ...); for one CPU process, use "
               "accelerate_configs/cpu.yaml")
    raise UsageError(f"started as {launched} processes ({name}={launched}), but Accelerate joined "
                     f"{'none of them' if joined == 1 else joined} into one run, so each would train alone "
                     f"into the same output: {why}")


def warn(accelerator, message):
    if accelerator.is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def want_sync_bn(sync_bn, accelerator):
    """--sync_bn applies only to several CUDA processes; otherwise say why it is not used."""
    if not sync_bn:
        return False
    if accelerator.device.type != "cuda":
        warn(accelerator, "--sync_bn ignored: SyncBatchNorm needs CUDA devices (this run is on "
                          f"{accelerator.device.type})")
        return False
    if accelerator.num_processes < 2:
        warn(accelerator, "--sync_bn ignored: only one process, so BatchNorm already sees the whole batch")
        return False
    return True
