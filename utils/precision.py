"""Apex opt levels (O0..O3) as precision plans over the half dtype that Accelerate's mixed_precision names.

Accelerate decides *which* half dtype (fp16 or bf16, from the launch config, the environment or
--mixed-precision); the plan decides *how* it is used: autocast (O1), a half model with fp32
BatchNorm and fp32 master weights (O2), or a pure half model (O3), and how the loss is scaled.

Non-finite steps never sync with the host: the inf/NaN check of the grads (unscaling them where
there is a loss scale, a plain check at O0 and bf16 where there is none), the skip of such a step
(the fused SGD kernel reads the found-inf flag on the device), the scale update and the counters
of skipped steps and of non-finite steps in a row all stay on the device; the training loop reads
them where it prints (Precision.divergence), so a run that keeps diverging stops there.
"""
import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from utils.loss_scale import DYNAMIC_INIT_SCALE, DYNAMIC_MIN_SCALE, LossScaler, NonFiniteCheck, clip_grad_norm_fp32
from utils.run.errors import UsageError

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Default of --max-nonfinite-steps: skipped steps in a row (inf/NaN loss or grads) before a run stops.
MAX_NONFINITE_STEPS = 100


@dataclass(frozen=True)
class Level:
    """One row of the opt-level table: what a level does with the half dtype."""
    weights: str             # 'fp32' | 'half': the dtype the model's parameters are cast to
    autocast: bool           # forward runs under torch.autocast in the half dtype
    master_weights: bool     # the optimizer updates fp32 copies of the half parameters
    keep_bn_fp32: bool       # --keep-batchnorm-fp32 default; only a half model has BN to keep
    loss_scale_fp16: object  # default loss scale with fp16: None | 'dynamic' | float (static)
    loss_scale_bf16: object  # the same with bf16 (its fp32-sized exponent rarely needs one)

    @property
    def half_weights(self):
        return self.weights == "half"

    @property
    def uses_half(self):
        return self.half_weights or self.autocast


# The README's opt-level table, column for column (BN at O0/O1 is fp32: the weights are fp32,
# and autocast runs BatchNorm in fp32).
#                 weights  autocast  masters  keep BN fp32  loss scale fp16  loss scale bf16
OPT_LEVELS = {
    "O0": Level("fp32",  False,    False,   False,        None,            None),
    "O1": Level("fp32",  True,     False,   False,        "dynamic",       None),
    "O2": Level("half",  False,    True,    True,         "dynamic",       None),
    "O3": Level("half",  False,    False,   False,        1.0,             1.0),
}


@dataclass(frozen=True)
class PrecisionPlan:
    opt_level: str          # O0 | O1 | O2 | O3, a key of OPT_LEVELS
    dtype_name: str         # 'no' (fp32, O0 only) | 'fp16' | 'bf16'
    keep_bn_fp32: bool      # only meaningful where the weights are half (O2/O3)
    loss_scale: object      # None | 'dynamic' | float (static)

    @property
    def level(self):
        return OPT_LEVELS[self.opt_level]

    @property
    def half_dtype(self):
        return HALF_DTYPES.get(self.dtype_name)

    @property
    def autocast(self):
        return self.level.autocast

    @property
    def half_weights(self):
        return self.level.half_weights

    @property
    def master_weights(self):
        return self.level.master_weights

    def describe(self, evaluation=False):
        """One line that says what was resolved, e.g. for the startup log. For evaluation (eval.py)
        only what the forward pass uses: no optimizer, master weights or loss scale."""
        half = self.dtype_name if self.level.uses_half else "fp32"
        if not self.half_weights:
            autocast = f"autocast {half}, " if self.autocast else ""
            parts = f"{autocast}weights fp32, BN fp32" + ("" if evaluation else ", optimizer fp32")
        else:
            bn = "fp32" if self.keep_bn_fp32 else "half"
            master = "master fp32" if self.master_weights else "no master (optimizer on half weights)"
            parts = f"weights half, BN {bn}" + ("" if evaluation else f", {master}")
        if evaluation:
            return f"precision: {self.opt_level} {half} | {parts}"
        if self.loss_scale is None:
            scale = "none"
        elif self.loss_scale == "dynamic":
            scale = f"dynamic ({DYNAMIC_INIT_SCALE:g})"
        else:
            scale = f"static {self.loss_scale:g}"
        return f"precision: {self.opt_level} {half} | {parts} | loss scale {scale}"


def requested_mixed_precision(flag_value):
    """The half dtype asked for and where it came from: the script's flag, else Accelerate's env."""
    if flag_value is not None:
        return flag_value, "--mixed-precision"
    env = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if env:
        return env.lower(), "the Accelerate config"
    return None, None


def resolve_precision(opt_level, keep_bn_fp32, loss_scale, mixed_precision, mp_source=None):
    """Turn the Apex flags plus Accelerate's mixed_precision into a PrecisionPlan, reading OPT_LEVELS.

    Returns (plan, notes): notes are warnings for the user (flags with no effect and why).
    Raises UsageError for combinations Apex refused too.
    """
    notes = []
    if mixed_precision not in (None, "no", "fp16", "bf16"):
        raise UsageError(f"mixed precision {mixed_precision!r} from {mp_source} is not supported here; "
                         "use no, fp16 or bf16")
    if opt_level is None:
        opt_level = "O1" if mixed_precision in HALF_DTYPES else "O0"
    level = OPT_LEVELS[opt_level]

    if not level.uses_half:
        if mixed_precision in HALF_DTYPES:
            notes.append(f"{opt_level} runs in fp32; mixed precision {mixed_precision} from {mp_source} "
                         "is not used")
        if keep_bn_fp32 is not None:
            notes.append(f"--keep-batchnorm-fp32 has no effect at {opt_level} (everything is fp32); ignored")
        if loss_scale is not None:
            notes.append(f"--loss-scale {loss_scale} has no effect in fp32 ({opt_level}); not applied")
        return PrecisionPlan(opt_level, "no", level.keep_bn_fp32, None), notes

    if mixed_precision == "no" and mp_source == "--mixed-precision":
        raise UsageError(f"--mixed-precision no contradicts --opt-level {opt_level}; drop one of them "
                         "(O0 is fp32)")
    if keep_bn_fp32 is not None and not level.half_weights:
        raise UsageError(f"--keep-batchnorm-fp32 cannot be used with --opt-level {opt_level}: autocast already "
                         "runs BatchNorm in fp32; drop the flag or use O2/O3")
    dtype_name = mixed_precision if mixed_precision in HALF_DTYPES else "fp16"  # Apex's dtype
    keep_bn = level.keep_bn_fp32 if keep_bn_fp32 is None else keep_bn_fp32
    default_scale = level.loss_scale_fp16 if dtype_name == "fp16" else level.loss_scale_bf16
    scale = default_scale if loss_scale is None else loss_scale
    return PrecisionPlan(opt_level, dtype_name, keep_bn, scale), notes


def cpu_has_native_bf16(cpuinfo="/proc/cpuinfo"):
    """True/False when the CPU flags say whether it has bf16 instructions; None where unknown."""
    try:
        with open(cpuinfo) as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


def cpu_fp16_note(plan, device_type):
    """Accelerate alone silently trains fp16 runs in fp32 on a CPU; say what happens here instead.

    Half precision pays on a CPU only with native bf16 instructions (AVX512_BF16, AMX): on a
    2-core AVX-512 Xeon without them a ResNet-18 step took 2.3x longer in bf16 autocast than in
    fp32 (docs/precision.md), so the advice depends on the CPU.
    """
    if device_type == "cuda" or plan.dtype_name != "fp16":
        return None
    note = ("fp16 on a machine without CUDA: running real fp16 on the CPU through torch's CPU kernels "
            "(slow; Accelerate alone would silently use fp32). ")
    native_bf16 = cpu_has_native_bf16()
    if native_bf16:
        return note + "This CPU has bf16 instructions: --mixed-precision bf16 is faster"
    if native_bf16 is False:
        return note + ("This CPU has no bf16 instructions (AVX512_BF16, AMX), so bf16 is slow here too: "
                       "--opt-level O0 (fp32) is the fastest")
    return note + ("Half precision pays on a CPU only with bf16 instructions (AVX512_BF16, AMX); "
                   "without them --opt-level O0 (fp32) is the fastest")


def _is_batchnorm(module):
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def _cast_floats(obj, dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(item, dtype) for item in obj)
    if isinstance(obj, dict):
        return {key: _cast_floats(value, dtype) for key, value in obj.items()}
    return obj


def cast_model(model, dtype, keep_bn_fp32):
    """Cast every parameter and floating buffer to dtype, BatchNorm layers excepted if asked."""
    for module in model.modules():
        if keep_bn_fp32 and _is_batchnorm(module):
            continue
        module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return model


class Precision:
    """Applies a PrecisionPlan to a model and runs backward/step the way the plan says."""

    def __init__(self, plan, model, device_type):
        self.plan = plan
        self.device_type = device_type
        device = next(model.parameters()).device
        self.scaler = LossScaler(plan.loss_scale, device) if plan.loss_scale is not None else None
        # Counts skipped and in-a-row non-finite steps at every level: the scaler, or a plain check.
        self.guard = self.scaler if self.scaler is not None else NonFiniteCheck(device)
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # O2 masters are copied before the cast, so they keep every fp32 bit (e.g. after a resume).
        fp32_copies = ({p: p.detach().clone().float().requires_grad_(True) for p in self.model_params}
                       if plan.master_weights else {})
        if plan.half_weights:
            cast_model(model, plan.half_dtype, plan.keep_bn_fp32)
            half = plan.half_dtype
            # Inputs in half for the half model; logits back in fp32 so the loss is computed in fp32.
            model.register_forward_pre_hook(lambda module, args: _cast_floats(args, half))
            model.register_forward_hook(lambda module, args, output: _cast_floats(output, torch.float32))
        # O2: fp32 masters for the half params; fp32 params (kept BatchNorm) are their own masters.
        self.master_of = {p: copy for p, copy in fp32_copies.items() if p.dtype != torch.float32}
        # Set by utils.training_state.build_training_state from the ingredient flags:
        self.clip_grad = None          # --clip-grad: max global grad norm, clipped after unscaling
        self.skips_on_device = True    # False for an optimizer that ignores found_inf (timm's Lamb)
        self.ema = None                # --model-ema: timm ModelEmaV3 over the fp32 weights

    def optimizer_params(self):
        """What the optimizer updates: fp32 masters at O2, the model's own parameters otherwise."""
        return [self.master_of.get(p, p) for p in self.model_params]

    def autocast(self):
        if self.plan.autocast:
            return torch.autocast(self.device_type, dtype=self.plan.half_dtype)
        return contextlib.nullcontext()

    def backward(self, loss, accelerator):
        accelerator.backward(self.scaler.scale_loss(loss) if self.scaler is not None else loss)

    @torch.no_grad()
    def step(self, optimizer):
        """Copy grads to masters (O2), unscale and check (or only check, without a loss scale),
        step: skipped on the device when a grad holds inf/NaN, at every level."""
        half_grads, master_grads = [], []
        for param, master in self.master_of.items():
            if param.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            half_grads.append(param.grad)
            master_grads.append(master.grad)
        if half_grads:
            torch._foreach_copy_(master_grads, half_grads)
        raw = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps the torch optimizer
        grads = [p.grad for p in self.optimizer_params() if p.grad is not None]
        if self.scaler is not None:
            found_inf = self.scaler.unscale_and_check(grads)
        else:
            found_inf = self.guard.check(grads)
        if self.clip_grad:
            # After unscaling (masters at O2), so N bounds the true gradient. On an overflow step the
            # norm is inf and the grads become 0/NaN: harmless, the step is skipped on found_inf,
            # which was computed before clipping.
            clip_grad_norm_fp32([p for p in self.optimizer_params() if p.grad is not None], self.clip_grad)
        if self.skips_on_device:
            raw.found_inf = found_inf  # read by the fused SGD/AdamW kernels: they leave everything as is when 1
            optimizer.step()
        elif not bool(found_inf.item()):  # Lamb ignores found_inf: skip on the host (one sync a step)
            optimizer.step()
        self.guard.update(found_inf)
        if self.master_of:
            torch._foreach_copy_(list(self.master_of), list(self.master_of.values()))

    @torch.no_grad()
    def update_ema(self, model):
        """--model-ema: move the EMA towards the fp32 weights (the masters at O2) after a step. A
        skipped step leaves the weights as they were, so the EMA only moves towards the same point."""
        if self.ema is not None:
            from utils.compiled import plain_module
            from utils.ingredients import update_ema
            update_ema(self.ema, plain_module(model), self.master_of)

    def zero_grad(self, model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        if self.master_of:
            model.zero_grad(set_to_none=True)

    def fp32_state_dict(self, model):
        """The model's state_dict with fp32 weights (the masters at O2), loadable at any level."""
        names = {id(p): name for name, p in model.named_parameters()}
        state = model.state_dict()
        for param, master in self.master_of.items():
            state[names[id(param)]] = master.detach()
        return {key: (value.detach().float() if value.is_floating_point() else value.detach()).cpu()
                for key, value in state.items()}

    @torch.no_grad()
    def weights_finite(self, model):
        """Whether every weight and floating buffer (BatchNorm statistics too, which a forward of
        inf activations poisons even when the step is skipped), and every O2 master, is finite.
        One host sync; checked on every process before a checkpoint is written, so all of them
        agree (the weights are the same everywhere)."""
        tensors = [t for t in model.state_dict().values() if t.is_floating_point() and t.numel()]
        tensors += list(self.master_of.values())
        by_dtype = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor.detach())
        peaks = [torch.stack(torch._foreach_norm(group, float("inf"))).float() for group in by_dtype.values()]
        return bool(torch.isfinite(torch.cat(peaks)).all()) if peaks else True

    def loss_scale_value(self):
        return self.scaler.scale if self.scaler is not None else None

    def skipped_steps(self):
        """Steps skipped for inf/NaN so far (a 0-d tensor on the device), at every level."""
        return self.guard.skipped

    def divergence(self, max_nonfinite_steps=MAX_NONFINITE_STEPS):
        """Why the run has diverged, or None. Reads the device (a sync): call it where the loop
        syncs anyway (print-freq, end of epoch). The counters are the same on every process
        (the grads they check were all-reduced), so every process answers the same."""
        streak = int(self.guard.streak)
        if streak >= max_nonfinite_steps:
            return (f"{streak} steps in a row had non-finite (inf/NaN) loss or gradients and were skipped "
                    f"(--max-nonfinite-steps {max_nonfinite_steps})")
        if self.scaler is not None and self.scaler.dynamic:
            scale = float(self.scaler.scale)
            if scale < DYNAMIC_MIN_SCALE:
                return (f"the dynamic loss scale fell to {scale:g}, below {DYNAMIC_MIN_SCALE:g}: the "
                        "gradients overflow fp16 even unscaled")
        return None

    def state_dict(self):
        return self.guard.state_dict()

    def load_state_dict(self, state):
        if state:
            self.guard.load_state_dict(state)
