"""The output directory's lock: one run owns its --output-dir while it runs.

LOCK_NAME in the directory names its owner (host, pid, start time, command line). It is created
with os.open(O_CREAT | O_EXCL), the one atomic "create if absent" that local and shared
filesystems (NFSv3 and later, Lustre, GPFS, CephFS) honour, by the global main process before it
looks for another run's files (utils.run.directory.prepare_output_dir): of two runs started at the
same moment one gets it, the other is refused with one line naming the owner. A lock goes on
every exit path: train.main's finally (@releases_output_dir), atexit as a backstop, and only by
the process that made it (its record is compared first: another's lock is never removed).

A lock whose owner died without releasing it (kill -9, a crashed node) must not block the requeue
that --resume auto exists for; it is taken over, with one line saying whose it was and why, when
  - its owner ran on this machine (same hostname, boot and pid namespace) and its pid is gone,
    a zombie, or now another process (started after the lock); after a reboot, at once;
  - its owner ran elsewhere (another host, another container), which no pid check can see, and
    it was not refreshed for STALE_SECONDS: a live owner touches it every REFRESH_SECONDS.
One process takes a stale lock over: the one that makes the directory named after it (mkdir,
atomic everywhere), which removes the lock once it has read it unchanged, then creates its own
with O_EXCL; losing that create (or the mkdir) to another run is a refusal, as above.
"""
import atexit
import contextlib
import functools
import hashlib
import json
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from datetime import datetime

from utils.run.errors import UsageError

LOCK_NAME = "train.lock"  # not a run file, nor a temp name (.tmp-*), which the directory's cleanup removes
REFRESH_SECONDS = 60      # how often a running owner touches its lock (a daemon thread)
STALE_SECONDS = 600       # a lock of another host untouched this long is abandoned: 10 refreshes missed
WRITE_WAIT_SECONDS = 2.0  # an owner writes its record right after the create; an empty lock is read again
TAKEOVER_WAIT_SECONDS = 10.0  # a take-over takes milliseconds; one pending longer was interrupted

# The locks this process holds: process-wide on purpose, like the process itself, so that every
# way out of train.main (releases_output_dir) and a pid check against our own locks (_pid_gone)
# find them without a lock object being threaded through the whole run.
_held = []


def this_machine():
    """What makes pids comparable: the hostname, this boot, and the pid namespace (two containers
    may share a hostname, yet neither sees the other's pids)."""
    def read(path, how):
        try:
            return how(path).strip()
        except OSError:
            return ""
    return {"host": socket.gethostname(),
            "boot": read("/proc/sys/kernel/random/boot_id", lambda p: open(p, encoding="ascii").read()),
            "pidns": read("/proc/self/ns/pid", os.readlink)}


def _record(command):
    now = time.time()
    started = datetime.fromtimestamp(now).astimezone().isoformat(sep=" ", timespec="seconds")
    return {**this_machine(), "pid": os.getpid(), "since": now, "started": started, "command": command,
            "token": uuid.uuid4().hex}


def _owner(raw):
    """The record in a lock's bytes, or None where they are not one (half written, another tool's)."""
    try:
        owner = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    if not isinstance(owner, dict) or not {"host", "pid", "token"} <= owner.keys():
        return None
    return owner if isinstance(owner["pid"], int) and isinstance(owner["host"], str) else None


def _look(path, wait=True):
    """(bytes, seconds since last refreshed) of the lock at path, or None once it is gone. An empty
    lock is read again for a moment (wait): its owner creates it, then writes its record."""
    deadline = time.monotonic() + (WRITE_WAIT_SECONDS if wait else 0)
    while True:
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
                age = time.time() - os.fstat(handle.fileno()).st_mtime
        except FileNotFoundError:
            return None
        if raw or time.monotonic() > deadline:
            return raw, age
        time.sleep(0.02)


def _duration(seconds):
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.0f} h"


def _process(pid):
    """(state letter, start time in epoch seconds) of a live pid from /proc, or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as handle:
            boot = next(float(line.split()[1]) for line in handle if line.startswith("btime "))
        return fields[0], boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _pid_gone(owner):
    """Why the owner's process (this machine's) is not running any more, or None while it is."""
    pid = int(owner["pid"])
    if pid == os.getpid():  # this process has its pid: an earlier process's lock, unless this one holds it
        return None if any(lock.owner["token"] == owner["token"] for lock in _held) else \
            "that process is gone; this one has its pid now"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "that process is gone"
    except PermissionError:  # another user's live process
        pass
    seen = _process(pid)
    if seen is not None and seen[0] in "ZX":
        return "that process has ended"
    if seen is not None and seen[1] > float(owner.get("since", seen[1])) + 2:  # btime counts whole seconds
        return "that process is gone; its pid is another process's now"
    return None


def stale_reason(owner, age, here=None):
    """Why a lock (its owner's record, None if unreadable; seconds since it was last refreshed) may
    be taken over, or None while its owner may still be running."""
    here = here or this_machine()
    if owner is None:
        return f"it was unreadable and not refreshed for {_duration(age)}" if age > STALE_SECONDS else None
    if owner["host"] == here["host"] and owner.get("boot") and owner.get("boot") != here["boot"]:
        return "that host has restarted since"
    if owner["host"] == here["host"] and owner.get("pidns", "") == here["pidns"]:
        return _pid_gone(owner)
    if age > STALE_SECONDS:
        return (f"it was not refreshed for {_duration(age)}; a running owner refreshes it every "
                f"{_duration(REFRESH_SECONDS)}, and {_duration(STALE_SECONDS)} without counts as abandoned")
    return None


def _whose(owner):
    return f"pid {owner['pid']} on {owner['host']}" if owner else "a run this lock does not name"


def refusal(out, owner, path):
    """The one line that refuses --output-dir out while the lock at path names a live owner."""
    if owner is None:
        return (f"--output-dir {out!r} is locked by {path}, which names no owner (a run starting this very "
                f"moment, or another program's file); wait, choose another --output-dir, or remove the file "
                f"if nothing uses this directory (after {_duration(STALE_SECONDS)} untouched it is taken over)")
    command = str(owner.get("command", ""))
    command = command if len(command) <= 100 else command[:97] + "..."
    return (f"--output-dir {out!r} is in use by another run: pid {owner['pid']} on {owner['host']} since "
            f"{owner.get('started', '?')} ({command}); wait for it to end or stop it, or choose another "
            f"--output-dir (a run that died without releasing {path} loses it to the next run: at once on "
            f"the same host, after {_duration(STALE_SECONDS)} without a refresh from another)")


def _take_over(path, raw, record):
    """Replace the stale lock at path (whose bytes were raw) with this process's: its bytes, or None
    if the lock changed meanwhile or another process took it over first. One taker per stale lock:
    the one that makes the directory named after it (mkdir is atomic on every filesystem), which
    reads the lock again and renames its own over it before removing that directory; the others
    wait for the directory to go, then look again. The rename leaves no moment without a lock, so
    a run that starts meanwhile finds one (ours) instead of making its own; no one else replaces a
    lock but a taker, so the lock read is the lock replaced, and a fresh one is never touched."""
    mutex = f"{path}.takeover-{hashlib.sha256(raw).hexdigest()[:16]}"
    try:
        os.mkdir(mutex)
    except FileExistsError:
        deadline = time.monotonic() + TAKEOVER_WAIT_SECONDS
        while os.path.isdir(mutex):
            if time.monotonic() > deadline:
                raise UsageError(f"the stale lock {path} is being taken over by another process, or a take-over "
                                 f"was interrupted; if no run uses this directory, remove {path} and {mutex}") from None
            time.sleep(0.02)
        return None
    try:
        seen = _look(path, wait=False)
        if seen is None or seen[0] != raw:
            return None
        new = os.path.join(mutex, LOCK_NAME)  # inside the take-over directory: one thing to remove if interrupted
        made = _create(new, record)
        try:
            os.replace(new, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.remove(new)
            raise UsageError(f"cannot replace the stale lock {path}: {err.strerror}; remove it by hand if no run "
                             "uses this directory") from None
        return made
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(mutex)


def take_lock(out, command=None):
    """Make this process the owner of the directory out (it exists): returns (RunLock, lines to
    print). Raises a UsageError naming the owner while another run holds it."""
    path = os.path.join(out, LOCK_NAME)
    record = _record(shlex.join(sys.argv) if command is None else command)
    for _ in range(5):  # each pass ends with the lock made, refused, or a change seen meanwhile
        try:
            return RunLock(path, record, _create(path, record)), []
        except FileExistsError:
            pass
        seen = _look(path)
        if seen is None:
            continue  # its run released it just now
        raw, age = seen
        owner = _owner(raw)
        why = stale_reason(owner, age)
        if why is None:
            raise UsageError(refusal(out, owner, path))
        made = _take_over(path, raw, record)
        if made is not None:
            return RunLock(path, record, made), [f"=> took over the lock of {_whose(owner)} in {out} ({why})"]
    raise UsageError(f"--output-dir {out!r}: its lock {path} kept changing hands while this run tried to take "
                     "it (several runs starting there at once); start one run per --output-dir")


def _create(path, record):
    """The lock at path, made with O_EXCL and holding record: its bytes. FileExistsError if there
    is one; any other failure is a UsageError (the directory was proven writable just before)."""
    raw = json.dumps(record).encode() + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise
    except OSError as err:
        raise UsageError(f"cannot create the lock {path}: {err.strerror}; give a directory you can "
                         "write to") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise UsageError(f"cannot write the lock {path}: {err.strerror}; free space or choose another "
                         "--output-dir") from None
    return raw


class RunLock:
    """A lock this process holds: refreshed in a daemon thread until release()."""

    def __init__(self, path, owner, raw):
        self.path, self.owner, self.raw = path, owner, raw
        self._stop = threading.Event()
        atexit.register(self.release)  # the backstop: an exit that skipped train.main's finally
        _held.append(self)
        threading.Thread(target=self._refresh, daemon=True, name="output-dir-lock").start()

    def ours(self):
        """Whether the file at path is still this lock (the same bytes), in the process that made it."""
        if os.getpid() != self.owner["pid"]:  # a forked child (a loader worker) never owns its parent's lock
            return False
        try:
            with open(self.path, "rb") as handle:
                return handle.read() == self.raw
        except OSError:
            return False

    def _refresh(self):
        warned = False
        while not self._stop.wait(REFRESH_SECONDS):
            if self.ours():
                with contextlib.suppress(OSError):  # a shared filesystem's hiccup: the next refresh tries again
                    os.utime(self.path)
            elif not warned and not self._stop.is_set():
                warned = True
                print(f"warning: {self.path} is no longer this run's lock (removed by hand, or taken over as "
                      "stale: see docs/troubleshooting.md); another run may now write into this directory",
                      file=sys.stderr, flush=True)

    def release(self):
        """Remove the lock if it is still ours; idempotent."""
        self._stop.set()
        if self in _held:
            _held.remove(self)
        if self.ours():
            with contextlib.suppress(OSError):
                os.remove(self.path)


def release_held():
    """Release every lock this process holds."""
    while _held:  # each release() leaves the list
        _held[0].release()


def releases_output_dir(main):
    """train.main's decorator: the output directory's lock goes however main ends (its return, a
    usage error, a divergence, a failed write, a stop signal's exit, an unexpected exception),
    before the scripts' exit path (which may end a multi-process run with os._exit, past atexit)."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        finally:
            release_held()
    return run
