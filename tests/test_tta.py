"""--tta flip: validation also scores each image mirrored and counts the mean of the two logits,
in train.py's epochs (a line after the Apex one, summary.csv columns) and eval.py (inherited from
the checkpoint, the results file, --predictions)."""
import csv
import json
import re
import types

import pytest
import torch
from conftest import run_script

from utils.data.batches import Data
from utils.data.sources import DataSpec, build_data
from utils.engine import Watch, validate
from utils.logs import SUMMARY_COLUMNS, TTA_COLUMNS, RunLog
from utils.meters import EpochResult
from utils.precision import Precision, resolve_precision
from utils.run.errors import UsageError

PLAIN = re.compile(r" \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)")
TTA = re.compile(r" \* TTA flip Prec@1 ([\d.]+) Prec@5 ([\d.]+)")
CPU = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}


def fp32(model):
    return Precision(resolve_precision("O0", None, None, None)[0], model, "cpu")


def run_validate(model, data, accelerator, **kwargs):
    """validate() on the CPU in fp32; (EpochResult, the lines it logged)."""
    lines = []
    result = validate(model, data, fp32(model), accelerator, print_freq=1000, watch=Watch(log=lines.append),
                      **kwargs)
    return result, lines


def topk_hits(logits, target, k):
    return logits.topk(k, dim=1).indices.eq(target.view(-1, 1)).any(dim=1).sum().item()


class SeesFormats(torch.nn.Module):
    """A small convolution whose kernel is not mirror-symmetric (so flipping changes its logits),
    and the memory formats of what it was given."""

    def __init__(self, classes):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 5, stride=2)
        self.head = torch.nn.Linear(8 * 4, classes)
        self.channels_last = []

    def forward(self, x):
        self.channels_last.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        features = torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), (2, 2))
        return self.head(features.flatten(1))


def test_flip_figures_are_the_mean_of_plain_and_mirrored_logits(accelerator, tiny_folder):
    spec = DataSpec(data=tiny_folder, batch_size=5, workers=0, seed=0, image_size=24, channels_last=True)
    data = build_data(spec, accelerator, train=False)
    model = SeesFormats(data.num_classes).eval()
    seen = []
    result, lines = run_validate(model, data, accelerator, tta="flip",
                                 on_logits=lambda logits, target: seen.append(logits.clone()))
    assert model.channels_last and all(model.channels_last)  # the mirrored batches stay channels_last too

    plain_hits = tta_hits = plain_top5_hits = tta_top5_hits = count = 0
    means = []
    with torch.no_grad():
        for images, target in data.val_batches():
            plain, mirrored = model(images), model(images.flip(3))
            mean = (plain + mirrored) / 2
            means.append(mean)
            plain_hits += topk_hits(plain, target, 1)
            tta_hits += topk_hits(mean, target, 1)
            plain_top5_hits += topk_hits(plain, target, min(5, data.num_classes))
            tta_top5_hits += topk_hits(mean, target, min(5, data.num_classes))
            count += target.numel()
    assert count == result.count == data.val_size == 18
    assert result.top1 == pytest.approx(100.0 * plain_hits / count)
    assert result.tta_top1 == pytest.approx(100.0 * tta_hits / count)
    assert result.tta_top5 == pytest.approx(100.0 * tta_top5_hits / count)
    assert lines == [f" * Prec@1 {100.0 * plain_hits / count:.3f} Prec@5 {100.0 * plain_top5_hits / count:.3f}",
                     f" * TTA flip Prec@1 {100.0 * tta_hits / count:.3f} Prec@5 {100.0 * tta_top5_hits / count:.3f}"]
    # on_logits saw the TTA mean of every batch, in loader order, and in fp32.
    assert len(seen) == len(means) and all(s.dtype == torch.float32 for s in seen)
    torch.testing.assert_close(torch.cat(seen), torch.cat(means))

    # Without --tta: the same plain figures, one line, no TTA figures, on_logits sees the plain logits.
    plain_seen = []
    off, off_lines = run_validate(model, data, accelerator,
                                  on_logits=lambda logits, target: plain_seen.append(logits.clone()))
    assert (off.top1, off.top5, off.loss) == (result.top1, result.top5, result.loss)
    assert off_lines == lines[:1] and (off.tta_top1, off.tta_top5) == (None, None)
    with torch.no_grad():
        expected = torch.cat([model(images) for images, _ in data.val_batches()])
    torch.testing.assert_close(torch.cat(plain_seen), expected)


class LeftColumn(torch.nn.Module):
    """Logits: the image's left pixel column (channel 0); a mirrored image shows it its right one."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))  # Precision places a model by its parameters

    def forward(self, x):
        return x[:, 0, :, 0] * self.scale


class MeanColour(torch.nn.Module):
    """Logits from the image's mean colour only: a mirrored image gives the very same logits."""

    def __init__(self, classes):
        super().__init__()
        torch.manual_seed(1)
        self.head = torch.nn.Linear(3, classes)

    def forward(self, x):
        return self.head(x.mean(dim=(2, 3)))


def sided_data(classes=4, per_batch=6, batches=2):
    """Images whose left column says the label (1.0 at row label) and whose right column says the
    next class louder (3.0): the left column alone is right, the mean with the mirror is wrong."""
    val = []
    for b in range(batches):
        target = torch.arange(b * per_batch, (b + 1) * per_batch) % classes
        images = torch.zeros(per_batch, 3, classes, 2)
        images[torch.arange(per_batch), 0, target, 0] = 1.0
        images[torch.arange(per_batch), 0, (target + 1) % classes, 1] = 3.0
        images[:, 1:] = torch.rand(per_batch, 2, classes, 2)
        val.append((images, target))
    return Data(train=None, val=val, num_classes=classes, val_size=per_batch * batches)


def test_a_mirror_invariant_model_scores_the_same_and_a_one_sided_one_does_not(accelerator):
    data = sided_data()
    one_sided, lines = run_validate(LeftColumn(), data, accelerator, tta="flip")
    assert (one_sided.top1, one_sided.tta_top1) == (100.0, 0.0)
    assert PLAIN.fullmatch(lines[0]).groups() == ("100.000", "100.000")  # 4 classes: top-5 is every class
    assert TTA.fullmatch(lines[1]).groups() == ("0.000", "100.000")

    invariant, lines = run_validate(MeanColour(data.num_classes), data, accelerator, tta="flip")
    assert (invariant.tta_top1, invariant.tta_top5) == (invariant.top1, invariant.top5)
    assert TTA.fullmatch(lines[1]).groups() == PLAIN.fullmatch(lines[0]).groups()


def test_the_ema_label_names_the_tta_line_and_an_unknown_mode_is_a_usage_error(accelerator):
    _, lines = run_validate(LeftColumn(), sided_data(), accelerator, tta="flip", label="EMA")
    assert lines == [" * EMA Prec@1 100.000 Prec@5 100.000", " * EMA TTA flip Prec@1 0.000 Prec@5 100.000"]
    with pytest.raises(UsageError, match=r"--tta 'mirror'.*--tta none or --tta flip"):
        run_validate(LeftColumn(), sided_data(), accelerator, tta="mirror")


def write_old_summary(path):
    """A summary.csv as runs without --tta write it: SUMMARY_COLUMNS only."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(SUMMARY_COLUMNS)
        writer.writerow([0, 2.5, 10, 2, 20, 60, 0.05, 32, 0, "", "", ""])


def read_csv(path):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return tuple(reader.fieldnames), list(reader)


@pytest.mark.parametrize("tta", [False, True])
def test_resuming_an_older_summary_keeps_its_rows(tmp_path, tta):
    write_old_summary(tmp_path / "summary.csv")
    main = types.SimpleNamespace(is_main_process=True, is_local_main_process=True, log=lambda values, step: None)
    run_log = RunLog(main, str(tmp_path), {}, start_epoch=1, resume=str(tmp_path / "checkpoint.pth.tar"))
    train = EpochResult(2.0, 30.0, 70.0, 64, 2.0, 32.0)
    val = EpochResult(1.5, 40.0, 80.0, 359, 1.0, 359.0, tta_top1=42.5 if tta else None,
                      tta_top5=81.25 if tta else None)
    run_log.epoch(1, train, val, types.SimpleNamespace(param_groups=[{"lr": 0.01}]))
    columns, rows = read_csv(tmp_path / "summary.csv")
    assert [row["epoch"] for row in rows] == ["0", "1"] and rows[0]["top1"] == "20" and rows[1]["top1"] == "40"
    if not tta:  # a run without --tta writes the header it always did
        assert columns == SUMMARY_COLUMNS
        return
    assert columns == SUMMARY_COLUMNS + TTA_COLUMNS
    assert [(row["tta_top1"], row["tta_top5"]) for row in rows] == [("", ""), ("42.5", "81.25")]
    assert rows[1]["ema_tta_top1"] == rows[1]["ema_tta_top5"] == ""  # no --model-ema


@pytest.fixture(scope="module")
def tta_run(cache_dir, tmp_path_factory):
    """One short digits epoch of train.py --tta flip: (output dir, its stdout)."""
    out = tmp_path_factory.mktemp("tta_run")
    result = run_script("train.py", "--epochs", "1", "--steps-per-epoch", "3", "-j", "0", "--tta", "flip",
                        "--output-dir", out, env=CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def test_train_prints_the_tta_line_after_the_plain_one_and_records_it(tta_run):
    out, stdout = tta_run
    lines = stdout.splitlines()
    plain = [i for i, line in enumerate(lines) if PLAIN.fullmatch(line)]
    tta = [i for i, line in enumerate(lines) if TTA.fullmatch(line)]
    assert len(plain) == len(tta) == 1 and tta[0] == plain[0] + 1
    columns, rows = read_csv(out / "summary.csv")
    assert columns == SUMMARY_COLUMNS + TTA_COLUMNS and len(rows) == 1
    printed = TTA.fullmatch(lines[tta[0]]).groups()
    assert (f"{float(rows[0]['tta_top1']):.3f}", f"{float(rows[0]['tta_top5']):.3f}") == printed
    assert (f"{float(rows[0]['top1']):.3f}", f"{float(rows[0]['top5']):.3f}") == PLAIN.fullmatch(
        lines[plain[0]]).groups()
    # model_best follows the plain Prec@1
    assert torch.load(out / "model_best.pth.tar", weights_only=False)["best_prec1"] == pytest.approx(
        float(rows[0]["top1"]))



def test_eval_inherits_tta_and_writes_its_figures(tta_run, evaluate, capsys, tmp_path):
    out, train_stdout = tta_run
    checkpoint = out / "checkpoint.pth.tar"
    record_file, preds = tmp_path / "r.json", tmp_path / "preds.csv"
    result = evaluate("--resume", checkpoint, "-j", "0", "--results-file", record_file, "--predictions", preds)
    stdout = capsys.readouterr().out
    # The checkpoint's own --tta flip, and the figures train.py printed for it.
    assert TTA.findall(stdout) == TTA.findall(train_stdout) and PLAIN.findall(stdout) == PLAIN.findall(train_stdout)
    record = json.loads(record_file.read_text())
    assert record["tta"] == "flip" and (record["tta_top1"], record["tta_top5"]) == (
        round(result.tta_top1, 4), round(result.tta_top5, 4))
    # --predictions come from the TTA logits: their top-1 hits are the TTA Prec@1's.
    _, rows = read_csv(preds)
    hits = sum(row["pred1"] == row["label"] for row in rows)
    assert len(rows) == result.count and 100.0 * hits / len(rows) == pytest.approx(result.tta_top1)

    off_file = tmp_path / "off.csv"
    off = evaluate("--resume", checkpoint, "-j", "0", "--tta", "none", "--results-file", off_file)
    stdout = capsys.readouterr().out
    assert not TTA.findall(stdout) and PLAIN.findall(stdout) == PLAIN.findall(train_stdout)
    columns, _ = read_csv(off_file)
    assert off.tta_top1 is None and not {"tta", "tta_top1", "tta_top5"} & set(columns)


def test_eval_refuses_an_unknown_tta_in_one_line(tta_run, evaluate, tmp_path):
    result = run_script("eval.py", "--resume", tta_run[0] / "checkpoint.pth.tar", "--tta", "mirror", env=CPU)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "--tta" in result.stderr and "'mirror'" in result.stderr
    # A checkpoint whose stored args carry a mode this version does not know (argparse checks no defaults)
    stored = torch.load(tta_run[0] / "checkpoint.pth.tar", weights_only=False)
    stored["args"]["tta"] = "mirror"
    torch.save(stored, tmp_path / "odd.pth.tar")
    with pytest.raises(UsageError, match=r"--tta 'mirror'"):
        evaluate("--resume", tmp_path / "odd.pth.tar", "-j", "0")
