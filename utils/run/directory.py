"""The output directory: created, writable, no other run's files replaced, temp files of a killed
save removed, before any work."""
import contextlib
import os
import shutil
from dataclasses import dataclass

from utils.run.checkpoint import BEST, CHECKPOINT, kept_checkpoints
from utils.run.errors import UsageError
from utils.run.files import TEMP_PREFIX, probe_folder, writer_gone
from utils.run.lock import take_lock

# The files a training run writes into --output-dir (utils/run/checkpoint.py, utils/logs.py). A new run
# never replaces another run's without --overwrite: with Apex everyone ran in the working directory
# and a second run silently replaced the first; timm makes a new folder per run, which leaves the
# first intact but scatters runs and makes "where is my checkpoint" a search. Resuming is the usual
# intent, so the refusal names the --resume command, and --overwrite says "start over" explicitly.
RUN_FILES = (CHECKPOINT, BEST, "summary.csv", "args.yaml", "curves.png")


@dataclass(frozen=True)
class RunDir:
    """What the output directory's checks need (utils.flags.specs.run_dir_spec makes it)."""
    path: str                     # --output-dir
    resume: str = ""              # --resume's checkpoint file ("" for a run that starts fresh)
    overwrite: bool = False       # --overwrite: start over, replacing the previous run's files
    writes_nothing: bool = False  # -e and --prof: no file is written, so nothing is checked


def prepare_output_dir(run_dir, accelerator):
    """Settle --output-dir (a RunDir) before any data or model is built: create it, prove it
    writable, remove temp files a killed save left there, and refuse to replace another run's
    files. The main process checks; every process gets its verdict, so all of them stop with the
    same one-line error (none is left waiting for the others). The main process takes the
    directory's lock (utils/run/lock.py) before it looks for another run's files, so of two runs
    started at once one goes on and the other is refused; a refusal after taking it releases it.
    -e and --prof write nothing, so nothing is checked and no lock is taken. Returns the previous
    run's files --overwrite replaces (main process; remove_replaced_run)."""
    if run_dir.writes_nothing:
        return []
    problem, replaced = None, []
    if accelerator.is_main_process:
        lock = None
        try:
            create_output_dir(run_dir.path)
            lock, lines = take_lock(run_dir.path)  # train.main's finally releases it (@releases_output_dir)
            more, replaced = check_output_dir(run_dir)
            for line in lines + more:
                print(line, flush=True)
        except UsageError as err:
            if lock is not None:
                lock.release()
            problem = str(err)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise UsageError(problem)
    return replaced


def remove_replaced_run(output_dir, accelerator, replaced):
    """--overwrite's removal of the previous run's files from output_dir, by the main process, once
    the new run has built its data and model and passed its checks: a mistyped command line (DATA,
    -a, a flag's value) stops before this and leaves the previous run as it was."""
    if not accelerator.is_main_process or not replaced:
        return
    for name in replaced:
        path = os.path.join(output_dir, name)
        if os.path.lexists(path):
            os.remove(path)
    print(f"=> --overwrite: removed the previous run's {', '.join(replaced)} from {output_dir}", flush=True)


def create_output_dir(out):
    """--output-dir out made if missing and proven writable, or a UsageError saying why not."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output-dir {out!r} is a file, not a directory; give a directory (created "
                         "if missing)")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create --output-dir {out!r}: {err.strerror}"
                         f"{f' ({err.filename})' if err.filename and err.filename != out else ''}; "
                         "give a directory you can write to") from None
    try:  # a real file made and removed (utils.run.files.probe_folder): root ignores mode bits
        probe_folder(out)
    except OSError as err:
        raise UsageError(f"--output-dir {out!r} is not writable ({err.strerror}); give a directory you "
                         "can write to") from None


def check_output_dir(run_dir):
    """The created --output-dir's checks: no other run's files replaced without --overwrite, a
    resume that continues the run there, the stale temp files removed. Returns (lines to print,
    the previous run's files that --overwrite replaces, removed later by remove_replaced_run)."""
    out = run_dir.path
    lines = []
    found = [name for name in RUN_FILES if os.path.lexists(os.path.join(out, name))]
    found += [name for _, name in kept_checkpoints(out)]  # --keep-checkpoints copies are the run's too
    resume, overwrite = run_dir.resume, run_dir.overwrite
    if resume and not os.path.isfile(resume):
        return lines, []  # load_checkpoint names the missing file next, before anything is written
    continuing = bool(resume) and os.path.samefile(os.path.dirname(os.path.abspath(resume)), out)
    if continuing and overwrite:
        raise UsageError(f"--overwrite would remove the run in {out!r} that --resume {resume} continues; "
                         "drop --overwrite to continue it, or drop --resume to start over")
    if continuing:
        newest = os.path.join(out, CHECKPOINT)
        if (os.path.isfile(newest) and not os.path.samefile(newest, resume)
                and os.path.getmtime(newest) > os.path.getmtime(resume)):
            lines.append(f"=> --resume {os.path.basename(resume)}: the {CHECKPOINT} beside it is newer; this "
                         f"run continues from the older file and its saves replace {CHECKPOINT}")
    if not found or continuing:
        return remove_stale_temp_files(out) + lines, []
    if not overwrite:
        listed = ", ".join(found)
        if resume:
            raise UsageError(f"--output-dir {out!r} holds another run's files ({listed}) that resuming "
                             f"{resume!r} there would replace; choose another --output-dir, or pass "
                             "--overwrite to replace them")
        how = (f"continue it with --resume {os.path.join(out, CHECKPOINT)}, " if CHECKPOINT in found else "")
        raise UsageError(f"--output-dir {out!r} already holds a run ({listed}); {how}start over with "
                         "--overwrite (removes those files), or choose another --output-dir")
    lines.append(f"=> --overwrite: the previous run's {', '.join(found)} in {out} will be removed once this run "
                 "has built its data and model")
    return remove_stale_temp_files(out) + lines, found


def remove_stale_temp_files(out):
    """Temp files (utils.run.files.TEMP_PREFIX) of a save that was killed before its rename: never a
    finished file, so safe to delete once this run owns the directory. Those of a writer still
    running (another run saving into the same folder right now) are left alone."""
    stale = sorted(name for name in os.listdir(out) if name.startswith(TEMP_PREFIX) and writer_gone(name))
    for name in stale:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # gone already, or not ours to remove: harmless
                os.remove(path)
    if not stale:
        return []
    shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
    return [f"=> removed {len(stale)} temp file(s) an interrupted save left in {out}: {shown}"]
