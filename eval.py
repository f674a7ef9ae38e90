"""Evaluate a train.py checkpoint: top-1/top-5, loss and images/s on a val split, Apex-style.

    python eval.py --resume model_best.pth.tar                     # the data it was trained on
    python eval.py --resume model_best.pth.tar /data/imagenet --opt-level O2 --results-file r.json
    accelerate launch --config_file accelerate_configs/2gpu.yaml eval.py --resume model_best.pth.tar

Every flag left out comes from the checkpoint's own training command line (its stored args):
DATA, image size, crop, batch size, opt level, channels_last; the architecture and the number of
classes always do (-a / --num-classes given on the command line must match them). Flags that
only make sense for training (--lr, --epochs, ...) are refused rather than silently ignored.
On N processes rank r scores every N-th val image, so every image counts exactly once.
"""
import argparse
import csv
import io
import json
import os
import sys

import torch

from utils.checkpoint import load_checkpoint, load_model_weights
from utils.cli import (FlagSafeHelpFormatter, OneLineErrorParser, add_data_args, add_datasets_args,
                       add_precision_args, add_run_args, positive_int)
from utils.data import build_data
from utils.engine import validate
from utils.errors import UsageError, exit_on_usage_error
from utils.files import atomic_write
from utils.logs import Progress
from utils.models import build_model
from utils.precision import HALF_DTYPES, Precision
from utils.setup import make_accelerator, parse_args, warn

# Training settings eval.py inherits from the checkpoint when the command line leaves them out.
FROM_CHECKPOINT = ("data", "image_size", "crop_pct", "interpolation", "mean", "std",
                   "opt_level", "keep_batchnorm_fp32", "channels_last", "batch_size",
                   "val_split", "image_column", "label_column")
# How a datasets source is read: inherited only together with the checkpoint's DATA.
DATA_READING = ("val_split", "image_column", "label_column")
# Training settings the shared start-up and data code reads; evaluation uses none of them.
NOT_EVALUATED = {"steps_per_epoch": 0, "prof": -1, "seed": 0, "train_split": None, "loss_scale": None}
RESULT_FORMATS = (".json", ".csv")
INHERITED = """\
defaults: DATA, -b, --image-size, --crop-pct, --interpolation, --opt-level, --keep-batchnorm-fp32,
  --channels-last and the datasets columns take the checkpoint's value unless given (the defaults
  printed above apply only where the checkpoint has none); --mixed-precision comes from the
  Accelerate config if it names fp16/bf16, else the dtype the checkpoint was trained with."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, FlagSafeHelpFormatter):
    """The usage examples and the defaults note keep their lines; flag help wraps as elsewhere."""


def results_path(text):
    """--results-file: the format follows the extension, checked before any work is done."""
    if os.path.splitext(text)[1].lower() not in RESULT_FORMATS:
        raise argparse.ArgumentTypeError(f"expected a file name ending in .json or .csv, got {text!r}")
    return text


def build_eval_parser():
    """eval.py's own flags, and the data, precision and run flags it shares with train.py."""
    parser = OneLineErrorParser(prog="eval.py", description=__doc__, epilog=INHERITED,
                                formatter_class=HelpFormatter)
    group = parser.add_argument_group("checkpoint")
    group.add_argument("--resume", default="", metavar="PATH",
                       help="the checkpoint to evaluate, written by train.py (required)")
    group.add_argument("-a", "--arch", default=None, metavar="ARCH",
                       help="must match the checkpoint's architecture (default: the checkpoint's)")
    group.add_argument("--num-classes", type=positive_int, default=None, metavar="N",
                       help="must match the checkpoint's classifier (default: the checkpoint's)")
    group.add_argument("--results-file", type=results_path, default=None, metavar="PATH",
                       help="also write the figures, with the checkpoint's epoch, arch and opt level, "
                            "to PATH: .json (one object) or .csv (a header and one row) (default: none)")
    group.add_argument("-e", "--evaluate", action="store_true",
                       help="accepted for train.py command lines; eval.py always only evaluates")
    add_data_args(parser, training=False)
    add_datasets_args(parser, training=False)
    add_precision_args(parser, training=False)
    add_run_args(parser, training=False)
    parser.set_defaults(**NOT_EVALUATED)
    return parser


class OnlyTyped(argparse.Namespace):
    """A namespace that claims every public attribute, so argparse fills in no defaults: after a
    parse it holds only what the command line set (and DATA as None, argparse's one exception)."""

    def __getattr__(self, name):
        if name.startswith("_"):  # argparse's own bookkeeping attributes
            raise AttributeError(name)
        return None


def typed_flags(argv):
    """The first parse: answers --help and bad values; returns (dests the user typed, --resume)."""
    typed, unknown = build_eval_parser().parse_known_args(argv, namespace=OnlyTyped())
    flags = sorted({arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")})
    if flags:
        raise UsageError(f"{', '.join(flags)}: not eval.py flag(s); eval.py takes no training flags "
                         "(--lr, --epochs, ...): drop them (see eval.py --help)")
    if unknown:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (see eval.py --help)")
    return {dest for dest, value in vars(typed).items() if value is not None}, typed.resume


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


def checkpoint_half_dtype(checkpoint):
    """fp16/bf16 the checkpoint was trained with, or None (fp32, or not recorded)."""
    for value in (checkpoint.get("mixed_precision"), (checkpoint.get("args") or {}).get("mixed_precision")):
        if value in HALF_DTYPES:
            return value
    return None


def parse_eval_args(argv):
    """Command line over checkpoint: argparse's own precedence does the merge, because the
    checkpoint's settings become the parser's defaults before the second, real, parse."""
    argv = sys.argv[1:] if argv is None else list(argv)
    given, resume = typed_flags(argv)
    if not resume:
        raise UsageError("eval.py needs a checkpoint: --resume PATH (e.g. model_best.pth.tar)")
    checkpoint = load_checkpoint(resume)
    stored = checkpoint.get("args") or {}
    inherit = [key for key in FROM_CHECKPOINT if not ("data" in given and key in DATA_READING)]
    # set_defaults also covers mean/std, which are no flags: parse_args puts them on args as well.
    defaults = {key: stored[key] for key in inherit if key in stored}
    defaults["arch"] = checkpoint["arch"]
    defaults["opt_level"] = checkpoint.get("opt_level") or defaults.get("opt_level")
    defaults["num_classes"] = checkpoint_num_classes(checkpoint)
    parser = build_eval_parser()
    parser.set_defaults(**defaults)
    args = parse_args(parser, argv)
    check_against_checkpoint(args, given, checkpoint, defaults)
    inherit_half_dtype(args, checkpoint)
    return args, checkpoint


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


def inherit_half_dtype(args, checkpoint):
    """Use the checkpoint's fp16/bf16 unless --mixed-precision or the Accelerate config names one.

    O0 stays fp32 whatever the checkpoint was trained with.
    """
    from_accelerate = os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() in HALF_DTYPES
    if args.mixed_precision is None and not from_accelerate and args.opt_level != "O0":
        args.mixed_precision = checkpoint_half_dtype(checkpoint)


def check_classes(data, checkpoint, args):
    """The val split must hold the classes the checkpoint was trained on, in the same order."""
    trained = checkpoint.get("classes")
    found = getattr(data, "classes", None)
    where = f"DATA {args.data or 'digits'!r}"
    if trained and found and list(trained) != list(found):
        extra = sorted(set(found) - set(trained))[:3]
        missing = sorted(set(trained) - set(found))[:3]
        detail = (f"not in the checkpoint: {extra}; " if extra else "") + \
                 (f"missing here: {missing}" if missing else "same names, other order")
        raise UsageError(f"{where} holds other classes than checkpoint {args.resume!r} was trained on "
                         f"({len(found)} vs {len(trained)}; {detail.rstrip('; ')}); evaluate on its own data")
    if data.num_classes != args.num_classes:
        raise UsageError(f"{where} has {data.num_classes} classes but checkpoint {args.resume!r} has "
                         f"{args.num_classes}; evaluate on the data it was trained on")


def build_eval_model(args, accelerator, recipe, checkpoint):
    """The checkpoint's model with the recipe applied. Not prepared: no DDP is needed to score,
    and each process scores its own images."""
    model = build_model(args.arch, args.num_classes)
    load_model_weights(model, checkpoint["state_dict"], args.arch, args.resume)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(accelerator.device, memory_format=memory_format)
    return model, Precision(recipe, model, accelerator.device.type)


def result_record(args, checkpoint, recipe, result, accelerator):
    return {
        "checkpoint": os.path.abspath(args.resume), "epoch": checkpoint["epoch"],
        "arch": checkpoint["arch"], "opt_level": checkpoint.get("opt_level"),
        "eval_opt_level": recipe.opt_level, "eval_dtype": recipe.dtype_name,
        "data": args.data or "digits", "images": result.count,
        "top1": round(result.top1, 4), "top5": round(result.top5, 4), "loss": round(result.loss, 6),
        "images_per_sec": round(result.images_per_sec, 2), "seconds": round(result.seconds, 3),
        "processes": accelerator.num_processes, "batch_size": args.batch_size,
        "image_size": args.image_size, "channels_last": args.channels_last,
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


def main(argv=None):
    args, checkpoint = parse_eval_args(argv)
    accelerator, recipe, notes = make_accelerator(args)
    for note in notes:
        warn(accelerator, note)
    progress = Progress(accelerator)
    log = progress.print

    data = build_data(args, accelerator, train=False)
    check_classes(data, checkpoint, args)
    model, precision = build_eval_model(args, accelerator, recipe, checkpoint)
    trained = f"{checkpoint.get('opt_level') or '?'} {checkpoint_half_dtype(checkpoint) or 'fp32'}"
    log(f"=> evaluating {args.resume!r}: {args.arch}, epoch {checkpoint['epoch']}, trained at {trained}, "
        f"best Prec@1 {checkpoint.get('best_prec1', float('nan')):.3f}")
    log(f"=> {args.data or 'digits'} val: {data.val_size} images | {args.num_classes} classes | "
        f"{accelerator.num_processes} process(es) on {accelerator.device.type} | batch {args.batch_size} "
        f"per process | {args.image_size} px")
    log(recipe.describe())

    criterion = torch.nn.CrossEntropyLoss().to(accelerator.device)
    result = validate(model, data, precision, accelerator, args, criterion, log, progress)
    log(f" * Loss {result.loss:.4f} Images {result.count} Speed {result.images_per_sec:.1f} images/s")
    if result.count != data.val_size:  # a sharding bug must never pass as a result
        raise RuntimeError(f"evaluated {result.count} images, but the val split holds {data.val_size}")
    if args.results_file and accelerator.is_main_process:
        write_results(result_record(args, checkpoint, recipe, result, accelerator), args.results_file)
        log(f"=> results written to {args.results_file}")
    accelerator.end_training()
    return result


if __name__ == "__main__":
    exit_on_usage_error(main)
