"""Evaluate a train.py checkpoint, or published weights: top-1/top-5, loss and images/s on a val split.

    python eval.py --resume model_best.pth.tar                     # the data it was trained on
    python eval.py --resume model_best.pth.tar /data/imagenet --opt-level O2 --results-file r.json
    python eval.py --pretrained -a resnet50 /data/imagenet         # torchvision/timm weights, local cache
    python eval.py --resume model_best.pth.tar --predictions preds.csv    # per-image top-5
    accelerate launch --config_file accelerate_configs/2gpu.yaml eval.py --resume model_best.pth.tar

Every flag left out comes from the checkpoint's own training command line (its stored args):
DATA, image size, crop, batch size, opt level (channels_last follows this device instead); the
architecture and the number of classes always do (-a / --num-classes given on the command line
must match them). Flags that only make sense for training (--lr, --epochs, ...) are refused
rather than silently ignored.
--pretrained instead scores the weights torchvision or timm publish for -a (never downloaded: from
the local cache, as train.py --pretrained), with the model's own input size, crop, interpolation
and mean/std, so the val pipeline can be checked against the published top-1; DATA must hold the
weights' classes (1000 for ImageNet weights), in their order.
On N processes rank r scores every N-th val image, so every image counts exactly once.
"""
import signal
import sys

if __name__ == "__main__":
    # Ctrl-C during the imports below (seconds, torch's) ends the process quietly (status 130), not with
    # a traceback from deep inside an import; exit_on_usage_error gives Ctrl-C its message back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse  # noqa: E402
import csv
import io
import json
import os

import torch

from utils.compiled import compile_model
from utils.data.sources import build_data
from utils.device import make_accelerator, warn
from utils.engine import Watch, validate
from utils.flags.parser import (
    EVALUATION_DEFAULTS,
    FlagSafeHelpFormatter,
    OneLineErrorParser,
    OnlyTyped,
    add_data_args,
    add_datasets_args,
    add_precision_args,
    add_run_args,
    add_validation_args,
    positive_int,
)
from utils.flags.precedence import (
    checkpoint_half_dtype,
    fp32_over_inherited_level,
    half_dtype_to_inherit,
    keep_bn_for_opt_level,
    parse_args,
)
from utils.flags.specs import data_spec, device_settings, precision_flags
from utils.logs import Progress
from utils.models import REFUSED, apply_blurpool, build_model, check_input_size, torchvision_names
from utils.precision import Precision
from utils.predictions import PredictionRecorder, write_predictions
from utils.run.checkpoint import checkpoint_weights, load_checkpoint, load_model_weights
from utils.run.directory import RUN_FILES
from utils.run.errors import UsageError, exit_on_usage_error
from utils.run.files import atomic_write, check_output_file, output_file_problem

# Training settings eval.py inherits from the checkpoint when the command line leaves them out.
# Not --channels-last: a memory layout for the device at hand (on by default on CUDA, off elsewhere),
# not part of what was trained; a checkpoint from a GPU run is evaluated on a CPU without it.
FROM_CHECKPOINT = ("data", "image_size", "crop_pct", "val_resize_size", "val_crop_size", "tta", "interpolation",
                   "mean", "std", "blurpool",
                   "opt_level", "keep_batchnorm_fp32", "batch_size",
                   "val_split", "image_column", "label_column")
# How a datasets source is read: inherited only together with the checkpoint's DATA.
DATA_READING = ("val_split", "image_column", "label_column")
# Training settings the shared start-up and data code reads; evaluation uses none of them.
NOT_EVALUATED = {"steps_per_epoch": 0, "prof": -1, "seed": 0, "train_split": None, "loss_scale": None, "aa": "none",
                 "train_crop_size": None, "min_res": None, "max_res": None, "start_ramp": None, "end_ramp": None,
                 "res_step": 32, "ra_reps": 1, "ra_sampler": False, "blurpool": False}
RESULT_FORMATS = (".json", ".csv")
INHERITED = """\
defaults: DATA, -b, --image-size, --crop-pct, --interpolation, --opt-level, --keep-batchnorm-fp32, --tta
  and the datasets columns take the checkpoint's value unless given (the defaults printed above
  apply only where the checkpoint has none); --mixed-precision comes from the Accelerate config if
  it names fp16/bf16, else the dtype the checkpoint was trained with; --channels-last follows this
  device (on for CUDA), not the checkpoint."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, FlagSafeHelpFormatter):
    """The usage examples and the defaults note keep their lines; flag help wraps as elsewhere."""


def output_path(*extensions):
    """The argparse type of an output file: a name ending in one of extensions (the format follows
    it) that can be written without harm (utils.run.files.output_file_problem: not a run's file,
    in a folder that takes a new file), checked before any work is done; a file already there is
    refused without --overwrite (check_outputs)."""
    def check(text):
        if os.path.splitext(text)[1].lower() not in extensions:
            expected = " or ".join(extensions)
            raise argparse.ArgumentTypeError(f"expected a file name ending in {expected}, got {text!r}")
        problem = output_file_problem(text, RUN_FILES)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r}: {problem}; choose another file")
        return text
    return check


def build_eval_parser():
    """eval.py's own flags, and the data, precision and run flags it shares with train.py."""
    parser = OneLineErrorParser(prog="eval.py", description=__doc__, epilog=INHERITED,
                                formatter_class=HelpFormatter)
    group = parser.add_argument_group("checkpoint or pretrained weights")
    group.add_argument("--resume", default="", metavar="PATH",
                       help="the checkpoint to evaluate, written by train.py (this or --pretrained is required)")
    group.add_argument("--pretrained", action="store_true",
                       help="evaluate the pretrained weights of -a ARCH (torchvision's, or timm's for "
                            "timm/<name>) from the local cache, never downloaded; not with --resume")
    group.add_argument("--ema", action="store_true",
                       help="evaluate the checkpoint's --model-ema weights (state_dict_ema) instead of the model's")
    group.add_argument("-a", "--arch", default=None, metavar="ARCH",
                       help="must match the checkpoint's architecture (default: the checkpoint's); with "
                            "--pretrained, the model to evaluate (required)")
    group.add_argument("--num-classes", type=positive_int, default=None, metavar="N",
                       help="must match the checkpoint's classifier (default: the checkpoint's), or "
                            "with --pretrained the weights' (default: theirs, e.g. 1000)")
    group.add_argument("--results-file", type=output_path(*RESULT_FORMATS), default=None, metavar="PATH",
                       help="also write the figures, with the checkpoint's epoch, arch and opt level, "
                            "to PATH: .json (one object) or .csv (a header and one row) (default: none)")
    group.add_argument("--predictions", type=output_path(".csv"), default=None, metavar="PATH.csv",
                       help="also write every val image's top-5 to PATH.csv: one row per image (index, "
                            "path, label and its name, 5 class indices, probabilities and names), "
                            "from all processes; under --tta flip, of the mean of the plain and the mirrored "
                            "logits (default: none)")
    group.add_argument("--overwrite", action="store_true",
                       help="replace an existing --results-file or --predictions file (default: refuse, "
                            "naming it, before any work)")
    group.add_argument("-e", "--evaluate", action="store_true",
                       help="accepted for train.py command lines; eval.py always only evaluates")
    add_data_args(parser, training=False)
    add_datasets_args(parser, training=False)
    add_precision_args(parser, training=False)
    add_run_args(parser, training=False)
    add_validation_args(parser)
    parser.set_defaults(**NOT_EVALUATED)
    parser.set_defaults(**EVALUATION_DEFAULTS)  # -e or not: the shared start-up checks must see an evaluation
    return parser


def typed_flags(argv):
    """The first parse: answers --help and bad values; returns {dest: value} of the flags typed."""
    typed, unknown = build_eval_parser().parse_known_args(argv, namespace=OnlyTyped())
    flags = sorted({arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")})
    if flags:
        raise UsageError(f"{', '.join(flags)}: not eval.py flag(s); eval.py takes no training flags "
                         "(--lr, --epochs, ...): drop them (see eval.py --help)")
    if unknown:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (see eval.py --help)")
    return {dest: value for dest, value in vars(typed).items() if value is not None}


def checkpoint_num_classes(checkpoint):
    """Classifier outputs: stored by train.py, else in its args, else the last 2-D weight's rows."""
    if checkpoint.get("num_classes"):
        return int(checkpoint["num_classes"])
    stored = checkpoint.get("args") or {}
    if stored.get("num_classes"):
        return int(stored["num_classes"])
    matrices = [value for value in checkpoint["state_dict"].values() if getattr(value, "ndim", 0) == 2]
    if not matrices:
        raise UsageError("cannot tell how many classes the checkpoint has; give --num-classes")
    return int(matrices[-1].shape[0])


def parse_eval_args(argv):
    """Command line over checkpoint: argparse's own precedence does the merge, because the
    checkpoint's settings become the parser's defaults before the second, real, parse."""
    argv = sys.argv[1:] if argv is None else list(argv)
    typed = typed_flags(argv)
    if "pretrained" in typed:
        return parse_pretrained_args(argv, typed), None
    if not typed.get("resume"):
        raise UsageError("eval.py needs a checkpoint: --resume PATH (e.g. model_best.pth.tar), or "
                         "--pretrained -a ARCH for published weights")
    checkpoint = load_checkpoint(typed["resume"])
    defaults = checkpoint_defaults(checkpoint, typed)
    parser = build_eval_parser()
    parser.set_defaults(**defaults)
    args = parse_args(parser, argv)
    given = set(typed)
    if fp32_over_inherited_level(args, given):
        given = given | {"opt_level"}
    keep_bn_for_opt_level(args, "opt_level" in given, "keep_batchnorm_fp32" in given, defaults["opt_level"])
    check_against_checkpoint(args, given, checkpoint, defaults)
    return args, checkpoint


def checkpoint_defaults(checkpoint, typed):
    """The checkpoint's settings as eval.py's defaults (typed: {dest: value} of the flags typed).
    set_defaults also covers mean/std, which are no flags: parse_args puts them on args as well."""
    stored = checkpoint.get("args") or {}
    inherit = [key for key in FROM_CHECKPOINT if not ("data" in typed and key in DATA_READING)]
    defaults = {key: stored[key] for key in inherit if key in stored}
    defaults["arch"] = checkpoint["arch"]
    defaults["opt_level"] = checkpoint.get("opt_level") or defaults.get("opt_level")
    defaults["num_classes"] = checkpoint_num_classes(checkpoint)
    # --mixed-precision: the checkpoint's fp16/bf16 at the opt level this run evaluates at, unless a
    # flag or Accelerate names one (a typed --mixed-precision no, which may lower the level, wins).
    level = typed["opt_level"] if "opt_level" in typed else defaults["opt_level"]
    defaults["mixed_precision"] = half_dtype_to_inherit(checkpoint, level)
    return defaults


def parse_pretrained_args(argv, typed):
    """--pretrained: no checkpoint; -a names the model, the weights fix the number of classes, and
    the model's data config (a timm model's size, crop, interpolation, mean/std) fills the data
    flags left out (utils.flags.precedence.parse_args -> apply_source_defaults)."""
    if typed.get("resume"):
        raise UsageError("--pretrained and --resume both name the weights to evaluate; give one of them")
    if "arch" not in typed:
        raise UsageError("--pretrained needs -a ARCH: the torchvision or timm/<name> model whose weights "
                         "to evaluate (e.g. -a resnet50)")
    parser = build_eval_parser()
    arch = parse_args(parser, argv).arch  # parse_args refuses an unknown timm name or weight tag first
    classes = pretrained_num_classes(arch)
    if typed.get("num_classes", classes) != classes:
        raise UsageError(f"the pretrained {arch} weights have {classes} classes, not --num-classes "
                         f"{typed['num_classes']}; drop --num-classes")
    parser.set_defaults(num_classes=classes)  # the weights' count is the default, as a checkpoint's is
    return parse_args(parser, argv)


def pretrained_num_classes(arch):
    """Classifier outputs of the weights --pretrained loads for arch (1000 for ImageNet weights)."""
    if arch.startswith("timm/"):  # parse_args has already refused unknown names and weight tags
        import timm.models
        cfg = timm.models.get_pretrained_cfg(arch[len("timm/"):])
        if cfg is None or not cfg.num_classes:
            raise UsageError(f"--pretrained: timm lists no pretrained weights for {arch}; drop --pretrained "
                             "or pick a model that has some (timm.list_pretrained())")
        return int(cfg.num_classes)
    import torchvision
    if arch in REFUSED or arch not in torchvision_names():
        build_model(arch, 1)  # raises the message train.py gives for this name
    return len(torchvision.models.get_model_weights(arch).DEFAULT.meta["categories"])


def check_against_checkpoint(args, given, checkpoint, defaults):
    """-a and --num-classes can only confirm the checkpoint; its DATA must exist here."""
    path = args.resume
    if args.arch != checkpoint["arch"]:
        raise UsageError(f"checkpoint {path!r} holds a {checkpoint['arch']} model, not -a {args.arch}; "
                         f"drop -a or pass -a {checkpoint['arch']}")
    if args.num_classes != defaults["num_classes"]:
        raise UsageError(f"checkpoint {path!r} has {defaults['num_classes']} classes, not --num-classes "
                         f"{args.num_classes}; drop --num-classes")
    data = args.data
    is_path = data not in (None, "digits", "synthetic") and not data.startswith("hf:")
    if "data" not in given and is_path and not os.path.exists(data):
        raise UsageError(f"{path!r} was trained on DATA {data!r}, which does not exist here; give DATA "
                         "(the folder holding val/) on the command line")


def check_classes(data, checkpoint, args):
    """The val split must hold the classes the checkpoint was trained on, in the same order; for
    --pretrained (checkpoint None), as many classes as the weights have."""
    found = getattr(data, "classes", None)
    where = f"DATA {args.data or 'digits'!r}"
    if checkpoint is None:
        if data.num_classes != args.num_classes:
            raise UsageError(f"{where} has {data.num_classes} classes but the pretrained {args.arch} weights "
                             f"have {args.num_classes}; evaluate on data with the weights' classes, in "
                             "their order (ImageNet weights: ImageNet's val/, one folder per class)")
        return
    trained = checkpoint.get("classes")
    if trained and found and list(trained) != list(found):
        extra = sorted(set(found) - set(trained))[:3]
        missing = sorted(set(trained) - set(found))[:3]
        detail = (f"not in the checkpoint: {extra}; " if extra else "") + \
                 (f"missing here: {missing}" if missing else "same names, other order")
        raise UsageError(f"{where} holds other classes than checkpoint {args.resume!r} was trained on "
                         f"({len(found)} vs {len(trained)}; {detail.rstrip('; ')}); evaluate on its own data")
    if trained and found:
        return  # the same names in the same order (the model may have more outputs: --num-classes)
    if data.num_classes > args.num_classes:  # labels beyond the model's outputs; fewer can be a val split's
        raise UsageError(f"{where} has {data.num_classes} classes but checkpoint {args.resume!r} has "
                         f"{args.num_classes}; evaluate on the data it was trained on")


def build_eval_model(args, accelerator, plan, checkpoint, device):
    """The checkpoint's model with the precision plan applied, in the memory format and compiled
    as device (utils.device.DeviceSettings) settled. Not prepared: no DDP is needed to score, and
    each process scores its own images."""
    if checkpoint is None:  # --pretrained: the local cache or the refusal train.py gives
        model = build_model(args.arch, args.num_classes, pretrained=True)
    else:
        model = build_model(args.arch, args.num_classes)
        if args.blurpool:  # the blur is no weight: the checkpoint's stored flag rebuilds it
            apply_blurpool(model, args.arch)
        load_model_weights(model, checkpoint_weights(checkpoint, args.resume, args.ema), args.arch, args.resume)
    check_input_size(model, args.arch, args.val_crop_size or args.image_size)
    memory_format = torch.channels_last if device.channels_last else torch.contiguous_format
    model = model.to(accelerator.device, memory_format=memory_format)
    precision = Precision(plan, model, accelerator.device.type)
    if device.compile:  # after the plan's casts and hooks, so the compiled graph holds them
        model = compile_model(model, device.compile, accelerator.print, device.compile_mode,
                              tune_kernels=device.tune_kernels)
    return model, precision


def result_record(args, checkpoint, plan, result, accelerator, channels_last, val_geometry):
    checkpoint = checkpoint or {}  # --pretrained: no epoch, no training opt level
    return {
        "checkpoint": os.path.abspath(args.resume) if args.resume else f"pretrained {args.arch}",
        "weights": "ema" if args.ema else "model",
        "epoch": checkpoint.get("epoch"), "arch": args.arch, "opt_level": checkpoint.get("opt_level"),
        "eval_opt_level": plan.opt_level, "eval_dtype": plan.dtype_name,
        "data": args.data or "digits", "images": result.count,
        "top1": round(result.top1, 4), "top5": round(result.top5, 4), "loss": round(result.loss, 6),
        "images_per_sec": round(result.images_per_sec, 2), "seconds": round(result.seconds, 3),
        "processes": accelerator.num_processes, "batch_size": args.batch_size,
        "image_size": val_geometry[0], "val_resize_size": val_geometry[1], "channels_last": channels_last,
        **({"tta": args.tta, "tta_top1": round(result.tta_top1, 4), "tta_top5": round(result.tta_top5, 4)}
           if result.tta_top1 is not None else {}),
    }


def write_results(record, path):
    """JSON or CSV by extension, replaced atomically so a reader never sees half a file."""
    if path.lower().endswith(".json"):
        text = json.dumps(record, indent=2) + "\n"
    else:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(record))
        writer.writeheader()
        writer.writerow(record)
        text = buffer.getvalue()
    atomic_write(path, text)


def check_outputs(args, checkpoint):
    """The output flags that cannot work with these weights or with each other, before any work."""
    if args.predictions and args.data == "synthetic":
        raise UsageError("--predictions needs real images; synthetic data has none to name: drop it")
    if args.ema and checkpoint is None:
        raise UsageError("--ema: --pretrained weights have no EMA (it names a --resume checkpoint's)")
    if args.predictions and args.results_file and os.path.abspath(args.predictions) == os.path.abspath(args.results_file):
        raise UsageError(f"--results-file and --predictions name the same file {args.predictions!r}; the second "
                         "would replace the first: give two names")
    for flag, path in (("--results-file", args.results_file), ("--predictions", args.predictions)):
        if path:  # again now that --overwrite is known: a file already there is the user's
            check_output_file(path, flag, args.overwrite, RUN_FILES)


def start_lines(args, checkpoint, data, accelerator, val_geometry):
    """What is scored, on what: the weights (with the best Prec@1 as the checkpoint counted it: of
    the EMA weights under --model-ema-best), then the val split and the processes."""
    if checkpoint is None:
        weights = f"=> evaluating the pretrained {args.arch} weights from the local cache"
    else:
        trained = f"{checkpoint.get('opt_level') or '?'} {checkpoint_half_dtype(checkpoint) or 'fp32'}"
        judged = " (of the EMA weights: --model-ema-best)" if (checkpoint.get("args") or {}).get("model_ema_best") else ""
        weights = (f"=> evaluating {args.resume!r}{' (its EMA weights)' if args.ema else ''}: {args.arch}, epoch "
                   f"{checkpoint['epoch']}, trained at {trained}, best Prec@1 "
                   f"{checkpoint.get('best_prec1', float('nan')):.3f}{judged}")
    return [weights, f"=> {args.data or 'digits'} val: {data.val_size} images | {args.num_classes} classes | "
                     f"{accelerator.num_processes} process(es) on {accelerator.device.type} | batch "
                     f"{args.batch_size} per process | resize {val_geometry[1]} + center crop {val_geometry[0]}"]


def main(argv=None):
    args, checkpoint = parse_eval_args(argv)
    check_outputs(args, checkpoint)
    accelerator, plan, notes = make_accelerator(precision_flags(args), args.deterministic)
    device = device_settings(args, accelerator.device.type)  # memory format, data backend, compile
    for note in notes + [device.note] * bool(device.note):
        warn(accelerator, note)
    progress = Progress(accelerator)
    log = progress.print

    # The model first: missing --pretrained weights are refused before the val split is read.
    model, precision = build_eval_model(args, accelerator, plan, checkpoint, device)
    spec = data_spec(args, backend=device.data_backend, jpeg_decoder=device.jpeg_decoder,
                     channels_last=device.channels_last)
    data = build_data(spec, accelerator, train=False)
    check_classes(data, checkpoint, args)
    for line in [*start_lines(args, checkpoint, data, accelerator, spec.val_geometry),
                 plan.describe(evaluation=True), device.input_line]:
        log(line)

    criterion = torch.nn.CrossEntropyLoss().to(accelerator.device)
    # The recorder sees the logits the figures count (--tta flip's mean), not the loss's; it only records.
    recorder = PredictionRecorder(lambda logits, target: None, args.num_classes) if args.predictions else None
    result = validate(model, data, precision, accelerator, print_freq=args.print_freq, criterion=criterion,
                      watch=Watch(log=log, progress=progress), tta=args.tta, on_logits=recorder)
    log(f" * Loss {result.loss:.4f} Images {result.count} Speed {result.images_per_sec:.1f} images/s")
    if result.count != data.val_size:  # a sharding bug must never pass as a result
        raise RuntimeError(f"evaluated {result.count} images, but the val split holds {data.val_size}")
    if args.results_file and accelerator.is_main_process:
        write_results(result_record(args, checkpoint, plan, result, accelerator, device.channels_last,
                                    spec.val_geometry), args.results_file)
        log(f"=> results written to {args.results_file}")
    if args.predictions:
        write_predictions(recorder, data, accelerator, args.predictions, names=(checkpoint or {}).get("classes"))
        log(f"=> {data.val_size} per-image predictions written to {args.predictions}")
    accelerator.end_training()
    return result


if __name__ == "__main__":
    exit_on_usage_error(main)
