"""Start-up steps shared by the scripts: flags to Accelerator, recipe, determinism, model."""
import os
import sys

import torch

from .checkpoint import load_checkpoint, load_model_weights
from .cli import apply_source_defaults
from .errors import UsageError
from .models import build_model, model_data_config
from .precision import Precision, build_sgd, cpu_fp16_note, requested_mixed_precision, resolve_recipe


def parse_args(parser, argv=None):
    args = parser.parse_args(argv)
    check_lr_steps(args)  # before the source defaults fill --lr-steps in
    # A timm model's own input size, crop pct, interpolation and mean/std fill what no flag set.
    apply_source_defaults(args, model_data_config(args.arch))
    warn_unreached_milestones(args)
    if not 0.0 < args.crop_pct <= 1.0:
        raise UsageError(f"--crop-pct must be in (0, 1], got {args.crop_pct}")
    if not 0.0 < args.min_scale <= 1.0:
        raise UsageError(f"--min-scale must be in (0, 1], got {args.min_scale}")
    if not 0.0 <= args.hflip <= 1.0:
        raise UsageError(f"--hflip is a probability in [0, 1], got {args.hflip}")
    window = getattr(args, "prof_steps", 10)  # profile.py's --prof-steps; train.py's window is 10
    if args.prof >= 0 and args.prof + window > (args.steps_per_epoch or sys.maxsize):
        raise UsageError(f"--prof {args.prof} needs {args.prof + window} steps but --steps-per-epoch is "
                         f"{args.steps_per_epoch}")
    return args


def check_lr_steps(args):
    """--lr-steps: increasing epochs, and only for the step schedule (no flag parsed and ignored)."""
    steps = getattr(args, "lr_steps", None)
    if steps is None:
        return
    if args.lr_schedule != "step":
        raise UsageError(f"--lr-steps applies to --lr-schedule step, not {args.lr_schedule}; drop it")
    if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
        raise UsageError(f"--lr-steps must be increasing epochs, got {' '.join(map(str, steps))}")


def warn_unreached_milestones(args):
    """A step schedule whose milestones all lie at or past --epochs never decays the LR: say so.

    Called before the Accelerator exists, so the rank comes from the launcher's RANK variable."""
    if getattr(args, "lr_schedule", None) != "step" or getattr(args, "evaluate", False):
        return
    if int(os.environ.get("RANK", 0)) != 0:
        return
    if not any(milestone < args.epochs for milestone in args.lr_steps):
        print(f"warning: no --lr-steps milestone ({' '.join(map(str, args.lr_steps))}) falls inside "
              f"--epochs {args.epochs}, so the LR never decays; pass --lr-steps with earlier epochs",
              file=sys.stderr, flush=True)


def set_determinism(args):
    """--deterministic: repeatable kernels (cuDNN, cuBLAS and torch's own); else cudnn.benchmark."""
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # warn_only: a few backward kernels (e.g. adaptive average pooling) are only flagged, and
        # torch names them in a warning rather than stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.backends.cudnn.benchmark = True


def make_accelerator(args, **accelerator_kwargs):
    """An Accelerator that leaves precision to our recipe, and the resolved recipe with its notes.

    Accelerate's mixed_precision (flag, config or environment) only picks the half dtype; the
    Accelerator itself runs with mixed_precision='no' so it adds no autocast or GradScaler of its own.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    mixed_precision, source = requested_mixed_precision(args.mixed_precision)
    recipe, notes = resolve_recipe(args.opt_level, args.keep_batchnorm_fp32, args.loss_scale,
                                   mixed_precision, source)
    set_determinism(args)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False)
    # accelerator_kwargs: e.g. the trackers of train.py's --log-with (utils.logs.tracker_kwargs)
    accelerator = Accelerator(mixed_precision="no", kwargs_handlers=[ddp], **accelerator_kwargs)
    note = cpu_fp16_note(recipe, accelerator.device.type)
    if note:
        notes.append(note)
    return accelerator, recipe, notes


def warn(accelerator, message):
    if accelerator.is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def want_sync_bn(args, accelerator):
    """--sync_bn applies only to several CUDA processes; otherwise say why it is not used."""
    if not args.sync_bn:
        return False
    if accelerator.device.type != "cuda":
        warn(accelerator, "--sync_bn ignored: SyncBatchNorm needs CUDA devices (this run is on "
                          f"{accelerator.device.type})")
        return False
    if accelerator.num_processes < 2:
        warn(accelerator, "--sync_bn ignored: only one process, so BatchNorm already sees the whole batch")
        return False
    return True


def build_training_state(args, accelerator, recipe, num_classes, checkpoint=None):
    """Model (weights from checkpoint if any), precision recipe applied, SGD, all prepared."""
    torch.manual_seed(args.seed)
    model = build_model(args.arch, num_classes, args.pretrained)
    if checkpoint is not None:
        load_model_weights(model, checkpoint["state_dict"], args.arch, args.resume)
    if want_sync_bn(args, accelerator):
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(accelerator.device, memory_format=memory_format)
    precision = Precision(recipe, model, accelerator.device.type)
    params = precision.optimizer_params()
    optimizer = build_sgd(params, args.lr, args.momentum, args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, precision


def build_or_resume(args, accelerator, recipe, num_classes):
    """The training state train.py and profile.py start from: (model, optimizer, precision, best
    top-1 so far). With --resume (loaded on every process) the weights, optimizer, loss scale and
    args.start_epoch come from the checkpoint, in the order that makes a resumed run bit-exact."""
    checkpoint = resume_checkpoint(args)
    model, optimizer, precision = build_training_state(args, accelerator, recipe, num_classes, checkpoint)
    if checkpoint is None:
        return model, optimizer, precision, 0.0
    optimizer.load_state_dict(checkpoint["optimizer"])
    precision.load_state_dict(checkpoint.get("loss_scale"))
    args.start_epoch = checkpoint["epoch"]
    return model, optimizer, precision, checkpoint.get("best_prec1", 0.0)


def resume_checkpoint(args):
    """The checkpoint given by --resume, or None."""
    if not args.resume:
        return None
    checkpoint = load_checkpoint(args.resume)
    if checkpoint["arch"] != args.arch:
        raise UsageError(f"checkpoint {args.resume!r} holds a {checkpoint['arch']} model, not -a "
                         f"{args.arch}; pass -a {checkpoint['arch']}")
    return checkpoint
