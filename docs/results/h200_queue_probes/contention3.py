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
B, STEPS, WARM = 256, int(os.environ.get("STEPS", "40")), 10
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


def take():
    x, y = next(feed)
    return x, y


def fed_graph():
    x, y = next(feed)
    static_x.copy_(x)
    static_y.copy_(y)
    graph.replay()


def fed_eager():
    x, y = next(feed)
    static_x.copy_(x)
    static_y.copy_(y)
    eager_step()


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


def spin_python(ms):
    def work():
        end = time.perf_counter() + ms / 1000
        while time.perf_counter() < end:
            sum(range(100))
        time.sleep(ms / 1000)
    return work


def decode_only():
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


def graph_replays():
    ahead = RunAhead(device)

    def work():
        graph.replay()
        ahead.step_queued()
    return work


def eager_steps():
    ahead = RunAhead(device)

    def work():
        eager_step()
        ahead.step_queued()
    return work


def report(label, value, extra=""):
    print(f"{label:52s} {value:8.0f} img/s {extra}", flush=True)


import gzip, json, collections  # noqa: E401,E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def graph_replays_on(stream):
    ahead = RunAhead(device)

    def work():
        with torch.cuda.stream(stream):
            graph.replay()
            ahead.step_queued()
    return work


def decoding(dec_obj, pin=False):
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
        packed = next(it)
        if pin:
            packed = packed._replace(buffer=packed.buffer.pin_memory())
        dec_obj.decode_stage(packed)
    return work


def profiled(work, label):
    with Beside(graph_replays()):
        for _ in range(2):
            work()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                work()
            torch.cuda.synchronize()
    prof.export_chrome_trace("/tmp/dec.json")
    events = [e for e in json.load(open("/tmp/dec.json"))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    per = collections.defaultdict(lambda: [0.0, 0])
    main_tid = threading.get_native_id()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["tid"] == main_tid:
            per[e["name"]][0] += e["dur"] / 1000 / 3
            per[e["name"]][1] += 1
    print("  profile:", label, flush=True)
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"    {name:40s} {ms:8.2f} ms/batch in {n / 3:.0f} calls", flush=True)
    kernels = collections.Counter(e["name"][:60] for e in events if e.get("cat") in ("kernel", "gpu_memcpy"))
    print("    GPU work:", kernels.most_common(6), flush=True)


def make(jpeg, priority):
    d = GpuBatchDecoder(device, 224, IMAGENET_MEAN, IMAGENET_STD, channels_last=True, name_of=samples.name,
                        jpeg_decoder=jpeg)
    d.decode_stream = torch.cuda.Stream(device, priority=priority)
    return d


print("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)
for jpeg in ("cuda", "hardware"):
    d = make(jpeg, 0)
    work = decoding(d)
    report(f"decode alone [{jpeg}]", timed(work, steps=30))
    with Beside(graph_replays()) as g:
        r = timed(work, limit=8)
    report(f"decode + graph replays [{jpeg}]", r, f"(graph {g.rate * B:.0f} img/s)")
report("graph step fed (train loop)", timed(fed_graph, steps=30, limit=10))
report("eager step fed (train loop)", timed(fed_eager, steps=30, limit=10))
