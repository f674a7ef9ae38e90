"""GPU kernel time a batch of the gpu backend costs: decode vs resample (torch.profiler, CUDA activity)."""
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from utils.batches import IMAGENET_MEAN, IMAGENET_STD, ShardedEpochSampler, _loader  # noqa: E402
from utils.crops import TrainBoxes  # noqa: E402
from utils.data import image_folder  # noqa: E402
from utils.gpu_batches import ByteSamples, GpuBatchDecoder, pack_bytes  # noqa: E402

device = torch.device("cuda")
B, N = 256, 8
dataset = image_folder(sys.argv[1], "train", None)
samples = ByteSamples(dataset.samples, TrainBoxes(0, 0.08, 0.5))
sampler = ShardedEpochSampler(len(dataset), B, 0, 1, 0)
loader = _loader(samples, sampler, SimpleNamespace(workers=8, batch_size=B), device, collate_fn=pack_bytes,
                 pin_memory=False)
packs = [p for _, p in zip(range(N + 3), loader)]
for name in ("cuda", "hardware"):
    decoder = GpuBatchDecoder(device, 224, IMAGENET_MEAN, IMAGENET_STD, channels_last=True, name_of=samples.name,
                              jpeg_decoder=name)
    for p in packs[:3]:
        decoder.resample(*decoder.decode_stage(p))
    torch.cuda.synchronize()
    for stage in ("decode", "resample"):
        staged = [decoder.decode_stage(p) for p in packs[3:]] if stage == "resample" else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if stage == "decode":
                for p in packs[3:]:
                    decoder.decode_stage(p)
            else:
                for s in staged:
                    decoder.resample(*s)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / N * 1e3
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events) / N / 1e3
        print(f"{name} {stage}: GPU kernel time {total:.2f} ms/batch, wall {wall:.1f} ms/batch", flush=True)
        for e in sorted(events, key=lambda e: -e.device_time_total)[:6]:
            print(f"    {e.device_time_total / N / 1e3:7.3f} ms  x{e.count // N:<4d} {e.key[:90]}")
