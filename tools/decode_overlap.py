#!/usr/bin/env python3
"""Does the gpu backend's batch decode overlap the training step? Up to six rates, one process.

    python tools/decode_overlap.py /data/fake_imagenet --batch-size 256 --steps 30

The gpu input backend decodes a batch (utils.gpu_batches.GpuBatchDecoder: JPEG decode, crop,
resize, normalise on the device) in threads while the training step of the batch before runs.
If the two overlapped fully, training from files would run at the slower one's rate; if something
serialises them, at about 1 / (1/step + 1/decode). This measures, on batches packed once from
DATA/train and replayed (no loader workers: their cost is another question,
tools/benchmark_loader.py's):

  step                 the training step alone on one random batch (plain PyTorch, channels_last,
                       half weights + fp32 BatchNorm as --opt-level O2, fused SGD)
  decode               GpuBatchDecoder alone, batch after batch, in one thread
  decode, two threads  GpuBatches alone: one thread decodes JPEGs while another resamples the
                       batch before
  both, one thread     the step fed by one thread doing decode and resampling
  both, default stream the step fed by GpuBatches' two threads (train.py's arrangement: the step
                       on torch's default stream)
  both, side stream    the same with the step on a stream of its own (CUDA only): the default
                       stream is CUDA's legacy stream, which every blocking CUDA call of a library
                       (a cudaFree, a synchronous copy) waits for; a side stream does not

and prints the overlap expected from the step and the faster decode. On a machine without CUDA everything runs on the
CPU (the decoder's CPU path), which checks the tool, not the GPU.

--trace DIR also profiles a few steps of "step" and of "both, default stream" (torch.profiler, all
threads), writes the two Chrome traces there and prints where each step's time went: per CUDA
stream the kernel and copy time, how long the step's stream sat idle and why (the host launched
its next kernel late, or other streams' kernels filled the GPU), the main thread's wait for the
batch, and per thread the CUDA calls that block (synchronisations, cudaFree, cudaMalloc, ...).
"""
import argparse
import collections
import gzip
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torchvision  # noqa: E402

from utils.batches import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from utils.crops import TrainBoxes  # noqa: E402
from utils.data import image_folder  # noqa: E402
from utils.engine import RunAhead  # noqa: E402
from utils.precision import cast_model  # noqa: E402
from utils.gpu_batches import ByteSamples, GpuBatchDecoder, GpuBatches, pack_bytes  # noqa: E402


def packed_batches(data, batch_size, count, seed=0):
    """count batches packed from DATA/train, as loader workers would hand them over."""
    dataset = image_folder(data, "train", None)
    samples = ByteSamples(dataset.samples, TrainBoxes(seed, 0.08, 0.5))
    if len(samples) < batch_size:
        raise ValueError(f"{data}/train holds {len(samples)} images, fewer than one batch of {batch_size}; "
                         "lower --batch-size")
    return [pack_bytes([samples[((k * batch_size + i) % len(samples), 0)] for i in range(batch_size)])
            for k in range(count)]


def make_step(arch, device):
    """A training step on a given batch, as --opt-level O2 runs it (fp32 on the CPU)."""
    model = torchvision.models.get_model(arch, num_classes=1000).to(device).to(memory_format=torch.channels_last)
    half = device.type == "cuda"
    if half:
        cast_model(model, torch.float16, keep_bn_fp32=True)  # O2's own cast
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=half)
    criterion = torch.nn.CrossEntropyLoss()

    def step(images, targets):
        loss = criterion(model(images.half() if half else images).float(), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


class Replay:
    """A loader of the same packed batches over and over, `steps` batches long."""

    def __init__(self, batches, steps):
        self.batches, self.steps = batches, steps

    def __len__(self):
        return self.steps

    def __iter__(self):
        return (self.batches[k % len(self.batches)] for k in range(self.steps))


def rate(device, batch_size, steps, warmup, run_one):
    """Images per second of run_one(k) over steps - warmup calls, after warmup calls."""
    ahead = RunAhead(device)
    for k in range(steps):
        if k == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        run_one(k)
        ahead.step_queued()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (steps - warmup) * batch_size / (time.perf_counter() - start)


class OnStream:
    """The decoder as GpuBatches takes it, its stages labelled for --trace, and the batch handed
    over with `stream` current (None: the taking thread's default), so it is ordered before the
    work queued on `stream`."""

    def __init__(self, decoder, stream):
        self.decoder, self.stream, self.cuda = decoder, stream, decoder.cuda
        self.decode_stage = labelled("decode_stage", decoder.decode_stage)
        self.resample_ahead = labelled("resample", decoder.resample_ahead)

    def hand_over(self, staged):
        with torch.cuda.stream(self.stream):  # None: changes nothing
            return self.decoder.hand_over(staged)

    def __call__(self, packed):
        return self.hand_over(self.resample_ahead(*self.decode_stage(packed)))


def labelled(name, function):
    """function, seen by the profiler as a range called name (names the thread in --trace)."""
    def run(*args):
        with torch.profiler.record_function(name):
            return function(*args)
    return run


def fed(decoder, batches, steps, step, stream, threads=2):
    """run_one for the step fed by GpuBatches' threads, the step on `stream` (None: default);
    step None: the batches alone."""
    iterator = iter(GpuBatches(Replay(batches, steps), OnStream(decoder, stream), threads=threads))

    def run_one(k):
        with torch.profiler.record_function("wait_batch"):
            images, targets = next(iterator)
        if step is not None:
            with torch.cuda.stream(stream), torch.profiler.record_function("step"):
                step(images, targets)
    return run_one


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
THREAD_ROLES = ("wait_batch", "step", "decode_stage", "resample")


def profile_steps(device, run_one, steps, warmup, path):
    """Run warmup calls, then profile steps calls (CUDA activity, every thread) into a Chrome trace."""
    for k in range(warmup):
        run_one(k)
    torch.cuda.synchronize(device)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except TypeError:  # an older torch: the main thread's ranges only
        config = None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
        for k in range(warmup, warmup + steps):
            run_one(k)
        torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)


def _busy(intervals):
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _gaps_line(events, stream, per):
    """Why `stream` (the step's) sat idle between two of its kernels: the next kernel was launched
    only after the gap began (host-late: the host was behind), or other streams were busy
    through most of the gap, or neither; gaps under 50 us counted apart (launch latency)."""
    launched = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    work, others = [], []
    for e in events:
        if e.get("cat") in GPU_WORK:
            args = e.get("args", {})
            if args.get("stream", "?") == stream:
                work.append((e["ts"], e["ts"] + e["dur"], args.get("correlation")))
            else:
                others.append((e["ts"], e["ts"] + e["dur"]))
    work.sort()
    kinds = collections.Counter()
    for (_, gap_start, _), (gap_end, _, correlation) in zip(work, work[1:]):
        if gap_end - gap_start <= 0:
            continue
        if gap_end - gap_start < 50:
            kinds["short"] += gap_end - gap_start
        elif launched.get(correlation, gap_start) > gap_start + 20:
            kinds["host-late"] += gap_end - gap_start
        elif _busy([(max(a, gap_start), min(b, gap_end)) for a, b in others if a < gap_end and b > gap_start]) \
                > (gap_end - gap_start) / 2:
            kinds["other streams busy"] += gap_end - gap_start
        else:
            kinds["other"] += gap_end - gap_start
    return "step stream gaps: " + ", ".join(f"{kind} {per(kinds[kind]):.2f}"
                                            for kind in ("host-late", "other streams busy", "short", "other"))


def summarise_trace(path, steps):
    """Lines saying where a profiled step's time went (milliseconds per step)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    # The host's ranges (the profiler also draws each range over its kernels on the GPU).
    ranges = [e for e in events if e["name"] in THREAD_ROLES and e.get("cat") == "user_annotation"]
    names_on = collections.defaultdict(set)
    for e in ranges:
        names_on[e["tid"]].add(e["name"])
    role = {tid: "main" if "step" in names or "wait_batch" in names else "+".join(sorted(names))
            for tid, names in names_on.items()}
    per = lambda us: us / 1000 / steps  # noqa: E731  (trace times are microseconds)
    spent = collections.Counter()
    for e in ranges:
        spent[e["name"]] += e["dur"]
    lines = ["host ranges: " + ", ".join(f"{name} {per(spent[name]):.1f}" for name in THREAD_ROLES if name in spent)]
    streams = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_WORK:
            streams[e.get("args", {}).get("stream", "?")].append((e["ts"], e["ts"] + e["dur"]))
    if not streams:
        return lines + ["no GPU activity in the trace"]
    busiest = max(streams, key=lambda s: sum(end - start for start, end in streams[s]))
    everything = [interval for intervals in streams.values() for interval in intervals]
    span = max(end for _, end in everything) - min(start for start, _ in everything)
    lines.append(f"GPU span {per(span):.1f}, some stream busy {per(_busy(everything)):.1f}")
    for stream, intervals in sorted(streams.items(), key=lambda item: -len(item[1])):
        own_span = max(end for _, end in intervals) - min(start for start, _ in intervals)
        busy = _busy(intervals)
        note = f", idle {per(own_span - busy):.1f} inside its span (the step's stream)" if stream == busiest else ""
        lines.append(f"stream {stream}: {len(intervals) / steps:.0f} kernels/copies, busy {per(busy):.1f}{note}")
    lines.append(_gaps_line(events, busiest, per))
    calls = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver", "cuda_sync"):
            key = (role.get(e["tid"], "gpu" if e.get("cat") == "cuda_sync" else f"thread {e['tid']}"), e["name"])
            calls[key][0] += e["dur"]
            calls[key][1] += 1
    for (who, name), (total, count) in sorted(calls.items(), key=lambda item: -item[1][0]):
        if per(total) >= 0.2:
            lines.append(f"{who:24s} {name:40s} {per(total):7.2f} ms in {count / steps:.0f} calls")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="an ImageFolder root holding train/<class>/*.JPEG")
    parser.add_argument("-a", "--arch", default="resnet50")
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=30, help="steps a measurement (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out first (default: 5)")
    parser.add_argument("--distinct", type=int, default=4, help="distinct packed batches replayed (default: 4)")
    parser.add_argument("--jpeg-decoder", choices=("cuda", "hardware"), default="cuda")
    parser.add_argument("--trace", metavar="DIR", help="also profile the step alone and fed by two threads "
                        "(CUDA only): Chrome traces into DIR and a summary of each")
    parser.add_argument("--trace-steps", type=int, default=6, help="steps profiled with --trace (default: 6)")
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be at least 1 and below --steps {args.steps}")
    if args.trace_steps < 1:
        parser.error(f"--trace-steps {args.trace_steps} must be at least 1")
    if args.trace and not torch.cuda.is_available():
        parser.error("--trace profiles CUDA streams and needs a GPU; run without it here")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    try:
        batches = packed_batches(args.data, args.batch_size, args.distinct)
    except ValueError as err:
        parser.error(str(err))
    decoder = GpuBatchDecoder(device, args.image_size, IMAGENET_MEAN, IMAGENET_STD, channels_last=True,
                              jpeg_decoder=args.jpeg_decoder if device.type == "cuda" else "cuda")
    step = make_step(args.arch, device)
    images, targets = decoder(batches[0])
    measure = lambda run_one: rate(device, args.batch_size, args.steps, args.warmup, run_one)  # noqa: E731

    rows = [("step", measure(lambda k: step(images, targets))),
            ("decode", measure(lambda k: decoder(batches[k % len(batches)])))]
    rows.append(("decode, two threads", measure(fed(decoder, batches, args.steps, None, None))))
    rows.append(("both, one thread", measure(fed(decoder, batches, args.steps, step, None, threads=1))))
    rows.append(("both, default stream", measure(fed(decoder, batches, args.steps, step, None))))
    if device.type == "cuda":
        rows.append(("both, side stream", measure(fed(decoder, batches, args.steps, step, torch.cuda.Stream(device)))))
    step_rate, decode_rate = rows[0][1], max(value for name, value in rows if name.startswith("decode"))
    print(f"{device.type}, {args.arch}, batch {args.batch_size}, {args.steps - args.warmup} steps measured")
    for name, value in rows:
        print(f"{name:22s} {value:9.1f} img/s")
    print(f"{'if serialised':22s} {1 / (1 / step_rate + 1 / decode_rate):9.1f} img/s")
    print(f"{'if overlapped':22s} {min(step_rate, decode_rate):9.1f} img/s")
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        runs = [("step", lambda k: labelled("step", step)(images, targets)),
                ("both, default stream", fed(decoder, batches, args.warmup + args.trace_steps, step, None))]
        for name, run_one in runs:
            path = os.path.join(args.trace, name.replace(", ", "_").replace(" ", "_") + ".json.gz")
            profile_steps(device, run_one, args.trace_steps, args.warmup, path)
            print(f"\n{name}, {args.trace_steps} steps profiled ({path}), ms per step:")
            for line in summarise_trace(path, args.trace_steps):
                print("  " + line)


if __name__ == "__main__":
    main()
