"""A probe, not part of the product: ResNet-50's stem relu + max-pool (3x3, stride 2, pad 1),
forward + backward at b256, fp16 NHWC, kernel time from torch.profiler; one way of running the
pool's backward per process (inductor's decomposition table is cached at the first compile):

  python bench/max_pool_backward.py eager|compiled|lowering|aten|gather [device]
    compiled: torch.compile of nn.MaxPool2d (torch 2.14's inductor decomposes the backward with
              torch._decomp; 2.11's runs its own lowering)
    lowering: that decomposition removed, so inductor's own lowering takes it
    aten:     the decomposition removed and ATen's kernel called from the compiled graph
    gather:   utils/max_pool.py's GatherMaxPool2d, compiled
"""
import os
import sys

import torch

variant = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
torch.backends.cudnn.benchmark = True
torch._inductor.config.fx_graph_cache = False  # the patches below are not in the caches' keys
torch._functorch.config.enable_autograd_cache = False
if variant in ("lowering", "aten"):
    from torch._inductor import decomposition
    for op in list(decomposition.decompositions):
        if "max_pool2d_with_indices_backward" in str(op):
            decomposition.decompositions.pop(op)
if variant == "aten":
    from torch._inductor import lowering
    backward = torch.ops.aten.max_pool2d_with_indices_backward
    for op in (backward, backward.default):
        lowering.lowerings[op] = lowering.fallback_max_pool2d_with_indices_backward

cuda = device == "cuda"
dtype, batch = (torch.float16, 256) if cuda else (torch.float32, 2)
x = torch.randn(batch, 64, 112, 112, device=device, dtype=dtype).to(memory_format=torch.channels_last)
x.requires_grad_(True)
dy = torch.randn(batch, 64, 56, 56, device=device, dtype=dtype).to(memory_format=torch.channels_last)
pool = torch.nn.MaxPool2d(3, 2, 1)
if variant == "gather":  # utils/max_pool.py, from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from utils.max_pool import GatherMaxPool2d
    pool = GatherMaxPool2d(3, 2, 1)


def fn(t):
    return pool(torch.relu(t))


def grad_of(f):
    f(x).backward(dy)
    grad, x.grad = x.grad, None
    return grad


reference = grad_of(fn)
f = fn if variant == "eager" else torch.compile(fn, dynamic=False)
for _ in range(5):
    grad = grad_of(f)
print(f"{variant}: max |dx - eager dx| {(grad.float() - reference.float()).abs().max().item():.3g}")
if cuda:
    torch.cuda.synchronize()
activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
with torch.profiler.profile(activities=[activity]) as prof:
    for _ in range(10):
        grad_of(f)
    if cuda:
        torch.cuda.synchronize()
rows = {}
for event in prof.events():
    if event.device_type == kind:
        rows.setdefault(event.name[:80], []).append(event.device_time if cuda else event.cpu_time)
print(f"{variant}: {sum(sum(v) for v in rows.values()) / 10 / 1e3:.3f} ms of kernels per fwd+bwd (relu + pool)")
for name, times in sorted(rows.items(), key=lambda kv: -sum(kv[1]))[:6]:
    print(f"   {sum(times) / 10 / 1e3:.3f} ms x{len(times) / 10:.0f} {name}")
