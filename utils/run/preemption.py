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

from utils.run.errors import EXIT_SIGINT, EXIT_SIGTERM

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

    def adopt(self, signum):
        """Stop for the signal another process got (the all-reduce said so), if none came here."""
        if self.signum is None and signum is not None:
            self.signum, self.first_at = signum, time.monotonic()

    def agreed(self, accelerator):
        """Whether any process was asked to stop (adopting its signal): one tiny all-reduce (call
        it on every rank at the same point; train.py does once an epoch, after the checkpoint)."""
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([1.0, float(self.signum)] if self.requested else [0.0, 0.0], device=accelerator.device)
        count, total = accelerator.reduce(flag, reduction="sum").tolist()
        self.adopt(agreed_signal(count, total))
        return bool(count)


def agreed_signal(count, total):
    """The signal `count` processes were stopped by, from the sum of their signal numbers: theirs
    if they all got the same one, else SIGTERM (a scheduler's, which outranks a Ctrl-C)."""
    if not count:
        return None
    signum = total / count
    return int(signum) if signum in (signal.SIGINT, signal.SIGTERM) else int(signal.SIGTERM)


class NoStop:
    """The stop request of loops that never stop early (profile.py)."""
    requested = False
    signum = None

    def adopt(self, signum):
        pass


def ignore_stop_signals_in_worker(worker_id):
    """DataLoader worker_init_fn: stopping is the main process's job. A worker outlives the stop
    signals that reach every process of a run, yet still ends when its main process ends it.

    Ctrl-C (SIGINT) reaches every process of the terminal's process group: ignored here. Slurm
    (time limit, preemption, scancel) sends SIGTERM to every process of the job step, workers
    included; a worker it ended would make the main process fail ("DataLoader worker exited
    unexpectedly") before it could save. But SIGTERM is also how the DataLoader and
    multiprocessing end a worker at shutdown, and after a crash multiprocessing's exit hook sends
    it once and then waits for the worker with no time limit: a worker that swallowed that one
    would hang the exit. So the sender decides (a waiting thread reads it; a Python handler cannot):
      - from the main process: exit 0 at once, as torch's own worker handler does (an exit code
        0, so the main process's SIGCHLD check reports no "killed worker" while it exits);
      - the first from anyone else: swallowed. The main process got the same signal; it stops at
        a step boundary and shuts the loader down as usual;
      - a second from anyone else (a user insisting): the default, the worker dies of it.
    A worker whose main process dies without a word (SIGKILL) exits by itself: torch's worker
    loop watches its parent. Where signal.sigwaitinfo is missing (macOS, Windows) SIGTERM keeps
    torch's handling: see docs/troubleshooting.md for sending it to the training processes only.
    A program a worker runs inherits the blocked SIGTERM (a signal mask survives exec); a
    dataset that starts one should unblock it there (signal.pthread_sigmask in preexec_fn).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):
        return
    # The default action for the second signal (torch set a handler of its own before this).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # SIGTERM waits, pending, for the thread below: blocked here and in every thread started from
    # here on (they inherit the mask). One that does not block it gets the default: no worse.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    import multiprocessing
    import threading
    # The process that started this worker: its parent under fork, not under forkserver (the
    # default from Python 3.14), where the parent is the fork server; multiprocessing knows both.
    main = multiprocessing.parent_process()
    threading.Thread(target=_sigterm_by_sender, args=(main.pid if main else os.getppid(),), daemon=True,
                     name="sigterm-by-sender").start()


def _sigterm_by_sender(main_pid):
    """The worker's SIGTERM rules (ignore_stop_signals_in_worker), in a thread of its own."""
    swallowed = False
    while True:
        sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
        if sender == main_pid:
            os._exit(0)
        if swallowed:
            break
        swallowed = True
    # Unblocked in this thread alone, the signal lands here, and the default action ends the
    # whole process: its exit status says "killed by SIGTERM", as before this function.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)


def canonical_flag(token, option_strings):
    """The option a typed long flag means: itself, or the one option it abbreviates (argparse
    takes any unambiguous prefix: --overwr is --overwrite); the token itself otherwise."""
    name = token.split("=", 1)[0]
    if not name.startswith("--") or name in option_strings:
        return name
    longer = [option for option in option_strings if option.startswith(name)]
    return longer[0] if len(longer) == 1 else name


def resume_command(path, argv=None, launcher=None, output_dir=None, option_strings=()):
    """The command line that resumes from path: this run's own, with --resume path in place of
    any --resume it had, --output-dir output_dir (where this run wrote, which a --resume DIR may
    have chosen) in place of any it had, and without --overwrite (which would remove the run
    being resumed). option_strings: the parser's, so that abbreviated flags are recognised."""
    import shlex
    import sys

    argv = list(sys.argv if argv is None else argv)
    replaced = {"--resume", "--output-dir"} if output_dir is not None else {"--resume"}
    script, flags, kept = argv[0], argv[1:], []
    skip = False
    for flag in flags:
        if skip:
            skip = False
            continue
        name = canonical_flag(flag, option_strings)
        if name in replaced:
            skip = "=" not in flag  # the value is the next word unless given as --flag=value
            continue
        if name == "--overwrite":
            continue
        kept.append(flag)
    prefix = launcher or "python"
    where = ["--output-dir", shlex.quote(output_dir)] if output_dir is not None else []
    return " ".join([prefix, shlex.quote(script), *map(shlex.quote, kept), *where, "--resume", shlex.quote(path)])


def stopped_line(stop, path, epoch, next_step, steps, num_processes=1, output_dir=None, option_strings=()):
    """The one line a run stopped by a signal prints: what was saved where, and how to resume."""
    where = (f"epoch {epoch}, step {next_step}/{steps}" if next_step else f"the start of epoch {epoch}")
    launcher = "python" if num_processes == 1 else "<your launcher, e.g. torchrun or accelerate launch>"
    return (f"=> stopped by {stop.name}: saved {path} at {where}; resume with: "
            f"{resume_command(path, launcher=launcher, output_dir=output_dir, option_strings=option_strings)}")
