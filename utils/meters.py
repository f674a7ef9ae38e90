"""The numbers an epoch reports: the device-side meter (loss, top-1, top-5, read only at
print-freq), the epoch's result, the log line's times and figures, the loss-scale fields."""
import time
from dataclasses import dataclass

import torch

from utils.run.preemption import agreed_signal


class DeviceMeter:
    """Sums of loss x n, top-1 hits, top-5 hits and n, kept on the device between reads."""

    def __init__(self, device, num_classes):
        self.device = device
        self.topk = min(5, num_classes)
        # loss x n, top-1 hits, top-5 hits, n; then the processes asked to stop and their signals' sum
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)
        self.total = [0.0] * 6  # what has been read so far (all processes)

    @torch.no_grad()
    def update(self, loss, output, target):
        n = target.size(0)
        top = output.topk(self.topk, dim=1).indices
        hits = top.eq(target.view(-1, 1))
        self.sums[0] += loss.detach().double() * n
        self.sums[1] += hits[:, :1].sum()
        self.sums[2] += hits.sum()
        self.sums[3] += n

    def read(self, accelerator=None, stop_signal=None):
        """Averages since the last read and over everything read; syncs (and reduces if given).

        stop_signal (the signal number this process was asked to stop by, or None) rides along in
        the same all-reduce (no collective of its own): the interval's "stop" is the number of
        processes that were asked to stop, "signal" the signal they got (SIGTERM if they differ)."""
        if stop_signal:
            self.sums[4], self.sums[5] = 1.0, float(stop_signal)
        sums = accelerator.reduce(self.sums, reduction="sum") if accelerator is not None else self.sums
        values = sums.tolist()
        self.sums.zero_()
        self.total = [t + v for t, v in zip(self.total, values)]
        return averages(values), averages(self.total)

    def so_far(self, accelerator=None):
        """The totals over everything so far ({"sums": loss x n, top-1, top-5 hits, n}) without
        ending the interval: what a mid-epoch checkpoint carries. Reduces if given (every process
        must call it at the same step)."""
        sums = self.sums.clone()
        if accelerator is not None:
            sums = accelerator.reduce(sums, reduction="sum")
        return [t + v for t, v in zip(self.total[:4], sums.tolist()[:4])]


def averages(sums):
    count = max(sums[3], 1.0)
    return {"loss": sums[0] / count, "top1": 100.0 * sums[1] / count, "top5": 100.0 * sums[2] / count,
            "count": int(sums[3]), "stop": int(sums[4]) if len(sums) > 4 else 0,
            "signal": agreed_signal(sums[4], sums[5]) if len(sums) > 5 else None}



@dataclass
class EpochResult:
    loss: float
    top1: float
    top5: float
    count: int
    seconds: float
    images_per_sec: float
    skipped_steps: int = 0
    loss_scale: float = None
    next_step: int = None    # where training stopped early (a stop signal): the next step to run
    diverged: str = None     # why training stopped for non-finite numbers (Precision.divergence)
    step: int = None         # the last step run (1-based, as the log lines), for messages
    lr: float = None         # the LR of that step
    sums: list = None        # loss x n, top-1 and top-5 hits, n: what a mid-epoch checkpoint carries
    tta_top1: float = None   # validation's --tta figures (the mean of the plain and the mirrored logits)
    tta_top5: float = None

    def so_far(self):
        """A mid-epoch checkpoint's record of the epoch until its step (train_one_epoch's carried)."""
        return {"sums": self.sums, "seconds": self.seconds}

    @property
    def stopped(self):
        return self.next_step is not None


def scale_fields(precision):
    """The log line's tail: skipped steps at every level, and the loss scale where there is one."""
    skipped = int(precision.skipped_steps())
    scale = precision.loss_scale_value()
    if scale is None:
        return f"\tSkipped {skipped}", skipped, None
    scale = float(scale)
    return f"\tSkipped {skipped}\tScale {scale:g}", skipped, scale


class EpochClock:
    """The train log line's times: an interval's time per step and the epoch's average, the steps
    before a mid-epoch checkpoint (carried) included."""

    def __init__(self, carried_seconds=0.0, carried_steps=0):
        self.started = self.interval_started = time.perf_counter()
        self.carried = carried_seconds
        self.total, self.total_steps = carried_seconds, carried_steps
        self.steps = 0  # in the interval so far

    def lap(self):
        """(seconds per step in the interval just ended, over the epoch so far); starts the next."""
        now = time.perf_counter()
        step_time = (now - self.interval_started) / self.steps
        self.total += now - self.interval_started
        self.total_steps += self.steps
        self.interval_started, self.steps = now, 0
        return step_time, self.total / self.total_steps

    def seconds(self):
        return self.carried + time.perf_counter() - self.started


def figures_text(interval, total):
    """The log line's loss, top-1 and top-5: the interval's, then (in brackets) the epoch's."""
    return (f"Loss {interval['loss']:.10f} ({total['loss']:.4f})\t"
            f"Prec@1 {interval['top1']:.3f} ({total['top1']:.3f})\t"
            f"Prec@5 {interval['top5']:.3f} ({total['top5']:.3f})")
