"""Train an ImageNet-style classifier with Apex's command line on HuggingFace Accelerate.

    python train.py                                   # digits demo, CPU or GPU
    python train.py --opt-level O2 /data/imagenet     # one GPU
    accelerate launch --config_file accelerate_configs/2gpu.yaml train.py --opt-level O1 /data/imagenet

The story: parse flags -> resolve the precision recipe -> data -> model, optimizer (resumed if
asked) -> per epoch: train, validate, checkpoint. Details live in utils/.
"""

import torch

from utils.checkpoint import save_checkpoint
from utils.cli import add_log_args, build_parser, source_kind
from utils.data import build_data
from utils.engine import train_one_epoch, training_epochs, validate
from utils.errors import exit_on_usage_error
from utils.logs import Progress, RunLog, tracker_kwargs
from utils.profiling import NoPhases, NvtxWindow
from utils.setup import build_or_resume, make_accelerator, parse_args, warn


def checkpoint_state(args, epoch, model, optimizer, precision, recipe, best_prec1, accelerator,
                     num_classes=None, classes=None):
    return {
        "epoch": epoch + 1,  # the next epoch to run, as Apex stores it
        "arch": args.arch,
        "state_dict": precision.fp32_state_dict(accelerator.unwrap_model(model)),
        "optimizer": optimizer.state_dict(),
        "loss_scale": precision.state_dict(),
        "best_prec1": best_prec1,
        "opt_level": recipe.opt_level,
        "mixed_precision": recipe.dtype_name,  # the half dtype in use; eval.py evaluates with it
        "num_classes": num_classes,
        "classes": classes,  # class names in label order: eval.py refuses data with other classes
        "args": dict(vars(args)),
    }


def main(argv=None):
    args = parse_args(add_log_args(build_parser(description=__doc__.splitlines()[0])), argv)
    accelerator, recipe, notes = make_accelerator(args, **tracker_kwargs(args))
    for note in notes:
        warn(accelerator, note)
    progress = Progress(accelerator)  # a bar on a terminal; log lines print above it
    log = progress.print

    data = build_data(args, accelerator, train=not args.evaluate)  # -e reads the val split only
    num_classes = args.num_classes or data.num_classes
    model, optimizer, precision, best_prec1 = build_or_resume(args, accelerator, recipe, num_classes)
    if args.resume:
        log(f"=> resumed {args.resume!r} at epoch {args.start_epoch} (best Prec@1 {best_prec1:.3f})")

    global_batch = args.batch_size * accelerator.num_processes
    log(f"=> {args.arch} on {source_kind(args.data) if args.data in (None, 'digits', 'synthetic') else args.data}"
        f" | {num_classes} classes | {accelerator.num_processes} process(es) on {accelerator.device.type}"
        f" | global batch {global_batch} | lr {args.lr * global_batch / 256:g}")
    log(recipe.describe())
    criterion = torch.nn.CrossEntropyLoss().to(accelerator.device)

    if args.evaluate:
        validate(model, data, precision, accelerator, args, criterion, log, progress)
        return

    resolved = {"opt_level": recipe.opt_level, "mixed_precision": recipe.dtype_name,  # what ran, for args.yaml
                "num_classes": num_classes, "data": args.data or "digits"}
    run_log = RunLog(args, accelerator, resolved)  # args.yaml, summary.csv, curves.png, trackers per epoch

    phases = NvtxWindow(args.prof) if args.prof >= 0 else NoPhases()
    if args.prof >= 0 and not torch.cuda.is_available():
        warn(accelerator, "--prof: no CUDA, so no NVTX ranges or cudaProfiler calls; the run still "
                          f"stops after step {args.prof + 10}")
    for epoch in training_epochs(args, data, accelerator):
        trained = train_one_epoch(model, data, optimizer, precision, accelerator, epoch, args, criterion,
                                  phases, log, progress)
        if args.prof >= 0:
            if phases.finished:
                break
            continue  # the window lies in a later epoch (NvtxWindow counts steps across epochs)
        result = validate(model, data, precision, accelerator, args, criterion, log, progress)
        is_best = result.top1 > best_prec1
        best_prec1 = max(result.top1, best_prec1)
        state = checkpoint_state(args, epoch, model, optimizer, precision, recipe, best_prec1, accelerator,
                                 num_classes, data.classes)
        if accelerator.is_main_process:
            save_checkpoint(state, is_best, args.output_dir)
        run_log.epoch(epoch, trained, result, optimizer)
    run_log.finish()
    accelerator.end_training()


if __name__ == "__main__":
    exit_on_usage_error(main)
