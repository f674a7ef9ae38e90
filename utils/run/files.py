"""Atomic file writes: a reader, a crash or a kill never leaves half a file behind.

Every file the project writes (checkpoints, logs, CSVs, the digits cache) goes through here:
write to a temp file in the destination's folder, optionally fsync, then rename it over the
destination. A failure at any point removes the temp file and leaves the old file untouched;
a failed write (full disk, quota, file too large, I/O error) becomes a utils.run.errors.WriteError
naming the file, which the scripts turn into one line and exit code 4.
"""
import contextlib
import csv
import io
import os
import re
import shutil
import socket
import tempfile

from utils.run.errors import WriteError

TEMP_PREFIX = ".tmp-"  # temp files and folders start with this; a killed writer leaves only these
# After the prefix, the writer: PID@HOST~ (a run cleaning its directory removes only the temp files
# of writers that are gone, never those of a save still in progress)
WRITER = re.compile(r"\.tmp-(\d+)@([^~/]*)~")


def temp_prefix():
    """TEMP_PREFIX naming this process as the writer (see WRITER)."""
    return f"{TEMP_PREFIX}{os.getpid()}@{socket.gethostname().replace('~', '-')}~"


def writer_gone(name):
    """Whether the temp file `name` was left by a writer that no longer runs: its process is gone
    from this host, or the name names no writer (code that did not record one). A writer on
    another host (a shared filesystem) cannot be checked here, so it counts as running."""
    match = WRITER.match(name)
    if match is None:
        return True
    pid, host = int(match.group(1)), match.group(2)
    if host != socket.gethostname().replace("~", "-"):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def _publish(tmp, path):
    """The one rename of the project: atomic on POSIX within one file system."""
    os.replace(tmp, path)


def atomic_write_csv(path, rows, fieldnames, lineterminator="\r\n"):
    """rows (dicts) under a header line, as a CSV file written atomically (atomic_write)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fieldnames, lineterminator=lineterminator)
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write(path, text.getvalue())


def output_file_problem(path, protected=()):
    """Why path cannot take a new output file, or None: it is a folder, a folder on its way is a
    file, or it is an existing checkpoint (*.pth.tar) or one of the protected names (a training
    run's summary.csv, args.yaml, ...), which a report or trace must not silently replace."""
    absolute = os.path.abspath(path)
    if os.path.isdir(absolute):
        return "it is a directory"
    parent = os.path.dirname(absolute)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a folder"
    name = os.path.basename(absolute)
    if os.path.exists(absolute) and (name in protected or name.endswith(".pth.tar")):
        return "it is a training run's file, which this would replace"
    return None


def atomic_write(path, content, fsync=False):
    """Write content to path atomically; content is bytes, str, or a callable(binary handle).

    fsync=True flushes the data to disk before the rename (checkpoints: a power cut must not
    leave a renamed but empty file). Returns path.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), suffix="-" + os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        # mkstemp makes 0600 files; give the file the permissions an ordinary open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        _publish(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        cause = _os_error(err)
        if cause is not None and not isinstance(err, WriteError):
            raise WriteError(path, cause) from err  # a full disk etc.: exit 4 with one clear line
        raise
    return path


def _os_error(err):
    """The OSError behind a failed write: err itself, or the one torch.save's RuntimeError
    ('unexpected pos ...') hides in its context when the handle's write raised ENOSPC/EFBIG."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def copy_atomic(source, path, fsync=False):
    """Copy the file source to path atomically (model_best.pth.tar from checkpoint.pth.tar)."""
    with open(source, "rb") as src:
        return atomic_write(path, lambda handle: shutil.copyfileobj(src, handle), fsync=fsync)


@contextlib.contextmanager
def atomic_directory(path):
    """Yield a temp folder beside path; on success it becomes path, on failure it is removed.

    If path appeared meanwhile (another process finished first), the temp folder is dropped and
    the existing one kept.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=temp_prefix(), dir=parent)
    try:
        yield tmp
        try:
            _publish(tmp, path)
        except OSError:  # path exists and is not empty: someone else built it
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
