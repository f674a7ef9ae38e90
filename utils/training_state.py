"""The training state the scripts start from: model, precision shim and optimizer, built fresh or
resumed from a checkpoint, with the checks that keep a resume meaning what it meant."""
from dataclasses import dataclass
from typing import NamedTuple

import torch

from utils.compiled import compile_model
from utils.device import want_sync_bn, warn
from utils.ingredients import build_ema, build_optimizer
from utils.models import apply_blurpool, apply_stem_channels, build_model, check_input_size
from utils.precision import Precision
from utils.run.checkpoint import load_checkpoint, load_model_weights
from utils.run.errors import UsageError, first_line


@dataclass(frozen=True)
class ModelSpec:
    """The model a run builds: -a, --pretrained, --drop-path, the input sizes it must accept, the
    memory format, --sync_bn, the resolved torch.compile backend (False: none) and mode, --seed,
    --blurpool, --stem-channels (4: the stem convolution padded to 4 input channels),
    --tune-kernels as resolved (utils.compiled.resolve_tune_kernels)."""
    arch: str
    pretrained: bool = False
    drop_path: float = 0.0
    input_sizes: tuple = (224,)  # the training crop size of every epoch, then validation's
    channels_last: bool = False
    sync_bn: bool = False
    compile: object = False
    compile_mode: str = "default"
    seed: int = 0
    blurpool: bool = False
    stem_channels: int = 3
    tune_kernels: bool = False


@dataclass(frozen=True)
class OptimizerSpec:
    """--opt and its settings, --clip-grad, and the EMA (--model-ema, --model-ema-decay).
    only_sgd: the script builds SGD only (profile.py), which a refused resume says."""
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    no_wd_norm_bias: bool = False
    clip_grad: float = None
    model_ema: bool = False
    model_ema_decay: float = 0.9998
    only_sgd: bool = False


@dataclass(frozen=True)
class ResumeSpec:
    """--resume (a checkpoint file, '' for none) and what a resume is checked against: --epochs,
    whether the run trains (-e does not), DATA for messages, and the global batch's parts."""
    path: str = ""
    epochs: int = 1
    training: bool = True
    data: str = None
    batch_size: int = 1
    accum_steps: int = 1
    lr: float = 0.1

    def global_batch(self, accelerator):
        return global_batch(self.batch_size, accelerator.num_processes, self.accum_steps)


class TrainingState(NamedTuple):
    """What utils.engine.train_one_epoch trains: the prepared model and optimizer, the precision
    shim (Precision: the opt level's casts, loss scale, clip, skips, EMA) and the Accelerator."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    accelerator: object


class Start(NamedTuple):
    """Where a run starts: epoch and step (a mid-epoch checkpoint's), the best top-1 so far, and
    the record of the epoch until that step (utils.engine.train_one_epoch's carried), or None."""
    epoch: int = 0
    step: int = 0
    best_prec1: float = 0.0
    so_far: dict = None


def global_batch(batch_size, processes, accum_steps=1):
    """Images per optimizer step: --batch-size x processes x --accum-steps (what the LR scales by
    and what a checkpoint's mid-epoch step counts in)."""
    return batch_size * processes * accum_steps


def build_training_state(model_spec, optimizer_spec, accelerator, plan, num_classes, checkpoint=None):
    """Model (weights from checkpoint if any, EMA too), precision plan applied, the --opt
    optimizer, all prepared. Precision carries the step's ingredients: clip, skip, EMA."""
    spec, opt = model_spec, optimizer_spec
    torch.manual_seed(spec.seed)
    pretrained = spec.pretrained and checkpoint is None  # a resumed run's weights come from its checkpoint
    model = build_model(spec.arch, num_classes, pretrained, spec.drop_path)
    if spec.blurpool:  # before the weights load, the cast and DDP: its blur filters follow them all
        apply_blurpool(model, spec.arch)
    apply_stem_channels(model, spec.arch, spec.stem_channels)  # the plain weights: loads below as they are
    for size in dict.fromkeys(spec.input_sizes):
        check_input_size(model, spec.arch, size)
    if checkpoint is not None:
        load_model_weights(model, checkpoint["state_dict"], spec.arch, checkpoint.path)
    if want_sync_bn(spec.sync_bn, accelerator):
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if spec.channels_last else torch.contiguous_format
    model = model.to(accelerator.device, memory_format=memory_format)
    # The EMA copy is taken here, fp32 and before Precision casts the model and adds its hooks.
    ema = build_ema(model, opt.model_ema_decay) if opt.model_ema else None
    if ema is not None and checkpoint is not None and "state_dict_ema" in checkpoint:
        ema.module.load_state_dict(checkpoint["state_dict_ema"])
    precision = Precision(plan, model, accelerator.device.type)
    precision.ema = ema
    precision.clip_grad = opt.clip_grad
    # --opt and --no-wd-norm-bias: grouped by the model's names, the optimizer holding the O2 masters.
    built = build_optimizer(opt.name, model, opt.lr, opt.momentum, opt.weight_decay, opt.no_wd_norm_bias,
                            param_of=lambda p: precision.master_of.get(p, p), clip_grad=precision.clip_grad)
    precision.skips_on_device = built.skips_on_device
    model, optimizer = accelerator.prepare(model, built.optimizer)
    if spec.compile:  # after prepare: DDP's buckets see the compiled graph (utils/compiled.py)
        model = compile_model(model, spec.compile, accelerator.print, spec.compile_mode, len(set(spec.input_sizes)),
                              spec.tune_kernels)
    return TrainingState(model, optimizer, precision, accelerator)


class Checkpoint(dict):
    """A loaded checkpoint dict that remembers its path (for messages)."""

    def __init__(self, content, path):
        super().__init__(content)
        self.path = path


def build_or_resume(specs, accelerator, plan, num_classes, classes=None):
    """The training state train.py and profile.py start from, and where it starts (a Start).
    specs: (ModelSpec, OptimizerSpec, ResumeSpec). With a --resume file (loaded on every process)
    the weights, optimizer, loss scale and start come from the checkpoint, in the order that makes
    a resumed run bit-exact. classes: the data's class names in label order, checked against the
    checkpoint's."""
    model_spec, optimizer_spec, resume = specs
    if classes and num_classes < len(classes):
        raise UsageError(f"--num-classes {num_classes} is fewer than the {len(classes)} classes in the data; "
                         "drop --num-classes (it defaults to the data's count)")
    checkpoint = resume_checkpoint(resume, model_spec.arch)
    same_dtype = True
    if checkpoint is not None:
        same_dtype = check_resume_meaning(resume, checkpoint, plan, accelerator, classes)
    state = build_training_state(model_spec, optimizer_spec, accelerator, plan, num_classes, checkpoint)
    if checkpoint is None:
        return state, Start()
    stored_opt = (checkpoint.get("args") or {}).get("opt", "sgd")
    if stored_opt != optimizer_spec.name:  # another optimizer's state loads, then fails at step 1
        raise UsageError(f"checkpoint {resume.path!r} was trained with --opt {stored_opt}, this run builds "
                         f"--opt {optimizer_spec.name}: its optimizer state does not carry over; "
                         f"resume with --opt {stored_opt}" + (" (profile.py profiles SGD runs only)"
                                                              if optimizer_spec.only_sgd else ""))
    try:
        state.optimizer.load_state_dict(checkpoint["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise UsageError(f"checkpoint {resume.path!r}: its 'optimizer' state does not fit this model's "
                         f"parameters ({first_line(err, 150)}); resume with the flags it was trained with") from None
    if same_dtype:  # a loss scale found for fp16 means nothing for bf16 (and the reverse)
        state.precision.load_state_dict(checkpoint.get("loss_scale"))
    step = resume_step(resume, checkpoint, accelerator)
    so_far = checkpoint.get("epoch_so_far") if step else None  # older checkpoints have none
    return state, Start(checkpoint["epoch"], step, checkpoint.get("best_prec1", 0.0), so_far)


def resume_step(resume, checkpoint, accelerator):
    """The step inside the checkpoint's epoch to continue at: 0, or where a mid-epoch checkpoint
    (a stop signal, --save-every-steps) stopped. A step names a place in the epoch's shuffle only
    for the global batch it was counted in, so a mid-epoch resume needs that same global batch."""
    step = checkpoint.get("step", 0)
    if not step:
        return 0
    saved, now = checkpoint.get("global_batch"), resume.global_batch(accelerator)
    if not isinstance(step, int) or step < 0 or not isinstance(saved, int):
        raise UsageError(f"checkpoint {resume.path!r} has a damaged mid-epoch position (step {step!r}, "
                         f"global batch {saved!r}); resume from an end-of-epoch checkpoint instead")
    if saved != now:
        raise UsageError(f"checkpoint {resume.path!r} stopped inside epoch {checkpoint['epoch']} at step "
                         f"{step} of global batch {saved}, but this run's global batch is {now} "
                         f"(--batch-size {resume.batch_size} x {accelerator.num_processes} process(es) x "
                         f"--accum-steps {resume.accum_steps}); "
                         f"resume with a global batch of {saved}")
    return step


def resume_checkpoint(resume, arch):
    """The checkpoint given by --resume, or None."""
    if not resume.path:
        return None
    checkpoint = Checkpoint(load_checkpoint(resume.path, training=resume.training), resume.path)
    if checkpoint["arch"] != arch:
        raise UsageError(f"checkpoint {resume.path!r} holds a {checkpoint['arch']} model, not -a "
                         f"{arch}; pass -a {checkpoint['arch']}")
    if resume.training and checkpoint["epoch"] >= resume.epochs:
        raise UsageError(f"checkpoint {resume.path!r} has finished {checkpoint['epoch']} epochs, and --epochs "
                         f"is {resume.epochs}: nothing is left to train; raise --epochs (the total) to train on")
    return checkpoint


def _precision_name(opt_level, dtype_name):
    return f"{opt_level} {dtype_name if opt_level != 'O0' and dtype_name not in (None, 'no') else 'fp32'}"


def check_resume_meaning(resume, checkpoint, plan, accelerator, classes=None):
    """Flags that change what a resumed run means: other class names refuse (labels would
    silently mean other classes); another opt level or half dtype works, since checkpoints hold
    fp32 weights, and says so; another global batch says how the LR changes. Returns whether
    the half dtype is the checkpoint's (the loss-scale state is only carried over then)."""
    trained = checkpoint.get("classes")
    if trained and classes and list(trained) != list(classes):
        extra = sorted(set(classes) - set(trained))[:3]
        missing = sorted(set(trained) - set(classes))[:3]
        detail = "; ".join(part for part in (f"not in the checkpoint: {extra}" if extra else "",
                                             f"missing here: {missing}" if missing else "") if part)
        raise UsageError(f"checkpoint {resume.path!r} was trained on other classes than DATA "
                         f"{resume.data or 'digits'!r} holds ({len(trained)} vs {len(classes)}; "
                         f"{detail or 'same names, other order'}); resume on the data it was trained on, "
                         "or start a new run")
    old_level, old_dtype = checkpoint.get("opt_level"), checkpoint.get("mixed_precision")
    same_dtype = True
    if old_level is not None:
        before = _precision_name(old_level, old_dtype)
        after = _precision_name(plan.opt_level, plan.dtype_name)
        same_dtype = before.split()[1] == after.split()[1]
        if before != after:
            had_scale = (checkpoint.get("loss_scale") or {}).get("scale") is not None  # a bf16/fp32 run has none
            carried = "" if same_dtype or not had_scale else "; its loss scale is not carried across dtypes"
            warn(accelerator, f"resuming a checkpoint trained at {before} with {after}: its fp32 weights "
                              f"and optimizer state carry over{carried}")
    # Global batch = batch x processes x accumulation steps on both sides (global_batch()); a
    # checkpoint whose args lack accum_steps was written before --accum-steps: 1.
    stored = checkpoint.get("args") or {}
    old_batch, old_world = stored.get("batch_size"), checkpoint.get("world_size") or accelerator.num_processes
    old_accum = stored.get("accum_steps") or 1
    if isinstance(old_batch, int) and isinstance(old_accum, int):
        old_global, new_global = old_batch * old_world * old_accum, resume.global_batch(accelerator)
        if old_global != new_global and resume.training:  # -e trains nothing
            warn(accelerator, f"resuming with global batch {new_global} (--batch-size {resume.batch_size} x "
                              f"{accelerator.num_processes} process(es) x --accum-steps "
                              f"{resume.accum_steps}) where the checkpoint had {old_global} "
                              f"({old_batch} x {old_world} x {old_accum}): the LR scales with it "
                              f"({resume.lr * old_global / 256:g} -> {resume.lr * new_global / 256:g} at full "
                              "rate) and the epoch's shuffle is cut differently")
    return same_dtype
