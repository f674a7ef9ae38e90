"""eval.py: settings from the checkpoint, the same top-1 as train.py printed, every opt level,
results files, and one-line errors. (Several processes: tests/test_distributed.py.)"""
import csv
import importlib
import json
import os
import re
import shutil
import sys

import pytest
import torch
from conftest import ROOT, make_image_folder, run_command, run_script

from utils.run.checkpoint import save_checkpoint
from utils.run.errors import UsageError, exit_on_usage_error

FINAL = re.compile(r" \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)")
EVAL_TAIL = re.compile(r" \* Loss ([\d.]+) Images (\d+) Speed ([\d.]+) images/s")
DIGITS_VAL = 359
# The scripts run on the CPU, one thread: spinning OpenMP threads crawl on a busy 2-core machine,
# and on a GPU machine train.py and eval.py could pick different cuDNN kernels (a near tie may flip).
CPU = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
# The model the checkpoint below holds. Not resnet18: it is evaluated in bf16 and fp16, and
# resnet18's half-precision convolutions crawl on a CPU without AVX-512 (conftest.py). timm's
# test_efficientnet has BatchNorm (so O2/O3 and --keep-batchnorm-fp32 change it) and, after 40
# steps, scores 40-50% (CPUs differ) with image-dependent predictions: 4 steps of a small model leave near-uniform
# logits, which every precision would reproduce whatever its rounding did to the features.
ARCH = "timm/test_efficientnet"


@pytest.fixture(scope="module")
def trained(cache_dir, tmp_path_factory):
    """One short O2 bf16 epoch of train.py on the digits (ARCH, 40 steps); (output dir, its stdout)."""
    out = tmp_path_factory.mktemp("trained")
    run = run_script("train.py", "-a", ARCH, "--image-size", "32", "-b", "16", "--steps-per-epoch", "40",
                     "--epochs", "1", "-j", "0", "-p", "2", "--opt-level", "O2", "--mixed-precision", "bf16",
                     "--output-dir", out, env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


@pytest.fixture(scope="module")
def fp32_result(trained, evaluate):
    return evaluate("--resume", trained[0] / "checkpoint.pth.tar", "--opt-level", "O0", "-j", "0", "-b", "64")



def test_no_arguments_but_the_checkpoint_repeats_train_top1(trained, tmp_path):
    out, train_stdout = trained
    printed = FINAL.findall(train_stdout)[-1]
    result = run_script("eval.py", "--resume", out / "model_best.pth.tar", env=CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    assert FINAL.findall(result.stdout) == [printed]  # top-1 and top-5, to the printed digit
    loss, images, speed = EVAL_TAIL.search(result.stdout).groups()
    assert int(images) == DIGITS_VAL and float(speed) > 0 and 0 < float(loss) < 10
    # Everything came from the checkpoint: digits, 32 px, batch 16, O2 with bf16.
    assert "=> digits val: 359 images | 10 classes" in result.stdout
    assert "batch 16 per process | resize 33 + center crop 32" in result.stdout  # the timm model's crop pct 0.95
    assert "precision: O2 bf16 | weights half, BN fp32\n" in result.stdout  # no loss scale: not training
    assert re.search(r"Test: \[\d+/\d+\]\tTime [\d.]+\tSpeed [\d.]+\tLoss [\d.]+\tPrec@1 [\d.]+\tPrec@5 [\d.]+",
                     result.stdout), "no Apex-style progress lines"


@pytest.mark.parametrize("flags", [
    ["--opt-level", "O0"],
    ["--opt-level", "O1", "--mixed-precision", "bf16"],
    ["--opt-level", "O1", "--mixed-precision", "fp16", "--channels-last"],
    ["--opt-level", "O2", "--mixed-precision", "fp16"],
    ["--opt-level", "O3", "--mixed-precision", "bf16", "--channels-last", "True"],
    ["--opt-level", "O3", "--mixed-precision", "bf16", "--keep-batchnorm-fp32", "True"],
])
def test_every_opt_level_scores_close_to_fp32(trained, evaluate, fp32_result, flags):
    reference = fp32_result
    result = evaluate("--resume", trained[0] / "checkpoint.pth.tar", "-j", "0", "-b", "64", *flags)
    assert result.count == reference.count == DIGITS_VAL
    assert abs(result.top1 - reference.top1) <= 1.5, (result.top1, reference.top1)  # a few near-ties flip
    # The loss moves with the half type's rounding, in proportion to the logits (and so to the
    # loss): measured on a CPU with native bf16, fp16 moved it 0.06 %, O1 bf16 0.6 %, O3 bf16 with
    # BatchNorm in bf16 1.2 % (bf16 keeps 8 significand bits, fp16 11). A wrong cast moves it far more.
    dtype = next((name for name in ("bf16", "fp16") if name in flags), "fp32")
    allowed = {"fp32": 1e-6, "fp16": 0.005, "bf16": 0.025}[dtype] * reference.loss
    assert abs(result.loss - reference.loss) <= allowed, (result.loss, reference.loss, dtype)


def test_results_files_and_overrides(trained, evaluate, tmp_path):
    out, _ = trained
    checkpoint = out / "checkpoint.pth.tar"
    digits = os.path.join(os.environ["IMAGENET_AMP_CACHE"], "digits-v1")
    as_json = tmp_path / "sub" / "r.json"
    evaluate("--resume", checkpoint, digits, "--image-size", "40", "-b", "50", "-j", "0",
             "--results-file", as_json)
    record = json.loads(as_json.read_text())
    assert (record["epoch"], record["arch"], record["opt_level"]) == (1, ARCH, "O2")
    assert (record["eval_opt_level"], record["eval_dtype"]) == ("O2", "bf16")  # inherited
    assert (record["data"], record["image_size"], record["batch_size"]) == (digits, 40, 50)  # overridden
    assert record["images"] == DIGITS_VAL and 0 <= record["top5"] <= 100 and record["images_per_sec"] > 0

    as_csv = tmp_path / "r.csv"
    result = evaluate("--resume", checkpoint, "-j", "0", "--opt-level", "O0", "--results-file", as_csv)
    with open(as_csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 1 and rows[0]["eval_opt_level"] == "O0" and rows[0]["eval_dtype"] == "no"
    assert float(rows[0]["top1"]) == pytest.approx(result.top1, abs=1e-4)
    assert int(rows[0]["images"]) == DIGITS_VAL and rows[0]["data"] == "digits"


def test_val_only_folder_is_enough(trained, evaluate, tmp_path):
    """Evaluating needs val/ only (a train/ folder is not read)."""
    out, _ = trained
    digits = os.path.join(os.environ["IMAGENET_AMP_CACHE"], "digits-v1")
    val_only = tmp_path / "val_only"
    shutil.copytree(os.path.join(digits, "val"), val_only / "val")
    result = evaluate("--resume", out / "checkpoint.pth.tar", val_only, "-j", "0")
    assert result.count == DIGITS_VAL


def test_checkpoint_and_data_mistakes_are_usage_errors(trained, evaluate, tmp_path):
    out, _ = trained
    checkpoint = out / "checkpoint.pth.tar"

    def refused(*argv, match):
        with pytest.raises(UsageError, match=match):
            evaluate(*argv)

    refused("-j", "0", match="needs a checkpoint: --resume")
    refused("--resume", tmp_path / "missing.pth.tar", match="no checkpoint at")
    data = checkpoint.read_bytes()
    (tmp_path / "truncated.pth.tar").write_bytes(data[: len(data) // 3])
    refused("--resume", tmp_path / "truncated.pth.tar", match="truncated or not a checkpoint")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    refused("--resume", tmp_path / "notes.txt", match="truncated or not a checkpoint")
    torch.save({"weights": torch.ones(3)}, tmp_path / "other.pth")
    refused("--resume", tmp_path / "other.pth", match="not a train.py checkpoint")

    refused("--resume", checkpoint, "-a", "resnet34", match=f"holds a {ARCH} model, not -a resnet34")
    refused("--resume", checkpoint, "--num-classes", "7", match="has 10 classes, not --num-classes 7")
    refused("--resume", checkpoint, "--lr", "0.5", "--epochs=3", match="--epochs, --lr: not eval.py flag")

    three = make_image_folder(tmp_path / "three", classes=3, per_class=2, splits=("val",))
    refused("--resume", checkpoint, three, match="other classes than checkpoint")
    ten = make_image_folder(tmp_path / "ten", classes=10, per_class=1, splits=("val",))
    refused("--resume", checkpoint, ten, "-j", "0", match=r"10 vs 10; not in the checkpoint: \['class0'")

    state = torch.load(checkpoint, weights_only=True)
    state["args"]["data"] = str(tmp_path / "moved-away")
    save_checkpoint(state, False, tmp_path / "moved")
    refused("--resume", tmp_path / "moved" / "checkpoint.pth.tar",
            match="was trained on DATA .*moved-away.*which does not exist here; give DATA")


def test_mixed_precision_no_evaluates_a_half_checkpoint_in_fp32(tmp_path):
    """--mixed-precision no on an O2 bf16 checkpoint was refused as contradicting --opt-level O2,
    which only the checkpoint named; it evaluates at O0, the checkpoint's keep-BN choice dropped."""
    import eval as eval_script
    from utils.precision import resolve_precision
    state = {"epoch": 1, "arch": "resnet18", "opt_level": "O2", "mixed_precision": "bf16",
             "state_dict": {"fc.weight": torch.zeros(3, 512)},
             "args": {"opt_level": "O2", "keep_batchnorm_fp32": False, "mixed_precision": "bf16"}}
    save_checkpoint(state, False, tmp_path)
    args, _ = eval_script.parse_eval_args(["--resume", str(tmp_path / "checkpoint.pth.tar"),
                                           "--mixed-precision", "no"])
    assert (args.opt_level, args.keep_batchnorm_fp32, args.mixed_precision) == ("O0", None, "no")
    recipe, notes = resolve_precision(args.opt_level, args.keep_batchnorm_fp32, None, "no", "--mixed-precision")
    assert recipe.opt_level == "O0" and notes == []


def one_error_line(code, stderr, needle):
    """Exit code 2 and one `prog: error: ...` line (warnings aside) naming needle; no traceback."""
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]
    assert code == 2 and len(lines) == 1, (code, stderr[-2000:])
    assert ": error: " in lines[0] and needle in lines[0] and "Traceback" not in stderr, lines[0]


def test_errors_exit_2_with_one_line(trained, evaluate, capsys, tmp_path):
    """In this process, through the exit path `python eval.py` takes: argparse's errors and ours."""
    out, _ = trained
    checkpoint = out / "checkpoint.pth.tar"
    for argv, needle in [(["--resume", tmp_path / "nothing.pth.tar"], "no checkpoint"),
                         (["--resume", checkpoint, "--results-file", "r.txt"], ".json or .csv"),
                         # a training run's own files are never replaced, nor is a file a folder
                         (["--resume", checkpoint, "--results-file", out / "summary.csv"], "a training run's file"),
                         (["--resume", checkpoint, "--predictions", out / "summary.csv"], "a training run's file"),
                         (["--resume", checkpoint, "--results-file", out / "args.yaml" / "r.json"],
                          "is a file, not a folder"),
                         (["--resume", checkpoint, "--opt-level", "O4"], "unknown opt level"),
                         (["--resume", checkpoint, "--lr", "0.5"], "--lr: not eval.py flag"),
                         (["--resume", checkpoint, "a", "b"], "unrecognized arguments: b")]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            exit_on_usage_error(lambda: evaluate(*argv))
        one_error_line(exited.value.code, capsys.readouterr().err, needle)


def test_error_end_to_end_exits_2_without_traceback(trained, tmp_path):
    """The real script in its own process, refused after the data was read."""
    three = make_image_folder(tmp_path / "three", classes=3, per_class=2, splits=("val",))
    result = run_script("eval.py", "--resume", trained[0] / "checkpoint.pth.tar", three, "-j", "0", env=CPU)
    one_error_line(result.returncode, result.stderr, "other classes")
    assert result.stderr.startswith("eval.py: error: ") or "\neval.py: error: " in result.stderr


def test_flags_typed_are_found_in_one_parse():
    """What the user typed, also when it equals the default; DATA only when given."""
    script = importlib.import_module("eval")
    typed = script.typed_flags(["--resume", "c.pth.tar", "-p", "10", "--channels-last", "-b=16"])
    assert (set(typed), typed["resume"]) == ({"resume", "print_freq", "channels_last", "batch_size"}, "c.pth.tar")
    assert set(script.typed_flags(["somewhere", "--deterministic"])) == {"data", "deterministic"}


def test_help_lists_eval_flags_with_defaults_and_no_training_ones():
    text = " ".join(importlib.import_module("eval").build_eval_parser().format_help().split())
    for flag in ("--resume", "--results-file", "--opt-level", "--channels-last", "--image-size", "-b N",
                 "--val-split", "--local_rank", "--pretrained", "--predictions PATH.csv"):
        assert flag in text, flag
    for flag in ("--lr", "--epochs", "--momentum", "--sync_bn", "--prof", "--min-scale", "--loss-scale",
                 "--train-split", "--output-dir", "--seed"):
        assert f" {flag} " not in text, flag
    assert "the checkpoint's value unless given" in text and "(default: none)" in text


# --- per-image predictions -------------------------------------------------------------------

def read_predictions(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def check_predictions(rows, val_size, top1):
    """Every val image once, in index order, with its file, label, a ranked top-5 and top-1 as printed."""
    assert [int(row["index"]) for row in rows] == list(range(val_size))
    paths = [row["path"] for row in rows]
    assert len(set(paths)) == val_size and all(os.path.isfile(path) for path in paths)
    hits = 0
    for row in rows:
        assert row["label_name"] == os.path.basename(os.path.dirname(row["path"]))  # the class folder
        probs = [float(row[f"prob{r}"]) for r in range(1, 6)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-5
        assert row["name1"] == row["pred1"]  # digits: class k lives in folder "k"
        hits += row["pred1"] == row["label"]
    assert 100.0 * hits / val_size == pytest.approx(top1, abs=1e-3)


def test_predictions_csv_holds_every_image_once(trained, evaluate, tmp_path):
    path = tmp_path / "out" / "preds.csv"
    result = evaluate("--resume", trained[0] / "checkpoint.pth.tar", "-j", "0", "-b", "64", "--opt-level", "O0",
                      "--predictions", path)
    rows = read_predictions(path)
    check_predictions(rows, DIGITS_VAL, result.top1)
    assert list(rows[0])[:6] == ["index", "path", "label", "label_name", "pred1", "pred2"]
    assert not [name for name in os.listdir(path.parent) if name != "preds.csv"]  # no temp file left


def test_predictions_from_two_processes_hold_every_image_once(trained, tmp_path):
    """gloo, 2 processes: 359 images split 180 + 179, gathered to rank 0 and written once."""
    path = tmp_path / "preds.csv"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = run_command([torchrun, "--standalone", "--nproc_per_node", 2, os.path.join(ROOT, "eval.py"),
                       "--resume", trained[0] / "checkpoint.pth.tar", "-j", "0", "-b", "32", "--opt-level", "O0",
                       "--predictions", path], env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es)" in run.stdout
    top1 = float(FINAL.findall(run.stdout)[-1][0])
    check_predictions(read_predictions(path), DIGITS_VAL, top1)


def test_predictions_mistakes_are_usage_errors(trained, evaluate):
    checkpoint = trained[0] / "checkpoint.pth.tar"
    with pytest.raises(SystemExit):  # argparse: checked before any work
        evaluate("--resume", checkpoint, "--predictions", "preds.txt")
    with pytest.raises(UsageError, match="--predictions needs real images"):
        evaluate("--resume", checkpoint, "synthetic", "--predictions", "p.csv")


# --- --pretrained ----------------------------------------------------------------------------

TINY_TIMM = "test_resnet.r160_in1k"  # timm's own test model (tests/test_models.py): 160 px, mean/std 0.5


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """A private TORCH_HOME holding a real torchvision resnet18 state dict where torchvision's
    weights enum says it lives (the file name of its download URL)."""
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = torchvision.models.get_model_weights("resnet18").DEFAULT.url
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.manual_seed(3)
    reference = torchvision.models.resnet18().state_dict()
    return folder / os.path.basename(url), reference


def test_pretrained_torchvision_weights_need_the_weights_classes(torch_home, evaluate, tmp_path):
    path, reference = torch_home
    three = make_image_folder(tmp_path / "three", classes=3, per_class=2, splits=("val",))
    with pytest.raises(UsageError, match="no local weights for resnet18 .*never downloads"):
        evaluate("--pretrained", "-a", "resnet18", three, "-j", "0")
    torch.save(reference, path)
    with pytest.raises(UsageError, match=r"has 3 classes but the pretrained resnet18 weights have 1000"):
        evaluate("--pretrained", "-a", "resnet18", three, "-j", "0")
    with pytest.raises(UsageError, match="weights have 1000 classes, not --num-classes 3"):
        evaluate("--pretrained", "-a", "resnet18", three, "--num-classes", "3")


def test_pretrained_usage_errors(trained, evaluate):
    with pytest.raises(UsageError, match="--pretrained and --resume both"):
        evaluate("--pretrained", "-a", "resnet18", "--resume", trained[0] / "checkpoint.pth.tar")
    with pytest.raises(UsageError, match="--pretrained needs -a ARCH"):
        evaluate("--pretrained")
    with pytest.raises(UsageError, match="unknown architecture 'resnet181'"):
        evaluate("--pretrained", "-a", "resnet181")
    with pytest.raises(UsageError, match="needs a checkpoint: --resume PATH .*or --pretrained -a ARCH"):
        evaluate("-a", "resnet18")


def test_pretrained_timm_weights_end_to_end_match_timms_own_pipeline(evaluate, tmp_path, monkeypatch):
    """timm/test_resnet's ImageNet head (1000 classes) on a 1000-class val folder, from a copied
    Hugging Face cache: eval.py uses the model's data config (160 px, crop 0.95, mean/std 0.5), and
    each image's top-5 equals what timm's own eval transform and the same weights give."""
    import timm
    import timm.data
    from huggingface_hub import constants
    from PIL import Image
    from test_models import fake_hf_cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    torch.manual_seed(4)
    model = timm.create_model(TINY_TIMM).eval()
    fake_hf_cache(tmp_path / "hub", "timm/" + TINY_TIMM, model.state_dict())
    folder = make_image_folder(tmp_path / "imagenet", classes=1000, per_class=1, size=(36, 28), splits=("val",))
    preds, record = tmp_path / "preds.csv", tmp_path / "r.json"
    result = evaluate("--pretrained", "-a", "timm/test_resnet", folder, "-j", "0", "-b", "100",
                      "--predictions", preds, "--results-file", record)
    assert result.count == 1000
    saved = json.loads(record.read_text())
    assert (saved["checkpoint"], saved["epoch"], saved["image_size"]) == ("pretrained timm/test_resnet", None, 160)

    rows = read_predictions(preds)
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    same = 0
    with torch.no_grad():
        for start in range(0, 1000, 250):
            batch = torch.stack([transform(Image.open(row["path"]).convert("RGB")) for row in rows[start:start + 250]])
            probs = torch.softmax(model(batch), 1)
            for row, image_probs in zip(rows[start:start + 250], probs):
                top = image_probs.topk(5)
                same += [int(row[f"pred{r}"]) for r in range(1, 6)] == top.indices.tolist()
                assert float(row["prob1"]) == pytest.approx(top.values[0].item(), abs=2e-3)
    assert same >= 990, same  # a near-tie among 1000 random-weight logits may flip an order


@pytest.fixture(scope="module")
def wide_adamw(cache_dir, tmp_path_factory):
    """A digits checkpoint with more outputs than classes (--num-classes 12) and AdamW."""
    out = tmp_path_factory.mktemp("wide_adamw")
    run = run_script("train.py", "-a", "resnet18", "--image-size", "32", "-b", "16", "--steps-per-epoch", "3",
                     "--epochs", "1", "-j", "0", "--num-classes", "12", "--opt", "adamw", "--lr", "0.01",
                     "--output-dir", out, env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_a_checkpoint_with_more_outputs_than_classes_evaluates(wide_adamw):
    result = run_script("eval.py", "--resume", wide_adamw / "checkpoint.pth.tar", env=CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    assert FINAL.search(result.stdout)


def test_resuming_with_another_optimizer_is_one_line(wide_adamw, tmp_path):
    result = run_script("train.py", "--resume", wide_adamw / "checkpoint.pth.tar", "--opt", "sgd", "--epochs", "2",
                        "--output-dir", tmp_path, env=CPU)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "was trained with --opt adamw, this run builds --opt sgd" in result.stderr


def test_results_and_predictions_in_one_file_are_refused(wide_adamw, tmp_path):
    same = tmp_path / "out.csv"
    result = run_script("eval.py", "--resume", wide_adamw / "checkpoint.pth.tar", "--results-file", same,
                        "--predictions", same, env=CPU)
    assert result.returncode == 2 and "name the same file" in result.stderr and not same.exists()


def test_a_checkpoint_names_its_data_folder_absolutely(tmp_path, monkeypatch):
    """DATA typed as a relative folder is stored absolute, so eval.py run from elsewhere reads
    the same folder, not a namesake in its own working directory."""
    from utils.data.sources import absolute_data
    (tmp_path / "fake").mkdir()
    monkeypatch.chdir(tmp_path)
    assert absolute_data("fake") == str(tmp_path / "fake")
    assert absolute_data("hf:fake") == "hf:" + str(tmp_path / "fake")
    assert [absolute_data(name) for name in (None, "digits", "synthetic", "hf:mnist", "missing")] == \
        [None, "digits", "synthetic", "hf:mnist", "missing"]


def test_channels_last_follows_the_evaluating_device_not_the_checkpoint(trained, evaluate, tmp_path):
    """A checkpoint from a CUDA run stores channels_last True (the default there); evaluated on a CPU
    it runs in the CPU's default layout unless --channels-last is given. The checkpoint here stores
    the other device's default, so the test holds on a GPU machine too (eval runs on CUDA there)."""
    default_here = torch.cuda.is_available()  # ARCH has 2-D convolutions: on by default on CUDA only
    state = torch.load(trained[0] / "checkpoint.pth.tar", weights_only=True)
    state["args"]["channels_last"] = not default_here
    save_checkpoint(state, False, tmp_path / "other_device")
    checkpoint = tmp_path / "other_device" / "checkpoint.pth.tar"
    for flags, expected in (((), default_here), (("--channels-last", str(not default_here)), not default_here)):
        record_file = tmp_path / f"r{int(expected)}.json"
        evaluate("--resume", checkpoint, "-j", "0", "--results-file", record_file, *flags)
        assert json.loads(record_file.read_text())["channels_last"] is expected
