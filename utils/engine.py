"""Train and validate loops and the LR schedule, with Apex-format log lines (the numbers: utils/meters.py).

Metrics accumulate on the device; they are reduced across processes and copied to the host
only at print-freq (and at the end of an epoch), so the hot path never waits for the GPU. The
same reads carry the two reasons a run stops early: a stop signal (utils/run/preemption.py; every
process stops at the same step) and divergence (Precision.divergence: non-finite steps in a row).
A run can start inside an epoch (a resumed mid-epoch checkpoint): the sampler starts at that
step of the same shuffle, the LR schedule at that step, and the seed of dropout & co. is a pure
function of (seed, epoch, step, rank), so nothing about the RNG needs saving.
"""
import collections
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from utils.compiled import eval_module
from utils.ingredients import micro_batch_context
from utils.logs import NoProgress
from utils.meters import DeviceMeter, EpochClock, EpochResult, averages, figures_text, scale_fields
from utils.precision import MAX_NONFINITE_STEPS
from utils.profiling import NoPhases
from utils.run.errors import UsageError, WorkerLost
from utils.run.preemption import NoStop, next_batch_or_stop


@dataclass(frozen=True)
class Schedule:
    """The LR schedule's flags: --lr (per 256 images), --lr-schedule, --lr-steps, --min-lr,
    --warmup-epochs and --epochs."""
    lr: float
    epochs: int
    lr_schedule: str = "step"
    lr_steps: tuple = ()
    min_lr: float = 0.0
    warmup_epochs: int = 0


def learning_rate(schedule, epoch, step, steps_per_epoch, global_batch):
    """Apex schedule: lr x global_batch/256, linear warmup, x0.1 at each milestone in --lr-steps
    the epoch has reached (30, 60, 80 for ImageNet), or cosine to --min-lr (default 0), or linear:
    from the peak at the warmup's end straight down to --min-lr at the last step (the warmup and
    this line make FFCV's triangular schedule). --min-lr is an absolute LR (timm's meaning, not
    scaled by the batch): the floor of every schedule."""
    peak = schedule.lr * global_batch / 256.0
    min_lr = min(schedule.min_lr, peak)
    if schedule.lr_schedule == "step":
        lr = max(peak * 0.1 ** sum(1 for milestone in schedule.lr_steps if epoch >= milestone), min_lr)
    elif schedule.lr_schedule == "linear":
        warm = schedule.warmup_epochs * steps_per_epoch
        done = epoch * steps_per_epoch + step - warm
        progress = max(0.0, done / float(max(1, schedule.epochs * steps_per_epoch - warm)))
        lr = peak - (peak - min_lr) * progress
    else:
        progress = (epoch * steps_per_epoch + step) / float(schedule.epochs * steps_per_epoch)
        lr = min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if epoch < schedule.warmup_epochs:
        lr *= (1 + step + epoch * steps_per_epoch) / float(schedule.warmup_epochs * steps_per_epoch)
    return lr


@dataclass(frozen=True)
class Loop:
    """How train_one_epoch runs its steps: the schedule, the batch per process, the seed that the steps' RNGs derive from,
    --print-freq, --accum-steps, the --steps-per-epoch cap (0: the whole loader), how many
    non-finite steps in a row end the run, and the batch ingredients (criterion, augment)."""
    schedule: Schedule
    batch_size: int              # per process
    seed: int
    print_freq: int
    criterion: object
    augment: object = None       # utils.ingredients.BatchAugment, or None
    accum_steps: int = 1
    max_steps: int = 0           # --steps-per-epoch
    max_nonfinite_steps: int = MAX_NONFINITE_STEPS

    def steps_per_epoch(self, batches):
        """Optimizer steps in an epoch of `batches` loader batches (see steps_per_epoch)."""
        return steps_per_epoch(batches, self.accum_steps, self.max_steps)


def set_learning_rate(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def steps_per_epoch(batches, accum_steps=1, max_steps=0):
    """Optimizer steps per epoch of `batches` loader batches. With --accum-steps N a step takes N
    loader batches, so an epoch has batches // N steps (a last group of fewer than N batches is
    dropped, as the big batch's drop_last would); --steps-per-epoch (max_steps) and every step
    number (logs, LR schedule, --save-every-steps, mid-epoch checkpoints) count optimizer steps."""
    steps = batches // accum_steps
    if steps == 0:
        raise UsageError(f"--accum-steps {accum_steps} needs at least {accum_steps} batches per epoch; this "
                         f"process has {batches}: lower --accum-steps or --batch-size")
    return min(steps, max_steps) if max_steps else steps


def training_epochs(data, epochs, start_epoch=0, start_step=0, accum_steps=1):
    """(epoch, first step) for the epochs left to run: from start_epoch, the first of them from
    start_step (a mid-epoch checkpoint), with the sampler set to that position (in loader
    batches: N per optimizer step with --accum-steps N)."""
    for epoch in range(start_epoch, epochs):
        first_step = start_step if epoch == start_epoch else 0
        data.set_epoch(epoch, first_step * accum_steps)
        yield epoch, first_step


def seed_rngs(seed):
    """Seed torch's, Python's and NumPy's global RNGs: timm's random erasing and mixup draw from
    Python's and NumPy's, dropout and drop-path from torch's."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)


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
        self.lost = None  # a WorkerLost met taking ahead: raised by the next(), at its own step

    def __iter__(self):
        return self

    def __next__(self):
        if self.lost is not None:
            raise self.lost
        return self.taken.pop() if self.taken else next(self.batches)

    def take_ahead(self):
        if not self.taken:
            try:
                self.taken.append(next(self.batches))
            except StopIteration:  # none left: the next next() says so again
                pass
            except WorkerLost as lost:
                self.lost = lost

    def close(self):
        self.taken.clear()
        close_batches(self.batches)


@dataclass
class Watch:
    """What follows an epoch from outside the step: the log, the progress bar, the profiler's
    phases, the stop signal, and on_step(epoch, next_step, so_far), run after each step but the
    last (train.py's --save-every-steps; so_far() is a collective: every process calls it)."""
    log: object = print
    progress: object = field(default_factory=NoProgress)
    phases: object = field(default_factory=NoPhases)
    stop: object = field(default_factory=NoStop)
    on_step: object = None


def close_batches(batches):
    """Stop what loads an iterator's batches (the gpu backend's threads); None is fine."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()


def train_one_epoch(state, data, epoch, loop, watch=None, *, first_step=0, batches=None, carried=None):
    """Train one epoch of state (utils.training_state.TrainingState: model, optimizer, precision,
    accelerator) from first_step. Stops early, at a step every process agrees on, when
    watch.stop.requested (returns next_step) or when the run diverged (returns diverged).
    loop.augment: utils.ingredients' BatchAugment (random erasing, mixup/cutmix) on the device
    batch, or None; loop.criterion then takes its soft targets, while top-1/top-5 count against
    the hard ones.

    --accum-steps N: each step runs N micro-batches (forward + backward of loss / N, under
    micro_batch_context so DDP all-reduces only the last), then one Precision.step: one unscale,
    one overflow check and skip, one clip, one loss-scale update, as for one batch of N x b.

    batches: the epoch's batches if already started (Data.start_epoch), else iter(data.train)
    here; closed when the epoch ends, so no decode thread outlives it. carried: a mid-epoch
    checkpoint's record of its epoch until first_step (EpochResult.so_far); the epoch's figures
    (log averages, summary.csv row) then cover the whole epoch, not only the steps after it."""
    model, optimizer, precision, accelerator = state.model, state.optimizer, state.precision, state.accelerator
    watch = watch or Watch()
    log, progress, phases, stop, on_step = watch.log, watch.progress, watch.phases, watch.stop, watch.on_step
    criterion, augment, accum = loop.criterion, loop.augment, loop.accum_steps
    model.train()
    steps = loop.steps_per_epoch(len(data.train))
    world = accelerator.num_processes
    global_batch = loop.batch_size * world * accum
    meter = DeviceMeter(accelerator.device, data.num_classes)
    clock = EpochClock(carried["seconds"] if carried else 0.0, first_step if carried else 0)
    if carried:  # the steps run before the checkpoint count in this epoch's figures
        meter.total[:4] = carried["sums"]
    next_step, diverged, lr = None, None, None
    batches = TakeAhead(iter(data.train) if batches is None else batches)
    run_ahead = RunAhead(accelerator.device)
    progress.begin((steps - first_step) * global_batch, f"Epoch {epoch}")  # a bar on a terminal
    step = first_step - 1
    for step in range(first_step, steps):
        phases.begin_step(step)
        seed_rngs(step_seed(loop.seed, epoch, step, accelerator.process_index))
        lr = learning_rate(loop.schedule, epoch, step, steps, global_batch)
        set_learning_rate(optimizer, lr)
        batch = ()
        for micro in range(accum):
            with phases.range("prefetcher.next()"):  # Apex's NVTX range names, kept for nsys users
                batch = next_batch_or_stop(batches, stop, world)
            if batch is None:  # a loader worker died (WorkerLost): stop before this step, as for a signal
                break
            images, target = batch
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
        if batch is None:
            next_step = step
            break
        with phases.range("optimizer.step()"):
            precision.step(optimizer)
            precision.update_ema(model)
            precision.zero_grad(model, optimizer)
        run_ahead.step_queued()
        progress.advance(global_batch)
        clock.steps += 1
        last = step + 1 == steps
        stopping = world == 1 and stop.requested  # one process: a host bool, checked every step
        if (step + 1) % loop.print_freq == 0 or last or stopping:
            if not (last or stopping):
                batches.take_ahead()  # before the sync below (TakeAhead)
            interval, total = meter.read(accelerator, stop.signum)
            step_time, avg_time = clock.lap()
            log(f"Epoch: [{epoch}][{step + 1}/{steps}]\t"
                f"Time {step_time:.3f} ({avg_time:.3f})\t"
                f"Speed {global_batch / step_time:.3f} ({global_batch / avg_time:.3f})\t"
                + figures_text(interval, total) + scale_fields(precision)[0])
            # Both verdicts are the same on every process (one all-reduce; counters of all-reduced
            # grads), so every process leaves the loop at this same step.
            diverged = precision.divergence(loop.max_nonfinite_steps)
            if diverged:
                break
            if interval["stop"]:
                stop.adopt(interval["signal"])  # the signal may have reached another process only
                next_step = step + 1
                break
        if on_step is not None and not last:  # the epoch's own checkpoint follows its last step
            on_step(epoch, step + 1, lambda: {"sums": meter.so_far(accelerator), "seconds": clock.seconds()})
        if phases.end_step(step):
            break
    progress.end()
    close_batches(batches)  # an epoch cut short (--steps-per-epoch, a stop) leaves them unfinished
    seconds = clock.seconds()
    _, total = meter.read(accelerator)
    _, skipped, scale = scale_fields(precision)
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


TTA_MODES = ("none", "flip")  # --tta's choices


@torch.no_grad()
def validate(model, data, precision, accelerator, *, print_freq, criterion=None, watch=None, label="",
             tta="none", on_logits=None):
    """Top-1/top-5/loss over the whole val split, every image counted once across processes.
    criterion: the loss reported (cross-entropy on the hard labels unless given); watch: its log
    and progress bar are used; label: a word for the summary line (" * EMA Prec@1 ..." for the
    --model-ema weights).

    tta "flip" (--tta) also scores each batch mirrored (the width axis) and counts top-1/top-5 of
    the mean of the two logits, in fp32: one more line after the plain one, " * TTA flip Prec@1 ..."
    (" * EMA TTA flip ..." with label), and EpochResult.tta_top1/tta_top5. The loss, the progress
    lines and the plain line stay those of the un-flipped logits. on_logits(logits, target), if
    given, sees every batch's scored logits in loader order: the TTA mean under "flip", else the
    plain ones (eval.py --predictions).

    The model is used unwrapped (no DDP collectives), because processes may hold one batch more
    or less than each other. Progress lines show this process's running figures; the final line
    is reduced over all processes.
    """
    if tta not in TTA_MODES:  # eval.py takes a checkpoint's stored --tta as it is: argparse checks no defaults
        raise UsageError(f"--tta {tta!r}: not a test-time augmentation ({', '.join(TTA_MODES)}); give --tta none "
                         "or --tta flip")
    watch = watch or Watch()
    log, progress = watch.log, watch.progress
    criterion = criterion or torch.nn.CrossEntropyLoss().to(accelerator.device)
    model = eval_module(model)  # no DDP wrapper; compiled on its own if training is
    share_buffers_from_main(model, accelerator)
    model.eval()
    meter = DeviceMeter(accelerator.device, data.num_classes)
    tta_meter = DeviceMeter(accelerator.device, data.num_classes) if tta == "flip" else None
    steps = len(data.val)
    start = time.perf_counter()
    progress.begin(steps, "Test", unit="batch")
    run_ahead = RunAhead(accelerator.device)
    batches = data.val_batches()  # the iterator Data.start_epoch started, if it did
    for step, (images, target) in enumerate(batches):
        with precision.autocast():
            output = model(images)
            loss = criterion(output, target)
            mirrored = model(images.flip(3)) if tta_meter is not None else None  # flip keeps the strides
        meter.update(loss, output, target)
        scored = output
        if mirrored is not None:
            scored = (output.float() + mirrored.float()) / 2  # fp32: two fp16 logits' sum can overflow
            tta_meter.update(loss, scored, target)  # its loss is never read: the plain one is reported
        if on_logits is not None:
            on_logits(scored, target)
        run_ahead.step_queued()
        progress.advance()
        if (step + 1) % print_freq == 0 and step + 1 < steps:
            running = averages(meter.sums.tolist())  # this process only: no collective here
            elapsed = time.perf_counter() - start
            log(f"Test: [{step + 1}/{steps}]\tTime {elapsed / (step + 1):.3f}\t"
                f"Speed {running['count'] * accelerator.num_processes / elapsed:.3f}\t"
                f"Loss {running['loss']:.4f}\tPrec@1 {running['top1']:.3f}\tPrec@5 {running['top5']:.3f}")
    progress.end()
    _, total = meter.read(accelerator)
    _, tta_total = tta_meter.read(accelerator) if tta_meter is not None else (None, None)
    seconds = time.perf_counter() - start
    prefix = f" * {label + ' ' if label else ''}"
    log(f"{prefix}Prec@1 {total['top1']:.3f} Prec@5 {total['top5']:.3f}")  # first: Apex's log readers parse it
    if tta_total is not None:
        log(f"{prefix}TTA {tta} Prec@1 {tta_total['top1']:.3f} Prec@5 {tta_total['top5']:.3f}")
    return EpochResult(total["loss"], total["top1"], total["top5"], total["count"], seconds,
                       total["count"] / max(seconds, 1e-9),
                       tta_top1=tta_total["top1"] if tta_total else None,
                       tta_top5=tta_total["top5"] if tta_total else None)


def diverged_message(reason, epoch, step, steps, lr, last_good):
    """Diverged's one line: where, at what LR, why, and what is left to resume from."""
    what_now = (f"the last good checkpoint is {last_good} (it was left as it was); resume from it"
                if last_good else "no checkpoint was written yet; start again")
    lr_text = f"lr {lr:g}" if lr is not None else "lr unknown"
    return (f"training diverged at epoch {epoch}, step {step}/{steps} ({lr_text}): {reason}; {what_now} "
            "with a lower --lr (or, at fp16, try bf16 or O0)")
