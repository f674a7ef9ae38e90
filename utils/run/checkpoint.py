"""Checkpoints: atomic writes, fp32 weights, and loads that explain what is wrong with a file."""
import collections
import os
import re

import torch

from utils.run.errors import UsageError, first_line
from utils.run.files import atomic_write, copy_atomic

CHECKPOINT = "checkpoint.pth.tar"
BEST = "model_best.pth.tar"
REQUIRED_KEYS = ("epoch", "arch", "state_dict")


KEPT = re.compile(r"^checkpoint-epoch(\d+)\.pth\.tar$")  # --keep-checkpoints copies


def kept_name(epoch):
    return f"checkpoint-epoch{epoch:03d}.pth.tar"


def kept_checkpoints(output_dir):
    """[(epochs finished, file name)] of the --keep-checkpoints copies in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(match.group(1)), name) for name in os.listdir(output_dir) if (match := KEPT.match(name))]
    return sorted(found)


def save_checkpoint(state, is_best, output_dir, keep=0):
    """checkpoint.pth.tar every call; model_best.pth.tar as well when is_best; with keep > 0 and an
    end-of-epoch state (step 0), also checkpoint-epochNNN.pth.tar (NNN = state["epoch"], the epochs
    finished), removing the older copies beyond the last keep: that copy and the keep - 1 newest
    before it stay. Copies numbered after it stay too: they are left from a continuation that a
    resume from an older copy abandoned, and this run overwrites them as it gets there (pruning
    them instead would delete the copy just written as "not among the newest"). Returns the paths
    written.

    fsync before each rename: after a power cut a checkpoint is the old one or the new one, never
    a renamed but empty file. Called by the main process only, so only it removes old copies.
    model_best.pth.tar is written first: if that write fails (a full disk), checkpoint.pth.tar
    still holds the epoch before, which the run's summary.csv ends with, and a resume redoes
    the epoch; if the next write fails, model_best is one epoch ahead, which best_on_disk reads.
    """
    path = os.path.join(output_dir, CHECKPOINT)
    if is_best:
        best = atomic_write(os.path.join(output_dir, BEST), lambda handle: torch.save(state, handle), fsync=True)
        written = [copy_atomic(best, path, fsync=True), best]
    else:
        written = [atomic_write(path, lambda handle: torch.save(state, handle), fsync=True)]
    if keep > 0 and not state.get("step", 0):
        epoch = state["epoch"]
        written.append(copy_atomic(path, os.path.join(output_dir, kept_name(epoch)), fsync=True))
        older = [name for finished, name in kept_checkpoints(output_dir) if finished < epoch]
        for name in older[:max(len(older) - (keep - 1), 0)]:  # never the copy just written
            os.remove(os.path.join(output_dir, name))
    return written


def checkpoint_weights(checkpoint, path, ema=False):
    """The state_dict eval.py and the export take: the model's, or with ema the --model-ema
    average (state_dict_ema), refused in one line where the run kept none."""
    if ema and "state_dict_ema" not in checkpoint:
        raise UsageError(f"--ema: checkpoint {path!r} holds no EMA weights (train with --model-ema)")
    return checkpoint["state_dict_ema" if ema else "state_dict"]


def best_on_disk(output_dir):
    """The best_prec1 of the model_best.pth.tar in output_dir, or None (none there, or unreadable).
    A run resumed from an older checkpoint starts from that one's best; the file already there may
    be better (from the continuation it abandons) and must not be replaced by a worse model."""
    path = os.path.join(output_dir, BEST)
    if not os.path.isfile(path):
        return None
    try:  # mmap: only the few bytes of one number are read, not the weights
        best = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("best_prec1")
    except Exception:  # a damaged file holds no claim to keep
        return None
    return float(best) if isinstance(best, (int, float)) else None


def load_checkpoint(path, training=False):
    """Load a checkpoint on the CPU with weights_only=True; UsageError if it is not one of ours.

    Every entry train.py writes is checked for its type (a foreign or damaged file fails here,
    naming the entry, rather than with a traceback later); training=True (--resume of a training
    run) also requires the optimizer state."""
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
    for key in REQUIRED_KEYS + (TRAINING_KEYS if training else ()):
        if key not in state:
            raise UsageError(f"checkpoint {path!r} has no {key!r} entry, which resuming training needs "
                             f"({EXPECTED[key]}); it was not written by train.py, or only holds weights: "
                             "use it with eval.py, or train from scratch")
    for key, expected in EXPECTED.items():
        if key in state and not _fits(key, state[key]):
            raise UsageError(f"checkpoint {path!r} is damaged or foreign: {key!r} should be {expected}, "
                             f"found {_describe(state[key])}")
    return state


# What each entry of a checkpoint must hold; load_checkpoint names the first that does not.
EXPECTED = {
    "epoch": "an integer >= 0 (the next epoch to run)",
    "arch": "a model name (text)",
    "state_dict": "a dict of parameter names to tensors",
    "optimizer": "an optimizer state dict (a dict with 'state' and 'param_groups')",
    "loss_scale": "a loss-scale state dict or None",
    "best_prec1": "a number",
    "opt_level": "O0, O1, O2, O3 or None",
    "mixed_precision": "'no', 'fp16', 'bf16' or None",
    "num_classes": "a positive integer or None",
    "classes": "a list of class names or None",
    "args": "a dict of the run's flags",
    "world_size": "a positive integer (processes that trained it)",
}
TRAINING_KEYS = ("optimizer",)  # --resume of a training run needs these on top of REQUIRED_KEYS


def _fits(key, value):
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key == "epoch":
        return is_int and value >= 0
    if key == "arch":
        return isinstance(value, str) and bool(value)
    if key == "state_dict":
        return (isinstance(value, dict) and bool(value) and all(isinstance(k, str) for k in value)
                and all(torch.is_tensor(v) for v in value.values()))
    if key == "optimizer":
        return (isinstance(value, dict) and isinstance(value.get("state"), dict)
                and isinstance(value.get("param_groups"), list))
    if key == "loss_scale":
        return value is None or isinstance(value, dict)
    if key == "best_prec1":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "opt_level":
        return value is None or value in ("O0", "O1", "O2", "O3")
    if key == "mixed_precision":
        return value is None or value in ("no", "fp16", "bf16")
    if key == "num_classes":
        return value is None or (is_int and value > 0)
    if key == "classes":
        return value is None or (isinstance(value, (list, tuple)) and all(isinstance(c, str) for c in value))
    if key == "args":
        return isinstance(value, dict)
    if key == "world_size":
        return is_int and value > 0
    return True


def _describe(value):
    if isinstance(value, dict):
        kinds = sorted({type(v).__name__ for v in value.values()})
        return f"a dict of {len(value)} entries ({', '.join(kinds) or 'empty'})"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def strip_module_prefix(state_dict):
    """Accept state dicts saved from a DDP-wrapped model too."""
    if all(key.startswith("module.") for key in state_dict):
        return {key[len("module."):]: value for key, value in state_dict.items()}
    return state_dict


def with_module_versions(state_dict, model):
    """state_dict with the per-module version metadata load_state_dict reads. Checkpoints hold
    plain dicts of fp32 copies (Precision.fp32_state_dict), which have none, and some torchvision
    models refuse to load without it (MNASNet raises on version None); the modules of the model
    built here are what the weights were saved from, so their versions stand in."""
    if getattr(state_dict, "_metadata", None) is not None:
        return state_dict
    versioned = collections.OrderedDict(state_dict)
    versioned._metadata = getattr(model.state_dict(), "_metadata", None)
    return versioned


def load_model_weights(model, state_dict, arch, path):
    """Load weights into model, with a clear message when the checkpoint is of another model."""
    missing, unexpected = [], []
    try:
        result = model.load_state_dict(with_module_versions(strip_module_prefix(state_dict), model), strict=False)
        missing, unexpected = result.missing_keys, result.unexpected_keys
    except RuntimeError as err:
        raise UsageError(f"checkpoint {path!r} does not fit -a {arch}: "
                         f"{str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else err}; "
                         "use the architecture and --num-classes it was trained with") from None
    if missing or unexpected:
        raise UsageError(f"checkpoint {path!r} does not fit -a {arch} ({len(missing)} missing and "
                         f"{len(unexpected)} unexpected weights, e.g. {(missing + unexpected)[0]}); use "
                         "the architecture it was trained with")
