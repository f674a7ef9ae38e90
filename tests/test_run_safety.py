"""Run safety (issue 10, items 3-7): the output directory settled before any work, no silent
overwrite, flag and resume checks, data folders as found on real disks, checkpoint validation,
a full disk during a save, temp files of a killed save, file permissions."""
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import HALF_QUICK, HALF_TINY, QUICK, ROOT, TIMEOUT, TINY, make_image_folder, run_script, subprocess_env
from test_train import one_error_line

from utils.data.folder import SafeImageFolder, skipped_message
from utils.flags.parser import SEED_MAX, add_log_args, build_parser
from utils.flags.precedence import parse_args
from utils.run.checkpoint import save_checkpoint
from utils.run.errors import EXIT_USAGE, EXIT_WRITE_FAILED, exit_on_usage_error

RUN_FILES = ("checkpoint.pth.tar", "model_best.pth.tar", "summary.csv", "args.yaml", "curves.png")


@pytest.fixture
def usage_error(capsys, cache_dir):
    """train.main(argv) in this process through the scripts' exit path: exit 2, one error line
    naming every needle. argv is complete (this fixture adds no --output-dir)."""
    import train

    def check(argv, *needles):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            exit_on_usage_error(lambda: train.main([*map(str, argv)]))
        err = capsys.readouterr().err
        one_error_line(exited.value.code, err, *needles)
        return err
    return check


def run_train(*args, cwd=None, preexec_fn=None):
    """train.py in a fresh process (run_script's limits), with an optional preexec_fn."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *map(str, args)], capture_output=True,
                          text=True, env=subprocess_env(), cwd=cwd or ROOT, timeout=TIMEOUT, preexec_fn=preexec_fn)


def snapshot(folder):
    """Bytes and mtime of every file in folder: what 'nothing of the old run changed' means."""
    return {name: ((folder / name).read_bytes(), os.stat(folder / name).st_mtime_ns)
            for name in sorted(os.listdir(folder)) if (folder / name).is_file()}


@pytest.fixture(scope="module")
def first_run(cache_dir, tmp_path_factory):
    """One QUICK digits epoch written under umask 027 (so the permission test below can see the
    umask was honoured, not a fixed mode)."""
    out = tmp_path_factory.mktemp("first_run") / "run"
    result = run_train("--epochs", "1", "--output-dir", out, *QUICK, preexec_fn=lambda: os.umask(0o027))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(RUN_FILES)
    return out


# --- item 3: the output directory is settled before any work ---------------------------------------

def test_bad_output_dir_is_a_usage_error_before_the_data(usage_error, tmp_path):
    # DATA does not exist either: the output directory error coming first shows it is checked
    # before the data is looked at (so before any epoch).
    missing_data = tmp_path / "no-data"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    usage_error([missing_data, "--output-dir", a_file], "--output-dir", "is a file")
    usage_error([missing_data, "--output-dir", a_file / "sub" / "run"], "cannot create --output-dir", str(a_file))
    if os.geteuid() == 0:  # root writes through mode bits; sysfs refuses even root
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("no read-only directory available to root here")
        readonly = "/sys/kernel"
    else:
        readonly = tmp_path / "readonly"
        readonly.mkdir()
        readonly.chmod(0o555)
    usage_error([missing_data, "--output-dir", readonly], "not writable", str(readonly))


def test_missing_output_dir_is_created_with_parents_and_evaluate_writes_nothing(first_run, tmp_path):
    out = tmp_path / "a" / "b" / "run"
    # -e reads the val split only and writes nothing: not refused in a run's directory, and the
    # directory it is given is not even created.
    before = snapshot(first_run)
    result = run_script("train.py", "-e", "--resume", first_run / "checkpoint.pth.tar", "--output-dir", first_run,
                        *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert snapshot(first_run) == before
    result = run_script("train.py", "-e", "--resume", first_run / "checkpoint.pth.tar", "--output-dir", out, *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not out.exists()
    # A training run creates it (parents too) at start-up: the start-epoch error comes after that.
    args = parse_args(add_log_args(build_parser("t")), ["--output-dir", str(out)])
    from utils.flags.specs import run_dir_spec
    from utils.run.directory import check_output_dir, create_output_dir
    create_output_dir(out)
    assert check_output_dir(run_dir_spec(args)) == ([], []) and out.is_dir() and os.listdir(out) == []


# --- item 4: no silent overwrite ---------------------------------------------------------------------

def copy_run(source, folder):
    folder.mkdir()
    for name in RUN_FILES:
        shutil.copy2(source / name, folder / name)
    return folder


def test_a_second_fresh_run_cannot_touch_the_first_and_overwrite_replaces_it(first_run, tmp_path):
    run = copy_run(first_run, tmp_path / "run")  # first_run stays as it is for the other tests
    before = snapshot(run)
    refused = run_script("train.py", "--epochs", "1", "--output-dir", run, *QUICK)
    one_error_line(refused.returncode, refused.stderr, "already holds a run",
                   f"--resume {run / 'checkpoint.pth.tar'}", "--overwrite", "another --output-dir")
    assert snapshot(run) == before  # bytes and mtimes: nothing of the old run changed

    # --overwrite with a mistake that only building the data, the model or the loss finds: nothing is removed.
    for mistake in (["/no/such/data"], ["-a", "resnet1"], ["--label-smoothing", "1"]):
        failed = run_script("train.py", "--epochs", "1", "--overwrite", "--output-dir", run, *QUICK, *mistake)
        assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
        assert snapshot(run) == before, mistake

    replaced = run_script("train.py", "--epochs", "1", "--seed", "1", "--overwrite", "--output-dir", run, *QUICK)
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "--overwrite: removed the previous run's checkpoint.pth.tar" in replaced.stdout
    after = snapshot(run)
    assert sorted(after) == sorted(RUN_FILES)
    for name in RUN_FILES:
        assert after[name][1] != before[name][1], f"{name} was not rewritten"
    assert torch.load(run / "checkpoint.pth.tar", weights_only=True)["args"]["seed"] == 1


def test_resume_into_another_runs_directory_and_overwrite_with_resume_refuse(usage_error, tmp_path):
    make_run = lambda folder: save_checkpoint({"epoch": 1, "arch": "resnet18", "state_dict": {"w": torch.ones(1)},
                                               "optimizer": {"state": {}, "param_groups": []}}, False, folder)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    make_run(tmp_path / "a")
    make_run(tmp_path / "b")
    usage_error(["--resume", tmp_path / "a" / "checkpoint.pth.tar", "--output-dir", tmp_path / "b", *QUICK],
                "another run's files", "--overwrite")
    usage_error(["--resume", tmp_path / "a" / "checkpoint.pth.tar", "--output-dir", tmp_path / "a", "--overwrite",
                 *QUICK], "--overwrite would remove the run", "drop --overwrite")
    assert os.path.isfile(tmp_path / "a" / "checkpoint.pth.tar")


# --- item 5: flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needles", [
    (["--lr", "nan"], ["--lr", "finite number > 0"]),
    (["--lr", "inf"], ["--lr", "finite number > 0"]),
    (["--lr", "0"], ["--lr", "> 0"]),
    (["--lr", "-0.1"], ["--lr", "> 0"]),
    (["--momentum", "1"], ["--momentum", "[0, 1)"]),
    (["--momentum", "-0.5"], ["--momentum", "[0, 1)"]),
    (["--momentum", "nan"], ["--momentum", "[0, 1)"]),
    (["--wd=-1e-4"], ["--wd", ">= 0"]),  # argparse reads a bare -1e-4 as a flag
    (["--wd", "nan"], ["--wd", ">= 0"]),
    (["--seed", "-1"], ["--seed", f"0..{SEED_MAX}"]),
    (["--seed", str(SEED_MAX + 1)], ["--seed", f"0..{SEED_MAX}"]),
    (["--start-epoch", "12", "--epochs", "12"], ["--start-epoch 12", "nothing to train"]),
    (["-b", "0"], ["--batch-size", "positive"]),
    ([os.path.join(ROOT, "README.md")], ["README.md' is a file, not a directory", "ImageFolder root"]),
])
def test_senseless_flag_values_are_usage_errors(usage_error, tmp_path, argv, needles):
    usage_error([*argv, "--output-dir", tmp_path / "out", *TINY], *needles)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_extreme_but_valid_seeds_parse():
    parser = add_log_args(build_parser("t"))
    assert parse_args(parser, ["--seed", str(SEED_MAX)]).seed == SEED_MAX
    assert parse_args(parser, ["--seed", "0", "--momentum", "0", "--wd", "0"]).momentum == 0.0


def test_a_flag_error_is_printed_by_rank_0_only(capsys, monkeypatch):
    """Every rank parses the same argv; a bad flag value is one line from rank 0, not one a rank."""
    parser = add_log_args(build_parser("t"))
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            parse_args(parser, ["--momentum", "1"])
        err = capsys.readouterr().err
        assert exited.value.code == 2
        assert ("--momentum" in err) is printed, (rank, err)


def test_resume_that_changes_the_runs_meaning(usage_error, first_run, tiny_folder, tmp_path):
    checkpoint = first_run / "checkpoint.pth.tar"
    # Other class names: the labels would silently mean other classes.
    usage_error([tiny_folder, "--resume", checkpoint, "--output-dir", tmp_path / "x", *QUICK, "--epochs", "2"],
                "other classes", "class0")
    # Nothing left to train: the checkpoint has done --epochs already.
    usage_error(["--resume", checkpoint, "--output-dir", tmp_path / "y", *QUICK, "--epochs", "1"],
                "nothing is left to train", "raise --epochs")
    # Another opt level and half dtype, another global batch: it works and says what changed. An O0
    # epoch of HALF_QUICK's model, not first_run's resnet18: bf16 on a CPU (conftest.py).
    fp32 = run_script("train.py", "--output-dir", tmp_path / "fp32", *HALF_QUICK, "--epochs", "1")
    assert fp32.returncode == 0, fp32.stderr[-3000:]
    out = tmp_path / "changed"
    result = run_script("train.py", "--resume", tmp_path / "fp32" / "checkpoint.pth.tar", "--output-dir", out,
                        *HALF_TINY, "-b", "8", "--steps-per-epoch", "2", "--epochs", "2", "--opt-level", "O1",
                        "--mixed-precision", "bf16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming a checkpoint trained at O0 fp32 with O1 bf16: its fp32 weights" in result.stderr
    assert "not carried" not in result.stderr  # an fp32 run had no loss scale to carry
    assert "global batch 8" in result.stderr and "checkpoint had 16" in result.stderr
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["opt_level"] == "O1"


# --- item 6: data folders as found on real disks --------------------------------------------------

def test_folder_scan_skips_loops_duplicates_fifos_and_names_them(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=3, splits=("train",))
    train = os.path.join(root, "train")
    clean = [(os.path.relpath(p, train), c) for p, c in SafeImageFolder(train).samples]
    # Nested folders whose names sort differently as paths and as a tree: torchvision's order kept.
    for sub in ("b", "b-c", os.path.join("b", "x")):
        os.makedirs(os.path.join(train, "class1", sub))
    from PIL import Image
    for sub in ("b", "b-c", os.path.join("b", "x")):
        Image.new("RGB", (8, 8), (1, 2, 3)).save(os.path.join(train, "class1", sub, "n.jpg"))
    from torchvision.datasets import ImageFolder
    expected = [(os.path.relpath(p, train), c) for p, c in ImageFolder(train).samples]

    os.symlink("..", os.path.join(train, "class0", "loop"))                      # a link up the tree
    os.symlink(".", os.path.join(train, "class1", "b", "x", "self"))           # a link to itself
    os.symlink(os.path.join(train, "class0"), os.path.join(train, "class1", "other"))  # another class
    os.symlink("0.jpg", os.path.join(train, "class0", "again.jpg"))             # the same file twice
    os.mkfifo(os.path.join(train, "class0", "pipe.jpg"))                        # would block a worker
    open(os.path.join(train, "class1", "notes.txt"), "w").close()               # not an image
    os.symlink("missing.jpg", os.path.join(train, "class1", "dangling.jpg"))    # a broken link
    open(os.path.join(train, "README"), "w").close()                            # not a class folder

    dataset = SafeImageFolder(train)  # torchvision's own walk would go round the loop here
    found = [(os.path.relpath(p, train), c) for p, c in dataset.samples]
    assert found == expected and set(clean) < set(found)
    reasons = {os.path.relpath(path, train): reason for path, reason in dataset.skipped}
    assert reasons == {
        "README": "not a class folder",
        os.path.join("class0", "loop"): "a link to the split folder or another class folder",
        os.path.join("class1", "b", "x", "self"): f"the same folder as {os.path.join(train, 'class1', 'b', 'x')}",
        os.path.join("class1", "other"): f"the same folder as {os.path.join(train, 'class0')}",
        os.path.join("class0", "again.jpg"): f"the same file as {os.path.join(train, 'class0', '0.jpg')}",
        os.path.join("class0", "pipe.jpg"): "not a regular file (a FIFO, socket or device)",
        os.path.join("class1", "notes.txt"): "not an image file name",
        os.path.join("class1", "dangling.jpg"): "a broken link (No such file or directory)",
    }
    message = skipped_message(train, dataset.skipped, limit=2)
    assert message.startswith(f"{train}: skipped 8 entries: ") and message.endswith("; and 6 more")


def test_empty_class_folder_is_a_usage_error(usage_error, tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    os.makedirs(os.path.join(root, "train", "zebra"))
    os.makedirs(os.path.join(root, "val", "zebra"))
    usage_error([root, "--output-dir", tmp_path / "out", *TINY], "no images in the class folder(s) zebra")


def test_a_split_folder_given_as_data_names_the_folder_meant(usage_error, tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    for split in ("train", "val/"):  # with a trailing slash too, as a shell completes it
        usage_error([os.path.join(root, split), "--output-dir", tmp_path / "out", *TINY],
                    "has no train/ folder", f"(give {str(root)!r}, the folder above it)")
    lone = tmp_path / "lone" / "train"
    shutil.copytree(os.path.join(root, "train"), lone)  # no val/ beside it: nothing to suggest
    err = usage_error([lone, "--output-dir", tmp_path / "out", *TINY], "has no train/ folder")
    assert "the folder above it" not in err


def test_a_class_folder_linked_to_another_is_named_as_a_link(usage_error, tmp_path):
    """A class folder that is a link to another class's folder holds no images of its own: the
    message says which folder it is (it read as if the folder were empty)."""
    root = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    for split in ("train", "val"):
        os.symlink(os.path.join(root, split, "class0"), os.path.join(root, split, "class2"))
    usage_error([root, "--output-dir", tmp_path / "out", *TINY],
                f"no images in the class folder(s) class2 (class2 is the same folder as "
                f"{os.path.join(root, 'val', 'class0')})")  # val is read first


def test_training_on_a_folder_with_a_fifo_and_a_loop_does_not_hang(cache_dir, tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=8)
    os.mkfifo(os.path.join(root, "train", "class0", "pipe.jpg"))
    os.symlink("..", os.path.join(root, "val", "class1", "loop"))
    # -j 1: a worker process opens the files; torchvision's walk would keep the FIFO and block it.
    result = run_script("train.py", root, "--output-dir", tmp_path / "out", *TINY, "-j", "1", "-b", "4",
                        "--epochs", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pipe.jpg (not a regular file" in result.stderr and "loop (a link to the split folder or another class folder)" in result.stderr
    assert "Epoch: [0][4/4]" in result.stdout and " * Prec@1" in result.stdout


# --- item 7: checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("change,needles", [
    (lambda s: s.pop("optimizer"), ["'optimizer'", "resuming training needs"]),
    (lambda s: s.pop("epoch"), ["lacks the keys"]),
    (lambda s: s.update(epoch="3"), ["'epoch'", "an integer >= 0", "str '3'"]),
    (lambda s: s.update(state_dict={"conv.weight": [1.0, 2.0]}), ["'state_dict'", "dict of parameter names to tensors"]),
    (lambda s: s.update(state_dict=[1, 2]), ["'state_dict'", "list"]),
    (lambda s: s.update(optimizer={"param_groups": 3}), ["'optimizer'", "param_groups"]),
    (lambda s: s.update(best_prec1="high"), ["'best_prec1'", "a number"]),
    (lambda s: s.update(classes="cats"), ["'classes'", "list of class names"]),
    (lambda s: s.update(opt_level="O9"), ["'opt_level'"]),
])
def test_checkpoint_with_a_missing_key_or_wrong_type_is_named(usage_error, tmp_path, change, needles):
    state = {"epoch": 1, "arch": "resnet18", "state_dict": {"fc.bias": torch.zeros(10)},
             "optimizer": {"state": {}, "param_groups": []}, "best_prec1": 1.0, "classes": None,
             "opt_level": "O0", "loss_scale": None, "args": {}}
    change(state)
    save_checkpoint(state, False, tmp_path)
    usage_error(["--resume", tmp_path / "checkpoint.pth.tar", "--output-dir", tmp_path, *QUICK, "--epochs", "2"],
                *needles)


@pytest.mark.parametrize("best_so_far,failing", [(101.0, "checkpoint.pth.tar"), (-1.0, "model_best.pth.tar")])
def test_full_disk_during_a_save_exits_4_and_keeps_the_previous_checkpoint(first_run, tmp_path, best_so_far, failing):
    """A real write failure: the resumed run may write files no larger than half the checkpoint
    (RLIMIT_FSIZE; SIGXFSZ ignored so write() returns EFBIG rather than killing the process, as a
    full disk's ENOSPC would), so its first save fails mid-file. Which file that is depends on
    whether the epoch is a new best (model_best.pth.tar is written first), so both saved files get
    a best_prec1 that settles it: 101 (no epoch beats it) or -1 (every epoch does)."""
    out = copy_run(first_run, tmp_path / "run")
    for name in ("checkpoint.pth.tar", "model_best.pth.tar"):
        state = torch.load(out / name, weights_only=False)
        torch.save({**state, "best_prec1": best_so_far}, out / name)
    size = os.path.getsize(out / "checkpoint.pth.tar")
    (out / ".tmp-k1ll3d-checkpoint.pth.tar").write_bytes(b"half a checkpoint")  # a save killed earlier

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    before = {name: (out / name).read_bytes() for name in ("checkpoint.pth.tar", "model_best.pth.tar")}
    result = run_train("--resume", out / "checkpoint.pth.tar", "--output-dir", out, "--epochs", "2", *QUICK,
                       preexec_fn=limit_file_size)
    assert result.returncode == EXIT_WRITE_FAILED, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"could not write {out / failing}: File too large (EFBIG)" in lines[0]
    assert "still loads" in lines[0]
    assert "removed 1 temp file(s) an interrupted save left" in result.stdout
    assert "Epoch: [1][4/4]" in result.stdout  # it trained, then failed to save
    for name, content in before.items():  # neither saved file was touched
        assert (out / name).read_bytes() == content, name
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1
    assert not [name for name in os.listdir(out) if name.startswith(".tmp-")]


def test_saved_files_get_the_users_umask(first_run, tmp_path):
    # first_run ran under umask 027: files 0640, not mkstemp's 0600 nor a fixed 0644.
    for name in RUN_FILES:
        assert os.stat(first_run / name).st_mode & 0o777 == 0o640, name
    old = os.umask(0o002)
    try:
        save_checkpoint({"epoch": 1, "arch": "a", "state_dict": {}}, True, tmp_path)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "checkpoint.pth.tar").st_mode & 0o777 == 0o664
    assert os.stat(tmp_path / "model_best.pth.tar").st_mode & 0o777 == 0o664


def test_exit_codes_are_the_documented_ones():
    assert (EXIT_USAGE, EXIT_WRITE_FAILED) == (2, 4)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "When things go wrong" in readme
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 4 |", "| 130 |", "| 143 |"):
        assert code in readme, code


def test_every_process_of_a_2_process_run_stops_at_the_refusal(first_run, tmp_path):
    """Only the main process checks --output-dir; the other must get its verdict and stop too,
    with the same exit code (the line is printed once, by rank 0), rather than wait for it at the
    first collective. The two
    ranks are started by hand with torchrun's environment: torchrun itself would kill rank 1 as
    soon as rank 0 exits and report its own exit code 1, hiding what rank 1 did."""
    import socket
    run = copy_run(first_run, tmp_path / "run")
    before = snapshot(run)
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = subprocess_env({"ACCELERATE_USE_CPU": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                              "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                              "LOCAL_WORLD_SIZE": "2"})
        ranks.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *QUICK, "--epochs", "1",
                                       "--output-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=ROOT, env=env))
    results = [(process.communicate(timeout=TIMEOUT)[1], process.returncode) for process in ranks]
    one_error_line(results[0][1], results[0][0], "already holds a run", "--overwrite")
    assert results[1][1] == 2 and "error" not in results[1][0]  # the same verdict, printed once (rank 0)
    assert snapshot(run) == before


def test_only_temp_files_of_writers_that_are_gone_are_removed_and_only_by_the_owning_run(first_run, tmp_path):
    """A refused start leaves every temp file alone (one may be a live run's save in progress);
    a run that owns the directory removes those of dead writers and keeps a live writer's."""
    import socket
    out = copy_run(first_run, tmp_path / "run")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    names = {"live": f".tmp-{live.pid}@{host}~abc123-checkpoint.pth.tar",
             "dead": f".tmp-{dead.pid}@{host}~def456-checkpoint.pth.tar",
             "elsewhere": f".tmp-{live.pid}@another-host~ghi789-checkpoint.pth.tar"}
    try:
        for name in names.values():
            (out / name).write_bytes(b"part of a checkpoint")
        refused = run_train("--output-dir", out, "--epochs", "1", *QUICK)
        assert refused.returncode == 2 and "already holds a run" in refused.stderr
        assert all((out / name).exists() for name in names.values())
        resumed = run_train("--resume", out / "checkpoint.pth.tar", "--output-dir", out, "--epochs", "2", *QUICK)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "removed 1 temp file(s)" in resumed.stdout
        assert not (out / names["dead"]).exists()
        assert (out / names["live"]).exists() and (out / names["elsewhere"]).exists()
    finally:
        live.kill()
        live.wait()


def test_a_save_names_its_writer_in_the_temp_file():
    from utils.run.files import WRITER, temp_prefix, writer_gone
    match = WRITER.match(temp_prefix() + "x1y2z3-checkpoint.pth.tar")
    assert match and int(match.group(1)) == os.getpid()
    assert not writer_gone(temp_prefix() + "x1y2z3-checkpoint.pth.tar")  # this process runs
    assert writer_gone(".tmp-k1ll3d-checkpoint.pth.tar")  # no writer named: an older save


def test_a_prof_run_in_a_run_directory_neither_refuses_nor_writes(first_run, tmp_path):
    """--prof writes nothing (no log, no checkpoint, --save-every-steps idle), so it may profile
    with --output-dir pointing at a finished run: no refusal, no --overwrite removal, no change;
    a stop signal during it saves nothing either (tested in test_preemption)."""
    out = copy_run(first_run, tmp_path / "run")
    before = snapshot(out)
    result = run_train("--prof", "0", "--save-every-steps", "1", "--overwrite",
                       "--output-dir", out, *QUICK, "--steps-per-epoch", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--save-every-steps, --overwrite have no effect here" in result.stderr or \
        "--overwrite, --save-every-steps have no effect here" in result.stderr, result.stderr[-2000:]
    assert snapshot(out) == before


def test_resuming_an_older_checkpoint_keeps_a_better_model_best(first_run, tmp_path):
    """model_best.pth.tar from a continuation the resume abandons may beat the resumed
    checkpoint's best: the run says so and replaces it only with a better epoch."""
    out = copy_run(first_run, tmp_path / "run")
    best = torch.load(out / "model_best.pth.tar", weights_only=True)
    best["best_prec1"] = 100.0  # as if a later epoch had scored it
    torch.save(best, out / "model_best.pth.tar")
    before = (out / "model_best.pth.tar").read_bytes()
    resumed = run_train("--resume", out / "checkpoint.pth.tar", "--output-dir", out, "--epochs", "2", *QUICK)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "model_best.pth.tar in" in resumed.stdout and "holds Prec@1 100.000, above this checkpoint's best" in \
        resumed.stdout
    assert (out / "model_best.pth.tar").read_bytes() == before
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["best_prec1"] == 100.0


def test_a_failed_model_best_write_leaves_checkpoint_at_the_epoch_before(tmp_path):
    """model_best.pth.tar is written first: when it cannot be (here a folder holds its name),
    checkpoint.pth.tar is still the previous epoch's, the one summary.csv ends with."""
    from utils.run.checkpoint import save_checkpoint
    from utils.run.errors import WriteError
    save_checkpoint({"epoch": 1, "step": 0}, False, tmp_path)
    (tmp_path / "model_best.pth.tar").mkdir()
    (tmp_path / "model_best.pth.tar" / "something").write_text("x")
    with pytest.raises((WriteError, OSError)):
        save_checkpoint({"epoch": 2, "step": 0}, True, tmp_path)
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1
