"""Checkpoints: atomic writes, fp32 weights, and loads that explain what is wrong with a file."""
import os

import torch

from .errors import UsageError, first_line
from .files import atomic_write, copy_atomic

CHECKPOINT = "checkpoint.pth.tar"
BEST = "model_best.pth.tar"
REQUIRED_KEYS = ("epoch", "arch", "state_dict")


def save_checkpoint(state, is_best, output_dir):
    """checkpoint.pth.tar every call; model_best.pth.tar as well when is_best. Returns the paths.

    fsync before each rename: after a power cut a checkpoint is the old one or the new one, never
    a renamed but empty file.
    """
    path = os.path.join(output_dir, CHECKPOINT)
    atomic_write(path, lambda handle: torch.save(state, handle), fsync=True)
    written = [path]
    if is_best:
        written.append(copy_atomic(path, os.path.join(output_dir, BEST), fsync=True))
    return written


def load_checkpoint(path):
    """Load a checkpoint on the CPU with weights_only=True; UsageError if it is not one of ours."""
    if not os.path.isfile(path):
        raise UsageError(f"no checkpoint at {path!r}; give the path of a checkpoint.pth.tar or "
                         "model_best.pth.tar written by train.py")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, pickle of other objects, not a torch file at all
        raise UsageError(f"cannot read checkpoint {path!r}: it is truncated or not a checkpoint "
                         f"written by train.py ({first_line(err, 200)})") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise UsageError(f"{path!r} is not a train.py checkpoint (it lacks the keys "
                         f"{', '.join(REQUIRED_KEYS)})")
    return state


def strip_module_prefix(state_dict):
    """Accept state dicts saved from a DDP-wrapped model too."""
    if all(key.startswith("module.") for key in state_dict):
        return {key[len("module."):]: value for key, value in state_dict.items()}
    return state_dict


def load_model_weights(model, state_dict, arch, path):
    """Load weights into model, with a clear message when the checkpoint is of another model."""
    missing, unexpected = [], []
    try:
        result = model.load_state_dict(strip_module_prefix(state_dict), strict=False)
        missing, unexpected = result.missing_keys, result.unexpected_keys
    except RuntimeError as err:
        raise UsageError(f"checkpoint {path!r} does not fit -a {arch}: "
                         f"{str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else err}; "
                         "use the architecture and --num-classes it was trained with") from None
    if missing or unexpected:
        raise UsageError(f"checkpoint {path!r} does not fit -a {arch} ({len(missing)} missing and "
                         f"{len(unexpected)} unexpected weights, e.g. {(missing + unexpected)[0]}); use "
                         "the architecture it was trained with")
