"""What a training run leaves behind and shows: the run directory, trackers and a progress bar.

Run directory (--output-dir, the working directory by default, as Apex), written by the global
main process only once the first epoch has ended, each file replaced atomically so a reader
never sees half of it:
  args.yaml     every setting after defaults were resolved (model data config included)
  summary.csv   one row per epoch: epoch (0-based, as the Apex lines), train loss and top-1,
                val loss, top-1 and top-5, lr at the epoch's last step, img/s (all processes),
                skipped steps and loss scale (empty without loss scaling), the EMA's val
                top-1 and top-5 (empty without --model-ema); with --tta, then tta_top1, tta_top5,
                ema_tta_top1, ema_tta_top5 (columns only in a file with a row that has them)
  curves.png    loss and top-1 per epoch, redrawn after every epoch and at the end
--log-with sends the same per-epoch figures to TensorBoard (OUTPUT_DIR/runs/imagenet-amp/) and/or
Weights & Biases through Accelerate's trackers.

Progress: on a terminal a tqdm bar, with the Apex lines (every --print-freq steps) written above
it; when stderr is not a terminal (a log file, a pipe) no bar at all, so logs hold the Apex lines
and nothing else.
"""
import csv
import io
import os
import sys

from utils.run.errors import UsageError
from utils.run.files import atomic_write

PROJECT = "imagenet-amp"  # the TensorBoard run folder and the W&B project
SUMMARY_COLUMNS = ("epoch", "train_loss", "train_top1", "val_loss", "top1", "top5", "lr", "img_per_s",
                   "skipped_steps", "loss_scale", "ema_top1", "ema_top5")
# --tta's figures: a file gets these columns only when one of its rows has them, so a run without
# --tta writes the header it always did; a resume rewrites every row, so a run that turns --tta on
# gets them with empty cells in the earlier rows.
TTA_COLUMNS = ("tta_top1", "tta_top5", "ema_tta_top1", "ema_tta_top5")
TRACKERS = {"none": (), "tensorboard": ("tensorboard",), "wandb": ("wandb",), "all": ("tensorboard", "wandb")}


def tracker_kwargs(log_with, output_dir):
    """Accelerator(...) arguments for --log-with (a TRACKERS key): the trackers, and where
    TensorBoard writes (under --output-dir).

    Accelerate silently drops a tracker whose package is missing, so check first and say so.
    """
    names = TRACKERS[log_with]
    if not names:
        return {}
    from accelerate.utils import ProjectConfiguration, is_tensorboard_available, is_wandb_available

    if "tensorboard" in names and not is_tensorboard_available():
        raise UsageError(f"--log-with {log_with} needs TensorBoard: pip install tensorboard")
    if "wandb" in names and not is_wandb_available():
        raise UsageError(f"--log-with {log_with} needs Weights & Biases: pip install wandb (and set "
                         "WANDB_MODE=offline to log without network), or use --log-with tensorboard")
    config = ProjectConfiguration(project_dir=output_dir, logging_dir=os.path.join(output_dir, "runs"))
    return {"log_with": list(names), "project_config": config}


def _plain(value):
    """A value YAML and the trackers accept: numbers, text, booleans, None and lists of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def write_args_yaml(settings, path):
    import yaml

    settings = {name: _plain(value) for name, value in settings.items()}
    atomic_write(path, yaml.safe_dump(settings, sort_keys=False))


def read_summary(path):
    """The rows of an existing summary.csv as dicts of floats (empty cells: None)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as handle:
        return [{key: float(value) if value not in ("", None) else None for key, value in row.items()}
                for row in csv.DictReader(handle)]


def write_summary(rows, path):
    tta = any(row.get(key) is not None for row in rows for key in TTA_COLUMNS)
    columns = SUMMARY_COLUMNS + TTA_COLUMNS if tta else SUMMARY_COLUMNS
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: ("" if row.get(key) is None else _csv_number(row[key])) for key in columns})
    atomic_write(path, text.getvalue())


def _csv_number(value):
    return int(value) if float(value).is_integer() and abs(value) < 2 ** 53 else value


def draw_curves(rows, path, title=""):
    """Loss and top-1 per epoch, train and val, as a PNG. Uses matplotlib's Figure directly
    (no pyplot), which renders with Agg: no display, no global backend switch."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    epochs = [row["epoch"] for row in rows]
    figure = Figure(figsize=(10, 4), layout="constrained")
    figure.suptitle(title)
    loss_axes, top1_axes = figure.subplots(1, 2)
    for axes, train_key, val_key, title in ((loss_axes, "train_loss", "val_loss", "loss"),
                                            (top1_axes, "train_top1", "top1", "top-1 (%)")):
        axes.plot(epochs, [row[train_key] for row in rows], marker="o", label="train")
        axes.plot(epochs, [row[val_key] for row in rows], marker="o", label="val")
        axes.set_xlabel("epoch")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    atomic_write(path, buffer.getvalue())


class RunLog:
    """Per epoch: a summary.csv row, a fresh curves.png and the tracker values.

    The files appear when the first epoch ends (args.yaml with them), so a run that stops early
    (an unreadable image, a wrong flag found at step 1) leaves the directory as it was, as Apex's
    checkpoints do. Only the global main process writes; the others hold an inert RunLog. A
    resumed run keeps the rows of the epochs before --start-epoch: the CSV and curves cover the
    whole run.

    output_dir: the run directory (--output-dir). settings: what args.yaml and the trackers record,
    every setting of the run: the flags as resumed (--start-epoch included), then what the run
    decided where a flag was left out (the opt level and dtype of the precision plan, the data's
    class count, 'digits' for no DATA) rather than the flags' None. title: curves.png's.
    start_epoch and resume (--resume's checkpoint, or ""): where a resumed run's earlier rows come
    from. trackers: --log-with named any (the Accelerator already holds them: tracker_kwargs).
    """

    def __init__(self, accelerator, output_dir, settings, *, title="", start_epoch=0, resume="",
                 trackers=False, active=True):
        self.accelerator = accelerator
        self.active = active and accelerator.is_main_process  # active=False: a run that logs nothing (--prof)
        self.settings = dict(settings)
        self.rows = []
        self.started = False
        self.can_draw = True
        if not self.active:
            return
        self.dir = output_dir
        self.summary = os.path.join(self.dir, "summary.csv")
        self.curves = os.path.join(self.dir, "curves.png")
        self.title = title
        if start_epoch > 0:
            self.rows = [row for row in read_summary(self.history(resume)) if row["epoch"] < start_epoch]
        if trackers:
            os.makedirs(self.dir, exist_ok=True)  # wandb.init(dir=...) wants it to exist
            # TensorBoard's hparams take only numbers, text and booleans
            config = {name: value if isinstance(value, (bool, int, float, str)) else str(value)
                      for name, value in self.settings.items()}
            accelerator.init_trackers(PROJECT, config=config, init_kwargs={"wandb": {"dir": self.dir}})

    def history(self, resume):
        """The summary.csv holding the epochs before a resumed one: this run directory's, or, for a
        checkpoint resumed from another directory into a new --output-dir, the one beside the
        checkpoint (else the new directory's summary.csv would start at the resumed epoch)."""
        if os.path.isfile(self.summary) or not resume:
            return self.summary
        return os.path.join(os.path.dirname(os.path.abspath(resume)), "summary.csv")

    def epoch(self, epoch, train, val, optimizer, ema=None):
        """Record one epoch: train, val (and ema, the --model-ema validation, else None) are
        utils.meters.EpochResult."""
        if not self.active:
            return
        if not self.started:
            os.makedirs(self.dir, exist_ok=True)
            write_args_yaml(self.settings, os.path.join(self.dir, "args.yaml"))
            self.started = True
        row = {"epoch": epoch, "train_loss": train.loss, "train_top1": train.top1, "val_loss": val.loss,
               "top1": val.top1, "top5": val.top5, "lr": optimizer.param_groups[0]["lr"],
               "img_per_s": train.images_per_sec, "skipped_steps": train.skipped_steps,
               "loss_scale": train.loss_scale, "ema_top1": ema.top1 if ema is not None else None,
               "ema_top5": ema.top5 if ema is not None else None, "tta_top1": val.tta_top1, "tta_top5": val.tta_top5,
               "ema_tta_top1": ema.tta_top1 if ema is not None else None,
               "ema_tta_top5": ema.tta_top5 if ema is not None else None}
        self.rows.append(row)
        write_summary(self.rows, self.summary)
        self.draw()
        values = {"train/loss": train.loss, "train/top1": train.top1, "val/loss": val.loss,
                  "val/top1": val.top1, "val/top5": val.top5, "lr": row["lr"], "img_per_s": train.images_per_sec,
                  "skipped_steps": train.skipped_steps}
        if train.loss_scale is not None:
            values["loss_scale"] = train.loss_scale
        if ema is not None:
            values.update({"val/ema_top1": ema.top1, "val/ema_top5": ema.top5})
        values.update({f"val/{key}": row[key] for key in TTA_COLUMNS if row[key] is not None})
        self.accelerator.log(values, step=epoch)

    def draw(self):
        if not self.rows or not self.can_draw:
            return
        try:
            draw_curves(self.rows, self.curves, self.title)
        except ImportError:  # the other logs are still worth having
            print(f"warning: {self.curves} not drawn: matplotlib is not installed (pip install "
                  "matplotlib)", file=sys.stderr, flush=True)
            self.can_draw = False

    def finish(self):
        """The final curves.png."""
        if self.active and self.started:
            self.draw()


class NoProgress:
    """The loops' default: no bar."""

    def begin(self, total, desc, unit="img"):
        pass

    def advance(self, n=1):
        pass

    def end(self):
        pass


class Progress(NoProgress):
    """A tqdm bar on a terminal (main process only) and the printer for the log lines beside it.

    print() is the scripts' log function: with a bar open it writes through tqdm.write, which
    lifts the bar, prints the line and redraws the bar under it. Without a terminal on stderr
    there is never a bar, so a log file gets plain lines only. Lines print on the local main
    process, as accelerator.print does.
    """

    def __init__(self, accelerator, enabled=None):
        self.printing = accelerator.is_local_main_process
        if enabled is None:
            enabled = accelerator.is_main_process and sys.stderr.isatty()
        self.enabled = enabled
        self.bar = None

    def print(self, line):
        if not self.printing:
            return
        if self.bar is not None:
            from tqdm import tqdm
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def begin(self, total, desc, unit="img"):
        if not self.enabled:
            return
        from tqdm import tqdm
        self.end()
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False,
                        dynamic_ncols=True, file=sys.stderr)

    def advance(self, n=1):
        if self.bar is not None:
            self.bar.update(n)

    def end(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
