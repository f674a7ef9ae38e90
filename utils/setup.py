"""Start-up steps shared by the scripts: flags to Accelerator, recipe, determinism, output
directory, model."""
import contextlib
import os
import shutil
import sys

import torch

from .checkpoint import BEST, CHECKPOINT, kept_checkpoints, load_checkpoint, load_model_weights
from .cli import apply_source_defaults, source_kind, typed_dests
from .compiled import DEFAULT_BACKEND, compile_model, resolve_compile
from .errors import UsageError, first_line
from .files import TEMP_PREFIX, atomic_write, writer_gone
from .models import build_model, check_input_size, has_2d_convolutions, model_data_config
from .precision import HALF_DTYPES, Precision, cpu_fp16_note, requested_mixed_precision, resolve_recipe
from .recipe import build_ema, build_optimizer


def parse_args(parser, argv=None):
    args = parse_flags(parser, argv)
    check_lr_steps(args)  # before the source defaults fill --lr-steps in
    # A timm model's own input size, crop pct, interpolation and mean/std fill what no flag set.
    apply_source_defaults(args, model_data_config(args.arch))
    warn_unreached_milestones(args)
    warn_endless_warmup(args)
    if not 0.0 < args.crop_pct <= 1.0:
        raise UsageError(f"--crop-pct must be in (0, 1], got {args.crop_pct}")
    if not 0.0 < args.min_scale <= 1.0:
        raise UsageError(f"--min-scale must be in (0, 1], got {args.min_scale}")
    if not 0.0 <= args.hflip <= 1.0:
        raise UsageError(f"--hflip is a probability in [0, 1], got {args.hflip}")
    # With --resume the checkpoint sets the start epoch (build_or_resume checks it there).
    if not getattr(args, "evaluate", False) and not getattr(args, "resume", "") \
            and args.start_epoch >= args.epochs:
        raise UsageError(f"--start-epoch {args.start_epoch} leaves nothing to train with --epochs "
                         f"{args.epochs} (the total, counted from 0); raise --epochs or lower --start-epoch")
    window = getattr(args, "prof_steps", 10)  # profile.py's --prof-steps; train.py's window is 10
    if args.prof >= 0 and args.prof + window > (args.steps_per_epoch or sys.maxsize):
        raise UsageError(f"--prof {args.prof} needs {args.prof + window} steps but --steps-per-epoch is "
                         f"{args.steps_per_epoch}")
    return args


# Flags a resumed run never takes from its checkpoint: where and how this run starts, and what the
# machine decided (data backend, memory format, worker count are settled again for this device).
NOT_RESUMED = ("resume", "config", "output_dir", "start_epoch", "evaluate", "overwrite", "local_rank",
               "data_backend", "jpeg_decoder", "channels_last", "workers", "prof")


def parse_flags(parser, argv=None):
    """The command line, with train.py's --config and --resume auto|DIR applied: defaults, then the
    resumed checkpoint's flags, then the --config file's, then what is typed (which always wins).
    Both go through parser.set_defaults, so typed flags are validated once, by argparse itself."""
    from .cli import flag_name, load_config

    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    first = parser.parse_args(argv)
    if not hasattr(first, "config"):  # eval.py: its --resume is a file, it takes no recipe
        return first
    typed = typed_dests(parser, argv)
    stored, lines = resume_flags(parser, first, typed)
    if first.resume and first.pretrained:  # --pretrained False says what a resume does anyway
        raise UsageError("--pretrained and --resume both give the starting weights (the checkpoint's would replace "
                         "the pretrained ones); drop --pretrained")
    keep_bn_default = parser.get_default("keep_batchnorm_fp32")  # before the checkpoint's replaces it
    pipeline_defaults = {dest: parser.get_default(dest) for dest in PIPELINE_FLAGS}  # and the --config's
    option_defaults = {dest: parser.get_default(dest) for options in SWITCH_OPTIONS.values() for dest in options}
    # A backend other than inductor that the run resolved --compile to (Accelerate's eager...): argparse
    # would read it through --compile's True|False type, so it goes in as True and is put back below.
    resumed_backend = stored.get("compile") if isinstance(stored.get("compile"), str) else None
    if stored:
        parser.set_defaults(**{**stored, **({"compile": True} if resumed_backend else {})})
    configured = load_config(parser, first.config) if first.config else {}
    parser.set_defaults(**configured)
    args = parser.parse_args(argv)
    args.resume, args.output_dir = first.resume, first.output_dir  # as resolved by resume_flags
    warnings = reject_pipeline_flags(args, typed, configured, pipeline_defaults)
    given = typed | set(configured)  # a --config's flags override the checkpoint's as typed ones do
    if resumed_backend and "compile" not in given:
        args.compile = resumed_backend  # utils.compiled.resolve_compile keeps it unless Accelerate names one
    if fp32_over_inherited_level(args, given):
        given |= {"opt_level"}
    if "keep_batchnorm_fp32" in stored:
        keep_bn_for_opt_level(args, "opt_level" in given, "keep_batchnorm_fp32" in given,
                              stored.get("opt_level"), keep_bn_default)
    if args.lr_schedule != "step" and "lr_schedule" in typed and "lr_steps" in set(configured) - typed:
        args.lr_steps = None  # the file's milestones belong to its step schedule, which the typed one replaced
    drop_options_of_switches_off(args, typed, stored, configured, option_defaults)
    if stored:
        if args.lr_schedule != "step" and args.lr_steps == stored.get("lr_steps"):
            args.lr_steps = None  # a resolved step schedule's milestones mean nothing to another schedule
        actions = {action.dest: action for action in parser._actions}
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


# Options only their switch reads. With the switch off, a value a checkpoint stored for a run that
# had it on, or a recipe's where --model-ema False / --compile False is typed, falls back to its
# default, rather than being refused as an option without its switch that nobody typed.
SWITCH_OPTIONS = {"compile": ("compile_mode",), "model_ema": ("model_ema_decay", "model_ema_best")}


def drop_options_of_switches_off(args, typed, stored, configured, defaults):
    for switch, options in SWITCH_OPTIONS.items():
        if getattr(args, switch, True):
            continue
        for dest in options:
            inherited = dest in stored and dest not in configured
            if dest not in typed and (inherited or (switch in typed and dest in configured)):
                setattr(args, dest, defaults[dest])


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


# The input pipeline's flags (decode, crop, workers). Synthetic tensors are made on the device and
# pass through none of it; the batch-level ingredients (--mixup, --reprob) still apply to them.
PIPELINE_FLAGS = {"min_scale": "--min-scale", "hflip": "--hflip", "crop_pct": "--crop-pct",
                  "interpolation": "--interpolation", "workers": "-j/--workers", "aa": "--aa"}


def reject_pipeline_flags(args, typed, configured=(), defaults=None):
    """synthetic DATA with input-pipeline flags typed: a usage error naming them (-j 0, or a value
    equal to the default, says what is true and passes; a resumed synthetic run's stored values are
    not asked for). In a --config file (a recipe written for real data) they are only named: the
    returned lines warn that they have no effect here."""
    if source_kind(args.data) != "synthetic":
        return []
    defaults = defaults or {}
    asked = {dest for dest in typed if getattr(args, dest, None) != defaults.get(dest, object())}
    asked -= {"workers"} if args.workers == 0 else set()
    given = [flag for dest, flag in PIPELINE_FLAGS.items() if dest in asked]
    if given:
        raise UsageError(f"{', '.join(given)}: synthetic data is made on the device, with no decode, crop or "
                         f"loader workers; drop {'it' if len(given) == 1 else 'them'}")
    from_config = [flag for dest, flag in PIPELINE_FLAGS.items() if dest in set(configured) - set(typed)]
    if from_config:
        return [f"warning: --config sets {', '.join(from_config)}, which synthetic data (made on the device, "
                "with no decode, crop or loader workers) does not use"]
    return []


def _shown(value):
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def find_resume_checkpoint(directory):
    """The checkpoint a run directory continues from: checkpoint.pth.tar (always the newest write,
    mid-epoch ones included), else the newest kept checkpoint-epochNNN.pth.tar, else None."""
    path = os.path.join(directory, CHECKPOINT)
    if os.path.isfile(path):
        return path
    kept = kept_checkpoints(directory)
    return os.path.join(directory, kept[-1][1]) if kept else None


def resume_flags(parser, args, typed=()):
    """Resolve --resume auto|DIR to a checkpoint file (in args) and read the run's flags from it.
    Returns ({dest: stored value} for the parser's flags, lines to print). auto with nothing in
    --output-dir starts fresh and says so; a DIR without a checkpoint is refused; a DIR is also
    the output directory unless --output-dir is typed (typed: the dests typed)."""
    if not args.resume:
        return {}, []
    lines = []
    if args.resume == "auto":
        found = find_resume_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
        if found is None:
            args.resume = ""
            return {}, [f"=> --resume auto: no checkpoint in {args.output_dir!r} yet, starting a new run"]
        args.resume = found
    elif os.path.isdir(args.resume):
        found = find_resume_checkpoint(args.resume)
        if found is None:
            raise UsageError(f"--resume {args.resume!r}: the directory holds no {CHECKPOINT} (nor a kept "
                             "checkpoint-epochNNN.pth.tar); give a checkpoint file or the run's directory")
        if "output_dir" not in typed:  # continue the run where it is
            args.output_dir = args.resume
        args.resume = found
    if not os.path.isfile(args.resume):
        return {}, []  # load_checkpoint names the missing file in build_or_resume
    checkpoint = load_checkpoint(args.resume)
    stored = checkpoint.get("args") or {}
    dests = {action.dest for action in parser._actions}
    flags = {dest: value for dest, value in stored.items() if dest in dests and dest not in NOT_RESUMED}
    if flags.get("compile") == DEFAULT_BACKEND:  # what --compile resolved to; another backend stays (parse_flags)
        flags["compile"] = True
    if "mixed_precision" in dests and flags.get("mixed_precision") is None:
        dtype = half_dtype_to_inherit(checkpoint, checkpoint.get("opt_level") or "O0")
        flags.update({"mixed_precision": dtype} if dtype else {})
    lines.append(f"=> --resume: {len(flags)} flags from {args.resume} (flags typed again win)")
    return flags, lines


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


def warn_endless_warmup(args):
    """A warmup as long as the run (a recipe's 5 epochs with --epochs 3 typed) never reaches the
    LR asked for: say so. A default warmup is already cut to a quarter of --epochs."""
    if getattr(args, "evaluate", False) or int(os.environ.get("RANK", 0)) != 0:
        return
    if getattr(args, "warmup_epochs", 0) >= args.epochs > 0:
        print(f"warning: --warmup-epochs {args.warmup_epochs} is not below --epochs {args.epochs}, so the LR "
              f"never reaches --lr {args.lr:g} (x global batch / 256); pass a shorter --warmup-epochs",
              file=sys.stderr, flush=True)


# The files a training run writes into --output-dir (utils/checkpoint.py, utils/logs.py). A new run
# never replaces another run's without --overwrite: with Apex everyone ran in the working directory
# and a second run silently replaced the first; timm makes a new folder per run, which leaves the
# first intact but scatters runs and makes "where is my checkpoint" a search. Resuming is the usual
# intent, so the refusal names the --resume command, and --overwrite says "start over" explicitly.
RUN_FILES = (CHECKPOINT, BEST, "summary.csv", "args.yaml", "curves.png")
PROBE = ".write-test"


def prepare_output_dir(args, accelerator):
    """Settle --output-dir before any data or model is built: create it, prove it writable, remove
    temp files a killed save left there, and refuse to replace another run's files. The main
    process checks; every process gets its verdict, so all of them stop with the same one-line
    error (none is left waiting for the others). -e and --prof write nothing, so nothing is
    checked. Returns the previous run's files --overwrite replaces (main process; remove_replaced_run)."""
    if getattr(args, "evaluate", False) or getattr(args, "prof", -1) >= 0:
        return []
    problem, replaced = None, []
    if accelerator.is_main_process:
        try:
            lines, replaced = settle_output_dir(args)
            for line in lines:
                print(line, flush=True)
        except UsageError as err:
            problem = str(err)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise UsageError(problem)
    return replaced


def remove_replaced_run(args, accelerator, replaced):
    """--overwrite's removal of the previous run's files, by the main process, once the new run has
    built its data and model and passed its checks: a mistyped command line (DATA, -a, a flag's
    value) stops before this and leaves the previous run as it was."""
    if not accelerator.is_main_process or not replaced:
        return
    for name in replaced:
        path = os.path.join(args.output_dir, name)
        if os.path.lexists(path):
            os.remove(path)
    print(f"=> --overwrite: removed the previous run's {', '.join(replaced)} from {args.output_dir}", flush=True)


def settle_output_dir(args):
    """The main process's part of prepare_output_dir; returns (lines to print, the previous run's
    files that --overwrite replaces, removed later by remove_replaced_run)."""
    out = args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output-dir {out!r} is a file, not a directory; give a directory (created "
                         "if missing)")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create --output-dir {out!r}: {err.strerror}"
                         f"{f' ({err.filename})' if err.filename and err.filename != out else ''}; "
                         "give a directory you can write to") from None
    try:  # through the same atomic write every output file takes
        probe = atomic_write(os.path.join(out, f"{PROBE}-{os.getpid()}"), b"")
        os.remove(probe)
    except OSError as err:
        raise UsageError(f"--output-dir {out!r} is not writable ({err.strerror}); give a directory you "
                         "can write to") from None
    lines = []
    found = [name for name in RUN_FILES if os.path.lexists(os.path.join(out, name))]
    found += [name for _, name in kept_checkpoints(out)]  # --keep-checkpoints copies are the run's too
    resume = getattr(args, "resume", "")
    overwrite = getattr(args, "overwrite", False)
    if resume and not os.path.isfile(resume):
        return lines, []  # load_checkpoint names the missing file next, before anything is written
    continuing = bool(resume) and os.path.samefile(os.path.dirname(os.path.abspath(resume)), out)
    if continuing and overwrite:
        raise UsageError(f"--overwrite would remove the run in {out!r} that --resume {resume} continues; "
                         "drop --overwrite to continue it, or drop --resume to start over")
    if continuing:
        newest = os.path.join(out, CHECKPOINT)
        if (os.path.isfile(newest) and not os.path.samefile(newest, resume)
                and os.path.getmtime(newest) > os.path.getmtime(resume)):
            lines.append(f"=> --resume {os.path.basename(resume)}: the {CHECKPOINT} beside it is newer; this "
                         f"run continues from the older file and its saves replace {CHECKPOINT}")
    if not found or continuing:
        return remove_stale_temp_files(out) + lines, []
    if not overwrite:
        listed = ", ".join(found)
        if resume:
            raise UsageError(f"--output-dir {out!r} holds another run's files ({listed}) that resuming "
                             f"{resume!r} there would replace; choose another --output-dir, or pass "
                             "--overwrite to replace them")
        how = (f"continue it with --resume {os.path.join(out, CHECKPOINT)}, " if CHECKPOINT in found else "")
        raise UsageError(f"--output-dir {out!r} already holds a run ({listed}); {how}start over with "
                         "--overwrite (removes those files), or choose another --output-dir")
    lines.append(f"=> --overwrite: the previous run's {', '.join(found)} in {out} will be removed once this run "
                 "has built its data and model")
    return remove_stale_temp_files(out) + lines, found


def remove_stale_temp_files(out):
    """Temp files (utils.files.TEMP_PREFIX) of a save that was killed before its rename: never a
    finished file, so safe to delete once this run owns the directory. Those of a writer still
    running (another run saving into the same folder right now) are left alone."""
    stale = sorted(name for name in os.listdir(out) if name.startswith(TEMP_PREFIX) and writer_gone(name))
    for name in stale:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # gone already, or not ours to remove: harmless
                os.remove(path)
    if not stale:
        return []
    shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
    return [f"=> removed {len(stale)} temp file(s) an interrupted save left in {out}: {shown}"]


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


# CUDA multiplexes every stream of a process onto this many hardware work queues (default 8).
# Streams that share a queue run in submission order, so a small kernel of the gpu backend's
# JPEG decoder (nvJPEG / nvImageCodec run one per image, each followed by a host wait) can sit
# behind a whole queued training step. On an H200 with a CUDA-graphed ResNet-50 step replaying
# beside it, batched decode fell from ~9,000 to ~250 img/s with 8 queues and ran at ~3,700 with 32
# (docs/speed.md). 32 is CUDA's maximum; a value the user set is kept.
CUDA_WORK_QUEUES = "32"


def widen_cuda_work_queues():
    """Set CUDA_DEVICE_MAX_CONNECTIONS before this process creates its CUDA context (it is read
    then), unless the environment already says."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_WORK_QUEUES)


def narrow_queues_caveat():
    """For the gpu backend's start-up line: a word where the environment keeps fewer queues."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_WORK_QUEUES)
    if value.strip().isdigit() and int(value) >= int(CUDA_WORK_QUEUES):
        return ""
    return (f"; CUDA_DEVICE_MAX_CONNECTIONS={value} from the environment: the decoder may wait behind "
            f"the training step (unset it or use {CUDA_WORK_QUEUES}, docs/speed.md)")


def make_accelerator(args, **accelerator_kwargs):
    """An Accelerator that leaves precision to our recipe, and the resolved recipe with its notes.

    Accelerate's mixed_precision (flag, config or environment) only picks the half dtype; the
    Accelerator itself runs with mixed_precision='no' so it adds no autocast or GradScaler of its own.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    widen_cuda_work_queues()
    check_gpus_per_node()
    mixed_precision, source = requested_mixed_precision(args.mixed_precision)
    recipe, notes = resolve_recipe(args.opt_level, args.keep_batchnorm_fp32, args.loss_scale,
                                   mixed_precision, source)
    set_determinism(args)
    compile_note = resolve_compile(args)
    if compile_note:
        notes.append(compile_note)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False)
    # accelerator_kwargs: e.g. the trackers of train.py's --log-with (utils.logs.tracker_kwargs).
    # dynamo_backend "no": we compile ourselves, once (utils/compiled.py), whatever the config says.
    accelerator = Accelerator(mixed_precision="no", dynamo_backend="no", kwargs_handlers=[ddp],
                              **accelerator_kwargs)
    check_processes_joined(accelerator.num_processes)
    note = cpu_fp16_note(recipe, accelerator.device.type)
    if note:
        notes.append(note)
    resolve_device_defaults(args, accelerator.device.type)
    return accelerator, recipe, notes


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


def resolve_device_defaults(args, device_type):
    """Settle the flags whose default depends on the device: --channels-last and --data-backend.

    Sets args.input_line, the start-up line that says what was chosen and why.
    """
    cuda = device_type == "cuda"
    if args.channels_last is None:  # channels_last speeds up convolutions on CUDA; elsewhere not
        args.channels_last = cuda and has_2d_convolutions(args.arch)
        layout = f"channels_last {'on' if args.channels_last else 'off'} (default on {device_type})"
    else:
        layout = f"channels_last {'on' if args.channels_last else 'off'} (--channels-last)"
    kind = source_kind(args.data)
    wanted = getattr(args, "data_backend", "auto")
    if kind == "synthetic":
        backend, why = "none", "synthetic tensors are made on the device"
        if wanted != "auto":
            raise UsageError(f"--data-backend {wanted}: synthetic data has no input pipeline; drop the flag")
    elif wanted == "gpu" and not cuda:
        raise UsageError("--data-backend gpu decodes with nvJPEG on CUDA, and this run has no CUDA device; "
                         "use --data-backend cpu (or auto)")
    elif wanted == "gpu" and kind == "datasets":
        raise UsageError("--data-backend gpu reads ImageFolder files; Hugging Face datasets sources use "
                         "--data-backend cpu (or auto)")
    elif wanted == "auto":
        backend = "gpu" if cuda and kind != "datasets" else "cpu"
        why = ("auto: ImageFolder data on CUDA" if backend == "gpu" else
               "auto: Hugging Face datasets are decoded in the workers" if cuda else "auto: no CUDA")
    else:
        backend, why = wanted, "--data-backend"
    args.data_backend = backend
    decoder = getattr(args, "jpeg_decoder", "auto")
    if backend != "gpu" and decoder != "auto":
        raise UsageError(f"--jpeg-decoder {decoder} applies to the gpu data backend only, and this run uses "
                         f"{'no input pipeline' if backend == 'none' else 'the cpu backend'}; drop the flag")
    if backend == "gpu":
        from .gpu_batches import settle_jpeg_decoder
        args.jpeg_decoder, decoder_why = settle_jpeg_decoder(decoder, "cuda", getattr(args, "deterministic", False))
        engines = "hardware JPEG engines" if args.jpeg_decoder == "hardware" else "nvJPEG"
        decode = (f"{engines} batch decode + crops on the GPU; jpeg decoder {args.jpeg_decoder}, {decoder_why}"
                  + narrow_queues_caveat())
    else:
        decode = {"cpu": "decode + crops in workers", "none": ""}[backend]
    args.input_line = (f"=> input: {backend} backend" + (f" ({decode})" if decode else "") +
                       f", {why} | {layout}" + (f" | torch.compile {args.compile}" if args.compile else ""))


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
    """Model (weights from checkpoint if any, EMA too), precision recipe applied, the --opt
    optimizer, all prepared. Precision carries the step's ingredients: clip, skip, EMA."""
    torch.manual_seed(args.seed)
    pretrained = args.pretrained and checkpoint is None  # a resumed run's weights come from its checkpoint
    model = build_model(args.arch, num_classes, pretrained, getattr(args, "drop_path", 0.0))
    check_input_size(model, args.arch, args.image_size)
    if checkpoint is not None:
        load_model_weights(model, checkpoint["state_dict"], args.arch, args.resume)
    if want_sync_bn(args, accelerator):
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(accelerator.device, memory_format=memory_format)
    # The EMA copy is taken here, fp32 and before Precision casts the model and adds its hooks.
    ema = build_ema(model, args.model_ema_decay) if getattr(args, "model_ema", False) else None
    if ema is not None and checkpoint is not None and "state_dict_ema" in checkpoint:
        ema.module.load_state_dict(checkpoint["state_dict_ema"])
    precision = Precision(recipe, model, accelerator.device.type)
    precision.ema = ema
    precision.clip_grad = getattr(args, "clip_grad", None)
    # --opt and --no-wd-norm-bias: grouped by the model's names, the optimizer holding the O2 masters.
    built = build_optimizer(getattr(args, "opt", "sgd"), model, args.lr, args.momentum, args.weight_decay,
                            getattr(args, "no_wd_norm_bias", False), param_of=lambda p: precision.master_of.get(p, p),
                            clip_grad=precision.clip_grad)
    precision.skips_on_device = built.skips_on_device
    model, optimizer = accelerator.prepare(model, built.optimizer)
    if args.compile:  # after prepare: DDP's buckets see the compiled graph (utils/compiled.py)
        model = compile_model(model, args.compile, accelerator.print, getattr(args, "compile_mode", "default"))
    return model, optimizer, precision


def build_or_resume(args, accelerator, recipe, num_classes, classes=None):
    """The training state train.py and profile.py start from: (model, optimizer, precision, best
    top-1 so far, the record of the epoch until its step for a mid-epoch checkpoint, else None:
    utils.engine.train_one_epoch's carried). With --resume (loaded on every process) the weights, optimizer, loss scale and
    args.start_epoch come from the checkpoint, in the order that makes a resumed run bit-exact.
    classes: the data's class names in label order, checked against the checkpoint's."""
    if classes and num_classes < len(classes):
        raise UsageError(f"--num-classes {num_classes} is fewer than the {len(classes)} classes in the data; "
                         "drop --num-classes (it defaults to the data's count)")
    checkpoint = resume_checkpoint(args)
    same_dtype = True
    if checkpoint is not None:
        same_dtype = check_resume_meaning(args, checkpoint, recipe, accelerator, classes)
    model, optimizer, precision = build_training_state(args, accelerator, recipe, num_classes, checkpoint)
    if checkpoint is None:
        return model, optimizer, precision, 0.0, None
    stored_opt = (checkpoint.get("args") or {}).get("opt", "sgd")
    if stored_opt != getattr(args, "opt", "sgd"):  # another optimizer's state loads, then fails at step 1
        raise UsageError(f"checkpoint {args.resume!r} was trained with --opt {stored_opt}, this run builds "
                         f"--opt {getattr(args, 'opt', 'sgd')}: its optimizer state does not carry over; "
                         f"resume with --opt {stored_opt}" + ("" if hasattr(args, "opt") else
                                                              " (profile.py profiles SGD runs only)"))
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise UsageError(f"checkpoint {args.resume!r}: its 'optimizer' state does not fit this model's "
                         f"parameters ({first_line(err, 150)}); resume with the flags it was trained with") from None
    if same_dtype:  # a loss scale found for fp16 means nothing for bf16 (and the reverse)
        precision.load_state_dict(checkpoint.get("loss_scale"))
    args.start_epoch = checkpoint["epoch"]
    args.start_step = resume_step(args, checkpoint, accelerator)
    so_far = checkpoint.get("epoch_so_far") if args.start_step else None  # older checkpoints have none
    return model, optimizer, precision, checkpoint.get("best_prec1", 0.0), so_far


def resume_step(args, checkpoint, accelerator):
    """The step inside args.start_epoch to continue at: 0, or where a mid-epoch checkpoint (a stop
    signal, --save-every-steps) stopped. A step names a place in the epoch's shuffle only for the
    global batch it was counted in, so a mid-epoch resume needs that same global batch."""
    step = checkpoint.get("step", 0)
    if not step:
        return 0
    saved, now = checkpoint.get("global_batch"), global_batch(args, accelerator)
    if not isinstance(step, int) or step < 0 or not isinstance(saved, int):
        raise UsageError(f"checkpoint {args.resume!r} has a damaged mid-epoch position (step {step!r}, "
                         f"global batch {saved!r}); resume from an end-of-epoch checkpoint instead")
    if saved != now:
        raise UsageError(f"checkpoint {args.resume!r} stopped inside epoch {checkpoint['epoch']} at step "
                         f"{step} of global batch {saved}, but this run's global batch is {now} "
                         f"(--batch-size {args.batch_size} x {accelerator.num_processes} process(es) x "
                         f"--accum-steps {getattr(args, 'accum_steps', 1)}); "
                         f"resume with a global batch of {saved}")
    return step


def global_batch(args, accelerator):
    """Images per optimizer step: --batch-size x processes x --accum-steps (what the LR scales by
    and what a checkpoint's mid-epoch step counts in)."""
    return args.batch_size * accelerator.num_processes * getattr(args, "accum_steps", 1)


def resume_checkpoint(args):
    """The checkpoint given by --resume, or None."""
    if not args.resume:
        return None
    training = not getattr(args, "evaluate", False)
    checkpoint = load_checkpoint(args.resume, training=training)
    if checkpoint["arch"] != args.arch:
        raise UsageError(f"checkpoint {args.resume!r} holds a {checkpoint['arch']} model, not -a "
                         f"{args.arch}; pass -a {checkpoint['arch']}")
    if training and checkpoint["epoch"] >= args.epochs:
        raise UsageError(f"checkpoint {args.resume!r} has finished {checkpoint['epoch']} epochs, and --epochs "
                         f"is {args.epochs}: nothing is left to train; raise --epochs (the total) to train on")
    return checkpoint


def _precision_name(opt_level, dtype_name):
    return f"{opt_level} {dtype_name if opt_level != 'O0' and dtype_name not in (None, 'no') else 'fp32'}"


def check_resume_meaning(args, checkpoint, recipe, accelerator, classes=None):
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
        raise UsageError(f"checkpoint {args.resume!r} was trained on other classes than DATA "
                         f"{args.data or 'digits'!r} holds ({len(trained)} vs {len(classes)}; "
                         f"{detail or 'same names, other order'}); resume on the data it was trained on, "
                         "or start a new run")
    old_level, old_dtype = checkpoint.get("opt_level"), checkpoint.get("mixed_precision")
    same_dtype = True
    if old_level is not None:
        before = _precision_name(old_level, old_dtype)
        after = _precision_name(recipe.opt_level, recipe.dtype_name)
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
        old_global, new_global = old_batch * old_world * old_accum, global_batch(args, accelerator)
        if old_global != new_global and not getattr(args, "evaluate", False):  # -e trains nothing
            warn(accelerator, f"resuming with global batch {new_global} (--batch-size {args.batch_size} x "
                              f"{accelerator.num_processes} process(es) x --accum-steps "
                              f"{getattr(args, 'accum_steps', 1)}) where the checkpoint had {old_global} "
                              f"({old_batch} x {old_world} x {old_accum}): the LR scales with it "
                              f"({args.lr * old_global / 256:g} -> {args.lr * new_global / 256:g} at full "
                              "rate) and the epoch's shuffle is cut differently")
    return same_dtype
