"""A probe, not part of the product: dgrad_dbn.cpp (cuDNN's DgradDreluBNBwdWeight graph) built as a
plain shared library and called through ctypes with torch tensors' pointers, in place of the torch
C++ extension that crashed. Same two functions fused_bottleneck.py called on that extension.

    python bench/fused/dgrad_dbn.py --build      # builds libdgrad_dbn.so, prints cuDNN's version
    python bench/fused/dgrad_dbn.py --check      # one shape against torch (CUDA)

Include folders: FE_INCLUDE (the frontend's headers, from its wheel; default bench/include), CUDNN_INCLUDE,
CUDA_INCLUDE; libraries from torch's nvidia packages (cudnn, cu13).
"""
import ctypes
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = os.path.join(os.environ.get("DD_BUILD", "/tmp/dgrad_dbn"), "libdgrad_dbn.so")
HEUR = int(os.environ.get("DD_HEUR", "1"))  # 0: heuristics A; 1: A + FALLBACK


def _site_nvidia():
    import torch
    return os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")


def _first(*patterns):
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


def build(verbose=True):
    nvidia = _site_nvidia()
    fe = os.environ.get("FE_INCLUDE", os.path.join(os.path.dirname(HERE), "include"))
    cudnn_inc = os.environ.get("CUDNN_INCLUDE", os.path.join(nvidia, "cudnn", "include"))
    cuda_inc = os.environ.get("CUDA_INCLUDE") or _first("/usr/local/cuda/include", os.path.join(nvidia, "cu13",
                                                                                                  "include"))
    cudnn_lib = os.path.join(nvidia, "cudnn", "lib")
    cuda_lib = _first(os.path.join(nvidia, "cu13", "lib"), os.path.join(nvidia, "cuda_runtime", "lib"))
    libs = [f"-L{cudnn_lib}", "-l:libcudnn.so.9", f"-Wl,-rpath,{cudnn_lib}"]
    if cuda_lib:
        libs += [f"-L{cuda_lib}", f"-Wl,-rpath,{cuda_lib}"]
        for name in ("libcudart.so.13", "libnvrtc.so.13"):
            if os.path.exists(os.path.join(cuda_lib, name)):
                libs.append(f"-l:{name}")
    os.makedirs(os.path.dirname(LIBRARY), exist_ok=True)
    command = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", os.path.join(HERE, "dgrad_dbn.cpp"), f"-I{fe}",
               f"-I{cudnn_inc}", f"-I{cuda_inc}", "-o", LIBRARY, *libs]
    if verbose:
        print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    return LIBRARY


class DgradDbn:
    """fused_bottleneck.py's DGRAD_DBN: refused(...) -> '' or why; dgrad_drelu_dbn(...) -> (dz,
    dgamma, dbeta, eq_dy, eq_x, eq_bias)."""

    def __init__(self, path=LIBRARY, heur=HEUR):
        self.lib = ctypes.CDLL(path)
        self.heur = heur
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.lib.dd_plan.argtypes = [i64] * 9 + [ctypes.c_int, ctypes.POINTER(i64)]
        self.lib.dd_plan.restype = ctypes.c_int
        self.lib.dd_run.argtypes = [ctypes.c_int] + [ptr] * 15
        self.lib.dd_run.restype = ctypes.c_int
        self.lib.dd_error.restype = ctypes.c_char_p
        self.workspaces = {}

    def backend_version(self):
        return self.lib.dd_version()

    def _plan(self, dy, w, x, stride, pad):
        n, c, h, wd = x.shape
        k, _, r, s = w.shape
        size = ctypes.c_int64(0)
        index = self.lib.dd_plan(n, c, h, wd, k, r, s, pad, stride, self.heur, ctypes.byref(size))
        return index, size.value

    def refused(self, dy, w, x, stride, pad):
        index, _ = self._plan(dy, w, x, stride, pad)
        return "" if index >= 0 else self.lib.dd_error().decode()

    def dgrad_drelu_dbn(self, dy, w, x, mean, invstd, gamma, beta, stride, pad, stream):
        import torch
        cl = torch.channels_last
        for name, t in (("dy", dy), ("w", w), ("x", x)):
            assert t.is_cuda and t.dtype == torch.float16 and t.is_contiguous(memory_format=cl), name
        index, size = self._plan(dy, w, x, stride, pad)
        if index < 0:
            raise RuntimeError(self.lib.dd_error().decode())
        c = x.shape[1]

        def per_channel(t):
            return t.detach().float().reshape(1, c, 1, 1).contiguous()

        m, v, g, b = (per_channel(t) for t in (mean, invstd, gamma, beta))
        dz = torch.empty_like(x, memory_format=cl)
        terms = [torch.empty(1, c, 1, 1, dtype=torch.float32, device=x.device) for _ in range(5)]
        workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=x.device)
        status = self.lib.dd_run(index, dy.data_ptr(), w.data_ptr(), x.data_ptr(), m.data_ptr(), v.data_ptr(),
                                 g.data_ptr(), b.data_ptr(), dz.data_ptr(), *[t.data_ptr() for t in terms],
                                 workspace.data_ptr(), ctypes.c_void_p(stream))
        if status != 0:
            raise RuntimeError(self.lib.dd_error().decode())
        return (dz, *terms)


def check():
    """One layer1 shape against torch in fp32 (the BN input's gradient through the graph's terms)."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    lib = DgradDbn()
    print("cuDNN", lib.backend_version(), flush=True)
    n, c, h, k, r, pad = 32, 64, 56, 64, 3, 1
    cl = torch.channels_last
    x = torch.randn(n, c, h, h, device="cuda").half().contiguous(memory_format=cl)
    w = (torch.randn(k, c, r, r, device="cuda") * 0.05).half().contiguous(memory_format=cl)
    dy = torch.randn(n, k, h, h, device="cuda").half().contiguous(memory_format=cl)
    x32 = x.float()
    mean = x32.mean((0, 2, 3))
    invstd = torch.rsqrt(x32.var((0, 2, 3), unbiased=False) + 1e-5)
    gamma, beta = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda") * 0.1
    dz, dgamma, dbeta, eq_dy, eq_x, eq_bias = lib.dgrad_drelu_dbn(dy, w, x, mean, invstd, gamma, beta, 1, pad,
                                                                  torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    xr = x32.clone().requires_grad_(True)
    g, bt = gamma.clone().requires_grad_(True), beta.clone().requires_grad_(True)
    a = F.relu(F.batch_norm(xr, None, None, g, bt, training=True, eps=1e-5))
    da = torch.nn.grad.conv2d_input(x.shape, w.float(), dy.float(), 1, pad)
    a.backward(da)
    dx = eq_dy * dz.float() + eq_x * x32 + eq_bias

    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()

    print(f"rel. errors: dx {rel(dx, xr.grad):.2e}, dgamma {rel(dgamma.flatten(), g.grad):.2e}, "
          f"dbeta {rel(dbeta.flatten(), bt.grad):.2e}", flush=True)


if __name__ == "__main__":
    if "--build" in sys.argv:
        build()
        print("cuDNN", DgradDbn().backend_version())
    if "--check" in sys.argv:
        check()
