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

from utils.run.errors import UsageError, WriteError

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
    return folder_write_problem(parent)  # the nearest folder there is: the rest is made on the way


def check_output_file(path, flag, overwrite=False, protected=()):
    """Refuse before any work, as one UsageError line naming flag and path, an output path that
    cannot be written without harm (output_file_problem) or that holds a file already, unless
    overwrite (the scripts' --overwrite, spelled as train.py spells it): a file the user has is
    never replaced without being asked."""
    problem = output_file_problem(path, protected)
    if problem:
        raise UsageError(f"{flag} {path!r}: {problem}; choose another file")
    if os.path.lexists(path) and not overwrite:
        raise UsageError(f"{flag} {path!r} already exists; pass --overwrite to replace it, or choose "
                         "another file")


def check_output_folder(path, flag):
    """Refuse before any work, as one UsageError line, a folder to write into that is a file, sits
    below a file, or cannot take a new file (folder_write_problem); made if missing. Returns path."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a file, not a directory; give a directory (created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{flag} {path!r}: cannot create it ({err.strerror}); give a directory you can "
                         "write to") from None
    problem = folder_write_problem(path)
    if problem:
        raise UsageError(f"{flag} {path!r} is not writable: {problem}; give a directory you can write to")
    return path


def atomic_write(path, content, fsync=False):
    """Write content to path atomically; content is bytes, str, or a callable(binary handle).

    fsync=True flushes the data to disk before the rename (checkpoints: a power cut must not
    leave a renamed but empty file). Returns path.
    """
    def fill(fd, tmp):
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
    return _replace_atomically(path, fill)


def atomic_export(path, export):
    """path written atomically by export(temp path), for writers that take a file name rather than
    a handle (torch.profiler's export_chrome_trace). Returns path."""
    def fill(fd, tmp):
        os.close(fd)
        export(tmp)
    return _replace_atomically(path, fill)


def _replace_atomically(path, fill):
    """The one mechanism behind atomic_write and atomic_export: make the folder, a temp file in it,
    fill(fd, temp path), the user's umask, the rename. Every step sits inside the one try, so any
    OSError on the way (a folder that cannot be made, an unwritable or immutable folder, a full
    disk, a rename refused) becomes the one WriteError naming path, and the temp file goes."""
    tmp = None
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), suffix="-" + os.path.basename(path), dir=folder)
        fill(fd, tmp)
        # mkstemp makes 0600 files; give the file the permissions an ordinary open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        _publish(tmp, path)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        converted = _as_write_error(err, path)
        if converted is err:
            raise
        raise converted from err
    return path


def _as_write_error(err, path, advice=None):
    """err as the WriteError naming path when an OSError is behind it (a full disk etc.: exit 4
    with one clear line); err itself otherwise (a KeyboardInterrupt, a usage error, a WriteError
    already, an error with no OSError behind it)."""
    if not isinstance(err, Exception) or isinstance(err, (WriteError, UsageError)):
        return err
    cause = _os_error(err)
    if cause is None:
        return err
    return WriteError(path, cause, advice)


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
def atomic_directory(path, advice=None):
    """Yield a temp folder beside path; on success it becomes path, on failure it is removed.

    If path appeared meanwhile (another process finished first), the temp folder is dropped and
    the existing one kept. An OSError on the way (the parent cannot be made, the temp folder
    cannot be created, a file written into it finds the disk full) is a WriteError naming path,
    with advice (the text after its message: what to do) where the caller knows better.
    """
    tmp = None
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=temp_prefix(), dir=parent)
        yield tmp
        try:
            _publish(tmp, path)
        except OSError:  # path exists and is not empty: someone else built it
            if not os.path.isdir(path):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        converted = _as_write_error(err, path, advice)
        if converted is err:
            raise
        raise converted from err


def probe_folder(folder):
    """Create and remove a probe file in folder; an OSError says it cannot take a new file. Never
    judged by mode bits: root ignores those, yet an immutable folder (chattr +i), a read-only
    mount or a quota still refuse a file. The probe carries this process's temp prefix, so one a
    kill left behind is removed as any stale temp file is (utils.run.directory)."""
    fd, probe = tempfile.mkstemp(prefix=temp_prefix(), suffix="-write-test", dir=folder)
    os.close(fd)
    os.remove(probe)


def folder_write_problem(folder):
    """Why a new file cannot be made in the existing folder (probe_folder), or None."""
    try:
        probe_folder(folder)
    except OSError as err:
        return f"cannot create a file in {folder} ({err.strerror})"
    return None
