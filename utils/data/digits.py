"""The digits demo's data: scikit-learn's handwritten digits, written once as a JPEG ImageFolder
into the cache directory, so `python train.py` needs no download."""
import os

import numpy as np
from PIL import Image

from utils.run.files import atomic_directory


def cache_dir():
    """IMAGENET_AMP_CACHE, else $XDG_CACHE_HOME/imagenet-amp (~/.cache/imagenet-amp)."""
    return os.environ.get("IMAGENET_AMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "imagenet-amp")


def ensure_digits(root=None):
    """Write scikit-learn's handwritten digits once as a JPEG ImageFolder; return its root.

    1,797 real 8x8 scans, upscaled to 32x32 and split 80/20 with a fixed seed. Built in a
    temporary folder that becomes root only when complete (utils.run.files.atomic_directory), so
    concurrent processes never see half a dataset.
    """
    root = root or os.path.join(cache_dir(), "digits-v1")
    if os.path.isdir(os.path.join(root, "val")):
        return root
    from sklearn.datasets import load_digits  # scikit-learn loads slowly; only a first run needs it

    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    n_val = len(order) // 5
    with atomic_directory(root) as tmp:
        for rank, index in enumerate(order):
            split = "val" if rank < n_val else "train"
            folder = os.path.join(tmp, split, str(int(digits.target[index])))
            os.makedirs(folder, exist_ok=True)
            pixels = (digits.images[index] * (255.0 / 16.0)).astype(np.uint8)
            image = Image.fromarray(pixels, mode="L").resize((32, 32), Image.BICUBIC).convert("RGB")
            image.save(os.path.join(folder, f"{index:04d}.jpg"), quality=95)
    return root
