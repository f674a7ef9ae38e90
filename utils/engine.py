"""Train and validate loops, the LR schedule, metrics and Apex-format log lines.

Metrics accumulate on the device; they are reduced across processes and copied to the host
only at print-freq (and at the end of an epoch), so the hot path never waits for the GPU.
"""
import math
import time
from dataclasses import dataclass

import torch

from .logs import NoProgress
from .profiling import NoPhases


def learning_rate(args, epoch, step, steps_per_epoch, global_batch):
    """Apex schedule: lr x global_batch/256, linear warmup, x0.1 at each milestone in --lr-steps
    the epoch has reached (30, 60, 80 for ImageNet), or cosine to 0."""
    lr = args.lr * global_batch / 256.0
    if args.lr_schedule == "step":
        lr *= 0.1 ** sum(1 for milestone in args.lr_steps if epoch >= milestone)
    else:
        progress = (epoch * steps_per_epoch + step) / float(args.epochs * steps_per_epoch)
        lr *= 0.5 * (1.0 + math.cos(math.pi * progress))
    if epoch < args.warmup_epochs:
        lr *= (1 + step + epoch * steps_per_epoch) / float(args.warmup_epochs * steps_per_epoch)
    return lr


def set_learning_rate(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


class DeviceMeter:
    """Sums of loss x n, top-1 hits, top-5 hits and n, kept on the device between reads."""

    def __init__(self, device, num_classes):
        self.device = device
        self.topk = min(5, num_classes)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.total = [0.0, 0.0, 0.0, 0.0]  # what has been read so far (all processes)

    @torch.no_grad()
    def update(self, loss, output, target):
        n = target.size(0)
        top = output.topk(self.topk, dim=1).indices
        hits = top.eq(target.view(-1, 1))
        self.sums[0] += loss.detach().double() * n
        self.sums[1] += hits[:, :1].sum()
        self.sums[2] += hits.sum()
        self.sums[3] += n

    def read(self, accelerator=None):
        """Averages since the last read and over everything read; syncs (and reduces if given)."""
        sums = accelerator.reduce(self.sums, reduction="sum") if accelerator is not None else self.sums
        values = sums.tolist()
        self.sums.zero_()
        self.total = [t + v for t, v in zip(self.total, values)]
        return averages(values), averages(self.total)


def averages(sums):
    count = max(sums[3], 1.0)
    return {"loss": sums[0] / count, "top1": 100.0 * sums[1] / count, "top5": 100.0 * sums[2] / count,
            "count": int(sums[3])}


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


def _scale_fields(precision):
    skipped = precision.skipped_steps()
    scale = precision.loss_scale_value()
    if skipped is None:
        return "", 0, None
    skipped, scale = int(skipped), float(scale)
    return f"\tSkipped {skipped}\tScale {scale:g}", skipped, scale


def training_epochs(args, data, accelerator):
    """The epochs left to run (from args.start_epoch), each with the sampler's epoch and the seed
    of dropout etc. set from the epoch alone: what lets a resumed run repeat an uninterrupted one."""
    for epoch in range(args.start_epoch, args.epochs):
        data.set_epoch(epoch)
        torch.manual_seed(args.seed * 1000 + epoch * 7 + accelerator.process_index)
        yield epoch


def train_one_epoch(model, data, optimizer, precision, accelerator, epoch, args, criterion,
                    phases=NoPhases(), log=print, progress=NoProgress()):
    model.train()
    steps = len(data.train)
    if args.steps_per_epoch:
        steps = min(steps, args.steps_per_epoch)
    world = accelerator.num_processes
    global_batch = args.batch_size * world
    meter = DeviceMeter(accelerator.device, data.num_classes)
    epoch_start = interval_start = time.perf_counter()
    interval_steps, time_avg_sum, time_avg_n = 0, 0.0, 0
    batches = iter(data.train)
    progress.begin(steps * global_batch, f"Epoch {epoch}")  # a bar on a terminal (utils/logs.py)
    for step in range(steps):
        phases.begin_step(step)
        with phases.range("prefetcher.next()"):  # Apex's NVTX range names, kept for nsys users
            images, target = next(batches)
        set_learning_rate(optimizer, learning_rate(args, epoch, step, steps, global_batch))
        with phases.range("forward"):
            with precision.autocast():
                output = model(images)
                loss = criterion(output, target)
        with phases.range("backward"):
            precision.backward(loss, accelerator)
        with phases.range("optimizer.step()"):
            precision.step(optimizer)
            precision.zero_grad(model, optimizer)
        meter.update(loss, output, target)
        progress.advance(global_batch)
        interval_steps += 1
        last = step + 1 == steps
        if (step + 1) % args.print_freq == 0 or last:
            interval, total = meter.read(accelerator)
            now = time.perf_counter()
            step_time = (now - interval_start) / interval_steps
            time_avg_sum += now - interval_start
            time_avg_n += interval_steps
            avg_time = time_avg_sum / time_avg_n
            scale_text, _, _ = _scale_fields(precision)
            log(f"Epoch: [{epoch}][{step + 1}/{steps}]\t"
                f"Time {step_time:.3f} ({avg_time:.3f})\t"
                f"Speed {global_batch / step_time:.3f} ({global_batch / avg_time:.3f})\t"
                f"Loss {interval['loss']:.10f} ({total['loss']:.4f})\t"
                f"Prec@1 {interval['top1']:.3f} ({total['top1']:.3f})\t"
                f"Prec@5 {interval['top5']:.3f} ({total['top5']:.3f})" + scale_text)
            interval_start, interval_steps = now, 0
        if phases.end_step(step):
            break
    progress.end()
    seconds = time.perf_counter() - epoch_start
    _, total = meter.read(accelerator)
    _, skipped, scale = _scale_fields(precision)
    return EpochResult(total["loss"], total["top1"], total["top5"], total["count"], seconds,
                       total["count"] / max(seconds, 1e-9), skipped, scale)


def share_buffers_from_main(model, accelerator):
    """Give every process the main process's buffers (BatchNorm running statistics).

    DDP broadcasts buffers from rank 0 at the start of each training forward, so after the last
    step every rank holds statistics updated by its own last batch only. Validating with them
    would score each rank's share of the val split with a slightly different model than the
    one the checkpoint (written by the main process) holds.
    """
    if accelerator.num_processes < 2:
        return
    for buffer in model.buffers():
        torch.distributed.broadcast(buffer, src=0)


@torch.no_grad()
def validate(model, data, precision, accelerator, args, criterion, log=print, progress=NoProgress()):
    """Top-1/top-5/loss over the whole val split, every image counted once across processes.

    The model is used unwrapped (no DDP collectives), because processes may hold one batch more
    or less than each other. Progress lines show this process's running figures; the final line
    is reduced over all processes.
    """
    model = accelerator.unwrap_model(model)
    share_buffers_from_main(model, accelerator)
    model.eval()
    meter = DeviceMeter(accelerator.device, data.num_classes)
    steps = len(data.val)
    start = time.perf_counter()
    progress.begin(steps, "Test", unit="batch")
    for step, (images, target) in enumerate(data.val):
        with precision.autocast():
            output = model(images)
            loss = criterion(output, target)
        meter.update(loss, output, target)
        progress.advance()
        if (step + 1) % args.print_freq == 0 and step + 1 < steps:
            running = averages(meter.sums.tolist())  # this process only: no collective here
            elapsed = time.perf_counter() - start
            log(f"Test: [{step + 1}/{steps}]\tTime {elapsed / (step + 1):.3f}\t"
                f"Speed {running['count'] * accelerator.num_processes / elapsed:.3f}\t"
                f"Loss {running['loss']:.4f}\tPrec@1 {running['top1']:.3f}\tPrec@5 {running['top5']:.3f}")
    progress.end()
    _, total = meter.read(accelerator)
    seconds = time.perf_counter() - start
    log(f" * Prec@1 {total['top1']:.3f} Prec@5 {total['top5']:.3f}")
    return EpochResult(total["loss"], total["top1"], total["top5"], total["count"], seconds,
                       total["count"] / max(seconds, 1e-9))
