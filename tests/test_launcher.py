"""tests/warm_launcher.py: a script run from the warm interpreter behaves as in a fresh one (exit
status, output, argv, working directory, environment, signals, time limit), and runs that need
a fresh interpreter get one."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import run_command

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    what = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "name", __name__, "path0", sys.path[0] == os.path.dirname(
        os.path.abspath(__file__)))
    print("env", os.environ.get("LAUNCHER_PROBE"), os.environ.get("IMAGENET_AMP_CACHE"))
    print("stdin", repr(sys.stdin.read()), "sigint", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          "sigterm", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    print("to stderr", file=sys.stderr)
    if what == "exit3":
        sys.exit(3)
    if what == "message":
        sys.exit("a message for the user")
    if what == "raise":
        raise ValueError("boom")
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if what == "thread":  # a non-daemon thread's output comes before the exit, as the interpreter waits
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
    if what == "atexit":
        import atexit
        atexit.register(lambda: print("atexit ran"))
    if what == "sleep":
        time.sleep(60)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("what", ["ok", "exit3", "message", "raise", "interrupt", "term", "thread", "atexit"])
def test_a_warm_run_ends_and_prints_as_a_fresh_interpreter_does(script, tmp_path, what):
    env = {"IMAGENET_AMP_CACHE": str(tmp_path / "cache")}
    warm = run_command([sys.executable, script, what], env=env, cwd=tmp_path)
    plain = run_command([sys.executable, script, what], env={**env, "TESTS_FRESH_PROCESSES": "1"}, cwd=tmp_path)
    assert warm.returncode == plain.returncode, (warm, plain)
    assert warm.stdout == plain.stdout
    # A traceback names the frames it went through: the warm run's has runpy's above the script's.
    assert warm.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:]
    assert warm.stderr.splitlines()[0] == plain.stderr.splitlines()[0] == "to stderr"
    expected = {"ok": 0, "exit3": 3, "message": 1, "raise": 1, "interrupt": -signal.SIGINT,
                "term": -signal.SIGTERM, "thread": 0, "atexit": 0}[what]
    assert warm.returncode == expected
    assert f"cwd {tmp_path}" in warm.stdout and f"env None {tmp_path / 'cache'}" in warm.stdout
    assert "name __main__ path0 True" in warm.stdout and "stdin '' sigint True sigterm True" in warm.stdout


def test_scripts_run_warm_unless_the_environment_needs_a_fresh_interpreter(tmp_path):
    probe = tmp_path / "parent.py"
    probe.write_text("import os, sys\nprint(os.getppid(), 'torch' in sys.modules)\n")
    warm = run_command([sys.executable, probe])
    parent, preloaded = warm.stdout.split()
    assert warm.returncode == 0 and int(parent) != os.getpid() and preloaded == "True"
    # A variable that a library may read at import time: a fresh interpreter, the test's child.
    other = run_command([sys.executable, probe], env={"LAUNCHER_PROBE": "1"})
    assert other.stdout.split() == [str(os.getpid()), "False"]
    assert run_command([sys.executable, probe], env={"TESTS_FRESH_PROCESSES": "1"}).stdout.split()[1] == "False"


def test_a_warm_run_past_its_limit_is_killed_and_raises_timeout_expired(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_command([sys.executable, script, "sleep"], cwd=tmp_path, timeout=5)
    assert "argv ['sleep']" in raised.value.output
    # the server is still there for the next run
    assert run_command([sys.executable, script, "exit3"], cwd=tmp_path).returncode == 3
