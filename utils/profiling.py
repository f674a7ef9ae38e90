"""Step hooks for the training loop, and the phase table and benchmark rows profile.py prints.

utils/engine.py train_one_epoch calls begin_step(step), wraps each phase of a step in
range(name) and stops when end_step(step) returns True. The hooks:

- NoPhases: does nothing; the default, so a normal run has no extra host syncs.
- NvtxWindow: Apex's --prof N. NVTX ranges on every step, cudaProfilerStart at step N,
  cudaProfilerStop after the window, then end_step says stop.
- PhaseProfiler: NvtxWindow plus what profile.py reports: per-phase times over the window
  (CUDA events on the GPU stream, the wall clock without CUDA), record_function ranges so the
  names show in a torch.profiler trace (on the CPU too), and that optional trace itself.
"""
import contextlib
import errno
import gc
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from utils.run.files import atomic_export

STEP_RANGE = "Body of iteration {}"
DATA_RANGE = "prefetcher.next()"   # the engine's names for its ranges (Apex's NVTX names)
WAIT_RANGE = "data wait"           # nested in DATA_RANGE by time_data_wait
TABLE_LABELS = {"forward": "forward", "backward": "backward",
                "optimizer.step()": "optimizer step"}
SUM_TOLERANCE = 0.10               # phases must add up to the measured step time within this


class NoPhases:
    """The loop's default: every hook does nothing."""

    finished = False

    def begin_step(self, step):
        pass

    def range(self, name):
        return contextlib.nullcontext()

    def end_step(self, step):
        """True when the loop should stop after this step."""
        return False


class NvtxWindow(NoPhases):
    """Apex --prof N: NVTX ranges per step and phase, cudaProfilerStart at step N, stop at N+length.

    Steps are counted here, across epochs (the loop's own step restarts every epoch, and a short
    epoch must not hide the window). end_step returns True, and finished turns True, once the
    window's last step is done, so the loop ends cleanly. nvtx=False (the default without CUDA)
    skips the NVTX ranges and the profiler calls; the window still ends the run.
    """

    def __init__(self, start_step, length=10, nvtx=None):
        self.start_step = start_step
        self.stop_step = start_step + length
        self.nvtx = torch.cuda.is_available() if nvtx is None else nvtx
        self.iteration = 0
        self.finished = False

    def in_window(self):
        return self.start_step <= self.iteration < self.stop_step

    def begin_step(self, step):
        if not self.nvtx:
            return
        if self.iteration == self.start_step:
            torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(STEP_RANGE.format(self.iteration))

    @contextlib.contextmanager
    def range(self, name):
        if not self.nvtx:
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()

    def end_step(self, step):
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self.iteration += 1
        if self.iteration == self.stop_step:
            if self.nvtx:
                torch.cuda.synchronize()  # the window's kernels finish inside the capture
                torch.cuda.cudart().cudaProfilerStop()
            self.finished = True
        return self.finished


class WallClock:
    """Host timestamps: what a step costs when the host does the work (no CUDA)."""

    name = "wall clock on the host"

    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, end):
        return (end - start) * 1e3

    def sync(self):
        pass


class CudaEventClock:
    """CUDA events on the current stream: the GPU's timeline, read once after the window.

    Consecutive events split that timeline into pieces that add up exactly; a phase the host
    spends waiting (for data, say) shows up as the GPU idling between its events.
    """

    name = "CUDA events on the GPU stream"

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end):
        return start.elapsed_time(end)

    def sync(self):
        torch.cuda.synchronize()


@dataclass
class PhaseTimes:
    """Mean milliseconds per step over the window, per phase (table order, 'other' last)."""
    phases: list            # [(label, ms)]
    step_ms: float          # measured independently: window wall clock / steps
    steps: int
    first_step: int
    clock: str
    data_waits: list = field(default_factory=list)  # ms each window step waited for its batch (clock)
    host_waits: list = field(default_factory=list)  # wall ms the host spent taking each step's batch
    gc_pauses: list = field(default_factory=list)   # (generation, wall ms) of each collection in the window

    @property
    def phase_sum_ms(self):
        return sum(ms for _, ms in self.phases)

    def mismatch(self):
        """Relative gap between the phases' sum and the measured step time."""
        return abs(self.phase_sum_ms - self.step_ms) / max(self.step_ms, 1e-9)


def export_trace(trace, path):
    """trace's Chrome JSON written atomically to path (utils.run.files.atomic_export): a failed
    write is one line and exit 4, and an earlier file at path stays as it was. Kineto only logs a
    failed write (leaving its own NAME.tmp), so the file's end is checked (a .gz is gzipped by
    torch's Python, which raises), and the temp file's name it records as traceName becomes path's."""
    def export(tmp):
        trace.export_chrome_trace(tmp)
        if os.path.lexists(tmp + ".tmp"):  # kineto writes NAME.tmp, renamed to NAME only when whole
            os.remove(tmp + ".tmp")
            raise OSError(errno.EIO, "torch.profiler wrote only part of the trace (a full disk or a file "
                                     "size limit)")
        if path.endswith(".gz"):
            return
        with open(tmp, "rb+") as handle:
            start = max(0, handle.seek(0, os.SEEK_END) - len(tmp.encode()) - 64)
            handle.seek(start)
            tail = handle.read()
            if b'"traceName"' not in tail or not tail.rstrip().endswith(b"}"):
                raise OSError(errno.EIO, "torch.profiler wrote only part of the trace (a full disk or a file "
                                         "size limit)")
            handle.seek(start)
            handle.write(tail.replace(tmp.encode(), path.encode()))
            handle.truncate()
    atomic_export(path, export)


class PhaseProfiler(NvtxWindow):
    """profile.py's hook: the NVTX window, per-phase timing over it, an optional trace.

    Timing only runs inside the window: one sync when it opens (so earlier queued work is not
    billed to it) and one when it closes (to read the events). Outside the window the only cost
    is the NVTX and record_function ranges.
    """

    def __init__(self, start_step, length=10, nvtx=None, clock=None, trace_path=None):
        super().__init__(start_step, length, nvtx)
        self.clock = clock or (CudaEventClock() if torch.cuda.is_available() else WallClock())
        self.trace_path = trace_path
        self.trace = None
        self.step_marks = []      # clock marks: each window step's start, then the window's end
        self.records = []         # (name, depth, start mark, end mark, host ms, step) of the window's ranges
        self.depth = 0
        self.step_function = None
        self.wall_start = self.wall_end = 0.0   # perf_counter at the synced ends of the window
        self.times = None
        self.gc_pauses = []       # (generation, ms) of Python's collections inside the window
        self._gc_started = None

    def _time_gc(self, phase, info):
        # gc.callbacks: a collection holds the GIL from start to stop, so pairs never interleave
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_pauses.append((info["generation"], (time.perf_counter() - self._gc_started) * 1e3))
            self._gc_started = None

    def begin_step(self, step):
        super().begin_step(step)  # first, so cudaProfilerStart's own cost stays out of the timing
        if self.iteration == self.start_step:
            self._open_window()
        self.step_function = torch.profiler.record_function(STEP_RANGE.format(self.iteration))
        self.step_function.__enter__()
        if self.in_window():
            self.step_marks.append(self.clock.mark())

    @contextlib.contextmanager
    def range(self, name):
        timed, depth = self.in_window(), self.depth
        self.depth += 1  # nested ranges (data wait) are split out of their parent, not added to it
        try:
            with super().range(name), torch.profiler.record_function(name):
                start, host_start = (self.clock.mark(), time.perf_counter()) if timed else (None, None)
                yield
                if timed:
                    self.records.append((name, depth, start, self.clock.mark(),
                                         (time.perf_counter() - host_start) * 1e3, self.iteration))
        finally:
            self.depth -= 1

    def end_step(self, step):
        last = self.iteration + 1 == self.stop_step
        if last:
            self.step_marks.append(self.clock.mark())
        self.step_function.__exit__(None, None, None)
        if last:
            self.clock.sync()
            self.wall_end = time.perf_counter()  # before cudaProfilerStop, whose cost is not a step's
        finished = super().end_step(step)
        if last:
            self._close_window()
        return finished

    def _open_window(self):
        self.clock.sync()
        if self.trace_path:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.trace = torch.profiler.profile(activities=activities)
            self.trace.start()
        gc.callbacks.append(self._time_gc)
        self.wall_start = time.perf_counter()

    def stop_timing_gc(self):
        """Unhook from gc.callbacks: at the window's end, or when a run dies inside the window."""
        if self._time_gc in gc.callbacks:
            gc.callbacks.remove(self._time_gc)

    def _close_window(self):
        self.stop_timing_gc()
        self.times = self._summarise()
        if self.trace is not None:
            self.trace.stop()
            export_trace(self.trace, self.trace_path)
            self.trace = None

    def _summarise(self):
        """Mean ms per phase over the window; 'other' is what the named ranges leave of a step."""
        steps = len(self.step_marks) - 1
        elapsed = self.clock.elapsed_ms
        span = elapsed(self.step_marks[0], self.step_marks[-1])
        top, nested = {}, {}
        waits = {DATA_RANGE: [0.0] * steps, WAIT_RANGE: [0.0] * steps}  # per window step
        host_waits = [0.0] * steps  # the whole data range's host time: taking a batch, whatever it includes
        for name, depth, start, end, host_ms, step in self.records:
            if name == WAIT_RANGE and depth == 0:
                # A batch taken ahead of a print step's sync (utils/engine.py TakeAhead), outside
                # the data range: host time of that step's 'other', while the GPU runs queued steps.
                continue
            totals = top if depth == 0 else nested
            ms = elapsed(start, end)
            totals[name] = totals.get(name, 0.0) + ms
            if name in waits:
                waits[name][step - self.start_step] += ms
            if name == DATA_RANGE:
                host_waits[step - self.start_step] += host_ms
        phases = []
        for name, total in top.items():
            if name == DATA_RANGE:
                phases.extend(_split_data(total, nested.get(WAIT_RANGE)))
            else:
                phases.append((TABLE_LABELS.get(name, name), total))
        phases.append(("other", span - sum(top.values())))
        step_ms = (self.wall_end - self.wall_start) * 1e3 / steps
        return PhaseTimes([(label, ms / steps) for label, ms in phases], step_ms, steps,
                          self.start_step, self.clock.name,
                          data_waits=(waits[WAIT_RANGE] if WAIT_RANGE in nested
                                      else waits[DATA_RANGE] if DATA_RANGE in top else []),
                          host_waits=host_waits if DATA_RANGE in top else [],
                          gc_pauses=list(self.gc_pauses))


def _split_data(data_ms, wait_ms):
    """The data range as 'data wait' (for the host batch) and 'host-to-device' (the rest).

    Without a nested wait range (data made on the device: no loader, no copy) all of it is wait.
    """
    if wait_ms is None:
        return [("data wait", data_ms), ("host-to-device", 0.0)]
    return [("data wait", wait_ms), ("host-to-device", data_ms - wait_ms)]


class TimedLoader:
    """A DataLoader whose every next() (and the start of each pass) runs in a 'data wait' range."""

    def __init__(self, loader, phases):
        self.loader = loader
        self.phases = phases

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        batches, done = None, object()
        while True:
            with self.phases.range(WAIT_RANGE):
                if batches is None:
                    batches = iter(self.loader)  # worker start-up is waiting for data too
                batch = next(batches, done)
            if batch is done:
                return
            yield batch


def time_data_wait(train, phases):
    """Split the loop's data phase into the wait for a host batch and the host-to-device step.

    utils/data/batches.py DevicePrefetcher takes a host batch from its DataLoader and copies it to the
    device inside one next(), which the loop times as a whole. Wrapping the DataLoader it holds
    (its .loader) gives the wait a nested range of its own, so profiling needs no hook in the data
    code and a normal run pays nothing. Returns False for sources with no host loader (synthetic
    data is made on the device) and for the gpu backend's GpuBatches when threads read its loader
    (utils/data/gpu/pipeline.py): ranges opened there would land in another thread's timing; the whole
    next() is then the wait for a decoded batch (host-to-device 0).
    """
    loader = getattr(train, "loader", None)
    if loader is None or getattr(train, "threads", 0):
        return False
    train.loader = TimedLoader(loader, phases)
    return True


def cuda_parts_skipped():
    """What a run without CUDA cannot do, in words; empty with CUDA."""
    if torch.cuda.is_available():
        return ""
    return "NVTX ranges, cudaProfilerStart/Stop, CUDA-event timing and GPU memory figures"


def format_phase_table(times, images_per_step, peak_bytes, recipe_line, skipped=""):
    """The table profile.py prints at the end, as one string."""
    step = times.step_ms
    lines = [f"=> phases over steps {times.first_step}-{times.first_step + times.steps - 1} "
             f"({times.steps} steps), mean per step, timed with {times.clock}",
             f"{'phase':<18}{'mean ms':>10}{'share':>9}"]
    for label, ms in times.phases:
        lines.append(f"{label:<18}{ms:>10.3f}{100.0 * ms / step:>8.1f}%")
    lines.append(f"{'sum of phases':<18}{times.phase_sum_ms:>10.3f}{100.0 * times.phase_sum_ms / step:>8.1f}%")
    lines.append(f"{'measured step':<18}{step:>10.3f}{100.0:>8.1f}%   (wall clock over the window)")
    if times.mismatch() > SUM_TOLERANCE:
        lines.append(f"warning: the phases add up to {times.phase_sum_ms:.3f} ms, "
                     f"{100 * times.mismatch():.0f}% off the measured step")
    lines.append(f"throughput: {images_per_step * 1e3 / step:.1f} img/s (steady state, "
                 f"{images_per_step} images a step)")
    lines.extend(format_waits_and_gc(times))
    lines.append(f"peak GPU memory: {format_gib(peak_bytes)}")
    lines.append(recipe_line)
    if skipped:
        lines.append(f"skipped without CUDA: {skipped}")
    return "\n".join(lines)


def format_waits_and_gc(times, long_ms=1.0, listed=12):
    """Lines under the table: is the mean data wait a little every step or a few long stalls (and
    which steps: a stall every -j steps points at the loader workers), how long the host itself
    was held taking the batch (on a GPU the loop runs steps ahead, so the GPU idles only when
    the host is held longer than the work it queued, or when the batch's own GPU work is not
    done), and did Python's garbage collector pause the process (it holds the GIL: the loop and
    the input threads stop) inside the window."""
    lines = []
    waits = times.data_waits
    if waits:
        lines.append("data wait per step: " + _distribution(waits, times.first_step, long_ms, "waited", listed))
    if times.host_waits and times.clock != WallClock.name:  # on the wall clock the line above is the same
        lines.append("host taking the batch per step: "
                     + _distribution(times.host_waits, times.first_step, long_ms, "took", listed))
    pauses = times.gc_pauses
    if pauses:
        counts = {generation: sum(g == generation for g, _ in pauses) for generation in (0, 1, 2)}
        generation, longest = max(pauses, key=lambda pause: pause[1])
        lines.append(f"Python garbage collection in the window: {len(pauses)} collection(s) (gen0 {counts[0]}, "
                     f"gen1 {counts[1]}, gen2 {counts[2]}), {sum(ms for _, ms in pauses):.1f} ms in all "
                     f"(wall clock, GIL held), longest {longest:.1f} ms (gen{generation})")
    else:
        lines.append("Python garbage collection in the window: none")
    return lines


def _distribution(values, first_step, long_ms, verb, listed):
    """'median M ms, longest L ms (step S); K of N steps <verb> over T ms: steps ...' (the first
    `listed` of them)."""
    longest = max(range(len(values)), key=values.__getitem__)
    slow = [first_step + k for k, ms in enumerate(values) if ms > long_ms]
    text = (f"median {statistics.median(values):.3f} ms, longest {values[longest]:.3f} ms (step "
            f"{first_step + longest}); {len(slow)} of {len(values)} steps {verb} over {long_ms:g} ms")
    if slow:
        text += ": step" + ("s " if len(slow) > 1 else " ") + " ".join(map(str, slow[:listed]))
        text += " ..." if len(slow) > listed else ""
    return text


def format_gib(peak_bytes):
    return "n/a (no CUDA)" if peak_bytes is None else f"{peak_bytes / 2 ** 30:.2f} GiB"
