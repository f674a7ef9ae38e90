"""Train and validate loops, the LR schedule, metrics and Apex-format log lines.

Metrics accumulate on the device; they are reduced across processes and copied to the host
only at print-freq (and at the end of an epoch), so the hot path never waits for the GPU. The
same reads carry the two reasons a run stops early: a stop signal (utils/preemption.py; every
process stops at the same step) and divergence (Precision.divergence: non-finite steps in a row).
A run can start inside an epoch (a resumed mid-epoch checkpoint): the sampler starts at that
step of the same shuffle, the LR schedule at that step, and the seed of dropout & co. is a pure
function of (seed, epoch, step, rank), so nothing about the RNG needs saving.
"""
import collections
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from .compiled import eval_module
from .errors import UsageError
from .logs import NoProgress
from .precision import MAX_NONFINITE_STEPS
from .preemption import NoStop, agreed_signal
from .profiling import NoPhases
from .recipe import micro_batch_context


def learning_rate(args, epoch, step, steps_per_epoch, global_batch):
    """Apex schedule: lr x global_batch/256, linear warmup, x0.1 at each milestone in --lr-steps
    the epoch has reached (30, 60, 80 for ImageNet), or cosine to --min-lr (default 0). --min-lr
    is an absolute LR (timm's meaning, not scaled by the batch): the floor of both schedules."""
    peak = args.lr * global_batch / 256.0
    min_lr = min(getattr(args, "min_lr", 0.0), peak)
    if args.lr_schedule == "step":
        lr = max(peak * 0.1 ** sum(1 for milestone in args.lr_steps if epoch >= milestone), min_lr)
    else:
        progress = (epoch * steps_per_epoch + step) / float(args.epochs * steps_per_epoch)
        lr = min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
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

    def so_far(self):
        """A mid-epoch checkpoint's record of the epoch until its step (train_one_epoch's carried)."""
        return {"sums": self.sums, "seconds": self.seconds}

    @property
    def stopped(self):
        return self.next_step is not None


def _scale_fields(precision):
    """The log line's tail: skipped steps at every level, and the loss scale where there is one."""
    skipped = int(precision.skipped_steps())
    scale = precision.loss_scale_value()
    if scale is None:
        return f"\tSkipped {skipped}", skipped, None
    scale = float(scale)
    return f"\tSkipped {skipped}\tScale {scale:g}", skipped, scale


def steps_per_epoch(data, args):
    """Optimizer steps per epoch. With --accum-steps N a step takes N loader batches, so an epoch
    has len // N steps (a last group of fewer than N batches is dropped, as the big batch's
    drop_last would); --steps-per-epoch and every step number (logs, LR schedule,
    --save-every-steps, mid-epoch checkpoints) count optimizer steps."""
    accum = getattr(args, "accum_steps", 1)
    steps = len(data.train) // accum
    if steps == 0:
        raise UsageError(f"--accum-steps {accum} needs at least {accum} batches per epoch; this process "
                         f"has {len(data.train)}: lower --accum-steps or --batch-size")
    return min(steps, args.steps_per_epoch) if args.steps_per_epoch else steps


def training_epochs(args, data, accelerator):
    """(epoch, first step) for the epochs left to run: from args.start_epoch, the first of them
    from args.start_step (a mid-epoch checkpoint), with the sampler set to that position (in
    loader batches: N per optimizer step with --accum-steps N)."""
    for epoch in range(args.start_epoch, args.epochs):
        first_step = getattr(args, "start_step", 0) if epoch == args.start_epoch else 0
        data.set_epoch(epoch, first_step * getattr(args, "accum_steps", 1))
        yield epoch, first_step


def step_seed(seed, epoch, step, rank):
    """The global RNG's seed for one step (dropout, drop-path, ...): a pure function of where the
    step is, so a run resumed mid-epoch draws what an uninterrupted run drew, with nothing saved."""
    return ((((seed * 1_000_003 + epoch) * 1_000_033 + step) * 1_009 + rank) * 7919) % (2 ** 63)


class RunAhead:
    """Keeps the host at most `depth` optimizer steps ahead of the GPU (CUDA only; else a no-op).

    Left alone, the loop queues kernels until CUDA's launch queue is full and then blocks inside a
    kernel launch still holding the GIL, which starves the thread that decodes the next batch
    (gpu backend) or copies it to the device (cpu backend). Waiting on an event from `depth`
    steps back lets go of the GIL instead, and with that many steps queued the GPU never waits
    for the host. Not a device synchronisation: the newest steps keep running."""

    def __init__(self, device, depth=2):
        self.depth = depth
        self.events = collections.deque() if torch.device(device).type == "cuda" else None

    def step_queued(self):
        if self.events is None:
            return
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)
        if len(self.events) > self.depth:
            self.events.popleft().synchronize()


class TakeAhead:
    """An epoch's batches, with take_ahead(): take the next batch now, before a host sync.

    At a print step the loop reads its figures from the device, which waits for every step
    queued so far: the GPU's queue runs empty. Had the next batch still to come from the input
    pipeline after that (the gpu backend delivers batches just in time when decoding sets the
    pace), the GPU would idle for it: on an H100 (ResNet-50, --print-freq 10) most steps after a
    print step waited 15-25 ms, and taking the batch first cut the mean data wait from 2.1 to
    0.4 ms a step (docs/speed.md). Taken before the sync, the batch is there when the sync
    returns, and the next step is queued at once."""

    def __init__(self, batches):
        self.batches = batches
        self.taken = []

    def __iter__(self):
        return self

    def __next__(self):
        return self.taken.pop() if self.taken else next(self.batches)

    def take_ahead(self):
        if not self.taken:
            try:
                self.taken.append(next(self.batches))
            except StopIteration:  # none left: the next next() says so again
                pass

    def close(self):
        self.taken.clear()
        close_batches(self.batches)


def close_batches(batches):
    """Stop what loads an iterator's batches (the gpu backend's threads); None is fine."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()


def train_one_epoch(model, data, optimizer, precision, accelerator, epoch, args, criterion,
                    phases=NoPhases(), log=print, progress=NoProgress(), first_step=0, stop=NoStop(),
                    on_step=None, augment=None, batches=None, carried=None):
    """Train one epoch from first_step. Stops early, at a step every process agrees on, when
    stop.requested (returns next_step) or when the run diverged (returns diverged). on_step(epoch,
    next_step) runs after each step (train.py's --save-every-steps). augment: utils.recipe's
    BatchAugment (random erasing, mixup/cutmix) on the device batch, or None; criterion then
    takes its soft targets, while top-1/top-5 count against the hard ones.

    --accum-steps N: each step runs N micro-batches (forward + backward of loss / N, under
    micro_batch_context so DDP all-reduces only the last), then one Precision.step: one unscale,
    one overflow check and skip, one clip, one loss-scale update, as for one batch of N x b.

    batches: the epoch's batches if already started (Data.start_epoch), else iter(data.train)
    here; closed when the epoch ends, so no decode thread outlives it. carried: a mid-epoch
    checkpoint's record of its epoch until first_step (EpochResult.so_far); the epoch's figures
    (log averages, summary.csv row) then cover the whole epoch, not only the steps after it.
    on_step(epoch, next_step, so_far) gets so_far(), that record now (a collective: call it on
    every process or none)."""
    model.train()
    steps = steps_per_epoch(data, args)
    world = accelerator.num_processes
    accum = getattr(args, "accum_steps", 1)
    global_batch = args.batch_size * world * accum
    max_nonfinite = getattr(args, "max_nonfinite_steps", None) or MAX_NONFINITE_STEPS
    meter = DeviceMeter(accelerator.device, data.num_classes)
    epoch_start = interval_start = time.perf_counter()
    interval_steps, time_avg_sum, time_avg_n = 0, 0.0, 0
    earlier_seconds = 0.0
    if carried:  # the steps run before the checkpoint count in this epoch's figures
        meter.total[:4] = carried["sums"]
        earlier_seconds = time_avg_sum = carried["seconds"]
        time_avg_n = first_step
    next_step, diverged, lr = None, None, None
    batches = TakeAhead(iter(data.train) if batches is None else batches)
    run_ahead = RunAhead(accelerator.device)
    progress.begin((steps - first_step) * global_batch, f"Epoch {epoch}")  # a bar on a terminal
    step = first_step - 1
    for step in range(first_step, steps):
        phases.begin_step(step)
        seed = step_seed(args.seed, epoch, step, accelerator.process_index)
        torch.manual_seed(seed)
        random.seed(seed)  # timm's random erasing and mixup draw from Python's and NumPy's RNGs
        np.random.seed(seed % 2 ** 32)
        lr = learning_rate(args, epoch, step, steps, global_batch)
        set_learning_rate(optimizer, lr)
        for micro in range(accum):
            with phases.range("prefetcher.next()"):  # Apex's NVTX range names, kept for nsys users
                images, target = next(batches)
            soft = target
            if augment is not None:
                images, soft = augment(images, target)
            with micro_batch_context(accelerator, model, micro, accum):  # forward too: DDP decides there
                with phases.range("forward"):
                    with precision.autocast():
                        output = model(images)
                        loss = criterion(output, soft)
                with phases.range("backward"):
                    precision.backward(loss / accum if accum > 1 else loss, accelerator)
            meter.update(loss, output, target)
        with phases.range("optimizer.step()"):
            precision.step(optimizer)
            precision.update_ema(model)
            precision.zero_grad(model, optimizer)
        run_ahead.step_queued()
        progress.advance(global_batch)
        interval_steps += 1
        last = step + 1 == steps
        stopping = world == 1 and stop.requested  # one process: a host bool, checked every step
        if (step + 1) % args.print_freq == 0 or last or stopping:
            if not (last or stopping):
                batches.take_ahead()  # before the sync below (TakeAhead)
            interval, total = meter.read(accelerator, stop.signum)
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
            # Both verdicts are the same on every process (one all-reduce; counters of all-reduced
            # grads), so every process leaves the loop at this same step.
            diverged = precision.divergence(max_nonfinite)
            if diverged:
                break
            if interval["stop"]:
                stop.adopt(interval["signal"])  # the signal may have reached another process only
                next_step = step + 1
                break
        if on_step is not None and not last:  # the epoch's own checkpoint follows its last step
            on_step(epoch, step + 1, lambda: {"sums": meter.so_far(accelerator),
                                              "seconds": earlier_seconds + time.perf_counter() - epoch_start})
        if phases.end_step(step):
            break
    progress.end()
    close_batches(batches)  # an epoch cut short (--steps-per-epoch, a stop) leaves them unfinished
    seconds = earlier_seconds + time.perf_counter() - epoch_start
    _, total = meter.read(accelerator)
    _, skipped, scale = _scale_fields(precision)
    return EpochResult(total["loss"], total["top1"], total["top5"], total["count"], seconds,
                       total["count"] / max(seconds, 1e-9), skipped, scale, next_step, diverged, step + 1, lr,
                       meter.total[:4])


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
def validate(model, data, precision, accelerator, args, criterion, log=print, progress=NoProgress(), label=""):
    """Top-1/top-5/loss over the whole val split, every image counted once across processes.
    label: a word for the summary line (" * EMA Prec@1 ..." for the --model-ema weights).

    The model is used unwrapped (no DDP collectives), because processes may hold one batch more
    or less than each other. Progress lines show this process's running figures; the final line
    is reduced over all processes.
    """
    model = eval_module(model)  # no DDP wrapper; compiled on its own if training is
    share_buffers_from_main(model, accelerator)
    model.eval()
    meter = DeviceMeter(accelerator.device, data.num_classes)
    steps = len(data.val)
    start = time.perf_counter()
    progress.begin(steps, "Test", unit="batch")
    run_ahead = RunAhead(accelerator.device)
    batches = data.val_batches()  # the iterator Data.start_epoch started, if it did
    for step, (images, target) in enumerate(batches):
        with precision.autocast():
            output = model(images)
            loss = criterion(output, target)
        meter.update(loss, output, target)
        run_ahead.step_queued()
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
    log(f" * {label + ' ' if label else ''}Prec@1 {total['top1']:.3f} Prec@5 {total['top5']:.3f}")
    return EpochResult(total["loss"], total["top1"], total["top5"], total["count"], seconds,
                       total["count"] / max(seconds, 1e-9))


def diverged_message(reason, epoch, step, steps, lr, last_good):
    """Diverged's one line: where, at what LR, why, and what is left to resume from."""
    what_now = (f"the last good checkpoint is {last_good} (it was left as it was); resume from it"
                if last_good else "no checkpoint was written yet; start again")
    lr_text = f"lr {lr:g}" if lr is not None else "lr unknown"
    return (f"training diverged at epoch {epoch}, step {step}/{steps} ({lr_text}): {reason}; {what_now} "
            "with a lower --lr (or, at fp16, try bf16 or O0)")
