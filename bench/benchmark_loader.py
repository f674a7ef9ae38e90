#!/usr/bin/env python3
"""Loader-only speed, no GPU needed: the cpu backend's train loader against timm's on one folder.

    python bench/benchmark_loader.py /data/fake_imagenet --workers 2 --batch-size 64 --batches 40
    python bench/benchmark_loader.py DATA --workers 8 16 --out loader_j2.csv

When training from JPEG files is decode-bound, the loader workers set the speed, and those run on
the CPU alone. This measures them without a GPU: train.py's own DataLoader for the cpu backend
(PIL decode, the seeded RandomResizedCrop + flip, uint8 collate; utils.data.batches) against the
DataLoader inside timm's create_loader with the options timm's train.py is compared with elsewhere
(--color-jitter 0 --train-interpolation bilinear: RandomResizedCrop + flip, uint8 collate). Both
stop at uint8 batches in host memory: what follows (copy to the GPU, normalising there) is the same
kind of work for both and is left out. The gpu backend's workers (file bytes and crop boxes only,
utils.data.gpu.packing) are measured too, as `gpu-workers`.

Each round builds every loader afresh and takes, per loader, the images per second between the end
of the --warmup-th batch and the --batches-th (worker start-up left out). Loaders alternate within
a round so a busy machine slows them alike; the figure is the median over --rounds.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from utils.data.folder import check_image_folder  # noqa: E402
from utils.run.errors import exit_on_usage_error  # noqa: E402
from utils.run.files import atomic_write_csv, check_output_file  # noqa: E402

LOADERS = ("cpu", "timm", "gpu-workers")


def ours(data, workers, batch_size, image_size, seed=0):
    """train.py's cpu-backend train DataLoader (utils.data.batches.batch_loader over SeededSamples)."""
    from utils.data.batches import SeededSamples, ShardedEpochSampler, batch_loader
    from utils.data.crops import train_transform
    from utils.data.folder import image_folder
    dataset = image_folder(data, "train", train_transform(image_size, 0.08, 0.5, "bilinear"))
    sampler = ShardedEpochSampler(len(dataset), batch_size, 0, 1, seed)
    return batch_loader(SeededSamples(dataset, seed), sampler, batch_size, workers, torch.device("cpu")), sampler


def gpu_workers(data, workers, batch_size, image_size, seed=0):
    """The gpu backend's worker side: file bytes, header and crop box per image, packed per batch."""
    from utils.data.batches import ShardedEpochSampler, batch_loader
    from utils.data.crops import TrainBoxes
    from utils.data.folder import image_folder
    from utils.data.gpu.packing import ByteSamples, pack_bytes
    dataset = image_folder(data, "train", None)
    samples = ByteSamples(dataset.samples, TrainBoxes(seed, 0.08, 0.5, image_size))
    sampler = ShardedEpochSampler(len(dataset), batch_size, 0, 1, seed)
    return batch_loader(samples, sampler, batch_size, workers, torch.device("cpu"), collate_fn=pack_bytes,
                        pin_memory=False), sampler


def timm_loader(data, workers, batch_size, image_size, seed=0):
    """The DataLoader inside timm's create_loader, configured as timm's train.py is with
    --color-jitter 0 --train-interpolation bilinear (its prefetcher's normalising left out)."""
    from timm.data import create_dataset, create_loader
    dataset = create_dataset("", root=os.path.join(data, "train"), is_training=True, seed=seed)
    loader = create_loader(dataset, input_size=(3, image_size, image_size), batch_size=batch_size,
                           is_training=True, use_prefetcher=True, color_jitter=0.0, interpolation="bilinear",
                           num_workers=workers, device=torch.device("cpu"),
                           persistent_workers=workers > 0)
    return getattr(loader, "loader", loader), None


BUILDERS = {"cpu": ours, "timm": timm_loader, "gpu-workers": gpu_workers}


def images_in(batch):
    """How many images one batch holds, whatever the loader's batch type."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return len(batch.labels) if hasattr(batch, "labels") else len(first)


def measure(name, data, workers, batch_size, image_size, batches, warmup):
    """Images per second between the warmup-th and the batches-th batch of a fresh loader."""
    loader, sampler = BUILDERS[name](data, workers, batch_size, image_size)
    seen, start, epoch, count = 0, None, 0, 0
    try:
        while count < batches:
            if sampler is not None:
                sampler.set_epoch(epoch)
            for batch in loader:
                count += 1
                if count == warmup:
                    start = time.perf_counter()
                elif count > warmup:
                    seen += images_in(batch)
                if count == batches:
                    break
            epoch += 1
        return seen / (time.perf_counter() - start)
    finally:
        del loader  # persistent workers end with their loader


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="an ImageFolder root holding train/<class>/*.JPEG")
    parser.add_argument("--workers", "-j", type=int, nargs="+", default=[2], help="worker counts (default: 2)")
    parser.add_argument("--batch-size", "-b", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batches", type=int, default=40, help="batches a measurement (default: 40)")
    parser.add_argument("--warmup", type=int, default=5, help="batches left out at the start (default: 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported (default: 3)")
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS))
    parser.add_argument("--out", help="CSV to write (rewritten after each row)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (default: refuse, naming it, before any measurement)")
    args = parser.parse_args(argv)
    for flag, value, low in (("--rounds", args.rounds, 1), ("--batch-size", args.batch_size, 1),
                             ("--image-size", args.image_size, 1), ("--workers", min(args.workers), 0)):
        if value < low:
            parser.error(f"{flag} {value}: at least {low}")
    if not 0 < args.warmup < args.batches:
        parser.error(f"--warmup {args.warmup} must be at least 1 and below --batches {args.batches}")
    if "timm" in args.loaders:
        try:
            import timm.data  # noqa: F401
        except ImportError:
            parser.error("timm is not installed: pip install timm, or leave timm out of --loaders")
    check_image_folder(args.data, ("train",))  # a UsageError: one line, exit 2
    if args.out:  # rewritten after each row: that it can be, and replaces no file of the user's, first
        check_output_file(args.out, "--out", args.overwrite)
    torch.set_num_threads(1)
    rows = []
    print(f"cores {os.cpu_count()}, torch {torch.__version__}, batch {args.batch_size}, "
          f"{args.batches - args.warmup} batches measured after {args.warmup}, {args.rounds} rounds", flush=True)
    for workers in args.workers:
        speeds = {name: [] for name in args.loaders}
        for round_ in range(args.rounds):
            for name in args.loaders:
                speed = measure(name, args.data, workers, args.batch_size, args.image_size, args.batches, args.warmup)
                speeds[name].append(speed)
                print(f"-j {workers} round {round_ + 1} {name:12s} {speed:8.1f} img/s", flush=True)
        timm_speed = statistics.median(speeds["timm"]) if "timm" in speeds else None
        for name in args.loaders:
            median = statistics.median(speeds[name])
            rows.append({"loader": name, "workers": workers, "img_per_s": round(median, 1),
                         "ratio_to_timm": round(median / timm_speed, 3) if timm_speed else "",
                         "rounds": " ".join(f"{s:.1f}" for s in speeds[name])})
            if args.out:
                atomic_write_csv(args.out, rows, list(rows[0]))
    print("loader,workers,img_per_s,ratio_to_timm")
    for row in rows:
        print(f"{row['loader']},{row['workers']},{row['img_per_s']},{row['ratio_to_timm']}")


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
