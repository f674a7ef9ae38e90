"""Stop on SIGTERM/SIGINT at a step boundary, so a preempted run can be resumed where it stopped.

SIGTERM is what Slurm, Kubernetes and cloud preemption send; SIGINT is Ctrl-C. The handler only
sets a flag (and writes one line with os.write, which is safe inside a signal handler where
print is not); the training loop (utils/engine.py) reads the flag after each finished step:
  - one process: every step, a host bool, free;
  - several processes: every rank must stop at the same step, so the flags are summed across
    processes in the all-reduce the loop already does every --print-freq steps (DeviceMeter.read):
    no extra collective, and a stop lands on the next print boundary. torchrun / accelerate
    launch forward SIGTERM to every rank and SIGKILL them 30 s later, so keep
    --print-freq x step time well under that (the default 10 steps is).
Then train.py writes a mid-epoch checkpoint, prints where it is and how to resume, and exits
with 130 (SIGINT) or 143 (SIGTERM). A second signal more than DUPLICATE_SECONDS after the first
stops at once, without a checkpoint (the files already written stay intact: every write is atomic).
"""
import os
import signal
import time

import torch

from .errors import EXIT_SIGINT, EXIT_SIGTERM

SIGNALS = {signal.SIGINT: ("SIGINT", EXIT_SIGINT), signal.SIGTERM: ("SIGTERM", EXIT_SIGTERM)}
# Ctrl-C in a terminal reaches torchrun and its children together, and torchrun then forwards the
# signal to them again: a repeat this soon is the same request, not a user insisting.
DUPLICATE_SECONDS = 2.0


class StopOnSignal:
    """SIGTERM/SIGINT handlers that only ask the loop to stop; `with stop.installed():`."""

    def __init__(self, announce=True):
        self.signum = None
        self.first_at = None
        self.announce = announce  # the main process says what happens; the other ranks stay quiet
        self._previous = {}

    @property
    def requested(self):
        return self.signum is not None

    @property
    def name(self):
        return SIGNALS[self.signum][0] if self.requested else None

    @property
    def exit_code(self):
        return SIGNALS[self.signum][1] if self.requested else 0

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            self._say(f"received {SIGNALS[signum][0]}: finishing the current step, then saving a "
                      "checkpoint to resume from (a second signal stops at once, without one)")
        elif now - self.first_at > DUPLICATE_SECONDS:
            self._say(f"received {SIGNALS[signum][0]} again: stopping now, without a checkpoint")
            raise SystemExit(SIGNALS[signum][1])  # runs finally blocks: temp files are removed

    def _say(self, text):
        if self.announce:
            os.write(2, (text + "\n").encode())

    def install(self):
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def installed(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.install()
            try:
                yield self
            finally:
                self.restore()
        return scope()

    def agreed(self, accelerator):
        """Whether any process was asked to stop: one tiny all-reduce (call it on every rank at
        the same point; train.py does once an epoch, after the checkpoint)."""
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())


class NoStop:
    """The stop request of loops that never stop early (profile.py)."""
    requested = False


def ignore_stop_signals_in_worker(worker_id):
    """DataLoader worker_init_fn: Ctrl-C is the main process's to handle.

    Ctrl-C reaches every process of the terminal's process group, loader workers included; a
    worker it ended would make the main process fail ("DataLoader worker exited unexpectedly")
    before it could save. SIGTERM keeps its default: the DataLoader and multiprocessing end
    workers with it at shutdown (a worker ignoring it hangs the exit of a failing main process),
    so a SIGTERM sent to every process of a job (Slurm does) can still end a worker first: see
    docs/troubleshooting.md for sending it to the training processes only.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def resume_command(path, argv=None, launcher=None):
    """The command line that resumes from path: this run's own, with --resume path in place of
    any --resume it had, and without --overwrite (which would remove the run being resumed)."""
    import shlex
    import sys

    argv = list(sys.argv if argv is None else argv)
    script, flags, kept = argv[0], argv[1:], []
    skip = False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag == "--resume":
            skip = True
            continue
        if flag.startswith("--resume=") or flag == "--overwrite":
            continue
        kept.append(flag)
    prefix = launcher or "python"
    return " ".join([prefix, shlex.quote(script), *map(shlex.quote, kept), "--resume", shlex.quote(path)])


def stopped_line(stop, path, epoch, next_step, steps, num_processes=1):
    """The one line a run stopped by a signal prints: what was saved where, and how to resume."""
    where = (f"epoch {epoch}, step {next_step}/{steps}" if next_step else f"the start of epoch {epoch}")
    launcher = "python" if num_processes == 1 else "<your launcher, e.g. torchrun or accelerate launch>"
    return (f"=> stopped by {stop.name}: saved {path} at {where}; resume with: "
            f"{resume_command(path, launcher=launcher)}")
