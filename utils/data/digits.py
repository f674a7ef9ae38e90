"""The digits demo's data: scikit-learn's handwritten digits, written once as a JPEG ImageFolder
into the cache directory, so `python train.py` needs no download.

The cache directory comes from the environment (IMAGENET_AMP_CACHE, else XDG_CACHE_HOME, else
HOME): one that names a file, cannot be made or cannot take a file is refused before the build, as
one line naming the variable (exit 2); a build that fails midway (a full disk) is one WriteError
line naming the variable too (exit 4), and leaves no half-built folder."""
import io
import os

import numpy as np
from PIL import Image

from utils.run.errors import UsageError
from utils.run.files import atomic_directory, folder_write_problem


def cache_source():
    """(the variable the cache directory comes from, what it says it is), in the order cache_dir
    reads them: IMAGENET_AMP_CACHE, XDG_CACHE_HOME, HOME (what ~ expands to)."""
    if os.environ.get("IMAGENET_AMP_CACHE"):
        return "IMAGENET_AMP_CACHE", os.environ["IMAGENET_AMP_CACHE"]
    if "XDG_CACHE_HOME" in os.environ:
        return "XDG_CACHE_HOME", os.environ["XDG_CACHE_HOME"]
    return "HOME", os.path.expanduser("~")


def cache_dir():
    """IMAGENET_AMP_CACHE, else $XDG_CACHE_HOME/imagenet-amp (~/.cache/imagenet-amp)."""
    return os.environ.get("IMAGENET_AMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "imagenet-amp")


def _fix(variable):
    return ("set IMAGENET_AMP_CACHE to a directory you can write to (created if missing)" if variable ==
            "IMAGENET_AMP_CACHE" else f"set IMAGENET_AMP_CACHE (or fix {variable}) to a directory you can write to")


def check_cache_dir(folder):
    """The cache folder made and proven writable, or a UsageError naming the variable it came from
    (a file where a directory is expected, a folder that cannot be made or cannot take a file)."""
    variable, value = cache_source()
    where = f"{variable}={value!r}" + ("" if os.path.abspath(folder) == os.path.abspath(value) else
                                       f" (the digits cache {folder!r})")
    blocker = os.path.abspath(folder)
    while not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if not os.path.isdir(blocker):  # the variable itself, or a folder on the way, is a file
        raise UsageError(f"{where}: {blocker!r} is a file, not a directory; {_fix(variable)}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{where} cannot be created ({err.strerror}); {_fix(variable)}") from None
    problem = folder_write_problem(folder)
    if problem:
        raise UsageError(f"{where} is not writable: {problem}; {_fix(variable)}")


def ensure_digits(root=None):
    """Write scikit-learn's handwritten digits once as a JPEG ImageFolder; return its root.

    1,797 real 8x8 scans, upscaled to 32x32 and split 80/20 with a fixed seed. Built in a
    temporary folder that becomes root only when complete (utils.run.files.atomic_directory), so
    concurrent processes never see half a dataset.
    """
    root = root or os.path.join(cache_dir(), "digits-v1")
    if os.path.isdir(os.path.join(root, "val")):
        return root
    check_cache_dir(os.path.dirname(os.path.abspath(root)))
    from sklearn.datasets import load_digits  # scikit-learn loads slowly; only a first run needs it

    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    n_val = len(order) // 5
    variable = cache_source()[0]
    advice = f"; free space there, or {_fix(variable).replace('you can write to', 'on a disk with room')}"
    with atomic_directory(root, advice=advice) as tmp:
        for rank, index in enumerate(order):
            split = "val" if rank < n_val else "train"
            folder = os.path.join(tmp, split, str(int(digits.target[index])))
            os.makedirs(folder, exist_ok=True)
            pixels = (digits.images[index] * (255.0 / 16.0)).astype(np.uint8)
            image = Image.fromarray(pixels, mode="L").resize((32, 32), Image.BICUBIC).convert("RGB")
            # Encoded in memory, then written by Python: PIL's encoder writes to the file descriptor
            # itself and, on a full disk, left a truncated JPEG without raising (seen under RLIMIT_FSIZE).
            encoded = io.BytesIO()
            image.save(encoded, format="JPEG", quality=95)
            with open(os.path.join(folder, f"{index:04d}.jpg"), "wb") as handle:
                handle.write(encoded.getvalue())
    return root
