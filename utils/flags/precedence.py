"""Flag resolution for the scripts: the precedence defaults < a resumed checkpoint's flags <
--config < typed (parse_flags), the defaults each DATA source and model give the flags left out,
and the checks and warnings that need the flags together (parse_args)."""
import os
import sys

from utils.compiled import DEFAULT_BACKEND
from utils.data.batches import IMAGENET_MEAN, IMAGENET_STD
from utils.data.sources import source_kind
from utils.flags.config import load_config
from utils.flags.parser import PROF_STEPS, flag_actions, flag_name, typed_dests
from utils.models import model_data_config
from utils.precision import HALF_DTYPES
from utils.run.checkpoint import CHECKPOINT, kept_checkpoints, load_checkpoint
from utils.run.errors import UsageError

# Defaults that depend on the source; a flag given on the command line always wins. mean and std
# are no flags: they come from the model (utils.models.model_data_config) or these defaults.
# The digits demo decays its LR inside its 12 epochs (ImageNet's 30/60/80 never come) and warms up
# for one epoch only: measured, its last epoch then ends at 99.2 % top-1 (98.6 % with --seed 1),
# where the undecayed LR left it at 94 %.
SOURCE_DEFAULTS = {
    "digits": dict(epochs=12, batch_size=64, image_size=32, min_scale=0.35, hflip=0.0, workers=2,
                   lr_steps=[6, 9], warmup_epochs=1),
    "default": dict(epochs=90, batch_size=256, image_size=224, min_scale=0.08, hflip=0.5, workers=4,
                    crop_pct=0.875, interpolation="bilinear", mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD),
                    lr_steps=[30, 60, 80], warmup_epochs=5),
}
# Flags a resumed run never takes from its checkpoint: where and how this run starts, and what the
# machine decided (data backend, memory format, worker count are settled again for this device).
NOT_RESUMED = ("resume", "config", "output_dir", "start_epoch", "evaluate", "overwrite", "local_rank",
               "data_backend", "jpeg_decoder", "channels_last", "workers", "prof")
# Options only their switch reads. With the switch off, a value a checkpoint stored for a run that
# had it on, or a recipe's where --model-ema False / --compile False is typed, falls back to its
# default, rather than being refused as an option without its switch that nobody typed.
SWITCH_OPTIONS = {"compile": ("compile_mode", "tune_kernels"), "model_ema": ("model_ema_decay", "model_ema_best"),
                  "bce_loss": ("bce_target_thresh",)}
# The input pipeline's flags (decode, crop, workers). Synthetic tensors are made on the device and
# pass through none of it; the batch-level ingredients (--mixup, --reprob) still apply to them.
PIPELINE_FLAGS = {"min_scale": "--min-scale", "hflip": "--hflip", "crop_pct": "--crop-pct",
                  "val_resize_size": "--val-resize-size", "interpolation": "--interpolation", "workers": "-j/--workers",
                  "aa": "--aa", "ra_reps": "--ra-reps", "ra_sampler": "--ra-sampler", "min_res": "--min-res"}
# FFCV's progressive resizing: these four come together, and replace --train-crop-size.
PROGRESSIVE = ("min_res", "max_res", "start_ramp", "end_ramp")
# Two spellings of one setting. Given in the same layer (typed, or one --config file) they are
# refused; from different layers (a checkpoint's, a recipe's, typed) the later one wins and the
# other goes back to its default (None), so a typed --crop-pct replaces a recipe's --val-resize-size.
ALTERNATIVES = ((("crop_pct",), ("val_resize_size",), "--crop-pct and --val-resize-size both set validation's resize "
                 "(resize = val crop / crop pct); give one"),
                (("train_crop_size",), PROGRESSIVE, "--train-crop-size and progressive resizing (--min-res, --max-res, "
                 "--start-ramp, --end-ramp) both set the training crop size; give one"))
# --image-size sets both crops; each of these replaces it for its side, from the same or a later layer.
CROP_SIDES = ("train_crop_size", "val_crop_size")


def parse_args(parser, argv=None):
    """The flags of train.py, eval.py or profile.py, resolved once: parsed in their precedence,
    the source's and the model's defaults filled in, checked together."""
    args = parse_flags(parser, argv)
    check_lr_steps(args)  # before the source defaults fill --lr-steps in
    # A timm model's own input size, crop pct, interpolation and mean/std fill what no flag set.
    apply_source_defaults(args, model_data_config(args.arch))
    warn_unreached_milestones(args)
    warn_endless_warmup(args)
    if not 0.0 < args.crop_pct <= 1.0:
        raise UsageError(f"--crop-pct must be in (0, 1], got {args.crop_pct}")
    check_geometry(args)
    if not 0.0 < args.min_scale <= 1.0:
        raise UsageError(f"--min-scale must be in (0, 1], got {args.min_scale}")
    if not 0.0 <= args.hflip <= 1.0:
        raise UsageError(f"--hflip is a probability in [0, 1], got {args.hflip}")
    # With --resume the checkpoint sets the start epoch (build_or_resume checks it there).
    if not args.evaluate and not args.resume and args.start_epoch >= args.epochs:
        raise UsageError(f"--start-epoch {args.start_epoch} leaves nothing to train with --epochs "
                         f"{args.epochs} (the total, counted from 0); raise --epochs or lower --start-epoch")
    if args.prof >= 0:
        window = args.prof_steps if "prof_steps" in flag_actions(parser) else PROF_STEPS  # profile.py's own
        if args.prof + window > (args.steps_per_epoch or sys.maxsize):
            raise UsageError(f"--prof {args.prof} needs {args.prof + window} steps but --steps-per-epoch is "
                             f"{args.steps_per_epoch}")
    return args


def parse_flags(parser, argv=None):
    """The command line in its precedence, lowest first:

      1. the parser's defaults;
      2. the flags stored in the checkpoint that --resume FILE|DIR|auto continues;
      3. the --config YAML recipe's (utils.flags.config);
      4. the flags typed, which always win.

    argparse does the merge: layers 2 and 3 become the parser's defaults (parser.set_defaults, in
    that order) before a second parse of the same argv, so a typed value is checked once, by its
    flag's own type, as a recipe's was. The first parse answers --help and refuses bad values
    before any file is read. Where a value came from then matters in a few places, settled below:
    a line names each flag that differs from the checkpoint's; options of a switch turned off
    and the milestones of a step schedule replaced fall back with it; a checkpoint's choice made
    for its opt level (--keep-batchnorm-fp32) gives way to another level given. eval.py's parser
    (no --config; its checkpoint's settings are the defaults eval.py sets) has layers 1 and 4."""
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    first = parser.parse_args(argv)
    actions = flag_actions(parser)
    typed = typed_dests(parser, argv)
    if "config" not in actions:  # eval.py: the checkpoint's settings are the parser's defaults, below typed
        settle_alternatives(first, [typed], actions)
        return first
    resume, output_dir, lines = resolve_resume(first.resume, first.output_dir, "output_dir" in typed)
    stored, loaded = resume_flags(resume, actions)
    lines += loaded
    if resume and first.pretrained:  # --pretrained False says what a resume does anyway
        raise UsageError("--pretrained and --resume both give the starting weights (the checkpoint's would replace "
                         "the pretrained ones); drop --pretrained")
    defaults = {dest: parser.get_default(dest) for dest in actions}  # layer 1, before 2 and 3 replace it
    # A backend other than inductor that the run resolved --compile to (Accelerate's eager...): argparse
    # would read it through --compile's True|False type, so it goes in as True and is put back below.
    backend = stored["compile"] if isinstance(stored.get("compile"), str) else None
    parser.set_defaults(**{**stored, **({"compile": True} if backend else {})})
    configured = load_config(parser, first.config) if first.config else {}
    parser.set_defaults(**configured)
    args = parser.parse_args(argv)
    args.resume, args.output_dir = resume, output_dir
    settle_alternatives(args, [set(configured), typed], actions)
    warnings = reject_pipeline_flags(args, typed, configured, defaults)
    given = typed | set(configured)  # a --config's flags override the checkpoint's as typed ones do
    if backend and "compile" not in given:
        args.compile = backend  # utils.compiled.resolve_compile keeps it unless Accelerate names one
    if fp32_over_inherited_level(args, given):
        given |= {"opt_level"}
    if "keep_batchnorm_fp32" in stored:
        keep_bn_for_opt_level(args, "opt_level" in given, "keep_batchnorm_fp32" in given, stored.get("opt_level"),
                              defaults["keep_batchnorm_fp32"])
    if args.lr_schedule != "step" and "lr_schedule" in typed and "lr_steps" in set(configured) - typed:
        args.lr_steps = None  # the file's milestones belong to its step schedule, which the typed one replaced
    if stored and args.lr_schedule != "step" and args.lr_steps == stored.get("lr_steps"):
        args.lr_steps = None  # a resolved step schedule's milestones mean nothing to another schedule
    for switch, options in SWITCH_OPTIONS.items():
        if switch in actions and not getattr(args, switch):  # profile.py has no --model-ema
            for dest in options:
                inherited = dest in stored and dest not in configured
                if dest not in typed and (inherited or (switch in typed and dest in configured)):
                    setattr(args, dest, defaults[dest])
    for dest, old in stored.items():
        new = getattr(args, dest)
        if new != old and not (dest == "lr_steps" and new is None):
            lines.append(f"=> {flag_name(actions[dest])} {_shown(new)} (checkpoint: {_shown(old)})")
    if int(os.environ.get("RANK", 0)) == 0:
        for line in lines:
            print(line, flush=True)
        for line in warnings:
            print(line, file=sys.stderr, flush=True)
    return args


def settle_alternatives(args, layers, actions):
    """Apply ALTERNATIVES and CROP_SIDES: layers are the sets of dests each layer above the
    defaults and a checkpoint's flags gave, lowest first (a --config's, then the typed ones)."""
    for one, other, message in ALTERNATIVES:
        for given in reversed(layers):
            first, second = set(one) & given, set(other) & given
            if first and second:
                raise UsageError(message)
            if first or second:
                for dest in (other if first else one):
                    if dest in actions:
                        setattr(args, dest, None)
                break
    sides = [dest for dest in CROP_SIDES if dest in actions]
    for given in layers:
        if "image_size" in given and sides and all(dest in given for dest in sides):
            raise UsageError(f"--image-size sets nothing that {' and '.join(flag_name(actions[d]) for d in sides)} "
                             "do not replace; drop it")
    latest = lambda dest: max((k for k, given in enumerate(layers) if dest in given), default=-1)
    for dest in sides:
        if latest("image_size") > latest(dest):  # a later --image-size replaces an older layer's crop size
            setattr(args, dest, None)


def _shown(value):
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def fp32_over_inherited_level(args, given):
    """--mixed-precision no given where the opt level was not, but inherited from a checkpoint (a
    half level, chosen for its half dtype): fp32 is asked for, so the level is O0, not a
    contradiction of a flag nobody typed. Returns whether the level changed."""
    if args.mixed_precision == "no" and "mixed_precision" in given and "opt_level" not in given \
            and args.opt_level not in (None, "O0"):
        args.opt_level = "O0"
        return True
    return False


def keep_bn_for_opt_level(args, level_given, keep_bn_given, inherited_level, default=None):
    """A --keep-batchnorm-fp32 inherited from a checkpoint was chosen for the checkpoint's opt level:
    with another --opt-level given and no --keep-batchnorm-fp32, the new level's default applies
    (not, say, a choice O1 refuses). train.py's --resume and eval.py share this rule."""
    if level_given and not keep_bn_given and args.opt_level != inherited_level:
        args.keep_batchnorm_fp32 = default


def reject_pipeline_flags(args, typed, configured, defaults):
    """synthetic DATA with input-pipeline flags typed: a usage error naming them (-j 0, or a value
    equal to the default, says what is true and passes; a resumed synthetic run's stored values are
    not asked for). In a --config file (a recipe written for real data) they are only named: the
    returned lines warn that they have no effect here."""
    if source_kind(args.data) != "synthetic":
        return []
    given = [flag for dest, flag in PIPELINE_FLAGS.items() if dest in typed and getattr(args, dest) != defaults[dest]
             and not (dest == "workers" and args.workers == 0)]
    if given:
        raise UsageError(f"{', '.join(given)}: synthetic data is made on the device, with no decode, crop or "
                         f"loader workers; drop {'it' if len(given) == 1 else 'them'}")
    from_config = [flag for dest, flag in PIPELINE_FLAGS.items() if dest in set(configured) - set(typed)]
    if from_config:
        return [f"warning: --config sets {', '.join(from_config)}, which synthetic data (made on the device, "
                "with no decode, crop or loader workers) does not use"]
    return []


def resolve_resume(resume, output_dir, output_dir_typed):
    """--resume auto|DIR|FILE and --output-dir as (the checkpoint file or "", the output directory,
    lines to print). A directory continues from its checkpoint.pth.tar (always the newest write,
    mid-epoch ones included), else its newest kept checkpoint-epochNNN.pth.tar. auto looks in
    --output-dir and starts fresh, saying so, when it holds none yet; a DIR without one is refused,
    and is also the output directory unless --output-dir is typed."""
    if resume != "auto" and not (resume and os.path.isdir(resume)):
        return resume, output_dir, []  # none, or a file (load_checkpoint names a missing one in build_or_resume)
    directory = output_dir if resume == "auto" else resume
    path = os.path.join(directory, CHECKPOINT)
    kept = kept_checkpoints(directory) if os.path.isdir(directory) else []
    found = path if os.path.isfile(path) else os.path.join(directory, kept[-1][1]) if kept else None
    if found is None and resume == "auto":
        return "", output_dir, [f"=> --resume auto: no checkpoint in {output_dir!r} yet, starting a new run"]
    if found is None:
        raise UsageError(f"--resume {resume!r}: the directory holds no {CHECKPOINT} (nor a kept "
                         "checkpoint-epochNNN.pth.tar); give a checkpoint file or the run's directory")
    return found, output_dir if resume == "auto" or output_dir_typed else resume, []


def resume_flags(path, dests):
    """The flags (of dests) that the checkpoint at path stored, as {dest: value}, and the line to
    print; nothing without a checkpoint file."""
    if not os.path.isfile(path):
        return {}, []
    checkpoint = load_checkpoint(path)
    stored = checkpoint.get("args") or {}
    flags = {dest: value for dest, value in stored.items() if dest in dests and dest not in NOT_RESUMED}
    if flags.get("compile") == DEFAULT_BACKEND:  # what --compile resolved to; another backend stays (parse_flags)
        flags["compile"] = True
    if flags.get("mixed_precision") is None:
        dtype = half_dtype_to_inherit(checkpoint, checkpoint.get("opt_level") or "O0")
        flags.update({"mixed_precision": dtype} if dtype else {})
    return flags, [f"=> --resume: {len(flags)} flags from {path} (flags typed again win)"]


def checkpoint_half_dtype(checkpoint):
    """fp16/bf16 the checkpoint was trained with, or None (fp32, or not recorded)."""
    for value in (checkpoint.get("mixed_precision"), (checkpoint.get("args") or {}).get("mixed_precision")):
        if value in HALF_DTYPES:
            return value
    return None


def half_dtype_to_inherit(checkpoint, opt_level):
    """The checkpoint's fp16/bf16 for a run at a half opt level that names no dtype itself, unless
    Accelerate's setting names one (it wins); None otherwise. A run whose dtype came from Accelerate
    (`accelerate launch --mixed_precision bf16`) stored no flag: resumed or evaluated under a config
    saying 'no', as the shipped yamls do, it went on in Apex's fp16."""
    if opt_level == "O0" or os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() in HALF_DTYPES:
        return None
    return checkpoint_half_dtype(checkpoint)


def apply_source_defaults(args, model_config=None):
    """Fill flags left at None: first the digits demo's own sizes and schedule (digits is small and
    grey), then the model's data config (a timm model's input size, crop pct, interpolation,
    mean/std), then the ImageNet defaults. A default warmup is cut to a quarter of --epochs, and
    the default workers never outnumber the cores there are."""
    default_warmup = args.warmup_epochs is None
    layers = [SOURCE_DEFAULTS["digits"]] if source_kind(args.data) == "digits" else []
    for defaults in layers + [model_config or {}, SOURCE_DEFAULTS["default"]]:
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, min(value, len(os.sched_getaffinity(0))) if name == "workers" else value)
    if default_warmup:  # short runs (--epochs 8) would otherwise spend most of their epochs warming up
        args.warmup_epochs = min(args.warmup_epochs, args.epochs // 4)
    return args


def check_geometry(args):
    """The crop sizes, the progressive schedule and the repeated-augmentation sampler, together."""
    if args.val_resize_size is not None and args.val_resize_size < (args.val_crop_size or args.image_size):
        raise UsageError(f"--val-resize-size {args.val_resize_size} is below the validation crop "
                         f"{args.val_crop_size or args.image_size}: the crop must fit inside the resized image")
    given = [dest for dest in PROGRESSIVE if getattr(args, dest) is not None]
    if given and len(given) < len(PROGRESSIVE):
        missing = ", ".join("--" + dest.replace("_", "-") for dest in PROGRESSIVE if dest not in given)
        raise UsageError(f"progressive resizing needs --min-res, --max-res, --start-ramp and --end-ramp together; "
                         f"add {missing}")
    if given:
        if args.min_res > args.max_res:
            raise UsageError(f"--min-res {args.min_res} is above --max-res {args.max_res}")
        if args.start_ramp >= args.end_ramp:
            raise UsageError(f"--start-ramp {args.start_ramp} must come before --end-ramp {args.end_ramp}")
        if not args.evaluate and args.start_ramp >= args.epochs - 1:
            raise UsageError(f"--start-ramp {args.start_ramp}: with --epochs {args.epochs} (epochs 0-"
                             f"{args.epochs - 1}) no epoch trains above --min-res; start the ramp earlier")
    elif args.res_step != 32:
        raise UsageError("--res-step rounds the sizes of progressive resizing: it needs --min-res, --max-res, "
                         "--start-ramp and --end-ramp")
    if args.ra_reps is None:
        args.ra_reps = 3 if args.ra_sampler else 1  # torchvision's default repeats
    if args.ra_sampler and args.ra_reps < 2:
        raise UsageError("--ra-sampler with --ra-reps 1 repeats nothing; give --ra-reps 2 or more, or drop it")


def check_lr_steps(args):
    """--lr-steps: increasing epochs, and only for the step schedule (no flag parsed and ignored)."""
    steps = args.lr_steps
    if steps is None:
        return
    if args.lr_schedule != "step":
        raise UsageError(f"--lr-steps applies to --lr-schedule step, not {args.lr_schedule}; drop it")
    if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
        raise UsageError(f"--lr-steps must be increasing epochs, got {' '.join(map(str, steps))}")


def warn_unreached_milestones(args):
    """A step schedule whose milestones all lie at or past --epochs never decays the LR: say so.
    Called before the Accelerator exists, so the rank comes from the launcher's RANK variable."""
    if args.evaluate or args.lr_schedule != "step" or int(os.environ.get("RANK", 0)) != 0:
        return
    if not any(milestone < args.epochs for milestone in args.lr_steps):
        print(f"warning: no --lr-steps milestone ({' '.join(map(str, args.lr_steps))}) falls inside "
              f"--epochs {args.epochs}, so the LR never decays; pass --lr-steps with earlier epochs",
              file=sys.stderr, flush=True)


def warn_endless_warmup(args):
    """A warmup as long as the run (a recipe's 5 epochs with --epochs 3 typed) never reaches the
    LR asked for: say so. A default warmup is already cut to a quarter of --epochs."""
    if not args.evaluate and int(os.environ.get("RANK", 0)) == 0 and args.warmup_epochs >= args.epochs > 0:
        print(f"warning: --warmup-epochs {args.warmup_epochs} is not below --epochs {args.epochs}, so the LR "
              f"never reaches --lr {args.lr:g} (x global batch / 256); pass a shorter --warmup-epochs",
              file=sys.stderr, flush=True)


def check_ingredient_flags(args):
    """Refuse flags that would be parsed and do nothing: the EMA's options without --model-ema,
    --mixup-switch-prob without both alphas, --bce-target-thresh without --bce-loss."""
    if not args.model_ema and (args.model_ema_best or args.model_ema_decay != 0.9998):
        raise UsageError("--model-ema-decay and --model-ema-best need --model-ema")
    if args.mixup_switch_prob != 0.5 and not (args.mixup and args.cutmix):
        raise UsageError("--mixup-switch-prob chooses between mixup and cutmix: it needs --mixup and --cutmix > 0")
    if args.bce_target_thresh is not None and not args.bce_loss:
        raise UsageError("--bce-target-thresh thresholds the targets of the BCE loss: it needs --bce-loss")
    if args.model_ema and not 0.0 < args.model_ema_decay < 1.0:
        raise UsageError(f"--model-ema-decay must be in (0, 1), got {args.model_ema_decay}")
