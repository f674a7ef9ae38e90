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
with 130 (SIGINT) or 143 (SIGTERM).

Schedulers signal every process of the job, more than once: Slurm sends SIGTERM to each process
of the step (at a --signal time, then at the time limit), torchrun forwards the one it gets, a
launcher may repeat it. So a repeated SIGTERM never costs the checkpoint: the handler counts it
and the run goes on to the step boundary and the save (what ends a run for good is the SIGKILL
that follows a grace period, which nothing can catch). Only a person insists: a second signal
more than DUPLICATE_SECONDS after the first, where either is a SIGINT (Ctrl-C), stops at once,
without a checkpoint (the files already written stay intact: every write is atomic). Once the
run has stopped, further SIGTERM/SIGINT are ignored while it exits (restore), so a late repeat
cannot turn exit 143 into "killed by SIGTERM". Loader workers leave stopping to their main
process (ignore_stop_signals_in_worker); a worker that is gone all the same (SIGKILL, the
out-of-memory killer) reaches the loop as a WorkerLost at the next batch, never as an error
raised in the middle of a save (quiet_worker_deaths), and the loop stops there like a signal.
"""
import os
import re
import signal
import time

import torch

from utils.run.errors import EXIT_CRASH, EXIT_SIGINT, EXIT_SIGTERM, WorkerLost

SIGNALS = {signal.SIGINT: ("SIGINT", EXIT_SIGINT), signal.SIGTERM: ("SIGTERM", EXIT_SIGTERM)}
# Ctrl-C in a terminal reaches torchrun and its children together, and torchrun then forwards the
# signal to them again: a repeat this soon is the same request, not a user insisting.
DUPLICATE_SECONDS = 2.0


class StopOnSignal:
    """SIGTERM/SIGINT handlers that only ask the loop to stop; `with stop.installed():`."""

    def __init__(self, announce=True):
        self.signum = None
        self.first_at = None
        self.repeats = 0     # signals after the first: counted, never fatal unless a person insists
        self.lost = None     # a WorkerLost that stopped the loop (lose), with or without a signal
        self.announce = announce  # the main process says what happens; the other ranks stay quiet
        self._previous = {}

    @property
    def requested(self):
        return self.signum is not None or self.lost is not None

    @property
    def name(self):
        return SIGNALS[self.signum][0] if self.signum is not None else None

    @property
    def exit_code(self):
        if self.signum is not None:
            return SIGNALS[self.signum][1]
        return EXIT_CRASH if self.lost is not None else 0

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            self._say(f"received {SIGNALS[signum][0]}: finishing the current step, then saving a "
                      "checkpoint to resume from (a repeated SIGTERM does not cancel it; a Ctrl-C "
                      f"more than {DUPLICATE_SECONDS:g} s later stops at once, without one)")
            return
        self.repeats += 1
        if now - self.first_at <= DUPLICATE_SECONDS:
            return  # the same request, delivered twice (the group's and a launcher's copy)
        if signal.SIGINT in (signum, self.signum):  # a person insisting
            self._say(f"received {SIGNALS[signum][0]} again: stopping now, without a checkpoint")
            raise SystemExit(SIGNALS[signum][1])  # runs finally blocks: temp files are removed
        if self.repeats == 1 or self.repeats % 10 == 0:  # a scheduler repeating itself: say so, not every time
            self._say(f"{SIGNALS[signum][0]} once more ({self.repeats + 1} in all): still saving the "
                      "checkpoint first")

    def lose(self, lost):
        """Stop at this step because a loader worker is gone (a WorkerLost): the checkpoint needs
        no loader. With a stop signal already here, that signal's name and code still hold."""
        self.lost = lost
        if self.signum is None:
            self._say(f"stopping: {lost}")

    def _say(self, text):
        if self.announce:
            os.write(2, (text + "\n").encode())

    def install(self):
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self):
        """The handlers from before install(); after a stop request, SIG_IGN instead: the run is
        leaving (its checkpoint written or being written), and a late repeat of the signal must
        neither interrupt the exit nor make its status "killed by SIGTERM" in place of 143."""
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if self.signum is not None else previous)
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
        flag = torch.tensor([1.0, float(self.signum)] if self.signum is not None else [0.0, 0.0],
                            device=accelerator.device)
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
    included, and often more than once (a --signal warning, then the time limit; a launcher
    repeating itself); a worker it ended would make the main process fail ("DataLoader worker
    exited unexpectedly") before it could save. But SIGTERM is also how the DataLoader and
    multiprocessing end a worker at shutdown, and after a crash multiprocessing's exit hook sends
    it once and then waits for the worker with no time limit: a worker that swallowed that one
    would hang the exit. So the sender decides (a waiting thread reads it; a Python handler cannot):
      - from the main process: exit 0 at once, as torch's own worker handler does (an exit code
        0, so the main process's SIGCHLD check reports no "killed worker" while it exits);
      - from anyone else, however often: swallowed. The main process got the same signal; it
        stops at a step boundary, saves, and shuts the loader down, which ends the workers.
        (Until issue 40 a second one was let through, "a user insisting"; but Slurm and
        launchers repeat SIGTERM, and that second one killed the worker and then the save.)
    A worker whose main process dies without a word (SIGKILL) exits by itself: torch's worker
    loop watches its parent. SIGKILL still ends a worker at once (nothing can catch it); the main
    process then stops with its checkpoint all the same (WorkerLost). Where signal.sigwaitinfo
    is missing (macOS, Windows) SIGTERM keeps torch's handling: see docs/troubleshooting.md for
    sending it to the training processes only.
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
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == main_pid:
            os._exit(0)


def quiet_worker_deaths():
    """Keep torch's SIGCHLD handler out of this process: a loader worker's death then reaches the
    training loop at its next batch, as WorkerLost (lost_workers_named), not anywhere at all.

    torch installs, at a DataLoader's first multi-process iteration, a SIGCHLD handler that
    raises "DataLoader worker (pid N) is killed by signal" in the main thread at whatever line it
    is running: in the middle of the checkpoint's save after a stop signal (issue 40: a traceback,
    exit 1, no checkpoint). Without it the loader still notices a dead worker itself, within its
    5 s status check, in the next() that waits for that worker's batch: between two steps, where
    the loop can stop and save. A private torch flag; if it is renamed nothing changes here
    (tests/test_signals_group.py checks that the handler stays out)."""
    from torch.utils.data._utils import signal_handling
    if getattr(signal_handling, "_SIGCHLD_handler_set", None) is False:
        signal_handling._SIGCHLD_handler_set = True  # "already set": torch never installs its own


def lost_workers_named(loader):
    """iter(loader), started now (a DataLoader's workers start or resume here), its batches then
    drawn lazily; a dead worker, met here or at any batch, raised as WorkerLost (one clear line,
    an exception the loop stops on) in place of torch's or multiprocessing's error."""
    try:
        batches = iter(loader)
    except LOADER_ERRORS as err:
        lost = _worker_lost(err)
        if lost is None:
            raise
        raise lost from None
    return _named(batches)


# What a dead worker looks like from the main process: torch's RuntimeError (its status check),
# or, for a batch the worker had queued just before it died, the connection that was to hand
# over the batch's shared memory, broken (multiprocessing's resource_sharer lives in the worker).
LOADER_ERRORS = (RuntimeError, ConnectionError, EOFError)


def _named(batches):
    try:
        yield from batches
    except LOADER_ERRORS as err:
        lost = _worker_lost(err)
        if lost is None:
            raise
        raise lost from None


def _worker_lost(err):
    """WorkerLost for an error that says a DataLoader worker is gone; None for any other (an
    error of the dataset's own, which torch re-raises in the main process as "Caught ...")."""
    text = str(err).strip()
    # (the pin-memory thread, on CUDA, dies of the broken hand-over in its place)
    if isinstance(err, RuntimeError) and re.match(r"DataLoader worker \(pid|Pin memory thread exited unexpectedly", text):
        what = text.rstrip(".")
    elif isinstance(err, (ConnectionError, EOFError)) and not text.startswith("Caught "):
        what = f"its batch could not be handed over: {type(err).__name__}: {text}"
    else:
        return None
    return WorkerLost(f"a data loader worker process died ({what}): killed from outside, or by the "
                      "kernel's out-of-memory killer when memory ran out (then lower --workers or --batch-size)")


def next_batch_or_stop(batches, stop, world):
    """next(batches), or None after a WorkerLost that one process stops on (stop.lose: the loop
    then saves the step before, as after a signal). In a run of several processes it ends this
    one instead (its line, exit 1), whose peers, mid-step, follow in their next collective; so
    does it where nothing can stop (profile.py's NoStop)."""
    try:
        return next(batches)
    except WorkerLost as lost:
        if world > 1 or not hasattr(stop, "lose"):
            raise
        stop.lose(lost)
        return None


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
    """The one line a run stopped by a signal (or a lost loader worker) prints: what was saved
    where, and how to resume."""
    where = (f"epoch {epoch}, step {next_step}/{steps}" if next_step else f"the start of epoch {epoch}")
    launcher = "python" if num_processes == 1 else "<your launcher, e.g. torchrun or accelerate launch>"
    why = f"by {stop.name}" if stop.name else "because a data loader worker process died"
    return (f"=> stopped {why}: saved {path} at {where}; resume with: "
            f"{resume_command(path, launcher=launcher, output_dir=output_dir, option_strings=option_strings)}")
