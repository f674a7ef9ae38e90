"""Train an ImageNet-style classifier with Apex's command line on HuggingFace Accelerate.

    python train.py                                   # digits demo, CPU or GPU
    python train.py --opt-level O2 /data/imagenet     # one GPU
    accelerate launch --config_file accelerate_configs/2gpu.yaml train.py --opt-level O1 /data/imagenet

The story: parse flags -> resolve the precision recipe -> data -> model, optimizer (resumed if
asked, possibly mid-epoch) -> per epoch: train, validate, checkpoint. Two ways out before the
end: SIGTERM/SIGINT (a mid-epoch checkpoint, one line saying how to resume, exit 130/143) and
divergence (one line naming the step, the LR and the last good checkpoint, exit 3). Details
live in utils/.
"""
import os
import signal
import sys

if __name__ == "__main__":
    # Ctrl-C during the imports below (seconds, torch's) ends the process quietly (status 130), not with
    # a traceback from deep inside an import; exit_on_usage_error gives Ctrl-C its message back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch  # noqa: E402

from utils.checkpoint import BEST, CHECKPOINT, best_on_disk, save_checkpoint
from utils.cli import absolute_data, add_log_args, build_parser, idle_flag_notes, source_kind, typed_dests
from utils.compiled import plain_module
from utils.data import build_data
from utils.engine import (close_batches, diverged_message, steps_per_epoch, train_one_epoch, training_epochs,
                          validate)
from utils.errors import Diverged, exit_on_usage_error
from utils.logs import Progress, RunLog, tracker_kwargs
from utils.preemption import StopOnSignal, stopped_line
from utils.profiling import NoPhases, NvtxWindow
from utils.recipe import build_batch_augment, build_criterion, check_ingredient_flags, ema_state_dict
from utils.setup import (build_or_resume, global_batch, make_accelerator, parse_args, prepare_output_dir,
                         remove_replaced_run, warn)


def checkpoint_state(args, epoch, model, optimizer, precision, recipe, best_prec1, accelerator,
                     num_classes=None, classes=None, next_step=0, so_far=None):
    """What --resume continues from: (epoch, step) is the position to continue at, the next
    epoch to run after a finished epoch (step 0, as Apex stores it), or the epoch in progress and
    its next step for a mid-epoch checkpoint (a stop signal, --save-every-steps), with so_far, the
    epoch's figures until then (for its summary.csv row)."""
    return {
        "epoch": epoch,
        "step": next_step,
        "mid_epoch": next_step > 0,  # resumes inside "epoch", at "step" of the same shuffle
        **({"epoch_so_far": so_far} if next_step > 0 and so_far is not None else {}),
        "global_batch": global_batch(args, accelerator),  # what "step" counts in (x --accum-steps)
        "arch": args.arch,
        "state_dict": precision.fp32_state_dict(plain_module(model)),
        **({"state_dict_ema": ema_state_dict(precision.ema)} if precision.ema is not None else {}),
        "optimizer": optimizer.state_dict(),
        "loss_scale": precision.state_dict(),
        "best_prec1": best_prec1,
        "opt_level": recipe.opt_level,
        "mixed_precision": recipe.dtype_name,  # the half dtype in use; eval.py evaluates with it
        "num_classes": num_classes,
        "classes": classes,  # class names in label order: eval.py refuses data with other classes
        "world_size": accelerator.num_processes,  # with args' batch_size: the global batch, for --resume
        "args": {**vars(args), "data": absolute_data(args.data)},  # eval.py may run elsewhere
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    parser = add_log_args(build_parser(description=__doc__.splitlines()[0]))
    args = parse_args(parser, argv)
    check_ingredient_flags(args)
    accelerator, recipe, notes = make_accelerator(args, **tracker_kwargs(args))
    replaced = prepare_output_dir(args, accelerator)  # created, writable, no other run's files: before any work
    for note in notes + idle_flag_notes(parser, args, typed_dests(parser, argv)):
        warn(accelerator, note)
    progress = Progress(accelerator)  # a bar on a terminal; log lines print above it
    log = progress.print

    data = build_data(args, accelerator, train=not args.evaluate)  # -e reads the val split only
    num_classes = args.num_classes or data.num_classes
    model, optimizer, precision, best_prec1, so_far = build_or_resume(args, accelerator, recipe, num_classes,
                                                                      data.classes)
    if args.resume:
        inside = f", step {args.start_step}" if args.start_step else ""  # a mid-epoch checkpoint
        log(f"=> resumed {args.resume!r} at epoch {args.start_epoch}{inside} (best Prec@1 {best_prec1:.3f})")

    log(f"=> {args.arch} on {source_kind(args.data) if args.data in (None, 'digits', 'synthetic') else args.data}"
        f" | {num_classes} classes | {accelerator.num_processes} process(es) on {accelerator.device.type}"
        f" | global batch {global_batch(args, accelerator)} | lr {args.lr * global_batch(args, accelerator) / 256:g}")
    log(recipe.describe())
    log(args.input_line)
    criterion = torch.nn.CrossEntropyLoss().to(accelerator.device)  # validation: hard targets
    if args.evaluate:
        validate(model, data, precision, accelerator, args, criterion, log, progress)
        return
    # The ingredients on the device batch and the loss (utils/recipe.py); None/plain CE by default.
    augment = build_batch_augment(args, accelerator.device, num_classes)
    train_criterion = build_criterion(args.label_smoothing, augment is not None and augment.mixup is not None)

    resolved = {"opt_level": recipe.opt_level, "mixed_precision": recipe.dtype_name,  # what ran, for args.yaml
                "num_classes": num_classes, "data": args.data or "digits"}
    remove_replaced_run(args, accelerator, replaced)  # --overwrite: only now that everything was built
    on_disk = best_on_disk(args.output_dir) if args.resume else None
    if on_disk is not None and on_disk > best_prec1:  # resumed from an older checkpoint: keep the better file
        log(f"=> {BEST} in {args.output_dir} holds Prec@1 {on_disk:.3f}, above this checkpoint's best "
            f"({best_prec1:.3f}): only an epoch that beats it replaces it")
        best_prec1 = on_disk
    profiling = args.prof >= 0  # a --prof run writes nothing: no log, no checkpoint
    run_log = RunLog(args, accelerator, resolved, active=not profiling)  # args.yaml, summary.csv, curves.png, trackers

    phases = NvtxWindow(args.prof) if profiling else NoPhases()
    if profiling and not torch.cuda.is_available():
        warn(accelerator, "--prof: no CUDA, so no NVTX ranges or cudaProfiler calls; the run still "
                          f"stops after step {args.prof + 10}")
    steps = steps_per_epoch(data, args)
    last_good = args.resume or None  # the checkpoint a divergence message points back to

    def save(epoch, next_step=0, is_best=False, lr=None, so_far=None):
        """checkpoint.pth.tar at (epoch, next_step), by the main process. Non-finite weights are
        never written (over a good checkpoint, or as model_best): every process checks them and
        stops with the divergence message instead."""
        nonlocal last_good
        if not precision.weights_finite(model):
            done = (epoch, next_step) if next_step else (epoch - 1, steps)  # the last step run
            raise Diverged(diverged_message("the weights (or BatchNorm statistics) hold inf/NaN", *done, steps, lr, last_good))
        if accelerator.is_main_process:
            save_checkpoint(checkpoint_state(args, epoch, model, optimizer, precision, recipe, best_prec1,
                                             accelerator, num_classes, data.classes, next_step, so_far),
                            is_best, args.output_dir, keep=args.keep_checkpoints)
        last_good = os.path.join(args.output_dir, CHECKPOINT)
        return last_good

    def every_n_steps(epoch, next_step, so_far):  # --save-every-steps: counted across epochs
        if (epoch * steps + next_step) % args.save_every_steps == 0:
            save(epoch, next_step, lr=optimizer.param_groups[0]["lr"], so_far=so_far())

    def stopped(path, epoch, next_step):  # after a stop signal: say where, and how to go on
        log(stopped_line(stop, path, epoch, next_step, steps, accelerator.num_processes, args.output_dir,
                         parser._option_string_actions))
        run_log.finish()
        accelerator.end_training()
        return stop.exit_code

    stop = StopOnSignal(announce=accelerator.is_main_process)  # SIGTERM/SIGINT: finish the step first
    ahead = None  # the next epoch's batches, started before this epoch validates
    with stop.installed():
        for epoch, first_step in training_epochs(args, data, accelerator):
            trained = train_one_epoch(model, data, optimizer, precision, accelerator, epoch, args, train_criterion,
                                      phases, log, progress, first_step, stop,
                                      every_n_steps if args.save_every_steps and not profiling else None, augment,
                                      ahead, so_far if epoch == args.start_epoch else None)
            ahead = None
            if trained.diverged:
                raise Diverged(diverged_message(trained.diverged, epoch, trained.step, steps, trained.lr,
                                                last_good))
            if trained.stopped and profiling:
                log(f"=> stopped by {stop.name} during the --prof run (it saves nothing)")
                return stop.exit_code
            if trained.stopped:  # every process stopped at this same step
                return stopped(save(epoch, trained.next_step, lr=trained.lr, so_far=trained.so_far()), epoch,
                               trained.next_step)
            if profiling:
                if phases.finished:
                    break
                continue  # the window lies in a later epoch (NvtxWindow counts steps across epochs)
            # Loader workers (and the gpu backend's decode threads) fill the next epoch's first
            # batches while this one validates, instead of after: the same batches, sooner.
            ahead = data.start_epoch(epoch + 1) if epoch + 1 < args.epochs else None
            result = validate(model, data, precision, accelerator, args, criterion, log, progress)
            if precision.ema is not None:  # after the model's line, which Apex's log readers expect first
                ema_result = validate(precision.ema.module, data, precision, accelerator, args, criterion,
                                      log, progress, label="EMA")
            judged = ema_result if args.model_ema_best else result  # model_best follows the EMA only if asked
            is_best = judged.top1 > best_prec1  # False for a NaN top-1
            best_prec1 = judged.top1 if is_best else best_prec1
            # The row first: a run killed between the two resumes after this epoch, and a resume
            # drops the rows from its start epoch on, so a row ahead of its checkpoint is rewritten.
            run_log.epoch(epoch, trained, result, optimizer, ema_result if precision.ema is not None else None)
            path = save(epoch + 1, 0, is_best, lr=trained.lr)
            if epoch + 1 < args.epochs and stop.agreed(accelerator):  # a signal during validation or the save
                close_batches(ahead)
                return stopped(path, epoch + 1, 0)
    accelerator.wait_for_everyone()  # a process whose last save failed makes the others exit with its code
    run_log.finish()
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
