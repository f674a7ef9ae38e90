"""What slows the gpu backend's pipeline when a step runs beside it: the GIL or the GPU?
python3 contention_probe.py DATA"""
import os
import sys
import threading
import time
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import torchvision  # noqa: E402

from utils.batches import IMAGENET_MEAN, IMAGENET_STD, ShardedEpochSampler, _loader  # noqa: E402
from utils.crops import TrainBoxes  # noqa: E402
from utils.data import image_folder  # noqa: E402
from utils.engine import RunAhead  # noqa: E402
from utils.gpu_batches import ByteSamples, GpuBatchDecoder, GpuBatches, pack_bytes  # noqa: E402
from utils.precision import cast_model  # noqa: E402

data = sys.argv[1]
device = torch.device("cuda")
B, STEPS, WARM = 256, 20, 5
dataset = image_folder(data, "train", None)
samples = ByteSamples(dataset.samples, TrainBoxes(0, 0.08, 0.5))
sampler = ShardedEpochSampler(len(dataset), B, 0, 1, 0)
loader = _loader(samples, sampler, SimpleNamespace(workers=8, batch_size=B), device, collate_fn=pack_bytes,
                 pin_memory=False)
decoder = GpuBatchDecoder(device, 224, IMAGENET_MEAN, IMAGENET_STD, channels_last=True, name_of=samples.name)


def batches():
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from GpuBatches(loader, decoder)
        epoch += 1


feed = batches()

# ---- the step, eager and as one CUDA graph (O2-like: half weights, fp32 BN, fused SGD)
model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
cast_model(model, torch.float16, keep_bn_fp32=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
criterion = torch.nn.CrossEntropyLoss()
static_x = torch.randn(B, 3, 224, 224, device=device).half().contiguous(memory_format=torch.channels_last)
static_y = torch.randint(0, 1000, (B,), device=device)


def eager_step():
    loss = criterion(model(static_x).float(), static_y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        eager_step()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
optimizer.zero_grad(set_to_none=True)
with torch.cuda.graph(graph):
    loss = criterion(model(static_x).float(), static_y)
    loss.backward()
    optimizer.step()


def timed(one, steps=STEPS, warm=WARM, limit=12.0):
    ahead = RunAhead(device)
    start = time.perf_counter()
    for k in range(steps + warm):
        if k == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        one()
        ahead.step_queued()
        if time.perf_counter() - start > limit and k > warm:
            break
    torch.cuda.synchronize()
    return (k - warm + 1) * B / (time.perf_counter() - t0)


class Beside:
    """Run `work` in a thread until the with block ends; count its rounds."""

    def __init__(self, work):
        self.work, self.rounds, self.stop = work, 0, threading.Event()

    def __enter__(self):
        def loop():
            while not self.stop.is_set():
                self.work()
                self.rounds += 1
        self.thread = threading.Thread(target=loop, daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.rate = self.rounds / (time.perf_counter() - self.t0)


def report(label, value, extra=""):
    print(f"{label:52s} {value:8.0f} img/s {extra}", flush=True)



import torch.cuda.green_contexts as gc  # noqa: E402
total = torch.cuda.get_device_properties(0).multi_processor_count
print("torch", torch.__version__, "SMs", total, "GreenContext has Stream:", hasattr(gc.GreenContext, "Stream"), flush=True)


def decoding():
    sampler2 = ShardedEpochSampler(len(dataset), B, 0, 1, 0)
    loader2 = _loader(samples, sampler2, SimpleNamespace(workers=8, batch_size=B), device, collate_fn=pack_bytes,
                      pin_memory=False)

    def packs():
        epoch = 100
        while True:
            sampler2.set_epoch(epoch)
            yield from loader2
            epoch += 1
    it = packs()

    def work():
        decoder.decode_stage(next(it))
    return work


def replays(stream):
    ahead = RunAhead(device)

    def work():
        with torch.cuda.stream(stream):
            graph.replay()
            ahead.step_queued()
    return work


decode = decoding()
report("decoder alone", timed(decode, steps=15, limit=5))
normal = torch.cuda.Stream()
report("graph alone, normal stream", timed(replays(normal), steps=30, limit=5))
start = time.perf_counter()
for again in range(8):
    with Beside(replays(normal)) as g:
        r = timed(decode, steps=15, limit=5)
    report(f"decoder + graph, all SMs, no green context, t={time.perf_counter() - start:.0f}s", r,
           f"(graph {g.rate * B:.0f} img/s)")
ctx = gc.GreenContext.create(num_sms=total - 16, device_id=0)
green_stream = ctx.Stream()
for again in range(4):
    with Beside(replays(normal)) as g:
        r = timed(decode, steps=15, limit=5)
    report(f"decoder + graph, all SMs, a green context exists, t={time.perf_counter() - start:.0f}s", r,
           f"(graph {g.rate * B:.0f} img/s)")
