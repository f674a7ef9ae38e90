#!/usr/bin/env python3
"""Training speed from JPEG files: cpu vs gpu input backend, with and without --compile, at a few
worker counts, beside plain-PyTorch and (optionally) timm references measured in the same run.

    python tools/benchmark_input.py /data/fake_imagenet --workers 8 16 --out docs/results/h200_input_o2_j8.csv
    python tools/benchmark_input.py DATA --timm-train /path/to/timm/train.py   # add timm's loader

Each configuration is a real `train.py` run (ResNet-50 by default, --epochs 2); its figure is the
second epoch's average Speed (img/s over all processes) from the Apex log line, so worker start-up
and cudnn.benchmark's search are left out. The plain-PyTorch reference trains the same model on one
random batch held on the GPU (no input pipeline at all): the GPU-bound ceiling for that config.
Rows are printed as they come and the CSV is rewritten after each (utils.files.atomic_write).
"""
import argparse
import csv
import io
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils.files import atomic_write  # noqa: E402

APEX_SPEED = re.compile(r"Epoch: \[1\]\[(\d+)/(\d+)\].*?Speed [\d.]+ \(([\d.]+)\)")
TIMM_SPEED = re.compile(r"Train: 1 \[\s*(\d+)/(\d+).*?\(\s*[\d.]+s,\s*([\d.]+)/s\)")
PLAIN_SPEED = re.compile(r"plain img/s ([\d.]+)")

PLAIN = r"""
import sys, time, torch, torchvision
arch, batch, steps, level, compile_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
torch.backends.cudnn.benchmark = True
model = torchvision.models.get_model(arch, num_classes=1000).cuda().to(memory_format=torch.channels_last)
if level == "O2":  # half weights, fp32 BatchNorm
    model.half()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.float()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
step_model = torch.compile(model) if compile_ else model
x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
y = torch.randint(0, 1000, (batch,), device="cuda")
if level == "O2":
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

COLUMNS = ("name", "backend", "workers", "compile", "opt_level", "img_per_s", "ratio_to_plain", "seconds", "note")


def run(command, timeout):
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        output, note = done.stdout + done.stderr, "" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired as err:
        output, note = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or ""), "timeout"
    return output, note, time.perf_counter() - start


def last_match(pattern, text, group):
    found = pattern.findall(text)
    return float(found[-1][group]) if found else None


def write_csv(rows, path):
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, text.getvalue())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="ImageFolder root with train/ and val/ (tools/make_fake_imagenet.py)")
    parser.add_argument("-a", "--arch", default="resnet50")
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--backends", nargs="+", default=["cpu", "gpu"], choices=("cpu", "gpu"))
    parser.add_argument("--compile", nargs="+", default=["False", "True"], choices=("False", "True"))
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--timm-train", default=None, help="path of timm's train.py (from its repository)")
    parser.add_argument("--out", default="input_benchmark.csv", help="CSV to write (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run (default: %(default)s)")
    args = parser.parse_args()

    rows = []

    def record(row, output):
        rows.append(row)
        print(" | ".join(str(row[key]) for key in COLUMNS), flush=True)
        if row["img_per_s"] in ("", None):
            print(output[-2000:], flush=True)
        write_csv(rows, args.out)

    plain = {}
    for compile_ in args.compile:
        output, note, seconds = run([sys.executable, "-c", PLAIN, args.arch, str(args.batch_size), "50",
                                     args.opt_level, "1" if compile_ == "True" else "0"], args.timeout)
        found = PLAIN_SPEED.findall(output)
        speed = float(found[-1]) if found else None
        plain[compile_] = speed
        record({"name": "plain PyTorch, random batch on the GPU", "backend": "none", "workers": 0,
                "compile": compile_, "opt_level": args.opt_level, "img_per_s": speed or "", "ratio_to_plain": 1.0,
                "seconds": round(seconds, 1), "note": note}, output)
    common = ["-a", args.arch, "-b", str(args.batch_size), "--opt-level", args.opt_level, "--epochs", "2",
              "--steps-per-epoch", str(args.steps_per_epoch), "-p", "10", "--lr-steps", "30", "--overwrite"]
    for workers in args.workers:
        for backend in args.backends:
            for compile_ in args.compile:
                out = os.path.join("/tmp", f"bench-{backend}-{workers}-{compile_}")
                command = [sys.executable, "train.py", args.data, *common, "-j", str(workers),
                           "--data-backend", backend, "--compile", compile_, "--output-dir", out]
                output, note, seconds = run(command, args.timeout)
                speed = last_match(APEX_SPEED, output, 2)
                reference = plain.get(compile_)
                record({"name": "train.py", "backend": backend, "workers": workers, "compile": compile_,
                        "opt_level": args.opt_level, "img_per_s": speed or "",
                        "ratio_to_plain": round(speed / reference, 3) if speed and reference else "",
                        "seconds": round(seconds, 1), "note": note}, output)
        if args.timm_train:
            command = [sys.executable, args.timm_train, "--data-dir", args.data, "--val-split", "val",
                       "--model", args.arch, "-b", str(args.batch_size), "-j", str(workers), "--amp",
                       "--channels-last", "--color-jitter", "0", "--train-interpolation", "bilinear",
                       "--epochs", "2", "--sched", "step", "--warmup-epochs", "0", "--log-interval", "10",
                       "--output", "/tmp/timm-bench", "--num-classes", "1000"]
            output, note, seconds = run(command, args.timeout)
            speed = last_match(TIMM_SPEED, output, 2)
            reference = plain.get("False")
            record({"name": "timm train.py --amp --channels-last", "backend": "timm", "workers": workers,
                    "compile": "False", "opt_level": "amp", "img_per_s": speed or "",
                    "ratio_to_plain": round(speed / reference, 3) if speed and reference else "",
                    "seconds": round(seconds, 1), "note": note}, output)
    print(f"=> written to {args.out}")


if __name__ == "__main__":
    main()
