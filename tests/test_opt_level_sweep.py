"""tools/opt_level_sweep.py: the accuracy set on the digits demo, its tables, and its refusals."""
import csv

from conftest import FINAL, HALF_TINY, run_script

SWEEP = "tools/opt_level_sweep.py"


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def markdown_rows(path):
    """{config: [cells]} of the Markdown table's body (a `\\|` inside a cell is not a border)."""
    rows = {}
    for line in open(path).read().splitlines()[2:]:
        cells = [c.strip() for c in line.replace("\\|", "\x00").strip("|").split("|")]
        rows[cells[0]] = [c.replace("\x00", "|") for c in cells]
    return rows


def test_accuracy_set_tabulates_what_each_run_printed(cache_dir, tmp_path):
    # O0 and one bf16 level (CPU fp16 is far slower), 2 epochs of 3 steps: two Prec@1 lines each.
    # HALF_TINY: a model whose bf16 convolutions are not crawling on a CPU (conftest.py).
    result = run_script(SWEEP, "digits", "--set", "accuracy", "--configs", "O0,O2 bf16", "--epochs", "2",
                        "--steps", "3", "--out-dir", tmp_path, "--", *HALF_TINY, "-b", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_csv(tmp_path / "opt_level_sweep.csv")
    assert [row["config"] for row in rows] == ["O0", "O2 bf16"]
    table = markdown_rows(tmp_path / "opt_level_sweep.md")
    assert list(table) == ["O0", "O2 bf16"]
    for row, run_dir, recipe in zip(rows, ("O0", "O2_bf16"), ("O0 fp32", "O2 bf16")):
        printed = [(float(a), float(b)) for a, b in FINAL.findall((tmp_path / run_dir / "train.log").read_text())]
        assert len(printed) == 2, row  # one validation an epoch
        assert not row["error"] and row["recipe"].startswith(recipe)
        assert (float(row["top1"]), float(row["top5"])) == printed[-1]
        assert float(row["best top1"]) == max(top1 for top1, _ in printed)
        assert float(row["img/s"]) > 0 and float(row["first loss"]) > 0 and float(row["last loss"]) > 0
        cells = table[row["config"]]
        assert [float(c) for c in cells[6:9]] == [float(row[k]) for k in ("top1", "top5", "best top1")]
        assert cells[9] == row["recipe"]


def test_failed_config_still_gets_a_row(tmp_path):
    result = run_script(SWEEP, tmp_path / "missing", "--configs", "O0", "--out-dir", tmp_path / "out")
    assert result.returncode == 1
    (row,) = read_csv(tmp_path / "out" / "opt_level_sweep.csv")
    assert row["config"] == "O0" and "does not exist" in row["error"] and not row["top1"]
    assert "failed: exit code 2" in (tmp_path / "out" / "opt_level_sweep.md").read_text()


def test_unknown_config_and_bad_epochs_are_refused(tmp_path):
    unknown = run_script(SWEEP, "digits", "--set", "accuracy", "--configs", "O0,O4", "--out-dir", tmp_path)
    assert unknown.returncode == 2 and "'O4' not in the accuracy set" in unknown.stderr
    assert "O3 + keep-BN bf16" in unknown.stderr  # the message lists what there is
    epochs = run_script(SWEEP, "digits", "--epochs", "0", "--out-dir", tmp_path)
    assert epochs.returncode == 2 and "--epochs must be at least 1" in epochs.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written
