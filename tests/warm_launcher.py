"""The project's scripts run for the tests from a warm interpreter, so a test does not pay for
importing torch, torchvision, timm and Accelerate again (about 9 s a process on a busy 2-core
machine, most of a short run's time, and most of the suite's).

A server process, started once per test process, imports those libraries and waits. Each run is
a child forked from it: a real process with its own pid, file descriptors 0-2 on the test's
files, the test's environment, working directory and argv, the interpreter's default signal
handlers, and the script run as __main__; its exit status (a signal's as a negative number, as
subprocess reports it) goes back to the test. Only the libraries come pre-imported: the
project's own modules are imported fresh by every run.

warm_run(command, env, cwd, timeout, base_env) takes `python SCRIPT.py ARGS` commands and returns
subprocess.CompletedProcess, or None where the run needs a fresh interpreter (conftest then
starts one): other commands, an environment that differs from the server's in a variable read
at import time (only RUNTIME_ENV may differ), a machine with an NVIDIA driver (a process forked
after CUDA's driver was loaded cannot use CUDA), or TESTS_FRESH_PROCESSES=1 in the environment.
"""
import io
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile

PRELOAD = ("numpy", "PIL.Image", "yaml", "torch", "torchvision", "accelerate", "timm")
# Read when used, not when imported: a run may set them differently from the server.
RUNTIME_ENV = frozenset({"IMAGENET_AMP_CACHE", "ACCELERATE_USE_CPU", "PYTEST_CURRENT_TEST"})
HERE = os.path.abspath(__file__)


# --- the test's side -------------------------------------------------------------------------

class _Server:
    def __init__(self, env):
        self.env = dict(env)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, HERE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                        env=self.env, stdin=subprocess.DEVNULL)
        theirs.close()

    def alive(self):
        return self.process.poll() is None


_server = None


def _usable(command, env):
    if env.get("TESTS_FRESH_PROCESSES") == "1" or os.path.exists("/dev/nvidiactl"):
        return False
    if len(command) < 2 or command[0] != sys.executable or not command[1].endswith(".py"):
        return False
    return True


def _server_for(env, base_env):
    """The server for a run in env, or None. The test process's own environment (base_env) can
    change under the server, e.g. a variable set by code a test ran in-process: then the server
    is started again from it, once, instead of every later run taking a fresh interpreter."""
    global _server
    base = {k: v for k, v in base_env.items() if k not in RUNTIME_ENV}
    if _server is None or not _server.alive() or _server.env != base:
        if _server is not None:
            _server.sock.close()  # the old server sees its socket close and exits
            _server.process.wait()
        _server = _Server(base)
    differs = {k for k in set(env) | set(_server.env) if env.get(k) != _server.env.get(k)}
    return _server if differs <= RUNTIME_ENV else None


def _text(handle):
    handle.seek(0)
    return io.TextIOWrapper(handle, newline=None).read()  # as subprocess.run(text=True) decodes


def warm_run(command, env, cwd, timeout, base_env):
    """`command` run in a child of the warm server, or None where it needs a fresh interpreter.
    base_env: the environment the server starts with (the test process's, with its limits)."""
    command = [str(part) for part in command]
    if not _usable(command, env):
        return None
    server = _server_for(env, base_env)
    if server is None:
        return None
    with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        request = pickle.dumps({"argv": command[1:], "env": dict(env), "cwd": os.path.abspath(cwd)})
        socket.send_fds(server.sock, [request], [stdin.fileno(), out.fileno(), err.fileno()])
        server.sock.settimeout(None)
        pid = struct.unpack("q", server.sock.recv(8))[0]
        server.sock.settimeout(timeout)
        try:
            status = struct.unpack("q", server.sock.recv(8))[0]
            timed_out = False
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            server.sock.settimeout(None)
            status = struct.unpack("q", server.sock.recv(8))[0]
            timed_out = True
        stdout, stderr = _text(out), _text(err)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, status, stdout, stderr)


# --- the server and its children -------------------------------------------------------------

def _exit_code(code):
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request, fds):
    """In the forked child: become the script's process, run it, exit as the interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        traceback.print_exc()
        code = 1
    # The interpreter's own way out: wait for non-daemon threads, then the atexit functions.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # an uncaught KeyboardInterrupt ends the process by SIGINT, as Python 3.8+ does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def serve(fd):
    import importlib
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        importlib.import_module(name)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        except OSError:
            return
        if not message:  # the test process is gone
            return
        request = pickle.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                _child(request, fds)
            finally:  # never back into this loop: a child that failed to start ends here
                os._exit(1)
        for descriptor in fds:
            os.close(descriptor)
        sock.sendall(struct.pack("q", pid))
        _, status = os.waitpid(pid, 0)
        sock.sendall(struct.pack("q", os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    serve(int(sys.argv[1]))
