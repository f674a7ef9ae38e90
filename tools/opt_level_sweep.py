#!/usr/bin/env python3
"""Run train.py once per precision config and tabulate speed, loss trend and top-1.

Two sets of configs (--set):
  speed (default): O0, O1, O2, O3, O3 + keep-BN, O1/O2 with a static loss scale of 128, all fp16;
    one epoch of --steps steps (default 200) each:
    tools/opt_level_sweep.py DATA --steps 200 --out-dir sweep -- -a resnet50 -b 256 -j 16
  accuracy: O0 once, then O1, O2 and O3 + keep-BN in fp16 and in bf16 (7 configs), each trained
    the same way for --epochs full epochs (--steps, if given, caps the steps an epoch):
    tools/opt_level_sweep.py /tmp/fake --set accuracy --epochs 8 --out-dir levels -- -a resnet18 -b 256 -j 8 --image-size 128 --lr-schedule cosine

--configs picks some configs of the set by name, e.g. --configs "O0,O2 bf16". Everything after
`--` goes to train.py unchanged (it may override the sweep's own flags: train.py takes the last).

The table gives the mean training speed over the second half of the last epoch's log intervals
(steady state), the first and last interval loss, the skipped steps and the final loss scale, the
last epoch's validation top-1 and top-5, and the best top-1 of any epoch. Into --out-dir (default
./opt_level_sweep) go each config's run directory (with train.log, what the run printed) and the
table, as opt_level_sweep.csv and opt_level_sweep.md, both rewritten after every config. A config
that fails still gets a row, holding its last error line; the exit code is then 1. An --out-dir
holding an earlier sweep's tables or runs is refused unless --overwrite.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere, yet import the project's utils
from utils.run.errors import UsageError, exit_on_usage_error  # noqa: E402
from utils.run.files import atomic_write, atomic_write_csv, check_output_folder  # noqa: E402

TABLES = ("opt_level_sweep.csv", "opt_level_sweep.md")  # rewritten after every config of one sweep
KEYS = ["config", "img/s", "first loss", "last loss", "skipped", "scale", "top1", "top5", "best top1", "recipe"]
SPEED = {
    "O0": ["--opt-level", "O0"],
    "O1": ["--opt-level", "O1"],
    "O2": ["--opt-level", "O2"],
    "O3": ["--opt-level", "O3"],
    "O3 + keep-BN": ["--opt-level", "O3", "--keep-batchnorm-fp32", "True"],
    "O1 + loss-scale 128": ["--opt-level", "O1", "--loss-scale", "128"],
    "O2 + loss-scale 128": ["--opt-level", "O2", "--loss-scale", "128"],
}
HALF_LEVELS = {name: SPEED[name] for name in ("O1", "O2", "O3 + keep-BN")}
# The dtype is always named: an Accelerate config asking for another one must not change a row.
ACCURACY = {"O0": ["--opt-level", "O0", "--mixed-precision", "no"],
            **{f"{name} {dtype}": [*flags, "--mixed-precision", dtype]
               for dtype in ("fp16", "bf16") for name, flags in HALF_LEVELS.items()}}
SETS = {"speed": SPEED, "accuracy": ACCURACY}
DEFAULT_STEPS = {"speed": 200, "accuracy": 0}  # 0: train.py's whole train split an epoch

LINE = re.compile(r"Epoch: \[(\d+)\]\[\d+/\d+\]\tTime [\d.]+ .*?Speed ([\d.]+) .*?Loss ([\d.]+) ")
SCALE = re.compile(r"Skipped (\d+)\tScale ([\d.e+]+)")
FINAL = re.compile(r"^ \* Prec@1 ([\d.]+) Prec@5 ([\d.]+)$", re.MULTILINE)  # not the " * EMA Prec@1" line


def run(name, flags, data, epochs, steps, extra, out_dir):
    """Train one config; its table row (or {"config", "error"} when train.py failed)."""
    run_dir = run_dir_name(out_dir, name)
    # train.py --overwrite: main() has refused an --out-dir holding a sweep's runs unless the sweep's
    # own --overwrite asked for them to be replaced.
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), data, "--epochs", str(epochs), "--steps-per-epoch",
           str(steps), "--print-freq", "20", "--output-dir", run_dir, "--overwrite", *flags, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True)
    os.makedirs(run_dir, exist_ok=True)  # train.py may have failed before making it
    atomic_write(os.path.join(run_dir, "train.log"), result.stdout + result.stderr)
    lines = LINE.findall(result.stdout)
    if result.returncode != 0 or not lines:
        why = (result.stderr.strip().splitlines() or ["no training log lines"])[-1]
        return {"config": name, "error": f"exit code {result.returncode}: {why}"}
    return {"config": name, **speed_and_loss(lines), **scale_fields(result.stdout),
            **accuracy(result.stdout), "recipe": precision_line(result.stdout)}


def run_dir_name(out_dir, name):
    """The folder config `name`'s train.py run writes into."""
    return os.path.join(out_dir, name.replace(" ", "_"))


def check_out_dir(out_dir, configs, overwrite):
    """Before any run: --out-dir must be a folder that takes files (made if missing), and must not
    hold an earlier sweep's tables or these configs' runs unless --overwrite (which train.py's
    --overwrite then passes on to each run)."""
    if os.path.isdir(out_dir) and not overwrite:
        found = [name for name in TABLES if os.path.lexists(os.path.join(out_dir, name))]
        found += [os.path.basename(run_dir_name(out_dir, name)) for name in configs
                  if os.path.lexists(run_dir_name(out_dir, name))]
        if found:
            raise UsageError(f"--out-dir {out_dir!r} already holds a sweep's {', '.join(found)}; pass --overwrite "
                             "to replace them, or choose another --out-dir")
    check_output_folder(out_dir, "--out-dir")


def speed_and_loss(lines):
    # Steady state: the second half of the last epoch's log intervals. Early intervals hold cuDNN
    # autotuning and, on JPEG data, batches the workers queued up during start-up (prefetch),
    # which would flatter the input pipeline.
    last_epoch = [line for line in lines if line[0] == lines[-1][0]]
    speeds = [float(speed) for _, speed, _ in last_epoch[len(last_epoch) // 2:]]
    return {"img/s": round(sum(speeds) / len(speeds), 1), "first loss": float(lines[0][2]),
            "last loss": float(lines[-1][2])}


def scale_fields(stdout):
    scale = SCALE.findall(stdout)  # none at O0 and for bf16 (no loss scale)
    return {"skipped": int(scale[-1][0]) if scale else 0, "scale": scale[-1][1] if scale else "-"}


def accuracy(stdout):
    """The last epoch's top-1 and top-5 and the best top-1 of any epoch, as train.py printed them."""
    finals = [(float(top1), float(top5)) for top1, top5 in FINAL.findall(stdout)]
    if not finals:
        return {"top1": "-", "top5": "-", "best top1": "-"}
    return {"top1": finals[-1][0], "top5": finals[-1][1], "best top1": max(top1 for top1, _ in finals)}


def precision_line(stdout):
    """train.py's `precision: ...` start-up line (the table's column keeps its first name, recipe)."""
    return next((l[len("precision: "):] for l in stdout.splitlines() if l.startswith("precision: ")), "-")


def cell(value):
    """A Markdown table cell: a `|` inside (the precision line holds some) would split the cell."""
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


def chosen_configs(parser, args):
    """The configs of --set, narrowed to --configs (in the set's order) when given."""
    configs = SETS[args.set]
    if args.configs is None:
        return configs
    wanted = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in configs]
    if unknown or not wanted:
        parser.error(f"--configs: {', '.join(map(repr, unknown)) or 'no names'} not in the {args.set} set; "
                     f"its configs: {', '.join(configs)}")
    return {name: flags for name, flags in configs.items() if name in wanted}


def parse_args():
    # No abbreviations: train.py's --config (a YAML recipe) must not be read as our --configs.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("data", help="what train.py trains on: an ImageFolder root, digits, synthetic, ...")
    parser.add_argument("--set", choices=sorted(SETS), default="speed",
                        help="speed: 7 fp16 configs, 1 epoch each; accuracy: O0 and O1/O2/O3 + keep-BN in "
                             "fp16 and bf16 (default: speed)")
    parser.add_argument("--configs", metavar="A,B",
                        help="only these configs of the set, comma-separated names (default: all)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs each config trains (default: 1)")
    parser.add_argument("--steps", type=int,
                        help="training steps an epoch; 0 means the whole train split (default: 200 for "
                             "the speed set, 0 for the accuracy set)")
    parser.add_argument("--out-dir", default="opt_level_sweep",
                        help="where each config's run and the tables go (default: ./opt_level_sweep)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the tables and these configs' runs an earlier sweep left in --out-dir "
                             "(default: refuse, naming them, before any run)")
    args, extra = parser.parse_known_args()  # the rest goes to train.py
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, not {args.epochs}")
    if args.steps is not None and args.steps < 0:
        parser.error(f"--steps must be 0 (whole epochs) or more, not {args.steps}")
    args.steps = DEFAULT_STEPS[args.set] if args.steps is None else args.steps
    args.configs = chosen_configs(parser, args)
    return args, [a for a in extra if a != "--"]


def main():
    args, extra = parse_args()
    check_out_dir(args.out_dir, args.configs, args.overwrite)
    rows = []
    for name, flags in args.configs.items():
        rows.append(run(name, flags, args.data, args.epochs, args.steps, extra, args.out_dir))
        print(rows[-1], flush=True)
        # Rewritten after every config, so a sweep cut short keeps what it measured.
        atomic_write_csv(os.path.join(args.out_dir, TABLES[0]), rows, KEYS + ["error"])
        atomic_write(os.path.join(args.out_dir, TABLES[1]), markdown_table(rows))
    print(markdown_table(rows), end="")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))  # a refusal: one line, exit 2; a failed write: one line, exit 4
