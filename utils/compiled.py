"""torch.compile of the model: whether to compile, the compile itself, and the plain module behind it.

--compile, or Accelerate's own dynamo_backend setting (`accelerate launch --dynamo_backend`, the
yaml, ACCELERATE_DYNAMO_BACKEND), turns it on; Accelerate's dynamo_mode is the mode unless
--compile-mode is typed (its fullgraph/dynamic settings are not used: see dynamic=False below).
We compile exactly once, ourselves, after Accelerate's prepare() (so DDP's bucketing sees the
compiled graph, as torch recommends), and tell the Accelerator not to compile again.
dynamic=False: the train batch never changes shape (the sampler drops the last partial batch);
validation's shorter last batch costs one more compile instead of a slower dynamic-shape graph
for every step.

--tune-kernels turns on inductor's coordinate descent tuning (the part of max-autotune that times
each Triton kernel's launch settings), passed as torch.compile options beside the mode's own, so
it holds for this model alone and not for every later compile in the process.

The compiled wrapper prefixes every state_dict key with `_orig_mod.`; checkpoints are taken from
plain_module(), so they load into an uncompiled model. Accelerate's unwrap_model(keep_torch_compile=
True) would rewire the compiled wrapper to the bare module (dropping DDP from training), so we
never call it on a compiled model.
"""
import os
import time

import torch

from utils.flags.parser import COMPILE_MODES
from utils.run.errors import UsageError

DEFAULT_BACKEND = "inductor"


def accelerate_dynamo_backend():
    """The backend Accelerate's config or launch flag asks for (lower case), or None."""
    value = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "").strip().lower()
    return None if value in ("", "no", "none") else value


def resolve_compile(requested, mode="default"):
    """What --compile and --compile-mode come to: (backend name or False, mode, a note for the user
    or None). requested is --compile as parsed: True/False, or a resumed run's backend name."""
    from_accelerate = accelerate_dynamo_backend()
    if mode != "default" and not (requested or from_accelerate):
        raise UsageError(f"--compile-mode {mode} needs --compile; add it or drop --compile-mode")
    # A resumed run that Accelerate's setting compiled with another backend keeps it, also when
    # resumed without that setting (it went on with inductor before).
    resumed = requested if isinstance(requested, str) and requested != DEFAULT_BACKEND else None
    if not (from_accelerate or resumed):
        return (DEFAULT_BACKEND if requested else False), mode, None
    # Every registered backend: list_backends() alone hides those tagged debug, and so refused
    # Accelerate's EAGER and AOT_EAGER, which torch.compile takes.
    backends = torch._dynamo.list_backends(exclude_tags=())
    if not from_accelerate:
        if resumed not in backends:
            raise UsageError(f"--resume: the run was compiled with backend {resumed!r}, which torch.compile "
                             "here lacks; add --compile True (inductor) or --compile False")
        return resumed, mode, (f"torch.compile with backend {resumed}, as the resumed run was compiled "
                               "(compiled once, by this script)")
    if from_accelerate not in backends:
        raise UsageError(f"Accelerate's dynamo_backend {from_accelerate!r} is not a torch.compile backend "
                         f"here ({', '.join(backends)}); fix the config or drop it")
    # `accelerate launch --dynamo_mode` (the yaml's dynamo_mode) comes with the backend; a typed
    # --compile-mode wins over it.
    accelerate_mode = os.environ.get("ACCELERATE_DYNAMO_MODE", "").strip().lower() or "default"
    if mode == "default" and accelerate_mode != "default":
        if accelerate_mode not in COMPILE_MODES:
            raise UsageError(f"Accelerate's dynamo_mode {accelerate_mode!r} is not a torch.compile mode "
                             f"({', '.join(COMPILE_MODES)}); fix the config or drop it")
        mode = accelerate_mode
    with_mode = f", mode {mode}" if mode != "default" and from_accelerate == DEFAULT_BACKEND else ""
    return from_accelerate, mode, (f"torch.compile with backend {from_accelerate}{with_mode}, from Accelerate's "
                                   "dynamo_backend setting (compiled once, by this script)")


def resolve_tune_kernels(tune, backend, device_type, deterministic, typed=True):
    """--tune-kernels as this run can honour it: (True only for inductor on CUDA, a note or "").
    Typed where it cannot work, it is a UsageError; taken from a resumed checkpoint or a --config
    recipe (typed=False), it is dropped with a note instead, so a run tuned on a GPU resumes on a
    CPU or under a typed --deterministic. backend: what resolve_compile settled (False: none)."""
    if not tune:
        return False, ""
    if backend != DEFAULT_BACKEND:
        why = f"this run compiles with backend {backend}" if backend else "this run does not compile"
        refusal = "--tune-kernels tunes the kernels inductor writes, and " + (
            f"{why}; drop --tune-kernels" if backend else "needs --compile; add it or drop --tune-kernels")
    elif device_type != "cuda":
        why = f"on {device_type} it would change nothing"
        refusal = f"--tune-kernels tunes the Triton kernels inductor writes for CUDA; {why}: drop it"
    elif deterministic:
        why = "kernels chosen by timing may sum their reductions in another order each run"
        refusal = ("--tune-kernels picks each kernel's launch settings by timing them, so two runs may sum their "
                   "reductions in different orders, which --deterministic rules out; drop one of them")
    else:
        return True, ""
    if typed:
        raise UsageError(refusal)
    return False, f"--tune-kernels (from the checkpoint or --config) is off for this run: {why}"


def compile_options(mode, tune_kernels):
    """torch.compile's mode= and options= arguments (one of them None): options when kernels are
    tuned, as torch.compile refuses both at once; they hold the mode's own settings too."""
    if not tune_kernels:
        return mode, None
    from torch._inductor import list_mode_options
    return None, {**list_mode_options(mode or "default", False), "coordinate_descent_tuning": True}


def compiled_sizes_note(sizes, backend, mode="default"):
    """The start-up line's words for a compiled model trained at several sizes (progressive
    resizing): each size is a graph of its own (dynamic=False), and with reduce-overhead its CUDA
    graphs are captured per size too. Empty for one size or no compile."""
    if not backend or len(sizes) < 2:
        return ""
    graphs = ", CUDA graphs captured per size" if mode == "reduce-overhead" else ""
    return f" | torch.compile: {len(sizes)} train sizes, one compiled graph each{graphs}"


def compile_model(model, backend, log, mode="default", sizes=1, tune_kernels=False):
    """torch.compile(model); the first forward's wall time (the compile) is logged once.
    mode is torch.compile's (inductor only: other backends take none). sizes: how many input
    sizes training uses (progressive resizing), each a graph of its own."""
    # Dynamo keeps a few graphs per forward (training, validation, its last short batch, ...)
    # and falls back to eager past its limit; each training size needs one more.
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if limit is not None and sizes > 1:
        torch._dynamo.config.recompile_limit = max(limit, 8 + sizes)
    mode = None if mode == "default" or backend != DEFAULT_BACKEND else mode
    as_mode, options = compile_options(mode, tune_kernels and backend == DEFAULT_BACKEND)
    compiled = torch.compile(model, backend=backend, dynamic=False, mode=as_mode, options=options)
    clock = {}

    def started(module, inputs):
        clock.setdefault("start", time.perf_counter())

    def finished(module, inputs, output):
        if "done" not in clock:
            clock["done"] = True
            how = (f", {mode}" if mode else "") + (", kernels tuned" if options else "")
            log(f"=> torch.compile ({backend}{how}): first forward, compile included, took "
                f"{time.perf_counter() - clock['start']:.1f} s")

    compiled.register_forward_pre_hook(started)
    compiled.register_forward_hook(finished)
    # plain attributes (not submodules, not in state_dict): torch.compile's arguments, for eval_module
    compiled.__dict__["_eval_backend"] = backend
    compiled.__dict__["_eval_mode"] = as_mode
    compiled.__dict__["_eval_options"] = options
    return compiled


def is_compiled(model):
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def plain_module(model):
    """The bare nn.Module under torch.compile and DDP wrappers, without changing any wrapper."""
    if is_compiled(model):
        model = model._orig_mod
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def eval_module(model):
    """What validation runs: the bare module (no DDP collectives, since ranks may hold one batch
    more or less than each other), compiled on its own when training is compiled (cached)."""
    if not is_compiled(model):
        return plain_module(model)
    if plain_module(model) is model._orig_mod:  # compiled without DDP (eval.py): use it as it is
        return model
    cached = getattr(model, "_eval_compiled", None)
    if cached is None:
        cached = torch.compile(plain_module(model), backend=model._eval_backend, dynamic=False,
                               mode=getattr(model, "_eval_mode", None), options=getattr(model, "_eval_options", None))
        model.__dict__["_eval_compiled"] = cached
    return cached
