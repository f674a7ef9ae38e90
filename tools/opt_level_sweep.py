#!/usr/bin/env python3
"""Run train.py once per precision config and tabulate img/s and the loss trend.

    tools/opt_level_sweep.py DATA --steps 200 --out-dir sweep -- -a resnet50 -b 256 -j 16

Every config trains --steps steps (one epoch, --print-freq 20) and validates; the table gives the
mean training speed over the second half of the log intervals (steady state), the first and last interval
loss, the skipped steps and the final loss scale. Into --out-dir (default ./opt_level_sweep) go
each config's run directory and the table, as opt_level_sweep.csv and opt_level_sweep.md.
"""
import argparse
import csv
import io
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere, yet import the project's utils
from utils.files import atomic_write  # noqa: E402

KEYS = ["config", "img/s", "first loss", "last loss", "skipped", "scale", "val top1", "recipe"]
CONFIGS = {
    "O0": ["--opt-level", "O0"],
    "O1": ["--opt-level", "O1"],
    "O2": ["--opt-level", "O2"],
    "O3": ["--opt-level", "O3"],
    "O3 + keep-BN": ["--opt-level", "O3", "--keep-batchnorm-fp32", "True"],
    "O1 + loss-scale 128": ["--opt-level", "O1", "--loss-scale", "128"],
    "O2 + loss-scale 128": ["--opt-level", "O2", "--loss-scale", "128"],
}
LINE = re.compile(r"Epoch: \[\d+\]\[(\d+)/\d+\]\tTime ([\d.]+) .*?Speed ([\d.]+) .*?Loss ([\d.]+) ")
SCALE = re.compile(r"Skipped (\d+)\tScale ([\d.e+]+)")


def run(name, flags, data, steps, extra, out_dir):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), data, "--epochs", "1", "--steps-per-epoch",
           str(steps), "--print-freq", "20", "--output-dir", os.path.join(out_dir, name.replace(" ", "_")),
           *flags, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return {"config": name, "error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    lines = LINE.findall(result.stdout)
    # Steady state: the second half of the log intervals. Early intervals hold cuDNN autotuning
    # and, on JPEG data, batches the workers queued up during start-up (prefetch), which would
    # flatter the input pipeline.
    speeds = [float(s) for _, _, s, _ in lines[len(lines) // 2:]]
    scale = SCALE.findall(result.stdout)
    top1 = re.findall(r" \* Prec@1 ([\d.]+)", result.stdout)
    precision = next(l for l in result.stdout.splitlines() if l.startswith("precision:"))
    return {"config": name, "img/s": round(sum(speeds) / len(speeds), 1), "first loss": float(lines[0][3]),
            "last loss": float(lines[-1][3]), "skipped": int(scale[-1][0]) if scale else 0,
            "scale": scale[-1][1] if scale else "-", "val top1": top1[-1] if top1 else "-",
            "recipe": precision[len("precision: "):]}


def cell(value):
    """A Markdown table cell: a `|` inside (the recipe line holds some) would split the cell."""
    return str(value).replace("|", "\\|")


def markdown_table(rows):
    lines = ["| " + " | ".join(KEYS) + " |", "|" + "---|" * len(KEYS)]
    for row in rows:
        if "error" in row:
            values = [row["config"], f"failed: {row['error']}"] + [""] * (len(KEYS) - 2)
        else:
            values = [row[key] for key in KEYS]
        lines.append("| " + " | ".join(cell(value) for value in values) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path, rows):
    def write(handle):  # atomic_write hands over a binary handle; csv wants text
        text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
        writer = csv.DictWriter(text, fieldnames=KEYS + ["error"])
        writer.writeheader()
        writer.writerows(rows)
        text.flush()
        text.detach()  # leave the handle open for atomic_write to close
    atomic_write(path, write)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("data")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out-dir", default="opt_level_sweep",
                        help="where each config's run and the tables go (default: ./opt_level_sweep)")
    args, extra = parser.parse_known_args()  # the rest goes to train.py
    extra = [a for a in extra if a != "--"]
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    for name, flags in CONFIGS.items():
        rows.append(run(name, flags, args.data, args.steps, extra, args.out_dir))
        print(rows[-1], flush=True)
        # Rewritten after every config, so a sweep cut short keeps what it measured.
        write_csv(os.path.join(args.out_dir, "opt_level_sweep.csv"), rows)
    table = markdown_table(rows)
    atomic_write(os.path.join(args.out_dir, "opt_level_sweep.md"), table)
    print(table, end="")


if __name__ == "__main__":
    main()
