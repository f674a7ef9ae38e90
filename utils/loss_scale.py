"""Loss scaling and the non-finite check, on the device: the static or dynamic scale (Apex's
rules: start 2**16, halve and skip on inf/NaN, double after 2000 clean steps, cap 2**24), the
plain check where there is no scale (O0, bf16), the counters of skipped steps and of non-finite
steps in a row, and an fp32-summed gradient clip. None of it syncs with the host."""
import torch

DYNAMIC_INIT_SCALE = 2.0 ** 16
DYNAMIC_GROWTH_INTERVAL = 2000
DYNAMIC_MAX_SCALE = 2.0 ** 24
# A dynamic scale below this means the gradients overflow fp16 even divided by 2**14 (the scale
# halved 30 times in a row from 2**16): the run has diverged, no scale will rescue it.
DYNAMIC_MIN_SCALE = 2.0 ** -14


class LossScaler:
    """Static or dynamic loss scale whose overflow check and update never leave the device."""

    def __init__(self, loss_scale, device):
        self.dynamic = loss_scale == "dynamic"
        init = DYNAMIC_INIT_SCALE if self.dynamic else float(loss_scale)
        self.scale = torch.full((), init, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self.streak = torch.zeros((), dtype=torch.float32, device=device)  # non-finite steps in a row
        self.growth_interval = DYNAMIC_GROWTH_INTERVAL

    def scale_loss(self, loss):
        return loss * self.scale

    def unscale_and_check(self, grads):
        """Divide grads by the scale in place; return a 0-d tensor, 1.0 when any grad is inf/NaN."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        inv_scale = self.scale.double().reciprocal().float()
        by_dtype = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
            except NotImplementedError:  # e.g. bf16 grads on CUDA (O3 bf16): same result, 3 launches
                unscale_and_check_foreach(group, found_inf, inv_scale)
        return found_inf

    def update(self, found_inf):
        count_nonfinite(self, found_inf)
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, 2.0, 0.5,
                                     self.growth_interval)
            self.scale.clamp_(max=DYNAMIC_MAX_SCALE)

    def state_dict(self):
        return {"dynamic": self.dynamic, "scale": float(self.scale), "skipped": int(self.skipped),
                "growth_tracker": int(self.growth_tracker), "streak": int(self.streak)}

    def load_state_dict(self, state):
        self.skipped.fill_(state["skipped"])
        self.streak.fill_(state.get("streak", 0))
        if self.dynamic and state.get("dynamic"):
            self.scale.fill_(state["scale"])
            self.growth_tracker.fill_(state["growth_tracker"])


class NonFiniteCheck:
    """The check of runs without a loss scale (O0, bf16 at O1/O2): LossScaler's inf/NaN check,
    skip and counters, without the multiply (one read of the grads, no write, no host sync)."""

    dynamic = False

    def __init__(self, device):
        self.device = device
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self.streak = torch.zeros((), dtype=torch.float32, device=device)

    def check(self, grads):
        """A 0-d tensor, 1.0 when any grad holds inf/NaN (max-abs is inf or NaN exactly then)."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        by_dtype = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            peaks = torch.stack(torch._foreach_norm(group, float("inf"))).float()
            found_inf = torch.maximum(found_inf, (~torch.isfinite(peaks)).any().float())
        return found_inf

    def update(self, found_inf):
        count_nonfinite(self, found_inf)

    def state_dict(self):
        return {"dynamic": False, "scale": None, "skipped": int(self.skipped), "streak": int(self.streak)}

    def load_state_dict(self, state):
        self.skipped.fill_(state.get("skipped", 0))
        self.streak.fill_(state.get("streak", 0))


def count_nonfinite(counters, found_inf):
    """On the device: one more skipped step when found_inf is 1; the run of non-finite steps in a
    row grows by one then, and drops to 0 on a clean step."""
    counters.skipped.add_(found_inf)
    counters.streak.add_(1.0).mul_(found_inf)


def unscale_and_check_foreach(grads, found_inf, inv_scale):
    """Portable twin of torch's fused unscale-and-check, still without a host sync.

    The max-abs of a tensor is inf when it holds an inf and NaN when it holds a NaN, so one
    foreach max-norm finds both; found_inf is raised in place on the device.
    """
    peaks = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
    found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(peaks)).any().float()))
    torch._foreach_mul_(grads, inv_scale.to(grads[0].dtype))


def clip_grad_norm_fp32(params, max_norm):
    """torch's clip_grad_norm_, with the norm summed in fp32: torch sums each gradient's norm in the
    gradient's dtype, so at O3 an fp16 gradient whose norm passed 65,504 made the total inf and
    scaled every gradient to 0: a step lost without being skipped or counted."""
    if not params:
        return torch.zeros(())
    norms = torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
