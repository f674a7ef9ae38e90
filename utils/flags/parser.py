"""The command line shared by train.py, eval.py and profile.py (Apex main_amp.py spellings): the
value types, the parser that reports errors in one line and reads DATA after a bare switch, and
the flag groups each script builds its parser from."""
import argparse
import math
import os
import sys
import textwrap

OPT_LEVELS = ("O0", "O1", "O2", "O3")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PROF_STEPS = 10  # train.py's --prof window, as Apex's (profile.py has its own --prof-steps)
SEED_MAX = 2 ** 32 - 1  # what numpy's and every other seeder accept; torch takes more, but the
                        # sampler's seed x 1_000_003 arithmetic (utils/data/batches.py) stays in 64 bits
BOOL_WORDS = ("true", "1", "yes", "y", "on", "false", "0", "no", "n", "off")  # five for True, five for False


def number(kind, low=None, high=None, *, low_open=False, high_open=False, what, outside=None):
    """An argparse type for a finite int or float within [low, high] (low_open, high_open: the
    bound itself is refused). Anything else is refused as "expected {what}, got 'text'", or, for a
    number out of range, with outside (a format string of text) where given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not -math.inf < value < math.inf:  # not a number, nan or inf
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if (low is not None and (value <= low if low_open else value < low)) or \
                (high is not None and (value >= high if high_open else value > high)):
            raise argparse.ArgumentTypeError((outside or "expected {what}, got {text!r}").format(what=what, text=text))
        return value
    return parse


positive_int = number(int, 1, what="a positive integer")
non_negative_int = number(int, 0, what="an integer >= 0")
positive_float = number(float, 0, low_open=True, what="a finite number > 0")  # --lr: nan, inf, 0 train nothing
non_negative_float = number(float, 0, what="a finite number >= 0")  # --wd < 0 pushes weights away from zero
probability = number(float, 0, 1, what="a finite number", outside="must be a probability in [0, 1], got {text}")


def str2bool(text):
    """Parse True/False the way people type it; Apex's type=bool made 'False' mean True."""
    value = str(text).strip().lower()
    if value in BOOL_WORDS:
        return BOOL_WORDS.index(value) < 5
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def loss_scale_type(text):
    """'dynamic' or a positive finite float (a static scale)."""
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dynamic' or a positive number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"a static loss scale must be a positive finite number, got {text!r}")
    return value


def opt_level_type(text):
    level = text.upper().replace("0O", "O0")
    if level not in OPT_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown opt level {text!r}; choose one of {', '.join(OPT_LEVELS)}")
    return level


def flag_actions(parser):
    """{dest: argparse action} of every flag and positional of parser. argparse has no public list
    of a parser's flags; this is the one place that reads its private one."""
    return {action.dest: action for action in parser._actions}


def flag_name(action):
    """The spelling a message names a flag by: its first long option, or the dest of a positional."""
    longs = [option for option in action.option_strings if option.startswith("--")]
    return (longs or action.option_strings or [action.dest.upper()])[0]


class FlagSafeHelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, except that wrapping never splits a flag named in help text
    (--prof-steps) at its hyphens, so a reader (or a docs check) sees whole flag names."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (plus a --help hint), exit code 2, and
    reads a word after a bare switch as DATA when it is one (bare_switches)."""

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


def add_switch(group, *names, help, default=False):
    """A flag that is True alone and also takes True|False, so that a --config recipe's true can
    be turned off on the command line (--model-ema False), as --channels-last False always could."""
    return group.add_argument(*names, type=str2bool, nargs="?", const=True, default=default, metavar="True|False",
                              help=help)


def bare_switches(parser, argv):
    """argv with each switch that is followed by a word that reads as DATA (a path, digits,
    synthetic, hf:...) written as --switch=True: argparse would otherwise take DATA as the switch's
    value and refuse it (--compile /data/imagenet). Any other word stays the value, so a typo
    (--channels-last maybe) is still refused; a True/False word that is also a folder here
    (--compile y, with a folder y) is refused as ambiguous."""
    actions = flag_actions(parser).values()
    switches = {option for action in actions if action.type is str2bool and action.nargs == "?"
                for option in action.option_strings}
    options = [option for action in actions for option in action.option_strings]

    def is_switch(arg):  # spelled out, or a prefix argparse would expand to one (--determ)
        if arg in options or not (parser.allow_abbrev and arg.startswith("--")):
            return arg in switches
        expansions = [option for option in options if option.startswith(arg)]
        return len(expansions) == 1 and expansions[0] in switches

    argv = [str(arg) for arg in argv]
    out = []
    for position, (arg, following) in enumerate(zip(argv, argv[1:] + [None])):
        if arg == "--":  # the rest are positionals
            return out + argv[position:]
        if following is not None and is_switch(arg):
            value = following.lower() in BOOL_WORDS
            if value and os.path.isdir(following):
                parser.error(f"{arg} {following}: {following!r} reads as the switch's value and is also a folder "
                             f"here; write {arg}={following} for the value, or {arg} ./{following} to use the folder")
            if not value and (following in ("digits", "synthetic") or following.startswith("hf:") or os.sep in following
                              or os.path.exists(following)):
                arg += "=True"  # DATA
        out.append(arg)
    return out


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


def add_data_args(parser, training=True):
    """DATA and how its images become batches; training=False leaves out the training-only flags."""
    group = parser.add_argument_group("data")
    add = group.add_argument
    add("data", nargs="?", metavar="DATA", help="ImageFolder root holding train/ and val/; a Hugging Face datasets "
        "directory written by save_to_disk; hf:NAME (a hub dataset from the local cache, never downloaded) or hf:DIR "
        "(DIR loaded by datasets.load_dataset, e.g. an imagefolder); 'digits' (built-in demo, the default when DATA "
        "is left out) or 'synthetic' (random tensors made on the device, for speed tests)")
    add("--data-backend", choices=("auto", "cpu", "gpu"), default="auto", help="cpu: the loader workers decode "
        "(libjpeg-turbo, PIL for other files) and crop; gpu: workers only read file bytes, nvJPEG decodes whole "
        "batches and crops/resizes run on the GPU (ImageFolder data on CUDA only); auto: gpu for ImageFolder data on "
        "CUDA, else cpu (default: auto)")
    add("--jpeg-decoder", choices=("auto", "cuda", "hardware"), default="auto", help="gpu backend only: cuda = "
        "torchvision's batched nvJPEG decode (it uses the GPU's JPEG engines for baseline files where the GPU has "
        "them); hardware = nvImageCodec on the JPEG engines only (A100/H100/H200; pip install nvidia-nvimgcodec-cu13 "
        "nvidia-nvjpeg); auto: cuda, which trained faster on an H200; with --deterministic hardware where it can be "
        "made (default: auto)")
    add("-j", "--workers", type=non_negative_int, metavar="N", help="data loading worker processes per process "
        "(default: 4; 2 for digits; never more than the CPU cores available)")
    add("--image-size", type=positive_int, metavar="PX", help="training crop and validation crop size, where "
        "--train-crop-size or --val-crop-size does not set one of them (default: a timm model's own input size, else "
        "224; 32 for digits)")
    if training:
        add("--train-crop-size", type=positive_int, metavar="PX", help="training crop size (torchvision's flag; "
            "default: --image-size); progressive resizing (--min-res ...) replaces it")
    add("--val-resize-size", type=positive_int, metavar="PX", help="validation resizes the short side to PX, then "
        "center-crops --val-crop-size (torchvision's flag; default: val crop size / --crop-pct); not with --crop-pct")
    add("--val-crop-size", type=positive_int, metavar="PX", help="validation crop size (torchvision's flag; default: "
        "--image-size)")
    add("--crop-pct", type=float, metavar="F", help="validation resizes to val crop size / crop-pct, then "
        "center-crops; timm's spelling of --val-resize-size (default: a timm model's own, else 0.875)")
    add("--interpolation", choices=("bilinear", "bicubic", "nearest"), help="resampling for crops and resizes "
        "(default: a timm model's own, else bilinear)")
    if not training:
        return group
    add("--min-scale", type=float, metavar="F", help="smallest area fraction RandomResizedCrop keeps (default: 0.08; "
        "0.35 for digits)")
    add("--hflip", type=float, metavar="P", help="probability of a horizontal flip in training (default: 0.5; 0 for "
        "digits, since a mirrored digit is another glyph)")
    add("--steps-per-epoch", type=non_negative_int, default=0, metavar="N", help="end each training epoch after N "
        "steps; 0 means the whole train split (default: 0; synthetic data has 100 steps an epoch unless set)")
    add("--ra-reps", type=positive_int, metavar="N", help="repeated augmentation: each epoch draws its images N times "
        "over, with different crops, on different processes where there are N or more, and still counts one pass of "
        "the train split's size (torchvision's --ra-sampler --ra-reps); 1 is off (default: 1; 3 with --ra-sampler)")
    add_switch(group, "--ra-sampler", help="repeated augmentation with --ra-reps repeats (default: off)")
    return group


def add_progressive_args(parser):
    """train.py's progressive resizing: FFCV's train-resolution schedule over epochs."""
    group = parser.add_argument_group("progressive resizing (FFCV's schedule; replaces --train-crop-size)")
    add = group.add_argument
    add("--min-res", type=positive_int, metavar="PX", help="training crop size up to epoch --start-ramp (default: off)")
    add("--max-res", type=positive_int, metavar="PX", help="training crop size from epoch --end-ramp on")
    add("--start-ramp", type=non_negative_int, metavar="EPOCH", help="last epoch at --min-res; from it the size "
        "rises linearly to --max-res at --end-ramp")
    add("--end-ramp", type=non_negative_int, metavar="EPOCH", help="first epoch at --max-res")
    add("--res-step", type=positive_int, default=32, metavar="PX", help="sizes on the ramp are rounded to a multiple "
        "of PX (default: 32, FFCV's)")
    return group


def add_validation_args(parser):
    """How validation scores: train.py's every epoch, eval.py's."""
    group = parser.add_argument_group("validation")
    group.add_argument("--tta", choices=("none", "flip"), default="none", help="test-time augmentation: flip also "
                       "scores each image's mirror and averages the two logits; printed as a line of its own after "
                       "the plain Prec@1 line, and in summary.csv; model_best still follows the plain Prec@1; "
                       "eval.py's --predictions then come from the averaged logits (default: none)")
    return group


def add_datasets_args(parser, training=True):
    group = parser.add_argument_group("Hugging Face datasets (DATA = hf:NAME, hf:DIR or a save_to_disk directory)")
    add = group.add_argument
    if training:
        add("--train-split", metavar="NAME", help="split to train on (default: train)")
    add("--val-split", metavar="NAME", help="split to validate on (default: validation, else val or valid; with -e or "
        "eval.py on a dataset of one split, that split)")
    add("--image-column", metavar="NAME", help="column holding the images (default: the column with the Image "
        "feature)")
    add("--label-column", metavar="NAME", help="column holding the integer class labels (default: the ClassLabel "
        "column, else one named label, labels or target)")
    return group


def add_model_args(parser):
    group = parser.add_argument_group("model")
    add = group.add_argument
    add("-a", "--arch", default="resnet18", metavar="ARCH", help="a torchvision classification model name, or "
        "timm/<name> for a timm model (default: resnet18)")
    add_switch(group, "--pretrained", help="start from pretrained weights found in the local cache (never downloads)")
    add("--num-classes", type=positive_int, metavar="N", help="classifier outputs (default: the number of classes in "
        "the data)")
    add_switch(group, "--blurpool", help="anti-aliased downsampling: a fixed 3x3 blur before each strided "
               "convolution with 16 or more input channels (FFCV's recipe); torchvision ResNets only; the weights' "
               "names do not change (default: off)")
    add("--stem-channels", type=int, choices=(3, 4), default=3, help="4 pads the input with a zero channel for the "
        "stem convolution, as MLPerf's ResNet-50 does for cuDNN's NHWC kernels; the checkpoint keeps 3 input channels; "
        "torchvision ResNets only (default: 3)")


def add_precision_args(parser, training=True):
    """Opt level, half dtype, memory format; training=False leaves out --loss-scale."""
    group = parser.add_argument_group("precision (Apex amp opt levels on Accelerate)")
    add = group.add_argument
    add("--opt-level", type=opt_level_type, metavar="O0|O1|O2|O3", help="O0 fp32; O1 autocast; O2 half weights, fp32 "
        "BN and master weights; O3 pure half (default: from --mixed-precision: no -> O0, fp16/bf16 -> O1)")
    add("--keep-batchnorm-fp32", type=str2bool, metavar="True|False", help="keep BatchNorm in fp32 (default: True at "
        "O2, False at O3; an error at O1)")
    if training:
        add("--loss-scale", type=loss_scale_type, metavar="dynamic|N", help="'dynamic', or a number for a static "
            "scale (default: dynamic for fp16 at O1/O2, none for bf16, static 1.0 at O3)")
    add("--mixed-precision", choices=MIXED_PRECISIONS, help="half dtype; overrides the Accelerate config / accelerate "
        "launch --mixed_precision (default: from Accelerate, else fp16 when an opt level above O0 is given, else no)")
    add_switch(group, "--channels-last", default=None, help="channels_last memory format for model and inputs; "
        "'--channels-last' alone means True (default: True on CUDA for models with 2-D convolutions, else False)")
    add_switch(group, "--compile", help="torch.compile the model (inductor; compiled once per input shape, the "
        "compile time is printed once); also turned on by Accelerate's dynamo_backend setting (default: False)")
    add("--compile-mode", choices=COMPILE_MODES, default="default", help="torch.compile mode with --compile: "
        "reduce-overhead replays CUDA graphs (less host work a step); max-autotune also benchmarks kernel choices "
        "(minutes of compile) (default: default)")
    add_switch(group, "--tune-kernels", help="with --compile on CUDA: inductor times launch settings (block sizes, "
        "warps) for each Triton kernel it writes and keeps the fastest (its coordinate descent tuning, part of "
        "max-autotune); minutes more compile for a few per cent on ResNet-50; refused with --deterministic "
        "(default: False)")
    return group


def add_run_args(parser, training=True):
    """Batch, logging, processes; training=False leaves out --resume, --seed, --sync_bn and
    --output-dir (eval.py's --resume is its own, required, flag)."""
    group = parser.add_argument_group("run")
    add = group.add_argument
    add("-b", "--batch-size", type=positive_int, metavar="N", help="mini-batch size per process (default: 256; 64 for "
        "digits)")
    add("-p", "--print-freq", type=positive_int, default=10, metavar="N", help="print (and reduce metrics across "
        "processes) every N steps (default: 10)")
    add_switch(group, "--deterministic", help="bitwise repeatable runs: deterministic cuDNN/cuBLAS algorithms, no "
        "cudnn.benchmark")
    add("--local_rank", "--local-rank", dest="local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
        metavar="N", help="accepted for torch.distributed.launch; the LOCAL_RANK environment variable is what counts")
    if not training:
        return group
    add("--resume", default="", metavar="PATH|DIR|auto", help="continue a run: a checkpoint file; a run directory "
        "(its checkpoint.pth.tar, and --output-dir defaults to it); or 'auto': --output-dir's checkpoint.pth.tar, "
        "starting fresh (with a line saying so) when there is none yet, as a Slurm requeue wants. The run's flags "
        "come back from the checkpoint; flags typed again win, one line naming each change (default: none)")
    add("--config", metavar="FILE.yaml", help="set flags from a YAML recipe (keys: flag names without dashes, e.g. "
        "lr, batch-size or batch_size); flags on the command line win; see configs/ (default: none)")
    add("--seed", type=number(int, 0, SEED_MAX, what=f"an integer seed in 0..{SEED_MAX}"), default=0,
        help=f"seed for weights, shuffling and augmentation, 0..{SEED_MAX} (default: 0)")
    add_switch(group, "--sync_bn", "--sync-bn", help="SyncBatchNorm across processes (several CUDA processes only)")
    add("--output-dir", default=".", metavar="DIR", help="where checkpoints and logs go (profile.py --benchmark: its "
        "CSV); created if missing (default: the working directory)")
    return group


def add_training_args(parser):
    group = parser.add_argument_group("training")
    add = group.add_argument
    add("--epochs", type=positive_int, metavar="N", help="total epochs (default: 90; 12 for digits)")
    add("--start-epoch", type=non_negative_int, default=0, metavar="N", help="epoch to start at; --resume sets it "
        "from the checkpoint (default: 0)")
    add("--lr", type=positive_float, default=0.1, metavar="LR", help="learning rate for a global batch of 256; scaled "
        "by global batch/256 (default: 0.1)")
    add("--lr-schedule", choices=("step", "cosine", "linear"), default="step", help="step: x0.1 at each epoch of "
        "--lr-steps (Apex); cosine: to --min-lr at the end; linear: from the end of the warmup straight down to "
        "--min-lr at the end (with the warmup, FFCV's triangular schedule) (default: step)")
    add("--lr-steps", type=positive_int, nargs="+", metavar="EPOCH", help="--lr-schedule step: the epochs "
        "(increasing) at which the LR is multiplied by 0.1 (default: 30 60 80; 6 9 for digits)")
    add("--warmup-epochs", type=non_negative_int, metavar="N", help="linear LR warmup epochs (default: 5, 1 for "
        "digits; either at most --epochs // 4, so short runs spend most epochs at full LR)")
    # SGD momentum of 1 or more never forgets a gradient and diverges
    add("--momentum", type=number(float, 0, 1, high_open=True, what="a number in [0, 1)",
                                  outside="SGD momentum must be in [0, 1) (0.9 is usual), got {text!r}"),
        default=0.9, metavar="M", help="SGD momentum, in [0, 1) (default: 0.9)")
    add("--wd", "--weight-decay", dest="weight_decay", type=non_negative_float, default=1e-4, metavar="W",
        help="weight decay, >= 0 (default: 1e-4)")
    add("--max-nonfinite-steps", type=positive_int, default=100, metavar="N", help="stop the run (exit code 3) after "
        "N steps in a row whose loss or gradients held inf/NaN; such steps are skipped and counted at every level; a "
        "dynamic loss scale below 2**-14 stops it too (default: 100)")
    add("-e", "--evaluate", action="store_true", help="only evaluate the model on the val split, then exit")


def add_ingredient_args(parser):
    """train.py's training ingredients (utils/ingredients.py); every default keeps Apex's recipe."""
    group = parser.add_argument_group("recipe ingredients (defaults: Apex's recipe)")
    add = group.add_argument
    add("--label-smoothing", type=non_negative_float, default=0.0, metavar="F", help="label smoothing of the training "
        "loss, in [0, 1) (default: 0)")
    add("--mixup", type=non_negative_float, default=0.0, metavar="A", help="mixup Beta alpha (timm Mixup, per batch; "
        "-b must be even); 0 is off (default: 0)")
    add("--cutmix", type=non_negative_float, default=0.0, metavar="A", help="cutmix Beta alpha (timm Mixup); 0 is off "
        "(default: 0)")
    add("--mixup-switch-prob", type=probability, default=0.5, metavar="P", help="with --mixup and --cutmix both on, "
        "the chance a batch uses cutmix (default: 0.5)")
    add("--aa", default="none", metavar="POLICY", help="augmentation policy after crop + flip, as timm spells it "
        "(rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, original) or ta_wide (TrivialAugmentWide); cpu data backend only "
        "(default: none)")
    add("--reprob", type=probability, default=0.0, metavar="P", help="random erasing probability per image (timm "
        "RandomErasing, on the device) (default: 0)")
    add_switch(group, "--bce-loss", help="binary cross-entropy on the (mixed, smoothed) one-hot targets instead of "
               "softmax cross-entropy, as timm's ResNet-strikes-back recipes (default: off)")
    add("--bce-target-thresh", type=probability, metavar="F", help="with --bce-loss: targets above F become 1, the "
        "rest 0 (timm's; default: off, soft targets)")
    add("--drop-path", type=probability, default=0.0, metavar="F", help="drop-path / stochastic-depth rate: timm's "
        "drop_path_rate, torchvision's stochastic_depth_prob; refused for models without it (default: 0, the model's "
        "own default)")
    add_switch(group, "--model-ema", help="keep an EMA of the weights (timm ModelEmaV3), validated every epoch beside "
        "the model and saved in checkpoints as state_dict_ema (default: off)")
    add("--model-ema-decay", type=positive_float, default=0.9998, metavar="D", help="EMA decay per optimizer step, in "
        "(0, 1) (default: 0.9998)")
    add_switch(group, "--model-ema-best", help="with --model-ema: model_best.pth.tar follows the EMA's top-1 rather "
        "than the model's (default: off)")
    add("--opt", choices=("sgd", "nesterov", "adamw", "lamb"), default="sgd", help="optimizer: torch SGD (nesterov: "
        "with Nesterov momentum), torch AdamW, timm Lamb (default: sgd)")
    add_switch(group, "--no-wd-norm-bias", help="no weight decay on norm weights and biases (1-D parameters) "
        "(default: off)")
    add("--clip-grad", type=positive_float, metavar="N", help="clip the global grad norm to N after unscaling, at "
        "every opt level (default: off)")
    add("--accum-steps", type=positive_int, default=1, metavar="N", help="gradient accumulation: one optimizer step "
        "per N batches, as one batch of N x -b (the LR scales with -b x processes x N; steps count optimizer steps) "
        "(default: 1)")
    add("--min-lr", type=non_negative_float, default=0.0, metavar="LR", help="absolute floor of the cosine and step "
        "schedules (default: 0)")
    return group


def add_checkpoint_args(parser):
    """train.py's checkpoint cadence (profile.py writes no checkpoints)."""
    group = parser.add_argument_group("checkpoints")
    add = group.add_argument
    add("--save-every-steps", type=non_negative_int, default=0, metavar="N", help="also write checkpoint.pth.tar "
        "every N training steps (counted across epochs), with the position inside the epoch, so --resume continues "
        "from that step; 0 means only at the end of each epoch (default: 0). SIGTERM/SIGINT always write one before "
        "the run stops")
    add("--keep-checkpoints", type=non_negative_int, default=0, metavar="N", help="also keep the last N end-of-epoch "
        "checkpoints as checkpoint-epochNNN.pth.tar (NNN: epochs finished) beside checkpoint.pth.tar and "
        "model_best.pth.tar; older ones are removed; 0 keeps none (default: 0)")
    return group


def add_prof_args(parser):
    """train.py's --prof (off by default); profile.py adds its own, always-on --prof."""
    group = parser.add_argument_group("profiling")
    group.add_argument("--prof", type=int, default=-1, metavar="N", help="profile: NVTX ranges, cudaProfilerStart at "
                       f"step N, stop and exit {PROF_STEPS} steps later (default: -1, off)")
    return group


def add_log_args(parser):
    """train.py's run-log flags (utils/logs.py); returns the parser so calls can be chained."""
    group = parser.add_argument_group("logs (written into --output-dir by the main process)")
    add = group.add_argument
    add("--log-with", choices=("none", "tensorboard", "wandb", "all"), default="none", help="also send per-epoch "
        "metrics to TensorBoard (OUTPUT_DIR/runs/), Weights & Biases (set WANDB_MODE=offline to run without network), "
        "or both; args.yaml, summary.csv and curves.png are always written; -e and --prof write none of these "
        "(default: none)")
    add("--overwrite", action="store_true", help="replace the run files in --output-dir: a new run into a directory "
        "that already holds a run's checkpoint.pth.tar, model_best.pth.tar, summary.csv, args.yaml or curves.png "
        "removes them at start-up (default: such a run is refused, with the --resume command that continues the old "
        "run)")
    return parser


def build_training_parser(description, prog=None):
    """Every flag of a training run but --prof: profile.py's parser starts here."""
    parser = OneLineErrorParser(prog=prog, description=description)
    for add in (add_data_args, add_datasets_args, add_model_args, add_precision_args, add_run_args, add_training_args):
        add(parser)
    parser.set_defaults(mean=None, std=None)  # no flags: the model's or the source's (apply_source_defaults)
    return parser


def build_parser(description, prog=None):
    """train.py's parser (less its --log-with): the training flags and the optional --prof."""
    parser = build_training_parser(description, prog)
    for add in (add_progressive_args, add_validation_args, add_ingredient_args, add_checkpoint_args, add_prof_args):
        add(parser)
    return parser


# What eval.py's parser, which has no training flags, holds for the dests the shared resolution
# reads: an evaluation, and the training data and schedule settings that the source defaults
# fill in (utils.flags.precedence.apply_source_defaults), as for train.py.
EVALUATION_DEFAULTS = dict(evaluate=True, epochs=None, lr_steps=None, warmup_epochs=None, min_scale=None,
                           hflip=None, mean=None, std=None)


def evaluation_dests():
    """The flags a `train.py -e` evaluation reads: those eval.py shares with train.py, the model's,
    and -e, --resume and --config themselves."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in (add_data_args, add_datasets_args, add_precision_args, add_run_args):
        add(parser, training=False)
    add_model_args(parser)
    add_validation_args(parser)
    return set(flag_actions(parser)) | {"evaluate", "resume", "config"}


# What a --prof run of train.py never reaches: it stops after its window, before validating,
# saving at an epoch's end or logging the epoch, and it writes nothing (no checkpoint on a stop
# signal either), so it neither checks nor replaces what --output-dir holds.
NOT_REACHED_BY_PROF = ("keep_checkpoints", "model_ema", "model_ema_best", "model_ema_decay", "log_with",
                       "save_every_steps", "overwrite")


def idle_flag_notes(parser, args, typed):
    """Warnings for flags typed on the command line that this run of train.py will not use."""
    names = {dest: flag_name(action) for dest, action in flag_actions(parser).items()}
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
