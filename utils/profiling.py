"""Step hooks for the training loop: no-ops by default, NVTX + cudaProfiler window for --prof."""
import contextlib

import torch


class NoPhases:
    """The loop's default: every hook does nothing."""

    def begin_step(self, step):
        pass

    def range(self, name):
        return contextlib.nullcontext()

    def end_step(self, step):
        """True when the loop should stop after this step."""
        return False


class NvtxWindow(NoPhases):
    """Apex --prof N: NVTX ranges per step and phase, cudaProfilerStart at step N, stop at N+10.

    Returns True from end_step once the 10 captured steps are done, so the loop ends cleanly.
    Without CUDA the ranges and profiler calls are skipped (the loop still stops at N+10).
    """

    def __init__(self, start_step, length=10):
        self.start_step = start_step
        self.stop_step = start_step + length
        self.cuda = torch.cuda.is_available()

    def begin_step(self, step):
        if not self.cuda:
            return
        if step == self.start_step:
            torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(f"Body of iteration {step}")

    @contextlib.contextmanager
    def range(self, name):
        if not self.cuda:
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()

    def end_step(self, step):
        if self.cuda:
            torch.cuda.nvtx.range_pop()
        if step + 1 >= self.stop_step:
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
            return True
        return False
