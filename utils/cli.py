"""The command line shared by train.py, eval.py and profile.py (Apex main_amp.py spellings), and
the defaults each DATA source gives the flags left out."""
import argparse
import os
import sys

from .batches import IMAGENET_MEAN, IMAGENET_STD

OPT_LEVELS = ("O0", "O1", "O2", "O3")
MIXED_PRECISIONS = ("no", "fp16", "bf16")

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


def source_kind(data):
    """'digits', 'synthetic', 'datasets' (hf:NAME, hf:DIR or a save_to_disk directory; see
    utils/hf_data.py) or 'imagefolder' for the DATA argument."""
    from .hf_data import is_saved_dataset  # hf_data imports torch; --help needs none of it

    if data in (None, "digits"):
        return "digits"
    if data == "synthetic":
        return "synthetic"
    if data.startswith("hf:") or is_saved_dataset(data):
        return "datasets"
    return "imagefolder"


def absolute_data(data):
    """DATA as a checkpoint stores it: a folder (hf:DIR too) as an absolute path, so that eval.py
    or a resume started from another working directory reads the same data, not a namesake there;
    names (digits, synthetic, hf:NAME of the hub cache) as they are."""
    if data in (None, "digits", "synthetic"):
        return data
    prefix, path = ("hf:", data[3:]) if data.startswith("hf:") else ("", data)
    return prefix + os.path.abspath(path) if path and os.path.exists(path) else data


def apply_source_defaults(args, model_config=None):
    """Fill flags left at None: first the digits demo's own sizes and schedule (digits is small and
    grey), then the model's data config (a timm model's input size, crop pct, interpolation,
    mean/std), then the ImageNet defaults. A default warmup is cut to a quarter of --epochs."""
    default_warmup = getattr(args, "warmup_epochs", None) is None
    layers = [SOURCE_DEFAULTS["digits"]] if source_kind(args.data) == "digits" else []
    for defaults in layers + [model_config or {}, SOURCE_DEFAULTS["default"]]:
        for name, value in defaults.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
                if name == "workers":  # the default never asks for more workers than there are cores
                    args.workers = min(value, len(os.sched_getaffinity(0)))
    if default_warmup:  # short runs (--epochs 8) would otherwise spend most of their epochs warming up
        args.warmup_epochs = min(args.warmup_epochs, args.epochs // 4)
    return args


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (plus a --help hint), exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", FlagSafeHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        # Every process of a run parses the same command line, so only the main one (RANK 0, or no
        # RANK) prints the line, as exit_on_usage_error does for the errors found after parsing.
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(bare_switches(self, sys.argv[1:] if args is None else args), namespace)


def add_switch(group, *names, help):
    """A flag that is True alone and also takes True|False, so that a --config recipe's true can
    be turned off on the command line (--model-ema False), as --channels-last False always could."""
    return group.add_argument(*names, type=str2bool, nargs="?", const=True, default=False, metavar="True|False",
                              help=help)


def bare_switches(parser, argv):
    """argv with each switch that is followed by a word that reads as DATA (a path, digits,
    synthetic, hf:...) written as --switch=True: argparse would otherwise take DATA as the switch's
    value and refuse it (--compile /data/imagenet). Any other word stays the value, so a typo
    (--channels-last maybe) is still refused; a True/False word that is also a folder here
    (--compile y, with a folder y) is refused as ambiguous."""
    switches = {option for action in parser._actions if action.type is str2bool and action.nargs == "?"
                for option in action.option_strings}
    options = [option for action in parser._actions for option in action.option_strings]

    def is_switch(arg):  # spelled out, or a prefix argparse would expand to one (--determ)
        if arg in switches or arg in options or not (parser.allow_abbrev and arg.startswith("--")):
            return arg in switches
        expansions = [option for option in options if option.startswith(arg)]
        return len(expansions) == 1 and expansions[0] in switches

    argv = [str(arg) for arg in argv]
    out = []
    for position, arg in enumerate(argv):
        if arg == "--":  # the rest are positionals
            return out + argv[position:]
        following = argv[position + 1] if position + 1 < len(argv) else None
        if following is not None and _reads_as_data(following) and is_switch(arg):
            arg += "=True"
        elif following is not None and following.lower() in BOOL_WORDS and os.path.isdir(following) \
                and is_switch(arg):
            parser.error(f"{arg} {following}: {following!r} reads as the switch's value and is also a folder "
                         f"here; write {arg}={following} for the value, or {arg} ./{following} to use the folder")
        out.append(arg)
    return out


def _reads_as_data(text):
    if text.lower() in BOOL_WORDS:
        return False
    return text in ("digits", "synthetic") or text.startswith("hf:") or os.sep in text or os.path.exists(text)


class FlagSafeHelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, except that wrapping never splits a flag named in help text
    (--prof-steps) at its hyphens, so a reader (or a docs check) sees whole flag names."""

    def _split_lines(self, text, width):
        import textwrap
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


BOOL_WORDS = ("true", "1", "yes", "y", "on", "false", "0", "no", "n", "off")  # five for True, five for False


def str2bool(text):
    """Parse True/False the way people type it; Apex's type=bool made 'False' mean True."""
    value = str(text).strip().lower()
    if value in BOOL_WORDS[:5]:
        return True
    if value in BOOL_WORDS[5:]:
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def loss_scale_type(text):
    """'dynamic' or a positive float (a static scale)."""
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dynamic' or a positive number, got {text!r}")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a static loss scale must be a positive finite number, got {text!r}")
    return value


def opt_level_type(text):
    level = text.upper().replace("0O", "O0")
    if level not in OPT_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown opt level {text!r}; choose one of {', '.join(OPT_LEVELS)}")
    return level


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def finite_float(text, what="a finite number"):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_float(text):
    """--lr: a finite number > 0 (nan, inf, 0 and negatives make no training run)."""
    value = finite_float(text, "a finite number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text):
    """--wd: a finite number >= 0 (negative weight decay pushes weights away from zero)."""
    value = finite_float(text, "a finite number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def momentum_type(text):
    """--momentum: SGD momentum in [0, 1); 1 or more never forgets a gradient and diverges."""
    value = finite_float(text, "a number in [0, 1)")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"SGD momentum must be in [0, 1) (0.9 is usual), got {text!r}")
    return value


SEED_MAX = 2 ** 32 - 1  # what numpy's and every other seeder accept; torch takes more, but the
                        # sampler's seed x 1_000_003 arithmetic (utils/batches.py) stays in 64 bits


def seed_type(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed in 0..{SEED_MAX}, got {text!r}")
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer seed in 0..{SEED_MAX}, got {text!r}")
    return value


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_data_args(parser, training=True):
    """DATA and how its images become batches; training=False leaves out the training-only flags."""
    group = parser.add_argument_group("data")
    group.add_argument("data", nargs="?", default=None, metavar="DATA",
                       help="ImageFolder root holding train/ and val/; a Hugging Face datasets "
                            "directory written by save_to_disk; hf:NAME (a hub dataset from the local "
                            "cache, never downloaded) or hf:DIR (DIR loaded by datasets.load_dataset, "
                            "e.g. an imagefolder); 'digits' (built-in demo, the default when DATA is "
                            "left out) or 'synthetic' (random tensors made on the device, for speed tests)")
    group.add_argument("--data-backend", choices=("auto", "cpu", "gpu"), default="auto",
                       help="cpu: the loader workers decode (libjpeg-turbo, PIL for other files) and crop; gpu: workers only read "
                            "file bytes, nvJPEG decodes whole batches and crops/resizes run on the GPU "
                            "(ImageFolder data on CUDA only); auto: gpu for ImageFolder data on CUDA, "
                            "else cpu (default: auto)")
    group.add_argument("--jpeg-decoder", choices=("auto", "cuda", "hardware"), default="auto",
                       help="gpu backend only: cuda = torchvision's batched nvJPEG decode (it uses the GPU's "
                            "JPEG engines for baseline files where the GPU has them); hardware = "
                            "nvImageCodec on the JPEG engines only (A100/H100/H200; pip install "
                            "nvidia-nvimgcodec-cu13 nvidia-nvjpeg); auto: cuda, which trained faster on an "
                            "H200; with --deterministic hardware where it can be made (default: auto)")
    group.add_argument("-j", "--workers", type=non_negative_int, default=None, metavar="N",
                       help="data loading worker processes per process (default: 4; 2 for digits; "
                            "never more than the CPU cores available)")
    group.add_argument("--image-size", type=positive_int, default=None, metavar="PX",
                       help="training crop and validation crop size (default: a timm model's own "
                            "input size, else 224; 32 for digits)")
    group.add_argument("--crop-pct", type=float, default=None, metavar="F",
                       help="validation resizes to image-size/crop-pct, then center-crops (default: a "
                            "timm model's own, else 0.875)")
    group.add_argument("--interpolation", choices=("bilinear", "bicubic", "nearest"), default=None,
                       help="resampling for crops and resizes (default: a timm model's own, else bilinear)")
    if not training:
        return group
    group.add_argument("--min-scale", type=float, default=None, metavar="F",
                       help="smallest area fraction RandomResizedCrop keeps (default: 0.08; 0.35 for digits)")
    group.add_argument("--hflip", type=float, default=None, metavar="P",
                       help="probability of a horizontal flip in training (default: 0.5; 0 for digits, "
                            "since a mirrored digit is another glyph)")
    group.add_argument("--steps-per-epoch", type=non_negative_int, default=0, metavar="N",
                       help="end each training epoch after N steps; 0 means the whole train split "
                            "(default: 0; synthetic data has 100 steps an epoch unless set)")
    return group


def add_datasets_args(parser, training=True):
    group = parser.add_argument_group("Hugging Face datasets (DATA = hf:NAME, hf:DIR or a save_to_disk directory)")
    if training:
        group.add_argument("--train-split", default=None, metavar="NAME",
                           help="split to train on (default: train)")
    group.add_argument("--val-split", default=None, metavar="NAME",
                       help="split to validate on (default: validation, else val or valid; with -e "
                            "or eval.py on a dataset of one split, that split)")
    group.add_argument("--image-column", default=None, metavar="NAME",
                       help="column holding the images (default: the column with the Image feature)")
    group.add_argument("--label-column", default=None, metavar="NAME",
                       help="column holding the integer class labels (default: the ClassLabel column, "
                            "else one named label, labels or target)")
    return group


def add_model_args(parser):
    group = parser.add_argument_group("model")
    group.add_argument("-a", "--arch", default="resnet18", metavar="ARCH",
                       help="a torchvision classification model name, or timm/<name> for a timm model "
                            "(default: resnet18)")
    add_switch(group, "--pretrained",
               help="start from pretrained weights found in the local cache (never downloads)")
    group.add_argument("--num-classes", type=positive_int, default=None, metavar="N",
                       help="classifier outputs (default: the number of classes in the data)")


def add_precision_args(parser, training=True):
    """Opt level, half dtype, memory format; training=False leaves out --loss-scale."""
    group = parser.add_argument_group("precision (Apex amp opt levels on Accelerate)")
    group.add_argument("--opt-level", type=opt_level_type, default=None, metavar="O0|O1|O2|O3",
                       help="O0 fp32; O1 autocast; O2 half weights, fp32 BN and master weights; "
                            "O3 pure half (default: from --mixed-precision: no -> O0, fp16/bf16 -> O1)")
    group.add_argument("--keep-batchnorm-fp32", type=str2bool, default=None, metavar="True|False",
                       help="keep BatchNorm in fp32 (default: True at O2, False at O3; an error at O1)")
    if training:
        group.add_argument("--loss-scale", type=loss_scale_type, default=None, metavar="dynamic|N",
                           help="'dynamic', or a number for a static scale (default: dynamic for fp16 "
                                "at O1/O2, none for bf16, static 1.0 at O3)")
    group.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=None,
                       help="half dtype; overrides the Accelerate config / accelerate launch "
                            "--mixed_precision (default: from Accelerate, else fp16 when an opt level "
                            "above O0 is given, else no)")
    group.add_argument("--channels-last", type=str2bool, nargs="?", const=True, default=None,
                       metavar="True|False",
                       help="channels_last memory format for model and inputs; '--channels-last' "
                            "alone means True (default: True on CUDA for models with 2-D "
                            "convolutions, else False)")
    group.add_argument("--compile", type=str2bool, nargs="?", const=True, default=False,
                       metavar="True|False",
                       help="torch.compile the model (inductor; compiled once per input shape, the "
                            "compile time is printed once); also turned on by Accelerate's "
                            "dynamo_backend setting (default: False)")
    group.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                       help="torch.compile mode with --compile: reduce-overhead replays CUDA graphs (less "
                            "host work a step); max-autotune also benchmarks kernel choices (minutes of "
                            "compile) (default: default)")
    return group


def add_run_args(parser, training=True):
    """Batch, logging, processes; training=False leaves out --resume, --seed, --sync_bn and
    --output-dir (eval.py's --resume is its own, required, flag)."""
    group = parser.add_argument_group("run")
    group.add_argument("-b", "--batch-size", type=positive_int, default=None, metavar="N",
                       help="mini-batch size per process (default: 256; 64 for digits)")
    group.add_argument("-p", "--print-freq", type=positive_int, default=10, metavar="N",
                       help="print (and reduce metrics across processes) every N steps (default: 10)")
    add_switch(group, "--deterministic",
               help="bitwise repeatable runs: deterministic cuDNN/cuBLAS algorithms, "
                    "no cudnn.benchmark")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int,
                       default=int(os.environ.get("LOCAL_RANK", 0)), metavar="N",
                       help="accepted for torch.distributed.launch; the LOCAL_RANK environment "
                            "variable is what counts")
    if not training:
        return group
    group.add_argument("--resume", default="", metavar="PATH|DIR|auto",
                       help="continue a run: a checkpoint file; a run directory (its checkpoint.pth.tar, "
                            "and --output-dir defaults to it); or 'auto': --output-dir's checkpoint.pth.tar, "
                            "starting fresh (with a line saying so) when there is none yet, as a Slurm "
                            "requeue wants. The run's flags come back from the checkpoint; flags typed "
                            "again win, one line naming each change (default: none)")
    group.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="set flags from a YAML recipe (keys: flag names without dashes, e.g. lr, "
                            "batch-size or batch_size); flags on the command line win; see configs/ "
                            "(default: none)")
    group.add_argument("--seed", type=seed_type, default=0,
                       help=f"seed for weights, shuffling and augmentation, 0..{SEED_MAX} (default: 0)")
    add_switch(group, "--sync_bn", "--sync-bn",
               help="SyncBatchNorm across processes (several CUDA processes only)")
    group.add_argument("--output-dir", default=".", metavar="DIR",
                       help="where checkpoints and logs go (profile.py --benchmark: its CSV); created "
                            "if missing (default: the working directory)")
    return group


def add_prof_args(parser):
    """train.py's --prof (off by default); profile.py adds its own, always-on --prof."""
    group = parser.add_argument_group("profiling")
    group.add_argument("--prof", type=int, default=-1, metavar="N",
                       help="profile: NVTX ranges, cudaProfilerStart at step N, stop and exit 10 "
                            "steps later (default: -1, off)")
    return group


def add_training_args(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--epochs", type=positive_int, default=None, metavar="N",
                       help="total epochs (default: 90; 12 for digits)")
    group.add_argument("--start-epoch", type=non_negative_int, default=0, metavar="N",
                       help="epoch to start at; --resume sets it from the checkpoint (default: 0)")
    group.add_argument("--lr", type=positive_float, default=0.1, metavar="LR",
                       help="learning rate for a global batch of 256; scaled by global batch/256 "
                            "(default: 0.1)")
    group.add_argument("--lr-schedule", choices=("step", "cosine"), default="step",
                       help="step: x0.1 at each epoch of --lr-steps (Apex); cosine: to 0 at the last "
                            "epoch (default: step)")
    group.add_argument("--lr-steps", type=positive_int, nargs="+", default=None, metavar="EPOCH",
                       help="--lr-schedule step: the epochs (increasing) at which the LR is multiplied "
                            "by 0.1 (default: 30 60 80; 6 9 for digits)")
    group.add_argument("--warmup-epochs", type=non_negative_int, default=None, metavar="N",
                       help="linear LR warmup epochs (default: 5, 1 for digits; either at most "
                            "--epochs // 4, so short runs spend most epochs at full LR)")
    group.add_argument("--momentum", type=momentum_type, default=0.9, metavar="M",
                       help="SGD momentum, in [0, 1) (default: 0.9)")
    group.add_argument("--wd", "--weight-decay", dest="weight_decay", type=non_negative_float, default=1e-4,
                       metavar="W", help="weight decay, >= 0 (default: 1e-4)")
    group.add_argument("--max-nonfinite-steps", type=positive_int, default=100, metavar="N",
                       help="stop the run (exit code 3) after N steps in a row whose loss or gradients "
                            "held inf/NaN; such steps are skipped and counted at every level; a dynamic "
                            "loss scale below 2**-14 stops it too (default: 100)")
    group.add_argument("-e", "--evaluate", action="store_true",
                       help="only evaluate the model on the val split, then exit")


def add_log_args(parser):
    """train.py's run-log flags (utils/logs.py); returns the parser so calls can be chained."""
    group = parser.add_argument_group("logs (written into --output-dir by the main process)")
    group.add_argument("--log-with", choices=("none", "tensorboard", "wandb", "all"), default="none",
                       help="also send per-epoch metrics to TensorBoard (OUTPUT_DIR/runs/), Weights & "
                            "Biases (set WANDB_MODE=offline to run without network), or both; "
                            "args.yaml, summary.csv and curves.png are always written; -e and --prof "
                            "write none of these (default: none)")
    group.add_argument("--overwrite", action="store_true",
                       help="replace the run files in --output-dir: a new run into a directory that "
                            "already holds a run's checkpoint.pth.tar, model_best.pth.tar, summary.csv, "
                            "args.yaml or curves.png removes them at start-up (default: such a run is "
                            "refused, with the --resume command that continues the old run)")
    return parser


def build_training_parser(description, prog=None):
    """Every flag of a training run but --prof: profile.py's parser starts here."""
    parser = OneLineErrorParser(prog=prog, description=description)
    add_data_args(parser)
    add_datasets_args(parser)
    add_model_args(parser)
    add_precision_args(parser)
    add_run_args(parser)
    add_training_args(parser)
    return parser


def add_checkpoint_args(parser):
    """train.py's checkpoint cadence (profile.py writes no checkpoints)."""
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--save-every-steps", type=non_negative_int, default=0, metavar="N",
                       help="also write checkpoint.pth.tar every N training steps (counted across epochs), "
                            "with the position inside the epoch, so --resume continues from that step; "
                            "0 means only at the end of each epoch (default: 0). SIGTERM/SIGINT always "
                            "write one before the run stops")
    group.add_argument("--keep-checkpoints", type=non_negative_int, default=0, metavar="N",
                       help="also keep the last N end-of-epoch checkpoints as checkpoint-epochNNN.pth.tar "
                            "(NNN: epochs finished) beside checkpoint.pth.tar and model_best.pth.tar; "
                            "older ones are removed; 0 keeps none (default: 0)")
    return group


def probability(text):
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return value


def add_ingredient_args(parser):
    """train.py's recipe ingredients (utils/recipe.py); every default keeps Apex's recipe."""
    group = parser.add_argument_group("recipe ingredients (defaults: Apex's recipe)")
    group.add_argument("--label-smoothing", type=non_negative_float, default=0.0, metavar="F",
                       help="label smoothing of the training loss, in [0, 1) (default: 0)")
    group.add_argument("--mixup", type=non_negative_float, default=0.0, metavar="A",
                       help="mixup Beta alpha (timm Mixup, per batch; -b must be even); 0 is off (default: 0)")
    group.add_argument("--cutmix", type=non_negative_float, default=0.0, metavar="A",
                       help="cutmix Beta alpha (timm Mixup); 0 is off (default: 0)")
    group.add_argument("--mixup-switch-prob", type=probability, default=0.5, metavar="P",
                       help="with --mixup and --cutmix both on, the chance a batch uses cutmix (default: 0.5)")
    group.add_argument("--aa", default="none", metavar="POLICY",
                       help="augmentation policy after crop + flip, as timm spells it (rand-m9-mstd0.5-inc1, "
                            "augmix-m5-w4-d2, v0, original) or ta_wide (TrivialAugmentWide); cpu data "
                            "backend only (default: none)")
    group.add_argument("--reprob", type=probability, default=0.0, metavar="P",
                       help="random erasing probability per image (timm RandomErasing, on the device) (default: 0)")
    group.add_argument("--drop-path", type=probability, default=0.0, metavar="F",
                       help="drop-path / stochastic-depth rate: timm's drop_path_rate, torchvision's "
                            "stochastic_depth_prob; refused for models without it (default: 0, the "
                            "model's own default)")
    add_switch(group, "--model-ema",
               help="keep an EMA of the weights (timm ModelEmaV3), validated every epoch beside the "
                    "model and saved in checkpoints as state_dict_ema (default: off)")
    group.add_argument("--model-ema-decay", type=positive_float, default=0.9998, metavar="D",
                       help="EMA decay per optimizer step, in (0, 1) (default: 0.9998)")
    add_switch(group, "--model-ema-best",
               help="with --model-ema: model_best.pth.tar follows the EMA's top-1 rather than the "
                    "model's (default: off)")
    group.add_argument("--opt", choices=("sgd", "nesterov", "adamw", "lamb"), default="sgd",
                       help="optimizer: torch SGD (nesterov: with Nesterov momentum), torch AdamW, timm Lamb "
                            "(default: sgd)")
    add_switch(group, "--no-wd-norm-bias",
               help="no weight decay on norm weights and biases (1-D parameters) (default: off)")
    group.add_argument("--clip-grad", type=positive_float, default=None, metavar="N",
                       help="clip the global grad norm to N after unscaling, at every opt level (default: off)")
    group.add_argument("--accum-steps", type=positive_int, default=1, metavar="N",
                       help="gradient accumulation: one optimizer step per N batches, as one batch of N x -b "
                            "(the LR scales with -b x processes x N; steps count optimizer steps) (default: 1)")
    group.add_argument("--min-lr", type=non_negative_float, default=0.0, metavar="LR",
                       help="absolute floor of the cosine and step schedules (default: 0)")
    return group


def build_parser(description, prog=None):
    """train.py's parser (less its --log-with): the training flags and the optional --prof."""
    parser = build_training_parser(description, prog)
    add_ingredient_args(parser)
    add_checkpoint_args(parser)
    add_prof_args(parser)
    return parser


# Flags a recipe file may not set: --config itself, the per-process launcher flag and --help.
NOT_IN_CONFIG = ("config", "local_rank", "help")
# Keys a recipe file refuses by name: where a run lives and what it continues are the command
# line's (--resume auto looks in --output-dir before any recipe is read).
RUN_NOT_RECIPE = ("output_dir", "resume")


def config_actions(parser):
    """Every key a recipe file may use -> its argparse action: the dest (batch_size) and each
    option spelling without its dashes (batch-size, b)."""
    keys = {}
    for action in parser._actions:
        if action.dest in NOT_IN_CONFIG or action.dest == argparse.SUPPRESS:
            continue
        keys[action.dest] = action
        for option in action.option_strings:
            keys[option.lstrip("-")] = action
    return keys


def flag_name(action):
    """The spelling a message names a flag by: its first long option, or the dest of a positional."""
    longs = [option for option in action.option_strings if option.startswith("--")]
    return (longs or action.option_strings or [action.dest.upper()])[0]


def _convert(action, value, where):
    """A YAML value through the flag's own argparse type and choices, as on the command line."""
    from .errors import UsageError

    if action.type is str2bool and value is not None and not isinstance(value, bool):
        raise UsageError(f"{where}: {flag_name(action)} is a switch; give true or false, got {value!r}")
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: {flag_name(action)} is a switch; give true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if value is None:
        return None
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:  # argparse refuses the bare flag; [] would mean "no milestones"
            raise UsageError(f"{where}: {flag_name(action)} takes one or more values, got []")
        return [_convert_one(action, item, where) for item in items]
    if isinstance(value, (list, dict)):
        raise UsageError(f"{where}: {flag_name(action)} takes one value, got {value!r}")
    return _convert_one(action, value, where)


def _convert_one(action, value, where):
    from .errors import UsageError

    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
        raise UsageError(f"{where}: bad value for {flag_name(action)}: {err}") from None
    if action.choices is not None and converted not in action.choices:
        raise UsageError(f"{where}: {flag_name(action)} must be one of "
                         f"{', '.join(map(str, action.choices))}, got {value!r}")
    return converted


def load_config(parser, path):
    """The flag values of a --config YAML file as {dest: value}, each through its flag's type.
    Unknown keys, a key given twice (lr and --lr) and wrong types are UsageErrors naming key and file."""
    import yaml

    from .errors import UsageError

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise UsageError(f"--config {path!r}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"--config {path!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--config {path!r} is not valid YAML ({' '.join(str(err).split())[:160]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must be a mapping of flag names to values, found a "
                         f"{type(data).__name__}")
    keys, values, source = config_actions(parser), {}, {}
    for key, value in data.items():
        action = keys.get(str(key))
        if action is not None and action.dest in RUN_NOT_RECIPE:
            raise UsageError(f"--config {path!r}: {key!r} names a run, not a recipe; give {flag_name(action)} on "
                             "the command line")
        if action is None:
            raise UsageError(f"--config {path!r}: unknown key {key!r} (not a flag of {parser.prog}; keys are "
                             "flag names without dashes, e.g. lr or batch-size)")
        if action.dest in values:
            raise UsageError(f"--config {path!r}: {key!r} sets {flag_name(action)} that {source[action.dest]!r} "
                             "already set; keep one")
        values[action.dest] = _convert(action, value, f"--config {path!r}, key {key!r}")
        source[action.dest] = key
    return values


class OnlyTyped(argparse.Namespace):
    """A namespace that claims every public attribute, so argparse fills in no defaults: after a
    parse it holds only what the command line set (and DATA as None, argparse's one exception)."""

    def __getattr__(self, name):
        if name.startswith("_"):  # argparse's own bookkeeping attributes
            raise AttributeError(name)
        return None


def typed_dests(parser, argv):
    """The dests of the flags argv sets (a value left at its default counts: it was typed)."""
    typed, _ = parser.parse_known_args(argv, namespace=OnlyTyped())
    return {dest for dest, value in vars(typed).items() if value is not None}


def evaluation_dests():
    """The flags a `train.py -e` evaluation reads: those eval.py shares with train.py, the model's,
    and -e, --resume and --config themselves."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in (add_data_args, add_datasets_args, add_precision_args, add_run_args):
        add(parser, training=False)
    add_model_args(parser)
    return {action.dest for action in parser._actions} | {"evaluate", "resume", "config"}


# What a --prof run of train.py never reaches: it stops after its window, before validating,
# saving at an epoch's end or logging the epoch, and it writes nothing (no checkpoint on a stop
# signal either), so it neither checks nor replaces what --output-dir holds.
NOT_REACHED_BY_PROF = ("keep_checkpoints", "model_ema", "model_ema_best", "model_ema_decay", "log_with",
                       "save_every_steps", "overwrite")


def idle_flag_notes(parser, args, typed):
    """Warnings for flags typed on the command line that this run of train.py will not use."""
    names = {action.dest: flag_name(action) for action in parser._actions}
    notes = []
    if args.resume and "start_epoch" in typed:
        notes.append("--start-epoch has no effect with --resume: the run continues where the checkpoint stopped")
    if args.evaluate:
        idle = sorted(names[dest] for dest in typed - evaluation_dests() if dest in names)
        if idle:
            notes.append(f"-e only evaluates: {', '.join(idle)} {'has' if len(idle) == 1 else 'have'} no "
                         "effect here (eval.py refuses them)")
        if not args.resume and not args.pretrained:
            notes.append("-e without --resume or --pretrained evaluates freshly initialised weights")
    elif args.prof >= 0:
        idle = sorted(names[dest] for dest in typed & set(NOT_REACHED_BY_PROF) if dest in names)
        if idle:
            notes.append(f"--prof stops after its window and writes nothing (no validation, checkpoint or "
                         f"log): {', '.join(idle)} {'has' if len(idle) == 1 else 'have'} no effect here")
    return notes
