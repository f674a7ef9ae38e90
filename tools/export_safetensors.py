#!/usr/bin/env python3
"""Export a train.py checkpoint's weights as safetensors, loadable by the bare torchvision/timm model.

    python tools/export_safetensors.py model_best.pth.tar resnet50.safetensors

The file holds the checkpoint's state_dict in fp32 (at O2 the masters: train.py always saves
fp32), with no `module.` (DDP) or `_orig_mod.` (torch.compile) prefixes, so

    model = torchvision.models.get_model("resnet50", num_classes=N)     # or timm.create_model(...)
    model.load_state_dict(safetensors.torch.load_file("resnet50.safetensors"), strict=True)

works without this project. Its metadata (strings, as safetensors requires) names the arch,
epoch, num_classes, best_prec1, opt_level, the class names (JSON, label order) and which weights
they are (`weights`: model, or ema with --ema: the --model-ema average, state_dict_ema); read it with
`safetensors.safe_open(path, "pt").metadata()`. The optimizer, loss scale and RNG state are
training state and are left out. Written atomically: a kill never leaves half a file. An existing
OUT is refused unless --overwrite; an OUT that cannot be written is refused before the checkpoint is
read, and a write that still fails (a full disk) is one line and exit code 4.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere, yet import the project's utils
from utils.flags.parser import OneLineErrorParser  # noqa: E402
from utils.run.checkpoint import checkpoint_weights, load_checkpoint  # noqa: E402
from utils.run.errors import UsageError, exit_on_usage_error  # noqa: E402
from utils.run.files import atomic_write, output_file_problem  # noqa: E402

# Wrappers whose attribute name ends up in front of every key: DDP, torch.compile's OptimizedModule.
PREFIXES = ("module.", "_orig_mod.")


def strip_prefixes(key):
    """'module._orig_mod.conv1.weight' -> 'conv1.weight' (wrappers nest in either order)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix):], True
    return key


def export_tensors(state_dict):
    """fp32, contiguous, unshared copies (safetensors refuses tensors that share storage)."""
    tensors = {}
    for key, value in state_dict.items():
        name = strip_prefixes(key)
        if name in tensors:
            raise UsageError(f"two weights become {name!r} once the wrapper prefixes are stripped; "
                             "the checkpoint's state_dict is not one model's")
        value = value.detach()
        tensors[name] = (value.float() if value.is_floating_point() else value).contiguous().clone()
    return tensors


def export_metadata(checkpoint, weights="model"):
    classes = checkpoint.get("classes")
    num_classes = checkpoint.get("num_classes") or (len(classes) if classes else None)
    fields = {"format": "pt",  # what Hugging Face / timm loaders expect of a torch safetensors file
              "arch": checkpoint["arch"], "epoch": checkpoint["epoch"], "num_classes": num_classes,
              "best_prec1": checkpoint.get("best_prec1"), "opt_level": checkpoint.get("opt_level"),
              "classes": json.dumps(list(classes)) if classes else None, "weights": weights}
    return {key: str(value) for key, value in fields.items() if value is not None}


def export(checkpoint_path, out_path, ema=False):
    """Write out_path (the EMA weights with ema); returns (number of tensors, metadata)."""
    import safetensors.torch

    checkpoint = load_checkpoint(checkpoint_path)
    tensors = export_tensors(checkpoint_weights(checkpoint, checkpoint_path, ema))
    metadata = export_metadata(checkpoint, "ema" if ema else "model")
    atomic_write(out_path, safetensors.torch.save(tensors, metadata=metadata), fsync=True)
    return len(tensors), metadata


def main(argv=None):
    parser = OneLineErrorParser(prog="export_safetensors.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint.pth.tar or model_best.pth.tar")
    parser.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    parser.add_argument("--ema", action="store_true", help="export the --model-ema weights (state_dict_ema)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT.safetensors if it exists (default: refuse, naming it, before any work)")
    args = parser.parse_args(argv)
    if not args.out.endswith(".safetensors"):
        raise UsageError(f"the output name should end in .safetensors, got {args.out!r}")
    problem = output_file_problem(args.out)  # also: its folder takes a new file (a probe, as root too)
    if problem:
        raise UsageError(f"cannot write {args.out!r}: {problem}; choose another file")
    if os.path.lexists(args.out) and not args.overwrite:
        raise UsageError(f"{args.out!r} already exists; pass --overwrite to replace it, or choose another file")
    count, metadata = export(args.checkpoint, args.out, args.ema)
    print(f"=> wrote {count} tensors of {metadata['arch']} ({metadata['weights']} weights, epoch "
          f"{metadata['epoch']}, {metadata.get('num_classes', '?')} classes) to {args.out}")


if __name__ == "__main__":
    exit_on_usage_error(main)
