"""One exception for user mistakes, and the exit path that turns it into a clear message."""
import sys

# Exit codes, the same for every script (README "When things go wrong" lists them).
EXIT_OK = 0
EXIT_CRASH = 1          # an unexpected error: Python's own exit code for an uncaught exception
EXIT_USAGE = 2          # a UsageError or a bad command line (argparse's code)
EXIT_DIVERGED = 3       # training stopped: non-finite loss/grads/weights kept coming (a Diverged)
EXIT_WRITE_FAILED = 4   # could not write output (full disk, quota, I/O error): a WriteError
EXIT_SIGINT = 130       # stopped by SIGINT (Ctrl-C) after writing a resumable checkpoint (128 + 2)
EXIT_SIGTERM = 143      # stopped by SIGTERM (Slurm, Kubernetes, cloud preemption), the same (128 + 15)


class UsageError(Exception):
    """A mistake the user can fix: bad flag value, missing data, wrong checkpoint.

    The scripts catch it at the top, print one line and exit with code 2.
    """


class UnreadableInput(UsageError):
    """A file of the data that cannot be read. Unlike other usage errors, which every process of a
    run meets alike, only the process reading that file meets it, so that process prints it. A
    subclass, not a flag: a DataLoader worker's error reaches the main process as the same type."""


class Diverged(Exception):
    """Training produced non-finite numbers it could not skip past (utils/engine.py says which).

    The message names the epoch/step, the LR and the last good checkpoint; exit code 3. Every
    process raises it at the same step; only the main process (RANK 0) prints it.
    """


class WorkerLost(Exception):
    """A data loader worker process died (SIGKILL, the out-of-memory killer): one line, exit 1.
    One process of training stops at that step with its checkpoint instead (utils/run/preemption.py);
    elsewhere (eval.py, validation, a run of several processes) it ends the script with its line."""


class WriteError(OSError):
    """Writing an output file failed (ENOSPC, EDQUOT, EFBIG, EIO, ...): exit code 4, one line.

    Raised by utils.run.files.atomic_write after it removed its temp file, so the file at path is
    still the previous version (or absent). An OSError, so code that catches OSError still does.
    """

    def __init__(self, path, error, advice=None):
        super().__init__(error.errno, error.strerror or str(error), path)
        self.path, self.error = path, error
        self.advice = advice  # what to do, where the writer knows better than WRITE_ADVICE (a cache)

    def __reduce__(self):  # OSError pickles as (errno, strerror, filename): this one's arguments differ
        return WriteError, (self.path, self.error, self.advice)

    def __str__(self):
        import errno as errno_names
        name = errno_names.errorcode.get(self.errno, "")
        what = f"{self.strerror}" + (f" ({name})" if name else "")
        return f"could not write {self.path}: {what}; the file there is still the previous version (or none)"


# What to do after a WriteError, per script (train.py's run can be resumed).
WRITE_ADVICE = {"train.py": " (the last checkpoint.pth.tar still loads); free space or choose another "
                            "--output-dir, then --resume"}
FAILED_CODE_KEY = "imagenet_amp_failed_exit_code"  # in the process group's store: see exit_on_usage_error


def _in_process_group():
    """torch.distributed if this process belongs to an initialised group of several, else None."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    return distributed if distributed.get_world_size() > 1 else None


def _process_group_failed(err):
    """Whether err is this process's collective failing because a peer left (gloo: the connection
    closed; NCCL: an error or a timeout), in a run of several processes."""
    distributed = _in_process_group()
    if distributed is None:
        return False
    dist_error = getattr(distributed, "DistError", ())
    text = str(err)
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and any(
        word in text for word in ("gloo", "Gloo", "NCCL", "nccl", "Connection closed", "Connection reset",
                                  "Broken pipe", "timed out")))


def _group_store():
    """The process group's key-value store (torchrun's agent holds it; hand-started ranks: rank
    0), or None. A private torch function: anything unexpected means no store."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:
        return None


def _tell_peers(code):
    """Leave this process's exit code where a peer whose collective then fails can read it: the
    process group's store. torchrun's agent holds that store, so it outlives this process; ranks
    started without torchrun keep it in rank 0, so when rank 0 fails its peers exit 1 instead."""
    if _in_process_group() is None:
        return
    store = _group_store()
    if store is not None:
        try:
            store.set(FAILED_CODE_KEY, str(code))
        except Exception:
            pass


def _peer_code():
    """The exit code a failed peer left (_tell_peers), else EXIT_CRASH."""
    store = _group_store()
    try:
        if store is not None and store.check([FAILED_CODE_KEY]):
            return int(store.get(FAILED_CODE_KEY))
    except Exception:
        pass
    return EXIT_CRASH


def exit_on_usage_error(main):
    """Run main(); turn a UsageError into 'prog: error: ...' on stderr and exit code 2, and a
    WriteError (output could not be written) into one such line and exit code 4.

    In a run of several processes, a usage error that every process meets alike is printed by
    rank 0 only; an unreadable input file or a failed write is printed by the process that met
    it, which also leaves its exit code in the process group's store. A peer then fails in its
    next collective: it says so in one line (no gloo/NCCL traceback) and exits with that code
    (1 where the store went with the failed process: see _tell_peers)."""
    import os
    import signal
    prog = os.path.basename(sys.argv[0])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the scripts' imports ran with the default action
    main_rank = int(os.environ.get("RANK", 0)) == 0
    try:
        return main()
    except UsageError as err:
        if main_rank or isinstance(err, UnreadableInput):
            print(f"{prog}: error: {one_line(err)}", file=sys.stderr, flush=True)
        _tell_peers(EXIT_USAGE)
        leave(EXIT_USAGE)
    except WriteError as err:
        advice = err.advice if err.advice is not None else WRITE_ADVICE.get(prog, '; free space or write it elsewhere')
        print(f"{prog}: error: {err}{advice}", file=sys.stderr, flush=True)
        _tell_peers(EXIT_WRITE_FAILED)
        leave(EXIT_WRITE_FAILED)
    except Diverged as err:
        if int(os.environ.get("RANK", 0)) == 0:  # every rank stops at the same step; one message
            print(f"{prog}: stopped: {err}", file=sys.stderr, flush=True)
        leave(EXIT_DIVERGED)
    except WorkerLost as err:  # where no checkpoint could be made of it (WorkerLost says where)
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        _tell_peers(EXIT_CRASH)
        leave(EXIT_CRASH)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (utils/run/preemption.py handles it inside)
        print(f"{prog}: interrupted (Ctrl-C) outside the training steps; no checkpoint was written for it",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_SIGINT)
    except Exception as err:
        if not _process_group_failed(err):
            raise
        code = _peer_code()
        print(f"{prog}: stopped: another process of this run failed (its error is above); rank "
              f"{os.environ.get('RANK', '?')} cannot go on without it ({first_line(err, 120)})",
              file=sys.stderr, flush=True)
        leave(code)


def leave(code):
    """sys.exit(code); in a process of a multi-process run, os._exit after flushing instead.

    A process that leaves early while its gloo/NCCL process group is alive can abort in the
    C++ teardown at interpreter exit ("terminate called without an active exception", SIGABRT)
    when its peers leave at the same moment: seen once in a 2-process refusal test. Everything
    this script wrote is already on disk (atomic writes), so skipping that teardown loses nothing."""
    import os
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def one_line(err):
    """The message of a UsageError, also when a DataLoader worker re-raised it with its traceback."""
    text = str(err)
    if "Original Traceback" in text:
        text = text.strip().splitlines()[-1]
        text = text.split("UsageError: ", 1)[-1]
    return text


def first_line(err, limit=300):
    """The first line of an exception's message (or its type name), for one-line error summaries."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:limit]
