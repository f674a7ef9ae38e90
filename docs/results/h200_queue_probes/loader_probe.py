"""Where does the gpu backend's loader path spend its time? Run on the device: python3 loader_probe.py DATA"""
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402
import torch  # noqa: E402

from utils.batches import ShardedEpochSampler, _loader  # noqa: E402
from utils.crops import TrainBoxes  # noqa: E402
from utils.data import image_folder  # noqa: E402
from utils.gpu_batches import (ByteSamples, GpuBatchDecoder, GpuBatches, jpeg_header, pack_bytes,  # noqa: E402
                               read_file)

data = sys.argv[1]
WORKERS = [int(w) for w in os.environ.get("WORKERS", "8 16").split()]
dataset = image_folder(data, "train", None)
paths = [p for p, _ in dataset.samples[:2560]]
boxes = TrainBoxes(0, 0.08, 0.5)


def timed(label, fn, n):
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    print(f"{label:40s} {dt / n * 1e6:9.1f} us/image", flush=True)
    return out


blobs = timed("read (2nd pass, cached)", lambda: [read_file(p) for p in paths], len(paths))
blobs = timed("read again", lambda: [read_file(p) for p in paths], len(paths))
heads = timed("jpeg_header", lambda: [jpeg_header(b) for b in blobs], len(paths))
timed("TrainBoxes", lambda: [boxes(max(w, 1), max(h, 1), 0, i) for i, (_, w, h) in enumerate(heads)], len(paths))
samples = ByteSamples(dataset.samples, boxes)
items = timed("ByteSamples[i] whole", lambda: [samples[(i, 0)] for i in range(len(paths))], len(paths))
batches = [items[k:k + 256] for k in range(0, len(items), 256)]
timed("pack_bytes (main: plain empty)", lambda: [pack_bytes(b) for b in batches], len(paths))
sizes = [sum(len(s[0]) for s in b) for b in batches]


def fresh_shared(size):
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).new(storage)


timed("shm alloc only", lambda: [fresh_shared(s) for s in sizes], len(paths))
bufs = [fresh_shared(s) for s in sizes]
timed("concat into fresh shm", lambda: [np.concatenate([s[0] for s in b], out=buf.numpy()) for b, buf in zip(batches, bufs)], len(paths))
timed("concat into same shm again", lambda: [np.concatenate([s[0] for s in b], out=buf.numpy()) for b, buf in zip(batches, bufs)], len(paths))
print("mean file KB", np.mean([len(b) for b in blobs]) / 1024, flush=True)

POOL = {}


def pack_pooled(batch):
    """prototype: a worker cycles through 12 shared buffers (unsafe, speed only)."""
    info = torch.utils.data.get_worker_info()
    ring = POOL.setdefault("ring", [])
    k = POOL.setdefault("k", 0)
    POOL["k"] = k + 1
    size = sum(len(s[0]) for s in batch)
    if len(ring) < 12:
        ring.append(fresh_shared(size * 2))
    buf = ring[k % len(ring)]
    if len(buf) < size:
        buf = ring[k % len(ring)] = fresh_shared(size * 2)
    payloads = [s[0] for s in batch]
    np.concatenate(payloads, out=buf.numpy()[:size])
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    return (buf, torch.from_numpy(offsets),
            torch.tensor([(s[4], s[5]) for s in batch], dtype=torch.int64),
            torch.tensor([s[6] for s in batch], dtype=torch.bool),
            torch.tensor([s[2] for s in batch], dtype=torch.float64),
            torch.tensor([s[1] for s in batch], dtype=torch.int64),
            torch.tensor([s[3] for s in batch], dtype=torch.int64))


def no_pack(batch):
    return torch.tensor([len(s[0]) for s in batch])


KEEP = {}


def loader_rate(collate, workers, touch=False, batches=40, warm=8, keep=False):
    sampler = ShardedEpochSampler(len(dataset), 256, 0, 1, 0)
    args = SimpleNamespace(workers=workers, batch_size=256)
    loader = _loader(samples, sampler, args, torch.device("cpu"), collate_fn=collate, pin_memory=False)
    n, t0 = 0, None
    epoch = 0
    while True:
        sampler.set_epoch(epoch) if hasattr(sampler, "set_epoch") else None
        for k, batch in enumerate(loader):
            if keep:
                KEEP[batch[0].data_ptr()] = batch[0]
            if touch:
                buf = batch[0]
                buf.numpy().sum(dtype=np.uint64)
            n += 1
            if n == warm:
                t0 = time.perf_counter()
            if n == warm + batches:
                rate = batches * 256 / (time.perf_counter() - t0)
                if keep:
                    print("   distinct buffers seen", len(KEEP))
                    KEEP.clear()
                del loader
                return rate
        epoch += 1


for workers in WORKERS:
    for label, collate, touch, keep in (("gpu-workers (fresh shm)", pack_bytes, False, False),
                                  ("gpu-workers + main reads buffer", pack_bytes, True, False),
                                  ("pooled shm", pack_pooled, False, False),
                                  ("pooled shm + main reads", pack_pooled, True, False),
                                  ("pooled shm + main keeps + reads", pack_pooled, True, True),
                                  ("no packing (read+header+box only)", no_pack, False, False)):
        print(f"-j{workers} {label:40s} {loader_rate(collate, workers, touch, keep=keep):8.0f} img/s", flush=True)

if torch.cuda.is_available():
    decoder = GpuBatchDecoder("cuda", 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), channels_last=True,
                              name_of=samples.name)
    from utils.gpu_batches import Packed

    def pooled_packed(batch):
        return Packed(*pack_pooled(batch))

    class Keeping:
        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            for packed in self.loader:
                KEEP[packed.buffer.data_ptr()] = packed.buffer
                yield packed

    for workers, collate, wrap in [(w, c, k) for w in WORKERS for c, k in ((pack_bytes, False), (pooled_packed, False), (pooled_packed, True))]:
        sampler = ShardedEpochSampler(len(dataset), 256, 0, 1, 0)
        args = SimpleNamespace(workers=workers, batch_size=256)
        loader = _loader(samples, sampler, args, torch.device("cuda"), collate_fn=collate, pin_memory=False)
        print(collate.__name__, "keep" if wrap else "", end=" ")
        loader = Keeping(loader) if wrap else loader
        n = 0
        for epoch in range(3):
            sampler.set_epoch(epoch) if hasattr(sampler, "set_epoch") else None
            for images, targets in GpuBatches(loader, decoder):
                n += 1
                if n == 8:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                if n == 48:
                    break
            if n >= 48:
                break
        torch.cuda.synchronize()
        print(f"-j{workers} loader + GpuBatches (no step)          {40 * 256 / (time.perf_counter() - t0):8.0f} img/s", flush=True)
        del loader
