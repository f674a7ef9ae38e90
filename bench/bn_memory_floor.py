"""How close torch.compile's BatchNorm(+add)+ReLU training kernels are to the memory
bound, over ResNet-50's BatchNorm layers at batch 256 (fp16 NHWC activations, fp32 BN params).

A kernel that is not fused into a convolution must at least read x twice in the forward (statistics,
then normalize) and write y; the backward reads dy and x for the two reductions, then dy and x again
and writes dx (and the residual's grad). Elements moved per element of x:
  bn+relu       3 + 5 = 8
  bn+add+relu   4 + 6 = 10    (reads r; writes dr)
  bn (no relu)  3 + 5 = 8     (downsample)
The floor is those bytes at the copy bandwidth this card reaches (y.copy_(x), 1 GiB).

  python3 bench/bn_memory_floor.py [batch] [device]
"""
import sys
import time

import torch
import torchvision


def shapes(batch):
    """[(kind, C, H, W, count)] of resnet50's BN layers, from one forward on a tiny input."""
    model = torchvision.models.resnet50()
    seen = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            kind = ("add" if name.endswith("bn3") else "plain" if "downsample" in name else "relu")
            module.register_forward_hook(lambda m, i, o, kind=kind: seen.append((kind, *o.shape[1:])))
    model(torch.randn(1, 3, 224, 224))
    counts = {}
    for s in seen:
        counts[s] = counts.get(s, 0) + 1
    return [(*k, n) for k, n in counts.items()]


def block(kind):
    def fn(bn, x, r):
        y = bn(x)
        if kind == "add":
            y = y + r
        return torch.relu(y) if kind != "plain" else y
    return fn


def timed(fn, iters, device):
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def main(batch=256, device="cuda"):
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    dtype = torch.float16 if device == "cuda" else torch.float32
    iters = 20 if device == "cuda" else 2
    src = torch.empty(2**29 if device == "cuda" else 2**22, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), iters, device)
    bandwidth = 2 * src.numel() * 2 / (copy_ms / 1e3)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s ({device}, {src.numel() * 2 / 2**30:.2f} GiB)")
    src = dst = None  # free the 2 GiB before the BN shapes
    totals = {"eager": 0.0, "compiled": 0.0, "floor": 0.0}
    print(f"{'kind':6} {'C':>5} {'HxW':>7} {'n':>2} {'MB x':>7} {'eager ms':>9} {'compiled':>9} {'floor':>7} "
          f"{'compiled/floor':>14}")
    for kind, c, h, w, count in shapes(batch):
        bn = torch.nn.BatchNorm2d(c).to(device)
        x = torch.randn(batch, c, h, w, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        x.requires_grad_(True)
        r = torch.randn_like(x) if kind == "add" else None
        dy = torch.randn_like(x)
        fn = block(kind)
        compiled = torch.compile(fn, dynamic=False)  # one static graph per shape, as train.py's
        row = {}
        for label, f in (("eager", fn), ("compiled", compiled)):
            def step(f=f):
                out = f(bn, x, r)
                out.backward(dy)
                x.grad = None
                bn.weight.grad = bn.bias.grad = None
            row[label] = timed(step, iters, device)
        elements = {"relu": 8, "add": 10, "plain": 8}[kind]
        floor = elements * x.numel() * x.element_size() / bandwidth * 1e3
        row["floor"] = floor
        for key in totals:
            totals[key] += row[key] * count
        print(f"{kind:6} {c:5} {h:3}x{w:<3} {count:2} {x.numel() * x.element_size() / 1e6:7.1f} "
              f"{row['eager']:9.3f} {row['compiled']:9.3f} {floor:7.3f} {row['compiled'] / floor:14.2f}")
        x = r = dy = None
    print(f"sum over resnet50's {sum(s[-1] for s in shapes(batch))} BN layers, fwd+bwd ms: eager "
          f"{totals['eager']:.2f}, compiled {totals['compiled']:.2f}, memory floor {totals['floor']:.2f} "
          f"(compiled is {totals['compiled'] / totals['floor']:.2f}x the floor; the most a hand-written "
          f"unfused kernel could save: {totals['compiled'] - totals['floor']:.2f} ms a step)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256, sys.argv[2] if len(sys.argv) > 2 else "cuda")
