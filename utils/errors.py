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


class Diverged(Exception):
    """Training produced non-finite numbers it could not skip past (utils/engine.py says which).

    The message names the epoch/step, the LR and the last good checkpoint; exit code 3. Every
    process raises it at the same step; only the main process (RANK 0) prints it.
    """


class WriteError(OSError):
    """Writing an output file failed (ENOSPC, EDQUOT, EFBIG, EIO, ...): exit code 4, one line.

    Raised by utils.files.atomic_write after it removed its temp file, so the file at path is
    still the previous version (or absent). An OSError, so code that catches OSError still does.
    """

    def __init__(self, path, error):
        super().__init__(error.errno, error.strerror or str(error), path)
        self.path, self.error = path, error

    def __str__(self):
        import errno as errno_names
        name = errno_names.errorcode.get(self.errno, "")
        what = f"{self.strerror}" + (f" ({name})" if name else "")
        return (f"could not write {self.path}: {what}; the file there is still the previous version "
                "(the last checkpoint.pth.tar still loads); free space or choose another --output-dir, "
                "then --resume")


def exit_on_usage_error(main):
    """Run main(); turn a UsageError into 'prog: error: ...' on stderr and exit code 2, and a
    WriteError (output could not be written) into one such line and exit code 4."""
    import os
    import signal
    prog = os.path.basename(sys.argv[0])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the scripts' imports ran with the default action
    try:
        return main()
    except UsageError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        leave(EXIT_USAGE)
    except WriteError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        leave(EXIT_WRITE_FAILED)
    except Diverged as err:
        if int(os.environ.get("RANK", 0)) == 0:  # every rank stops at the same step; one message
            print(f"{prog}: stopped: {err}", file=sys.stderr, flush=True)
        leave(EXIT_DIVERGED)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (utils/preemption.py handles it inside)
        print(f"{prog}: interrupted (Ctrl-C) outside the training steps; no checkpoint was written for it",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_SIGINT)


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
