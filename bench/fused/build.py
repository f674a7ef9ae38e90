"""Builds dgrad_dbn.cpp as a torch extension (a probe for bench/fused_bottleneck.py).

Include and library folders come from the installed packages: the cuDNN frontend's wheel ships
its C++ headers (include/ beside the `cudnn` package), torch's nvidia packages hold cudnn.h and
libcudnn, and the CUDA runtime's headers are in CUDA_HOME or nvidia/cu13 (or cuda_runtime).
Each can be given instead: FE_INCLUDE, CUDNN_INCLUDE, CUDNN_LIB, CUDA_INCLUDE.

    python bench/fused/build.py        # builds (or loads the cached build) and prints cuDNN's version
"""
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def first(*patterns):
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


def folders():
    import importlib.util
    site = [p for p in sys.path if p.endswith("site-packages")] + [os.path.dirname(p) for p in sys.path if p]
    fe = os.environ.get("FE_INCLUDE")
    if not fe:
        spec = importlib.util.find_spec("cudnn")
        roots = [os.path.dirname(os.path.dirname(spec.origin))] if spec and spec.origin else []
        fe = first(*[os.path.join(r, "include") for r in roots if os.path.isfile(os.path.join(r, "include",
                                                                                             "cudnn_frontend.h"))],
                   *[os.path.join(s, "include") for s in site if os.path.isfile(os.path.join(s, "include",
                                                                                          "cudnn_frontend.h"))])
    cudnn_inc = os.environ.get("CUDNN_INCLUDE") or first(*[os.path.join(s, "nvidia", "cudnn", "include")
                                                            for s in site])
    cudnn_lib = os.environ.get("CUDNN_LIB") or first(*[os.path.join(s, "nvidia", "cudnn", "lib") for s in site])
    cuda_inc = os.environ.get("CUDA_INCLUDE") or first(
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"),
        *[os.path.join(s, "nvidia", "cu13", "include") for s in site],
        *[os.path.join(s, "nvidia", "cuda_runtime", "include") for s in site])
    missing = [name for name, path in (("FE_INCLUDE", fe), ("CUDNN_INCLUDE", cudnn_inc), ("CUDNN_LIB", cudnn_lib),
                                       ("CUDA_INCLUDE", cuda_inc)) if not path or not os.path.isdir(path)]
    if missing:
        raise SystemExit(f"not found: {', '.join(missing)} (set them): fe={fe} cudnn={cudnn_inc} lib={cudnn_lib} "
                         f"cuda={cuda_inc}")
    return fe, cudnn_inc, cudnn_lib, cuda_inc


def load(verbose=False):
    from torch.utils.cpp_extension import load as load_extension
    fe, cudnn_inc, cudnn_lib, cuda_inc = folders()
    library = first(os.path.join(cudnn_lib, "libcudnn.so.9"), os.path.join(cudnn_lib, "libcudnn.so*"))
    return load_extension(
        name="dgrad_dbn", sources=[os.path.join(HERE, "dgrad_dbn.cpp")], verbose=verbose,
        extra_include_paths=[fe, cudnn_inc, cuda_inc],
        extra_cflags=["-O2"],
        extra_ldflags=[f"-L{cudnn_lib}", f"-l:{os.path.basename(library)}", f"-Wl,-rpath,{cudnn_lib}"])


if __name__ == "__main__":
    module = load(verbose="-v" in sys.argv)
    print("built dgrad_dbn; functions:", [n for n in dir(module) if not n.startswith("_")])
    if "--version" in sys.argv:
        print("cuDNN", module.backend_version())
