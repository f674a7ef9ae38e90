"""Hardware JPEG decode: interleaved (I_RGB) vs planar (P_RGB) output, as_tensor vs from_dlpack.
python3 prgb_probe.py DATA"""
import glob
import sys
import time

import torch
from torch._utils import _flatten_dense_tensors
from nvidia import nvimgcodec

files = sorted(glob.glob(sys.argv[1] + "/train/*/*.JPEG"))[:256]
payloads = [open(f, "rb").read() for f in files]
backend = nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)
decoder = nvimgcodec.Decoder(device_id=0, backends=[backend])
stream = torch.cuda.Stream()


def params(fmt):
    return nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                   allow_any_depth=False, sample_format=fmt)


I, P = params(nvimgcodec.SampleFormat.I_RGB), params(nvimgcodec.SampleFormat.P_RGB)


def decode(p):
    sources = [nvimgcodec.CodeStream(x) for x in payloads]
    return decoder.decode(sources, params=p, cuda_stream=stream.cuda_stream)


imgs_i, imgs_p = decode(I), decode(P)
torch.cuda.synchronize()
print("refused I", sum(x is None for x in imgs_i), "P", sum(x is None for x in imgs_p))
k = next(j for j, x in enumerate(imgs_p) if x is not None)
print("I CAI", {a: b for a, b in imgs_i[k].__cuda_array_interface__.items() if a != "data"})
print("P CAI", {a: b for a, b in imgs_p[k].__cuda_array_interface__.items() if a != "data"})
same, worst = 0, 0
for a, b in zip(imgs_i, imgs_p):
    if a is None or b is None:
        continue
    ta = torch.as_tensor(a, device="cuda").permute(2, 0, 1)
    tb = torch.as_tensor(b, device="cuda")
    if tb.shape != ta.shape:
        print("shape mismatch", ta.shape, tb.shape)
        break
    d = (ta.int() - tb.int()).abs().max().item()
    worst = max(worst, d)
    same += d == 0
print("P_RGB equals I_RGB permuted:", same, "of", len(payloads), "max diff", worst)
try:
    td = torch.from_dlpack(imgs_p[k])
    print("from_dlpack P shape", tuple(td.shape), td.stride(), td.device)
except Exception as e:
    print("from_dlpack failed:", repr(e)[:200])


def run(label, p, convert, reps=20):
    for _ in range(3):
        convert(decode(p))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(reps):
        imgs = decode(p)
        h0 = time.perf_counter()
        with torch.cuda.stream(stream):
            flat = convert(imgs)
        host += time.perf_counter() - h0
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"{label:40s} {reps * 256 / dt:7.0f} img/s  host convert {host / reps * 1e3:6.1f} ms/batch", flush=True)


def i_as_tensor(imgs):
    return _flatten_dense_tensors([torch.as_tensor(x, device="cuda").permute(2, 0, 1) for x in imgs if x is not None])


def p_as_tensor(imgs):
    return _flatten_dense_tensors([torch.as_tensor(x, device="cuda") for x in imgs if x is not None])


def p_dlpack(imgs):
    return _flatten_dense_tensors([torch.from_dlpack(x) for x in imgs if x is not None])


def decode_only(imgs):
    return None


run("decode only, I_RGB", I, decode_only)
run("decode only, P_RGB", P, decode_only)
run("I_RGB as_tensor permute flatten (main)", I, i_as_tensor)
run("P_RGB as_tensor flatten", P, p_as_tensor)
try:
    run("P_RGB from_dlpack flatten", P, p_dlpack)
except Exception as e:
    print("dlpack run failed", repr(e)[:200])
run("I_RGB as_tensor permute flatten (main)", I, i_as_tensor)
run("P_RGB as_tensor flatten", P, p_as_tensor)
