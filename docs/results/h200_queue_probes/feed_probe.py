"""The step fed by GpuBatches over a real loader, in loader variants. python3 feed_probe.py DATA"""
import os
import queue
import sys
import threading
import time
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from decode_overlap import make_step  # noqa: E402
from utils.batches import IMAGENET_MEAN, IMAGENET_STD, ShardedEpochSampler, _loader  # noqa: E402
from utils.crops import TrainBoxes  # noqa: E402
from utils.data import image_folder  # noqa: E402
from utils.engine import RunAhead  # noqa: E402
from utils.gpu_batches import ByteSamples, GpuBatchDecoder, GpuBatches, Packed, pack_bytes  # noqa: E402

data = sys.argv[1]
WORKERS = int(os.environ.get("WORKERS", "8"))
STEPS, WARM = int(os.environ.get("STEPS", "40")), 10
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
B = int(os.environ.get("BATCH", "256"))
dataset = image_folder(data, "train", None)
samples = ByteSamples(dataset.samples, TrainBoxes(0, 0.08, 0.5))


def fresh_shared(size):
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).new(storage)


def meta(batch):
    return (np.array([(s[4], s[5]) for s in batch], dtype=np.int64), np.array([s[6] for s in batch], dtype=bool),
            np.array([s[2] for s in batch], dtype=np.float64), np.array([s[1] for s in batch], dtype=np.int64),
            np.array([s[3] for s in batch], dtype=np.int64))


def offsets_of(batch):
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum([len(s[0]) for s in batch], out=offsets[1:])
    return offsets


def pack_numpy_meta(batch):
    """fresh shm buffer, metadata as numpy (pickled by value, no shm segment each)"""
    offsets = offsets_of(batch)
    buffer = fresh_shared(int(offsets[-1]))
    np.concatenate([s[0] for s in batch], out=buffer.numpy())
    return (buffer, offsets) + meta(batch)


RING = {}


def pack_pooled_numpy(batch):
    ring = RING.setdefault("ring", [])
    k = RING["k"] = RING.get("k", -1) + 1
    offsets = offsets_of(batch)
    size = int(offsets[-1])
    if len(ring) < 12:
        ring.append(fresh_shared(size * 2))
    if len(ring[k % len(ring)]) < size:
        ring[k % len(ring)] = fresh_shared(size * 2)
    buffer = ring[k % len(ring)]
    np.concatenate([s[0] for s in batch], out=buffer.numpy()[:size])
    return (buffer, offsets) + meta(batch)


class AsPacked:
    """numpy-meta tuples -> Packed; keep: hold every buffer seen so its mapping stays cached."""

    def __init__(self, loader, keep=False):
        self.loader, self.keep, self.kept = loader, keep, {}

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for buffer, *rest in self.loader:
            if self.keep:
                self.kept[buffer.data_ptr()] = buffer
            yield Packed(buffer, *(torch.from_numpy(a) for a in rest))


class Received:
    """The loader read in a thread of its own, depth batches ahead."""

    def __init__(self, loader, depth=2):
        self.loader, self.depth = loader, depth

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        results = queue.Queue(self.depth)

        def work():
            for item in self.loader:
                results.put(item)
            results.put(None)
        threading.Thread(target=work, daemon=True).start()
        while (item := results.get()) is not None:
            yield item


def build(variant):
    sampler = ShardedEpochSampler(len(dataset), B, 0, 1, 0)
    args = SimpleNamespace(workers=WORKERS, batch_size=B)
    collate = {"numpy": pack_numpy_meta, "pooled": pack_pooled_numpy}.get(variant.get("pack"), pack_bytes)
    loader = _loader(samples, sampler, args, device, collate_fn=collate, pin_memory=variant.get("pin", False))
    if variant.get("pack"):
        loader = AsPacked(loader, keep=variant.get("keep", False))
    if variant.get("thread"):
        loader = Received(loader)
    return loader, sampler


step = make_step(os.environ.get("ARCH", "resnet50"), device)
images = torch.randn(B, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
targets = torch.randint(0, 1000, (B,), device=device)
decoder = GpuBatchDecoder(device, 224, IMAGENET_MEAN, IMAGENET_STD, channels_last=True, name_of=samples.name)


def run(feed):
    ahead = RunAhead(device)
    n = 0
    for epoch in range(100):
        for x, y in feed(epoch):
            step(x, y)
            ahead.step_queued()
            n += 1
            if n == WARM:
                torch.cuda.synchronize() if device.type == "cuda" else None
                t0 = time.perf_counter()
            if n == STEPS + WARM:
                torch.cuda.synchronize() if device.type == "cuda" else None
                return STEPS * B / (time.perf_counter() - t0)


def random_feed(epoch):
    return ((images, targets) for _ in range(1000))


print(f"step alone (random)                  {run(random_feed):8.0f} img/s", flush=True)
VARIANTS = [("current", {}),
            ("pin_memory", {"pin": True}),
            ("receive thread", {"thread": True}),
            ("numpy meta", {"pack": "numpy"}),
            ("numpy meta + thread", {"pack": "numpy", "thread": True}),
            ("numpy meta + pin", {"pack": "numpy", "pin": True}),
            ("pooled+keep", {"pack": "pooled", "keep": True}),
            ("pooled+keep + thread", {"pack": "pooled", "keep": True, "thread": True}),
            ("current (again)", {})]
only = os.environ.get("ONLY")
for label, variant in VARIANTS:
    if only and label not in only.split(","):
        continue
    loader, sampler = build(variant)

    def feed(epoch):
        sampler.set_epoch(epoch)
        return GpuBatches(loader, decoder)

    both = run(feed)

    def decode_only(epoch):
        sampler.set_epoch(epoch)
        return ((x, targets) for x, _ in GpuBatches(loader, decoder))
    # the pipeline without the step: a trivial "step" so run() still counts
    saved = step
    globals()["step"] = lambda x, y: None
    alone = run(decode_only)
    globals()["step"] = saved
    print(f"{label:36s} fed {both:8.0f} img/s   pipeline alone {alone:8.0f} img/s", flush=True)
    del loader
print(f"step alone (random, again)           {run(random_feed):8.0f} img/s", flush=True)
