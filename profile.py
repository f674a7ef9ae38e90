"""Profile training steps: an nsys window, a phase table, a torch.profiler trace, a benchmark sweep.

    python profile.py                                   # digits demo: phase table after step 109
    nsys profile -c cudaProfilerApi --capture-range-end stop python profile.py --prof 100 DATA
    python profile.py --prof 20 --trace out.json DATA   # Chrome/Perfetto trace of steps 20-29
    python profile.py --benchmark -a resnet50 -b 256 synthetic   # O0..O3 x channels_last sweep

Same flags as train.py. The run trains --prof warm-up steps, then a window of --prof-steps steps
(NVTX ranges on every step, cudaProfilerStart/Stop around the window), and stops cleanly. See
docs/profiling.md for how to read the table.
"""
import sys

if __name__ == "profile":
    # This file is named like the standard library's `profile` module, which torch imports (via
    # cProfile). Any script run from this folder has the folder first on sys.path, so that import
    # finds this file: hand the importer the real module instead. The imports below do not run
    # then, so the rest of this file must only define functions and constants (no classes with
    # imported bases, no default arguments using them): tests/test_profile.py checks it.
    import importlib.util
    import os
    import sysconfig

    _spec = importlib.util.spec_from_file_location(
        "profile", os.path.join(sysconfig.get_path("stdlib"), "profile.py"))
    _stdlib_profile = importlib.util.module_from_spec(_spec)
    sys.modules["profile"] = _stdlib_profile
    _spec.loader.exec_module(_stdlib_profile)
else:
    if __name__ == "__main__":
        # Ctrl-C during the imports below (seconds, torch's) ends the process quietly (status 130), not with
        # a traceback from deep inside an import; exit_on_usage_error gives Ctrl-C its message back.
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    import argparse
    import os

    import torch

    from utils.benchmark import BenchmarkRow, format_benchmark_table, write_benchmark_csv
    from utils.data.sources import build_data
    from utils.device import make_accelerator, warn
    from utils.engine import Watch, diverged_message, train_one_epoch, training_epochs
    from utils.flags.parser import (
        OPT_LEVELS,
        build_training_parser,
        non_negative_int,
        opt_level_type,
        positive_int,
        str2bool,
        typed_dests,
    )
    from utils.flags.precedence import parse_args
    from utils.flags.specs import data_spec, device_settings, precision_flags, training_loop, training_specs
    from utils.precision import resolve_precision
    from utils.profiling import PhaseProfiler, cuda_parts_skipped, format_phase_table, time_data_wait
    from utils.run.directory import RUN_FILES
    from utils.run.errors import Diverged, UsageError, exit_on_usage_error
    from utils.run.files import check_output_file
    from utils.training_state import build_or_resume

PROF_DEFAULT = 100  # warm-up steps before the window: past cudnn.benchmark's search and allocator growth
# profile.py times plain SGD steps with cross-entropy: train.py's optimizer and ingredient flags are
# not its own, and these are the values they stand at (its parser defines them, so code that reads
# them reads the run's real settings).
PLAIN_SGD_STEPS = {"opt": "sgd", "no_wd_norm_bias": False, "clip_grad": None, "accum_steps": 1, "min_lr": 0.0,
                   "drop_path": 0.0, "model_ema": False, "model_ema_decay": 0.9998, "aa": "none", "bce_loss": False,
                   "bce_target_thresh": None, "tta": "none", "min_res": None, "max_res": None, "start_ramp": None,
                   "end_ramp": None, "res_step": 32}


def comma_list(item_type):
    """argparse type for 'A,B,C': each item parsed by item_type, duplicates dropped, order kept."""
    def parse(text):
        items = []
        for part in text.split(","):
            value = item_type(part.strip())
            if value not in items:
                items.append(value)
        return items
    return parse


def build_profile_parser():
    """train.py's flags, and profile.py's own: an always-on --prof and the window, trace and sweep."""
    parser = build_training_parser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("profile.py")
    group.add_argument("--prof", type=non_negative_int, default=PROF_DEFAULT, metavar="N",
                       help="warm-up steps before the window: NVTX ranges on every step, "
                            "cudaProfilerStart at step N, cudaProfilerStop and a clean exit "
                            f"--prof-steps later (default: {PROF_DEFAULT})")
    group.add_argument("--prof-steps", type=positive_int, default=10, metavar="N",
                       help="steps in the window: captured by nsys, timed for the phase table, "
                            "traced by --trace (default: 10, as Apex)")
    group.add_argument("--trace", default=None, metavar="PATH",
                       help="also write a torch.profiler trace of the window to PATH (Chrome/Perfetto "
                            "JSON; .rankN is added per process when there are several) (default: none)")
    group.add_argument("--benchmark", action="store_true",
                       help="sweep opt levels x channels_last instead: each configuration trains "
                            "--prof warm-up steps and --prof-steps timed steps on DATA (use 'synthetic' "
                            "for GPU-bound figures); prints one row each and writes them as CSV")
    group.add_argument("--benchmark-csv", default=None, metavar="PATH",
                       help="where --benchmark writes its CSV (default: benchmark.csv in --output-dir)")
    group.add_argument("--benchmark-levels", type=comma_list(opt_level_type), default=None,
                       metavar="LIST", help=f"opt levels --benchmark sweeps (default: {','.join(OPT_LEVELS)})")
    group.add_argument("--benchmark-channels-last", type=comma_list(str2bool), default=None,
                       metavar="LIST", help="channels_last settings --benchmark sweeps (default: False,True)")
    group.add_argument("--overwrite", action="store_true",
                       help="replace an existing --trace file or --benchmark-csv (default: refuse, naming "
                            "it, before any work)")
    parser.set_defaults(**PLAIN_SGD_STEPS)
    return parser


def idle_flag_notes(args, typed):
    """Warnings for typed flags a train.py command line may carry that profile.py has no use for:
    it never validates, and only --benchmark writes a file (its CSV, into --output-dir)."""
    idle = [flag for dest, flag in (("crop_pct", "--crop-pct"), ("val_resize_size", "--val-resize-size"),
                                    ("val_crop_size", "--val-crop-size")) if dest in typed]
    found_there = bool(args.resume) and (os.path.dirname(os.path.abspath(args.resume)) ==
                                         os.path.abspath(args.output_dir))  # --resume auto looked there
    if "output_dir" in typed and not args.benchmark and not found_there:
        idle.append("--output-dir")
    if not idle:
        return []
    return [f"{', '.join(idle)}: profile.py runs no validation and, without --benchmark, writes no files; "
            f"{'it has' if len(idle) == 1 else 'they have'} no effect here"]


def benchmark_csv_path(args):
    """Where --benchmark writes its rows: --benchmark-csv, else benchmark.csv in --output-dir."""
    return args.benchmark_csv or os.path.join(args.output_dir, "benchmark.csv")


def check_profile_args(args):
    """profile.py's own flag rules, before anything is built."""
    if args.evaluate:
        raise UsageError("profile.py profiles training steps; -e/--evaluate does not apply (use train.py -e)")
    if args.trace:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if not os.path.isdir(folder):
            raise UsageError(f"--trace {args.trace!r}: folder {folder!r} does not exist; create it first")
        for path in trace_paths(args.trace, int(os.environ.get("WORLD_SIZE") or 1)):
            check_output_file(path, "--trace", args.overwrite, RUN_FILES)
        if args.benchmark:
            raise UsageError("--trace traces one run; it cannot be combined with --benchmark")
    if not args.benchmark:
        for flag in ("benchmark_csv", "benchmark_levels", "benchmark_channels_last"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} only applies with --benchmark")
        return
    if args.opt_level is not None:
        raise UsageError("--benchmark sweeps the opt levels itself; choose them with --benchmark-levels "
                         "instead of --opt-level")
    if args.channels_last is not None:
        raise UsageError("--benchmark sweeps channels_last itself; choose with --benchmark-channels-last "
                         "instead of --channels-last")
    for level in args.benchmark_levels or OPT_LEVELS:  # refused now, not after the levels before it ran
        try:
            resolve_precision(level, args.keep_batchnorm_fp32, args.loss_scale, args.mixed_precision, "--mixed-precision")
        except UsageError as err:
            raise UsageError(f"--benchmark sweeps {level} too (--benchmark-levels), and there {err}") from None
    if args.benchmark_csv:
        folder = os.path.dirname(os.path.abspath(args.benchmark_csv))
        if not os.path.isdir(folder):
            raise UsageError(f"--benchmark-csv {args.benchmark_csv!r}: folder {folder!r} does not exist")
    check_output_file(benchmark_csv_path(args), "--benchmark-csv", args.overwrite, RUN_FILES)


def check_enough_steps(args, data, start_epoch):
    """The epochs left from start_epoch (a resumed run's) must hold the warm-up and the window
    (steps count on across epochs)."""
    per_epoch = len(data.train)
    if args.steps_per_epoch:
        per_epoch = min(per_epoch, args.steps_per_epoch)
    epochs = max(args.epochs - start_epoch, 0)
    needed = args.prof + args.prof_steps
    if per_epoch * epochs < needed:
        raise UsageError(f"--prof {args.prof} with --prof-steps {args.prof_steps} needs {needed} training "
                         f"steps, but {epochs} epoch(s) of {per_epoch} steps give {per_epoch * epochs}; "
                         "lower --prof or raise --epochs")


def train_window(args, accelerator, plan, device, phases, log):
    """Build data and model as train.py does, train until the window is done; return peak bytes.
    device: the flags this device settled (utils.device.DeviceSettings)."""
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    data = build_data(data_spec(args, backend=device.data_backend, jpeg_decoder=device.jpeg_decoder,
                                channels_last=device.channels_last), accelerator)
    num_classes = args.num_classes or data.num_classes
    specs = training_specs(args, channels_last=device.channels_last, compile=device.compile,
                           tune_kernels=device.tune_kernels, only_sgd=True)
    state, start = build_or_resume(specs, accelerator, plan, num_classes)
    check_enough_steps(args, data, start.epoch)
    loop = training_loop(args, torch.nn.CrossEntropyLoss().to(accelerator.device))
    time_data_wait(data.train, phases)
    watch = Watch(log=log, phases=phases)
    for epoch, first_step in training_epochs(data, args.epochs, start.epoch, start.step):
        trained = train_one_epoch(state, data, epoch, loop, watch, first_step=first_step)
        if trained.diverged:  # no window to report: exit 3 with the step, as train.py does
            raise Diverged(diverged_message(trained.diverged, epoch, trained.step,
                                            loop.steps_per_epoch(len(data.train)), trained.lr, args.resume or None))
        if phases.finished:
            break
    if accelerator.device.type == "cuda":
        return torch.cuda.max_memory_allocated(accelerator.device)
    return None


def trace_path(args, accelerator):
    """--trace as given; with several processes each writes its own file (name.rankN.json)."""
    if not args.trace:
        return args.trace
    return trace_paths(args.trace, accelerator.num_processes)[accelerator.process_index]


def trace_paths(trace, processes):
    """The file each of processes writes for --trace: trace itself for one, name.rankN.json for
    several. Every process checks all of them at start-up (WORLD_SIZE tells how many there are
    before the Accelerator does), so all refuse alike."""
    if processes == 1:
        return [trace]
    stem, ext = os.path.splitext(trace)
    return [f"{stem}.rank{rank}{ext}" for rank in range(processes)]


def run_profile(args):
    accelerator, plan, notes = make_accelerator(precision_flags(args), args.deterministic)
    device = device_settings(args, accelerator.device.type)
    for note in notes + [device.note] * bool(device.note):
        warn(accelerator, note)
    skipped = cuda_parts_skipped()
    if skipped:
        warn(accelerator, f"no CUDA: skipping {skipped}; phases are timed with the wall clock")
    log = accelerator.print
    last = args.prof + args.prof_steps - 1
    log(f"=> profile.py: {args.arch} | {accelerator.num_processes} process(es) on "
        f"{accelerator.device.type} | {args.prof} warm-up steps, then window steps {args.prof}-{last}")
    log(plan.describe())
    log(device.input_line)
    phases = PhaseProfiler(args.prof, args.prof_steps, trace_path=trace_path(args, accelerator))
    peak = train_window(args, accelerator, plan, device, phases, log)
    log(f"=> ran {phases.iteration} steps; window steps {args.prof}-{last} done")
    images_per_step = args.batch_size * accelerator.num_processes
    log(format_phase_table(phases.times, images_per_step, peak, plan.describe(), skipped))
    if phases.trace_path:
        log(f"=> trace of the window written to {phases.trace_path}")
    accelerator.end_training()


def benchmark_configs(args):
    levels = args.benchmark_levels or list(OPT_LEVELS)
    layouts = args.benchmark_channels_last or [False, True]
    return [(level, channels_last) for level in levels for channels_last in layouts]


def run_benchmark(args):
    """One short profile per configuration, no NVTX; rows printed and rewritten as CSV as they come."""
    csv_path = benchmark_csv_path(args)
    if not args.benchmark_csv:
        os.makedirs(args.output_dir, exist_ok=True)
    rows, seen_notes = [], set()
    skipped = cuda_parts_skipped()
    for level, channels_last in benchmark_configs(args):
        config = argparse.Namespace(**vars(args))
        config.opt_level, config.channels_last = level, channels_last
        accelerator, plan, notes = make_accelerator(precision_flags(config), config.deterministic)
        device = device_settings(config, accelerator.device.type)
        for note in notes + [device.note] * bool(device.note):
            if note not in seen_notes:
                seen_notes.add(note)
                warn(accelerator, f"{level}: {note}")
        if skipped and not rows:
            warn(accelerator, f"no CUDA: skipping {skipped}; steps are timed with the wall clock")
        row = BenchmarkRow(level, "fp32" if plan.dtype_name == "no" else plan.dtype_name, channels_last,
                           args.batch_size * accelerator.num_processes,
                           extra={"arch": args.arch, "image_size": args.image_size,
                                  "device": device_name(accelerator)})
        phases = PhaseProfiler(args.prof, args.prof_steps, nvtx=False)
        try:
            row.peak_bytes = train_window(config, accelerator, plan, device, phases, log=lambda *a, **k: None)
            row.times = phases.times
        except torch.OutOfMemoryError:
            row.note = "out of memory"
        phases.stop_timing_gc()  # an out-of-memory inside the window left it hooked
        del phases
        # Drop this configuration's model and optimizer (Accelerate keeps references) before the
        # next; free_memory also runs gc and empties the CUDA cache, so peaks don't carry over.
        accelerator.free_memory()
        rows.append(row)
        table = format_benchmark_table(rows).splitlines()
        accelerator.print("\n".join(table if len(rows) == 1 else table[-1:]), flush=True)
        if accelerator.is_main_process:
            write_benchmark_csv(rows, csv_path)
    accelerator.print(f"=> benchmark: {args.arch}, {args.image_size} px, global batch "
                      f"{rows[0].images_per_step}, {args.prof} warm-up + {args.prof_steps} timed steps "
                      f"per configuration, on {rows[0].extra['device']}")
    accelerator.print(format_benchmark_table(rows))
    accelerator.print(f"=> written to {csv_path}")
    accelerator.end_training()


def device_name(accelerator):
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_name(accelerator.device)
    return accelerator.device.type


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    parser = build_profile_parser()
    args = parse_args(parser, argv)
    check_profile_args(args)
    if int(os.environ.get("RANK", 0)) == 0:
        for note in idle_flag_notes(args, typed_dests(parser, argv)):
            print(f"warning: {note}", file=sys.stderr, flush=True)
    if args.benchmark:
        run_benchmark(args)
    else:
        run_profile(args)


if __name__ == "__main__":
    exit_on_usage_error(main)
