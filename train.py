"""Train an ImageNet-style classifier with Apex's command line on HuggingFace Accelerate.

    python train.py                                   # digits demo, CPU or GPU
    python train.py --opt-level O2 /data/imagenet     # one GPU
    accelerate launch --config_file accelerate_configs/2gpu.yaml train.py --opt-level O1 /data/imagenet

The story: parse flags -> Accelerator and precision plan -> output directory -> data -> model,
optimizer (resumed if asked, possibly mid-epoch) -> per epoch: train, validate, checkpoint. Two
ways out before the end: SIGTERM/SIGINT (a mid-epoch checkpoint, one line saying how to resume,
exit 130/143) and divergence (one line naming the step, the LR and the last good checkpoint,
exit 3). Details live in utils/ (its __init__ is the map).
"""
import os
import signal
import sys
from dataclasses import dataclass

if __name__ == "__main__":
    # Ctrl-C during the imports below (seconds, torch's) ends the process quietly (status 130), not with
    # a traceback from deep inside an import; exit_on_usage_error gives Ctrl-C its message back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch  # noqa: E402

from utils.compiled import compiled_sizes_note, plain_module
from utils.data.sources import absolute_data, build_data, source_kind
from utils.device import make_accelerator, warn
from utils.engine import Watch, close_batches, diverged_message, train_one_epoch, training_epochs, validate
from utils.flags.parser import PROF_STEPS, add_log_args, build_parser, idle_flag_notes, typed_dests
from utils.flags.precedence import check_ingredient_flags, parse_args
from utils.flags.specs import (
    batch_ingredients,
    data_spec,
    device_settings,
    precision_flags,
    run_dir_spec,
    training_loop,
    training_specs,
)
from utils.ingredients import build_batch_augment, build_criterion, ema_state_dict
from utils.logs import Progress, RunLog, tracker_kwargs
from utils.profiling import NoPhases, NvtxWindow
from utils.run.checkpoint import BEST, CHECKPOINT, best_on_disk, save_checkpoint
from utils.run.directory import prepare_output_dir, remove_replaced_run
from utils.run.errors import Diverged, exit_on_usage_error
from utils.run.lock import releases_output_dir
from utils.run.preemption import StopOnSignal, stopped_line
from utils.training_state import build_or_resume, global_batch


@dataclass
class Run:
    """What the epoch loop carries, and the two ways it writes: save() a checkpoint, stopped()
    after a stop signal. settings: the run's flags as resolved (the checkpoint's "args")."""
    state: object                 # utils.training_state.TrainingState
    plan: object                  # utils.precision.PrecisionPlan
    data: object                  # utils.data.batches.Data
    settings: dict
    output_dir: str
    keep_checkpoints: int
    steps: int                    # optimizer steps per epoch
    log: object
    best_prec1: float = 0.0
    last_good: str = None         # the checkpoint a divergence message points back to
    num_classes: int = None
    save_every_steps: int = 0     # --save-every-steps, counted across epochs

    def checkpoint(self, epoch, next_step=0, so_far=None):
        """What --resume continues from: (epoch, step) is the position to continue at, the next
        epoch to run after a finished epoch (step 0, as Apex stores it), or the epoch in progress
        and its next step for a mid-epoch checkpoint (a stop signal, --save-every-steps), with
        so_far, the epoch's figures until then (for its summary.csv row)."""
        model, optimizer, precision, accelerator = self.state
        return {
            "epoch": epoch,
            "step": next_step,
            "mid_epoch": next_step > 0,  # resumes inside "epoch", at "step" of the same shuffle
            **({"epoch_so_far": so_far} if next_step > 0 and so_far is not None else {}),
            "global_batch": global_batch(self.settings["batch_size"], accelerator.num_processes,
                                         self.settings["accum_steps"]),  # what "step" counts in
            "arch": self.settings["arch"],
            "state_dict": precision.fp32_state_dict(plain_module(model)),
            **({"state_dict_ema": ema_state_dict(precision.ema)} if precision.ema is not None else {}),
            "optimizer": optimizer.state_dict(),
            "loss_scale": precision.state_dict(),
            "best_prec1": self.best_prec1,
            "opt_level": self.plan.opt_level,
            "mixed_precision": self.plan.dtype_name,  # the half dtype in use; eval.py evaluates with it
            "num_classes": self.num_classes,
            "classes": self.data.classes,  # class names in label order: eval.py refuses data with other classes
            "world_size": accelerator.num_processes,  # with args' batch_size: the global batch, for --resume
            "args": self.settings,
        }

    def save(self, epoch, next_step=0, is_best=False, lr=None, so_far=None):
        """checkpoint.pth.tar at (epoch, next_step), by the main process. Non-finite weights are
        never written (over a good checkpoint, or as model_best): every process checks them and
        stops with the divergence message instead."""
        model, _, precision, accelerator = self.state
        if not precision.weights_finite(model):
            done = (epoch, next_step) if next_step else (epoch - 1, self.steps)  # the last step run
            raise Diverged(diverged_message("the weights (or BatchNorm statistics) hold inf/NaN", *done, self.steps,
                                            lr, self.last_good))
        if accelerator.is_main_process:
            save_checkpoint(self.checkpoint(epoch, next_step, so_far), is_best, self.output_dir,
                            keep=self.keep_checkpoints)
        self.last_good = os.path.join(self.output_dir, CHECKPOINT)
        return self.last_good

    def after_step(self, epoch, next_step, so_far):
        """utils.engine.Watch.on_step for --save-every-steps: a mid-epoch checkpoint every N steps."""
        if (epoch * self.steps + next_step) % self.save_every_steps == 0:
            self.save(epoch, next_step, lr=self.state.optimizer.param_groups[0]["lr"], so_far=so_far())

    def stopped(self, stop, epoch, next_step, run_log, option_strings):
        """After a stop signal, with the checkpoint at (epoch, next_step) saved: the line that says
        where and how to go on, the logs closed; returns the exit code (130/143)."""
        accelerator = self.state.accelerator
        self.log(stopped_line(stop, self.last_good, epoch, next_step, self.steps, accelerator.num_processes,
                              self.output_dir, option_strings))
        run_log.finish()
        accelerator.end_training()
        return stop.exit_code


@releases_output_dir  # the --output-dir lock prepare_output_dir takes goes on every way out of main
def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    parser = add_log_args(build_parser(description=__doc__.splitlines()[0]))
    args = parse_args(parser, argv)
    typed = typed_dests(parser, argv)
    check_ingredient_flags(args)
    accelerator, plan, notes = make_accelerator(precision_flags(args), args.deterministic,
                                                **tracker_kwargs(args.log_with, args.output_dir))
    device = device_settings(args, accelerator.device.type, typed)
    replaced = prepare_output_dir(run_dir_spec(args), accelerator)  # created, writable, no other run's files
    for note in notes + [device.note] * bool(device.note) + idle_flag_notes(parser, args, typed):
        warn(accelerator, note)
    progress = Progress(accelerator)  # a bar on a terminal; log lines print above it
    log = progress.print

    spec = data_spec(args, backend=device.data_backend, jpeg_decoder=device.jpeg_decoder,
                     channels_last=device.channels_last)
    data = build_data(spec, accelerator, train=not args.evaluate)  # -e reads the val split only
    num_classes = args.num_classes or data.num_classes
    specs = training_specs(args, channels_last=device.channels_last, compile=device.compile,
                           tune_kernels=device.tune_kernels)
    state, start = build_or_resume(specs, accelerator, plan, num_classes, data.classes)
    if args.resume:
        inside = f", step {start.step}" if start.step else ""  # a mid-epoch checkpoint
        log(f"=> resumed {args.resume!r} at epoch {start.epoch}{inside} (best Prec@1 {start.best_prec1:.3f})")
    batch = global_batch(args.batch_size, accelerator.num_processes, args.accum_steps)
    log(f"=> {args.arch} on {source_kind(args.data) if args.data in (None, 'digits', 'synthetic') else args.data}"
        f" | {num_classes} classes | {accelerator.num_processes} process(es) on {accelerator.device.type}"
        f" | global batch {batch} | lr {args.lr * batch / 256:g}")
    log(plan.describe())
    log(device.input_line)
    log(f"=> {spec.describe(args.epochs)}" + (f" | TTA {args.tta}" if args.tta != "none" else "")
        + compiled_sizes_note(spec.sizes.distinct(args.epochs), device.compile, device.compile_mode))
    watch = Watch(log=log, progress=progress)
    if args.evaluate:
        validate(state.model, data, state.precision, accelerator, print_freq=args.print_freq, watch=watch,
                 tta=args.tta)
        return

    # The ingredients on the device batch and the loss (utils/ingredients.py); None/plain CE by default.
    augment = build_batch_augment(batch_ingredients(args), accelerator.device, num_classes, args.batch_size)
    criterion = build_criterion(args.label_smoothing, augment is not None and augment.mixup is not None,
                                args.bce_loss, args.bce_target_thresh, num_classes)
    loop = training_loop(args, criterion, augment)
    settled = {**vars(args), **device.as_flags(), "start_epoch": start.epoch}
    run = Run(state, plan, data, {**settled, "data": absolute_data(args.data)}, args.output_dir, args.keep_checkpoints,
              loop.steps_per_epoch(len(data.train)), log, start.best_prec1, args.resume or None, num_classes,
              args.save_every_steps)
    remove_replaced_run(args.output_dir, accelerator, replaced)  # --overwrite: only now that everything was built
    on_disk = best_on_disk(args.output_dir) if args.resume else None
    if on_disk is not None and on_disk > run.best_prec1:  # resumed from an older checkpoint: keep the better file
        log(f"=> {BEST} in {args.output_dir} holds Prec@1 {on_disk:.3f}, above this checkpoint's best "
            f"({run.best_prec1:.3f}): only an epoch that beats it replaces it")
        run.best_prec1 = on_disk
    profiling = args.prof >= 0  # a --prof run writes nothing: no log, no checkpoint
    what_ran = {"opt_level": plan.opt_level, "mixed_precision": plan.dtype_name, "num_classes": num_classes,
                "data": args.data or "digits"}  # args.yaml records what ran
    run_log = RunLog(accelerator, args.output_dir, {**settled, **what_ran},  # args.yaml, summary.csv, curves.png
                     title=f"{args.arch} on {args.data or 'digits'}", start_epoch=start.epoch, resume=args.resume,
                     trackers=args.log_with != "none", active=not profiling)
    watch.phases = NvtxWindow(args.prof, PROF_STEPS) if profiling else NoPhases()
    if profiling and not torch.cuda.is_available():
        warn(accelerator, "--prof: no CUDA, so no NVTX ranges or cudaProfiler calls; the run still "
                          f"stops after step {args.prof + PROF_STEPS}")
    watch.on_step = run.after_step if args.save_every_steps and not profiling else None

    watch.stop = stop = StopOnSignal(announce=accelerator.is_main_process)  # SIGTERM/SIGINT: finish the step
    ahead = None  # the next epoch's batches, started before this epoch validates
    with stop.installed():
        for epoch, first_step in training_epochs(data, args.epochs, start.epoch, start.step, args.accum_steps):
            carried = start.so_far if epoch == start.epoch else None
            trained = train_one_epoch(state, data, epoch, loop, watch, first_step=first_step, batches=ahead,
                                      carried=carried)
            ahead = None
            if trained.diverged:
                raise Diverged(diverged_message(trained.diverged, epoch, trained.step, run.steps, trained.lr,
                                                run.last_good))
            if trained.stopped and profiling:
                log(f"=> stopped by {stop.name} during the --prof run (it saves nothing)")
                return stop.exit_code
            if trained.stopped:  # every process stopped at this same step
                run.save(epoch, trained.next_step, lr=trained.lr, so_far=trained.so_far())
                return run.stopped(stop, epoch, trained.next_step, run_log, parser._option_string_actions)
            if profiling:
                if watch.phases.finished:
                    break
                continue  # the window lies in a later epoch (NvtxWindow counts steps across epochs)
            # Loader workers (and the gpu backend's decode threads) fill the next epoch's first
            # batches while this one validates, instead of after: the same batches, sooner.
            ahead = data.start_epoch(epoch + 1) if epoch + 1 < args.epochs else None
            result = validate(state.model, data, state.precision, accelerator, print_freq=args.print_freq,
                              watch=watch, tta=args.tta)
            ema = None
            if state.precision.ema is not None:  # after the model's line, which Apex's log readers expect first
                ema = validate(state.precision.ema.module, data, state.precision, accelerator,
                               print_freq=args.print_freq, watch=watch, label="EMA", tta=args.tta)
            # model_best follows the EMA only if asked, and the plain Prec@1 (the Apex line), never --tta's
            judged = ema if args.model_ema_best else result
            is_best = judged.top1 > run.best_prec1  # False for a NaN top-1
            run.best_prec1 = judged.top1 if is_best else run.best_prec1
            # The row first: a run killed between the two resumes after this epoch, and a resume
            # drops the rows from its start epoch on, so a row ahead of its checkpoint is rewritten.
            run_log.epoch(epoch, trained, result, state.optimizer, ema)
            run.save(epoch + 1, 0, is_best, lr=trained.lr)
            if epoch + 1 < args.epochs and stop.agreed(accelerator):  # a signal during validation or the save
                close_batches(ahead)
                return run.stopped(stop, epoch + 1, 0, run_log, parser._option_string_actions)
    accelerator.wait_for_everyone()  # a process whose last save failed makes the others exit with its code
    run_log.finish()
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
