import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private cache so the digits folder the tests use is written by the tests."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["IMAGENET_AMP_CACHE"] = str(path)
    return path


def make_image_folder(root, classes=3, per_class=6, size=(40, 30), splits=("train", "val"), seed=0):
    """Real JPEGs in ImageFolder layout: root/<split>/<class>/<n>.jpg, each class its own colour."""
    rng = np.random.RandomState(seed)
    for split in splits:
        for label in range(classes):
            folder = os.path.join(root, split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            for index in range(per_class):
                base = np.zeros((size[1], size[0], 3), dtype=np.uint8)
                base[..., label % 3] = 180
                noise = rng.randint(0, 60, size=base.shape).astype(np.uint8)
                Image.fromarray(base + noise).save(os.path.join(folder, f"{index}.jpg"), quality=90)
    return str(root)


def run_script(script, *args, env=None, cwd=None, timeout=600):
    """Run one of the project's scripts in a fresh process; returns CompletedProcess."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)],
                          capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout)


@pytest.fixture(scope="session")
def accelerator():
    """One Accelerator for the whole session: Accelerate allows one state per process."""
    from accelerate import Accelerator
    return Accelerator(mixed_precision="no")
