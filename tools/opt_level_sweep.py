"""Run train.py once per precision config and tabulate img/s and the loss trend.

    python tools/opt_level_sweep.py DATA --steps 200 -- -a resnet50 -b 256 -j 16

Every config trains --steps steps (one epoch, --print-freq 20) and validates; the table gives the
mean training speed over the second half of the log intervals (steady state), the first and last interval
loss, the skipped steps and the final loss scale. Writes a Markdown table and a CSV.
"""
import argparse
import csv
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def run(name, flags, data, steps, extra):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), data, "--epochs", "1", "--steps-per-epoch",
           str(steps), "--print-freq", "20", "--output-dir", os.path.join("/tmp/sweep", name.replace(" ", "_")),
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--csv", default="opt_level_sweep.csv")
    args, extra = parser.parse_known_args()  # the rest goes to train.py
    extra = [a for a in extra if a != "--"]
    rows = []
    for name, flags in CONFIGS.items():
        rows.append(run(name, flags, args.data, args.steps, extra))
        print(rows[-1], flush=True)
    keys = ["config", "img/s", "first loss", "last loss", "skipped", "scale", "val top1", "recipe", "error"]
    with open(args.csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print("| " + " | ".join(keys[:-1]) + " |\n|" + "---|" * (len(keys) - 1))
    for row in rows:
        if "error" in row:
            print(f"| {row['config']} | failed: {row['error']} |")
        else:
            print("| " + " | ".join(str(row[k]) for k in keys[:-1]) + " |")


if __name__ == "__main__":
    main()
