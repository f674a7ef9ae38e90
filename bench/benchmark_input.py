#!/usr/bin/env python3
"""Training speed from JPEG files: cpu vs gpu input backend, with and without --compile, at a few
worker counts, beside plain-PyTorch and (optionally) timm references measured in the same run.

    python bench/benchmark_input.py /data/fake_imagenet --workers 8 16 --out input_o2_j8.csv
    python bench/benchmark_input.py DATA --timm-train /path/to/timm/train.py   # add timm's loader
    python bench/benchmark_input.py DATA --backends synthetic --timm-benchmark /path/to/timm/benchmark.py
    python bench/benchmark_input.py DATA --backends gpu synthetic --decoders cuda hardware --compile True

Backends: cpu and gpu read DATA's JPEGs (gpu once per --decoders entry), synthetic trains train.py on
random tensors made on the device (its own input-free speed). --compile takes False, True or a
torch.compile mode (reduce-overhead, max-autotune): train.py --compile --compile-mode MODE.

Each configuration is a real `train.py` run (ResNet-50 by default, --epochs 2); its figure is the
last epoch's average Speed (img/s over all processes) from the Apex log line, so with 2 or more
epochs worker start-up, compilation and cudnn.benchmark's search are left out; more epochs show
whether a run keeps speeding up after its first minute. Each train.py row also gives the rate over
the second half of that last epoch (second_half_img_per_s): epochs here are short, and each begins
with the input pipeline refilling after validation, which a 5,000-step ImageNet epoch would hide.
The plain-PyTorch reference trains the same model on one random batch held on the GPU (no input
pipeline at all): the GPU-bound ceiling for that config. Without a CUDA device its row says it was
not run and the train.py rows run on the CPU, without ratios (a smoke test, not a benchmark).
Each row also gives the GPU memory in use at the run's peak (nvidia-smi, polled every 0.2 s: it
counts what torch's allocator does not see, such as nvImageCodec's buffers and the CUDA context).
Rows are printed as they come and the CSV is rewritten after each (utils.run.files.atomic_write_csv);
an --out that exists is refused before any run unless --append (add to it) or --overwrite (replace it).
--repeat N runs the whole list N times, round by round (A B C, A B C, ...), so that a slow spell of
the machine falls on every configuration alike; each run is a row (column round; ratio_to_plain
against the same round's reference) and the tool ends with each configuration's median and range.
One run of one configuration on one machine has differed by up to 11 % from the next on the H200:
compare configurations on medians, not single runs (docs/results.md gives each round's rows).
--variants A B ... runs every train.py configuration once per string of extra train.py flags ('' for
none), rows named "train.py [FLAGS]": a flag's A/B beside one plain reference per round. A variant's
flags come last, so they win over the tool's own (--variants '--compile-mode max-autotune' against
--compile reduce-overhead compiles that row in max-autotune, the plain reference in reduce-overhead).
--timm-benchmark PATH also runs timm's own train-step benchmark (its repository's benchmark.py,
--bench train: random tensors, the same -a and -b, fp16 autocast unless --opt-level O0, channels_last,
the model compiled with the --compile value's mode, the optimizer step not) beside each plain
reference, in every round: timm's figure for the same card in the same call.
--other-code DIR runs every train.py configuration a second time from another copy of this
project (say the code before a change: git archive REV | tar -x -C DIR), right after this copy's
run of it in every round; its rows are named "train.py (DIR's name)". An A/B of two versions of
the code on one machine start, where two invocations on two starts would differ by more than the
change.
--append adds this invocation's rounds to the rows already in --out (rounds numbered on, medians
over all of them), so that one benchmark can be split over several shorter calls; it refuses a file
written with other flags or timed on another kind of device (a machine lent as an H200 can be an
H100: one median over both would mean nothing). Every row names the device that timed it (the GPU's
name, or cpu), the host it ran on and the flags its runs shared (setup), and the tool says when the
rows come from more than one host.
"""
import argparse
import csv
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils.run.errors import exit_on_usage_error  # noqa: E402
from utils.run.files import atomic_write, atomic_write_csv, check_output_file, check_output_folder  # noqa: E402

# (epoch, step, steps, average img/s) of train.py's and timm's interval lines; epochs count from 0.
APEX_SPEED = re.compile(r"Epoch: \[(\d+)\]\[(\d+)/(\d+)\].*?Speed [\d.]+ \(([\d.]+)\)")
TIMM_SPEED = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+).*?\(\s*[\d.]+s,\s*([\d.]+)/s\)")
PLAIN_SPEED = re.compile(r"plain img/s ([\d.]+)")
TIMM_BENCHMARK_SPEED = re.compile(r'"train_samples_per_sec":\s*([\d.]+)')  # its closing JSON

PLAIN = r"""
import sys, time, torch, torchvision
arch, batch, steps, level, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.backends.cudnn.benchmark = True
model = torchvision.models.get_model(arch, num_classes=1000).cuda().to(memory_format=torch.channels_last)
if level in ("O2", "O3"):  # half weights, fp32 BatchNorm (O3 with --keep-batchnorm-fp32 True)
    model.half()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.float()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
step_model = model if mode == "False" else torch.compile(model, mode=None if mode == "True" else mode)
x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
y = torch.randint(0, 1000, (batch,), device="cuda")
if level in ("O2", "O3"):
    x = x.half()
def step():
    with torch.autocast("cuda", dtype=torch.float16, enabled=level == "O1"):
        loss = torch.nn.functional.cross_entropy(step_model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
for _ in range(15):
    step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(steps):
    step()
torch.cuda.synchronize()
print(f"plain img/s {steps * batch / (time.perf_counter() - start):.1f}")
"""

COLUMNS = ("name", "backend", "decoder", "workers", "compile", "opt_level", "img_per_s", "ratio_to_plain",
           "gpu_mem_gib", "seconds", "note", "epochs", "second_half_img_per_s", "round", "device", "host", "setup")


class PeakGpuMemory:
    """The largest memory.used nvidia-smi reports for GPU 0 while the block runs, in GiB ('' if
    nvidia-smi is missing)."""

    def __enter__(self):
        self.peak, self.stop = None, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.stop.wait(0.2):
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                used = float(text.split()[0])
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self.peak = max(self.peak or 0.0, used)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def gib(self):
        return round(self.peak / 1024, 2) if self.peak is not None else ""


def run(command, timeout):
    """(output, note, seconds, peak GPU memory in GiB) of one subprocess."""
    start = time.perf_counter()
    with PeakGpuMemory() as memory:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            output, note = done.stdout + done.stderr, "" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired as err:
            output = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
            note = "timeout"
    return output, note, time.perf_counter() - start, memory.gib()


def compile_flags(value):
    """--compile's value for train.py: False, True, or a torch.compile mode name."""
    if value in ("False", "True"):
        return ["--compile", value]
    return ["--compile", "True", "--compile-mode", value]


def epoch_lines(pattern, text, epoch):
    """(epoch, step, steps, average) of each interval line of `epoch` (from 0) in a log."""
    return [match for match in pattern.findall(text) if int(match[0]) == epoch]


def epoch_average(pattern, text, epoch):
    """The average img/s of the last interval line of `epoch` (from 0) in a log, or None."""
    found = epoch_lines(pattern, text, epoch)
    return float(found[-1][3]) if found else None


def second_half_rate(text, epoch):
    """img/s over the second half of `epoch` in a train.py log, or None (fewer than two interval
    lines with one in the first half). An epoch's average climbs while its start-up (the input
    pipeline refilling after validation) fades, so the epoch average understates a long epoch;
    this is the rate after the last interval line at or before the middle. A line's average is
    steps / (time since the epoch began) x batch, so the time between lines k1 and k2 is
    k2 / avg2 - k1 / avg1 batches' worth, whatever the batch."""
    lines = [(int(step), float(average)) for _, step, _, average in epoch_lines(APEX_SPEED, text, epoch)]
    if len(lines) < 2:
        return None
    k2, average2 = lines[-1]
    first_half = [(k, average) for k, average in lines[:-1] if k <= k2 / 2]
    if not first_half:
        return None
    k1, average1 = first_half[-1]
    return round((k2 - k1) / (k2 / average2 - k1 / average1), 1)


PLAIN_NAME = "plain PyTorch, random batch on the GPU"
TIMM_BENCHMARK_NAME = "timm benchmark.py --bench train"


def result_row(name, backend, compile_, opt_level, speed, reference, seconds, memory, note, decoder="", workers=0,
               epochs="", second_half=None, round_=1):
    """One CSV row; ratio_to_plain where both this figure and the reference exist."""
    return {"name": name, "backend": backend, "decoder": decoder, "workers": workers, "compile": compile_,
            "opt_level": opt_level, "img_per_s": speed or "",
            "ratio_to_plain": round(speed / reference, 3) if speed and reference else "",
            "gpu_mem_gib": memory, "seconds": round(seconds, 1), "note": note, "epochs": epochs,
            "second_half_img_per_s": second_half or "", "round": round_}


class Run(NamedTuple):
    """One configuration of a round: what its rows say of it, and the command that measures it
    (None: not runnable here, recorded with note)."""
    kind: str          # "plain", "train", "timm" or "timm-benchmark": which log format to read
    name: str
    backend: str
    decoder: str
    workers: int
    compile: str
    command: list
    note: str = ""


def medians(rows):
    """Per configuration (name, backend, decoder, workers, compile), in first-seen order: the
    median img/s over its rounds, the lowest, the highest, the rounds with a figure, and the
    median's ratio to the median of the plain reference with the same compile value."""
    groups = {}
    for row in rows:
        # as strings: rows read back from the CSV (--append) beside this invocation's
        key = tuple(str(row[field]) for field in ("name", "backend", "decoder", "workers", "compile"))
        groups.setdefault(key, []).extend([float(row["img_per_s"])] if row["img_per_s"] not in ("", None) else [])
    plain = {key[4]: statistics.median(speeds) for key, speeds in groups.items()
             if key[0] == PLAIN_NAME and speeds}
    summary = []
    for key, speeds in groups.items():
        if not speeds:
            continue
        middle = statistics.median(speeds)
        reference = plain.get(key[4])  # timm's runs are planned with compile "False", as it runs
        summary.append((key, middle, min(speeds), max(speeds), len(speeds),
                        round(middle / reference, 3) if reference else None))
    return summary


def timm_benchmark_run(args, compile_):
    """timm's benchmark.py --bench train for this invocation's model and batch: fp16 autocast
    (--amp) unless O0, channels_last, --torchcompile with the mode of compile_ unless False;
    20 warm-up steps, then --steps-per-epoch timed ones."""
    model = args.arch[len("timm/"):] if args.arch.startswith("timm/") else args.arch
    command = [sys.executable, args.timm_benchmark, "--model", model, "--bench", "train", "-b", str(args.batch_size),
               "--img-size", "224", "--channels-last", "--no-retry", "--num-warm-iter", "20",
               "--num-bench-iter", str(args.steps_per_epoch), *(["--amp"] if args.opt_level != "O0" else [])]
    if compile_ != "False":
        command += ["--torchcompile", *(["--torchcompile-mode", compile_] if compile_ != "True" else [])]
    return Run("timm-benchmark", TIMM_BENCHMARK_NAME, "none", "", 0, compile_, command)


def planned_runs(args, cuda):
    """One round's runs, in order: the plain reference per --compile value, then per worker count
    every train.py configuration and timm's run. Without CUDA the reference is not run (said in
    its note) and the train.py rows run on the CPU."""
    runs = []
    for compile_ in args.compile:
        if not cuda:
            runs.append(Run("plain", PLAIN_NAME, "none", "", 0, compile_, None,
                            "not run: no CUDA device here, and the reference trains on the GPU"))
            if args.timm_benchmark:
                runs.append(Run("timm-benchmark", TIMM_BENCHMARK_NAME, "none", "", 0, compile_, None,
                                "not run: no CUDA device here (timm's benchmark times the GPU)"))
            continue
        runs.append(Run("plain", PLAIN_NAME, "none", "", 0, compile_,
                        [sys.executable, "-c", PLAIN, args.arch, str(args.batch_size), "50", args.opt_level, compile_]))
        if args.timm_benchmark:
            runs.append(timm_benchmark_run(args, compile_))
    common = ["-a", args.arch, "-b", str(args.batch_size), "--opt-level", args.opt_level, "--epochs", str(args.epochs),
              "--steps-per-epoch", str(args.steps_per_epoch), "-p", "10", "--lr-steps", "30", "--overwrite",
              *shlex.split(args.train_args)]
    for workers in args.workers:
        for backend in args.backends:
            decoders = args.decoders if backend == "gpu" else [""]
            for decoder, compile_, size, variant in [(d, c, s, v) for d in decoders for c in args.compile
                                                     for s in args.train_crop_sizes or [None] for v in args.variants]:
                if backend == "synthetic" and workers != args.workers[0]:
                    continue  # no workers to vary
                source = ["synthetic"] if backend == "synthetic" else [args.data, "-j", str(workers),
                                                                       "--data-backend", backend]
                crop = ["--train-crop-size", str(size)] if size else []
                for code in [ROOT, *args.other_code]:
                    name = ("train.py" if code == ROOT else f"train.py ({os.path.basename(code)})") + \
                        (f" {size} px" if size else "") + (f" [{variant}]" if variant else "")
                    out = os.path.join(args.runs_dir, f"bench-{backend}-{decoder}-{workers}-{compile_}"
                                       + (f"-{size}" if size else "")
                                       + (f"-v{args.variants.index(variant)}" if variant else "")
                                       + ("" if code == ROOT else f"-{os.path.basename(code)}"))
                    runs.append(Run("train", name, backend, decoder, 0 if backend == "synthetic" else workers,
                                    compile_, [sys.executable, os.path.join(code, "train.py"),
                                               *source, *common, *crop, *compile_flags(compile_),
                                               *(["--jpeg-decoder", decoder] if decoder else []),
                                               *shlex.split(variant), "--output-dir", out]))
        if args.timm_train:
            runs.append(Run("timm", "timm train.py --amp --channels-last", "timm", "", workers, "False", [
                sys.executable, args.timm_train, "--data-dir", args.data, "--val-split", "val", "--model", args.arch,
                "-b", str(args.batch_size), "-j", str(workers), "--amp", "--channels-last", "--color-jitter", "0",
                "--train-interpolation", "bilinear", "--epochs", str(args.epochs), "--sched", "step",
                "--warmup-epochs", "0", "--log-interval", "10", "--output", os.path.join(args.runs_dir, "timm-bench"),
                "--num-classes", "1000"]))
    return runs


def configuration(row):
    """What makes two rows runs of one configuration (each round has one run of it)."""
    return tuple(str(row[key]) for key in ("name", "backend", "workers", "compile", "setup"))


def log_name(round_, planned):
    """The file a run's printed output is kept in: round, then what the row is named by."""
    parts = [f"r{round_}", planned.name, planned.backend, planned.decoder, f"j{planned.workers}",
             f"compile-{planned.compile}"]
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", "-".join(part for part in parts if part)).strip("_") + ".log"


def keep_output(runs_dir, round_, planned, output):
    """Keep a run's printed output (the interval lines an epoch average comes from) beside its
    output folder: the CSV holds only the figures, and a device call brings files back."""
    atomic_write(os.path.join(runs_dir, "benchmark-logs", log_name(round_, planned)), output)  # full disk: exit 4


def setup(args):
    """The flags every run of an invocation shares, as the CSV's setup column records them."""
    return shlex.join([args.data, "-a", args.arch, "-b", str(args.batch_size), "--opt-level", args.opt_level,
                       "--steps-per-epoch", str(args.steps_per_epoch), "--epochs", str(args.epochs),
                       *(["--train-args", args.train_args] if args.train_args else []),
                       *(["--variants", *args.variants] if args.variants != [""] else [])])


def earlier_rows(path, runs, setup_, device):
    """The rows an earlier invocation wrote to `path` (--append), or [] if there is no such file.
    A usage error (ValueError with the message) when they are not the runs this invocation plans,
    or were timed on another kind of device: medians over both would mix them."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        rows = list(reader)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"--append: {path} does not have this tool's columns (an older version's, or "
                             "another file); give a new --out")
    if not rows:
        return []
    setups = sorted({row["setup"] for row in rows})
    if setups != [setup_]:
        raise ValueError(f"--append: {path} was written with {' / '.join(setups)}; these flags give {setup_}. "
                         "Give the flags of the invocation that wrote it, or a new --out")
    devices = sorted({row["device"] for row in rows})
    if devices != [device]:
        raise ValueError(f"--append: {path} was timed on {' / '.join(devices)}; this machine's device is {device}, "
                         "and one median over both would mean nothing. Give a new --out, or run where that file's "
                         "rounds ran")
    planned = {configuration(dict(name=run.name, backend=run.backend, workers=run.workers, compile=run.compile,
                                  setup=setup_)) for run in runs}
    found = {configuration(row) for row in rows}
    if found != planned:
        differ = ", ".join(f"{name} {backend} -j {workers} compile {compile_}"
                           for name, backend, workers, compile_, _ in sorted(found ^ planned)[:4])
        raise ValueError(f"--append: {path} holds other runs than these flags plan (differing: {differ}). "
                         "Give the flags of the invocation that wrote it, or a new --out")
    return rows


def cuda_available():
    import torch
    return torch.cuda.is_available()


def device_name(cuda):
    """What times the runs, as the CSV's device column names it: the GPU's model, or cpu."""
    import torch
    return torch.cuda.get_device_name(0) if cuda else "cpu"


def refuse_misread_flag_strings(parser, argv):
    """A string of train.py flags (--variants, --train-args) that opens with one of this script's
    own short options, such as '-b 400', is read by argparse as that option with the rest as its
    value: the string would silently set this script's batch, not a variant's. Refused instead.
    A lone train.py switch there ('--tune-kernels') reads as an option too, one this script lacks:
    refused with the spelling that works (with its value, so the string holds a space)."""
    options = {flag for action in parser._actions for flag in action.option_strings}
    short = {flag for flag in options if not flag.startswith("--")}
    taking = None  # the flag-string option whose values argv is in
    for arg in argv:
        if arg[:2] in short and any(char.isspace() for char in arg):
            parser.error(f"{arg!r}: a string of train.py flags may not open with {arg[:2]}, which this script "
                         f"reads as its own {arg[:2]}; write train.py's long flag (e.g. '--batch-size 400')")
        if arg in options:
            taking = arg if arg in ("--variants", "--train-args") else None
        elif taking and arg.startswith("--") and not any(char.isspace() for char in arg):
            spelled = arg.replace("=", " ", 1) if "=" in arg else f"{arg} True"
            parser.error(f"{arg!r} after {taking}: a lone flag reads as an option of this script, which has no "
                         f"{arg.split('=')[0]}; give the train.py flag with its value, one space between "
                         f"('{spelled}')")
        elif taking == "--train-args":
            taking = None  # one string


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="ImageFolder root with train/ and val/ (tools/make_fake_imagenet.py)")
    parser.add_argument("-a", "--arch", default="resnet50")
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--backends", nargs="+", default=["cpu", "gpu"], choices=("cpu", "gpu", "synthetic"))
    parser.add_argument("--decoders", nargs="+", default=["auto"], choices=("auto", "cuda", "hardware"),
                        help="--jpeg-decoder values for the gpu backend (default: auto)")
    parser.add_argument("--compile", nargs="+", default=["False", "True"],
                        choices=("False", "True", "reduce-overhead", "max-autotune"))
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--train-args", default="", help="more train.py flags, one string (e.g. "
                        "'--keep-batchnorm-fp32 True' with --opt-level O3)")
    parser.add_argument("--variants", nargs="+", default=[""], metavar="FLAGS",
                        help="run each train.py configuration once per string of extra train.py flags (e.g. '' "
                             "'--stem-channels 4' '--batch-size 400'; '' is none; long flags: a string opening with "
                             "-b or -a reads as this script's own), rows named 'train.py [FLAGS]' (default: one, none)")
    parser.add_argument("--train-crop-sizes", type=int, nargs="+", default=None, metavar="PX",
                        help="also run each train.py configuration at these --train-crop-size values (rows named "
                             "'train.py N px'; validation and the plain reference stay at 224) (default: off)")
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2, help="epochs a run; its last epoch's average "
                        "is the figure (default: %(default)s)")
    parser.add_argument("--timm-train", default=None, help="path of timm's train.py (from its repository)")
    parser.add_argument("--timm-benchmark", default=None, metavar="PATH",
                        help="path of timm's benchmark.py (from its repository): its --bench train beside each "
                             "plain reference, every round (default: off)")
    parser.add_argument("--out", default="input_benchmark.csv", help="CSV to write (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds: every configuration this many times, "
                        "round by round, then each one's median (default: %(default)s)")
    parser.add_argument("--runs-dir", default="/tmp", help="where each run's output folder goes "
                        "(bench-BACKEND-DECODER-WORKERS-COMPILE), and each run's printed output "
                        "(benchmark-logs/rROUND-NAME.log: the interval lines behind a figure; default: %(default)s)")
    parser.add_argument("--other-code", nargs="+", default=[], metavar="DIR",
                        help="other copies of this project whose train.py runs each configuration too, "
                        "in the same rounds (an A/B of two versions on one machine start)")
    parser.add_argument("--append", action="store_true",
                        help="add this invocation's rounds to the rows already in --out (same flags), "
                        "medians over all of them: one benchmark split over several calls")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out without --append (default: refuse, naming it, before any run)")
    refuse_misread_flag_strings(parser, sys.argv[1:])
    args = parser.parse_args()
    # The runs start in the project folder (train.py's cwd): paths typed relative to the caller's
    # folder are made absolute first.
    args.data = os.path.abspath(args.data)
    args.runs_dir = os.path.abspath(args.runs_dir)
    args.out = os.path.abspath(args.out)
    args.timm_train = os.path.abspath(args.timm_train) if args.timm_train else None
    args.timm_benchmark = os.path.abspath(args.timm_benchmark) if args.timm_benchmark else None
    for flag, path in (("--timm-train", args.timm_train), ("--timm-benchmark", args.timm_benchmark)):
        if path and not os.path.isfile(path):
            parser.error(f"{flag} {path!r}: no such file; give the script's path in a copy of timm's repository")
    args.other_code = [os.path.abspath(code) for code in args.other_code]
    for code in args.other_code:
        if not os.path.isfile(os.path.join(code, "train.py")):
            parser.error(f"--other-code {code!r}: no train.py there; give a copy of this project "
                         "(e.g. git archive REV | tar -x -C DIR)")
    names = [os.path.basename(code) for code in args.other_code]
    if len(set(names)) < len(names) or ROOT in args.other_code:
        parser.error("--other-code: give folders with different names, none of them this copy "
                     "(rows are named by folder)")
    if len(set(args.variants)) < len(args.variants):  # each names its rows and run folder
        parser.error(f"--variants {shlex.join(args.variants)}: a string is given twice; give each once")
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: a run needs at least one epoch (2 or more leave start-up out)")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: at least one round")
    # Before any run: --out (an existing one only with --append or --overwrite) and --runs-dir take files.
    check_output_file(args.out, "--out", args.overwrite or args.append)
    check_output_folder(args.runs_dir, "--runs-dir")

    cuda = cuda_available()
    runs = planned_runs(args, cuda)
    shared_flags, device = setup(args), device_name(cuda)
    try:
        rows = earlier_rows(args.out, runs, shared_flags, device) if args.append else []
    except ValueError as err:
        parser.error(str(err))
    first_round = max((int(row["round"]) for row in rows), default=0) + 1
    earlier = len(rows)  # rows of an earlier invocation: their failures were reported by it

    def record(row, output):
        rows.append(dict(row, device=device, host=socket.gethostname(), setup=shared_flags))
        print(" | ".join(str(rows[-1][key]) for key in COLUMNS if key != "setup"), flush=True)
        if row["img_per_s"] in ("", None) and output:
            print(output[-2000:], flush=True)
        atomic_write_csv(args.out, rows, COLUMNS, lineterminator="\n")

    for round_ in range(first_round, first_round + args.repeat):
        plain = {}  # this round's reference figure per compile value
        for planned in runs:
            if planned.command is None:  # a run that cannot happen here: its row carries the note
                output, note, seconds, memory = "", planned.note, 0.0, ""
            else:
                output, note, seconds, memory = run(planned.command, args.timeout)
                keep_output(args.runs_dir, round_, planned, output)
            fields = dict(decoder=planned.decoder, workers=planned.workers, round_=round_)
            if planned.kind == "plain":
                found = PLAIN_SPEED.findall(output)
                speed = float(found[-1]) if found else None
                plain[planned.compile] = speed
                row = result_row(planned.name, planned.backend, planned.compile, args.opt_level, speed, speed,
                                 seconds, memory, note, **fields)
            elif planned.kind == "train":
                used = re.findall(r"jpeg decoder (\w+)", output)
                fields["decoder"] = used[0] if used else planned.decoder
                row = result_row(planned.name, planned.backend, planned.compile, args.opt_level,
                                 epoch_average(APEX_SPEED, output, args.epochs - 1), plain.get(planned.compile),
                                 seconds, memory, note, epochs=args.epochs,
                                 second_half=second_half_rate(output, args.epochs - 1), **fields)
            elif planned.kind == "timm-benchmark":  # its own summary: timed steps only
                found = TIMM_BENCHMARK_SPEED.findall(output)
                row = result_row(planned.name, planned.backend, planned.compile,
                                 "amp" if args.opt_level != "O0" else "fp32", float(found[-1]) if found else None,
                                 plain.get(planned.compile), seconds, memory, note, **fields)
            else:  # timm; no second-half figure: timm's averages count steps differently
                row = result_row(planned.name, planned.backend, planned.compile, "amp",
                                 epoch_average(TIMM_SPEED, output, args.epochs - 1), plain.get(planned.compile),
                                 seconds, memory, note, epochs=args.epochs, **fields)
            record(row, output)
    rounds = first_round + args.repeat - 1
    if rounds > 1:
        print(f"=> median img/s of {rounds} rounds (lowest-highest), x the plain reference's median:")
        for (name, backend, decoder, workers, compile_), middle, low, high, count, ratio in medians(rows):
            label = " ".join(str(part) for part in (name, backend, decoder, f"-j {workers}" if workers != "0" else "",
                                                    f"compile {compile_}") if part)
            print(f"   {label}: {middle:.1f} ({low:.1f}-{high:.1f}, {count} of {rounds} rounds)"
                  + (f", {ratio}x plain" if ratio is not None else ""))
    hosts = sorted({row["host"] for row in rows})
    if len(hosts) > 1:
        print(f"=> the rows come from {len(hosts)} hosts ({', '.join(hosts)}): figures from different "
              "machines are not comparable, and their medians mix them")
    print(f"=> written to {args.out}")
    failed = [row for row in rows[earlier:] if row["note"] and not row["note"].startswith("not run")]
    if failed:
        print(f"=> {len(failed)} run(s) failed (their output is printed above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))  # a refusal: one line, exit 2; a failed write: one line, exit 4
