"""The scripts' edge: resolved flags (an argparse Namespace) become each concern's frozen spec.

Nothing below the scripts reads `args`; the scripts call these once, after parsing, and hand
the specs down. One section per concern.
"""
from utils.compiled import resolve_compile, resolve_tune_kernels
from utils.data.backend import choose_backend
from utils.data.batches import IMAGENET_MEAN, IMAGENET_STD
from utils.data.sizes import TrainSizes
from utils.data.sources import DataSpec, source_kind
from utils.device import DeviceSettings, PrecisionFlags, settle_channels_last
from utils.engine import Loop, Schedule
from utils.ingredients import BatchIngredients
from utils.precision import MAX_NONFINITE_STEPS
from utils.run.directory import RunDir
from utils.training_state import ModelSpec, OptimizerSpec, ResumeSpec


# --- The run directory (utils/run/directory.py) ---------------------------------------------------

def run_dir_spec(args):
    """train.py's --output-dir, --resume, --overwrite, -e and --prof, as the output directory's checks
    read them."""
    return RunDir(path=args.output_dir, resume=args.resume, overwrite=args.overwrite,
                  writes_nothing=args.evaluate or args.prof >= 0)


# --- training: precision flags, the loop, the model, the optimizer, the resume -----------------
# (utils.device, utils.engine, utils.training_state, utils.ingredients)

def precision_flags(args):
    """utils.device.PrecisionFlags: the Apex precision flags as typed."""
    return PrecisionFlags(args.opt_level, args.keep_batchnorm_fp32, args.loss_scale, args.mixed_precision)


def batch_ingredients(args):
    """utils.ingredients.BatchIngredients: the batch-level ingredient flags."""
    return BatchIngredients(args.reprob, args.mixup, args.cutmix, args.mixup_switch_prob, args.label_smoothing)


def training_loop(args, criterion, augment=None):
    """utils.engine.Loop: the schedule and how the steps run."""
    schedule = Schedule(args.lr, args.epochs, args.lr_schedule, tuple(args.lr_steps or ()), args.min_lr,
                        args.warmup_epochs)
    return Loop(schedule, args.batch_size, args.seed, args.print_freq, criterion, augment, args.accum_steps,
                args.steps_per_epoch or 0, args.max_nonfinite_steps or MAX_NONFINITE_STEPS)


def training_specs(args, *, channels_last, compile, tune_kernels=False, only_sgd=False):
    """(ModelSpec, OptimizerSpec, ResumeSpec) for utils.training_state.build_or_resume; channels_last,
    compile and tune_kernels as settled for this device (utils.device.settle_channels_last,
    utils.compiled)."""
    sizes = (*train_sizes(args).distinct(args.epochs or 1), args.val_crop_size or args.image_size)
    model = ModelSpec(args.arch, args.pretrained, args.drop_path, sizes, channels_last, args.sync_bn,
                      compile, args.compile_mode, args.seed, args.blurpool, args.stem_channels, tune_kernels)
    optimizer = OptimizerSpec(args.opt, args.lr, args.momentum, args.weight_decay, args.no_wd_norm_bias,
                              args.clip_grad, args.model_ema, args.model_ema_decay, only_sgd)
    resume = ResumeSpec(args.resume or "", args.epochs, not args.evaluate, args.data, args.batch_size,
                        args.accum_steps, args.lr)
    return model, optimizer, resume


def device_settings(args, device_type, typed=None):
    """utils.device.DeviceSettings: --channels-last, --data-backend, --jpeg-decoder, --compile,
    --compile-mode and --tune-kernels as this device settles them, and the start-up line that says
    what was chosen. typed: the dests typed on the command line (None: all count as typed), as a
    --tune-kernels a checkpoint or recipe gave gives way where it cannot work."""
    channels_last, layout = settle_channels_last(args.channels_last, args.arch, device_type)
    compile_backend, compile_mode, note = resolve_compile(args.compile, args.compile_mode)
    tune_kernels, tune_note = resolve_tune_kernels(args.tune_kernels, compile_backend, device_type, args.deterministic,
                                                   typed is None or "tune_kernels" in typed)
    backend = choose_backend(source_kind(args.data), args.data_backend, args.jpeg_decoder, device_type,
                             args.deterministic, pil_policy=args.aa not in (None, "", "none"))
    compiled = f" | torch.compile {compile_backend}" + (", kernels tuned" if tune_kernels else "")
    line = f"{backend.line} | {layout}" + (compiled if compile_backend else "")
    note = "; ".join(part for part in (note, tune_note) if part) or None
    return DeviceSettings(channels_last, backend.backend, backend.jpeg_decoder, compile_backend, compile_mode,
                          line, note, tune_kernels)


# --- data: DATA to batches (utils/data/) --------------------------------------------------------

def data_spec(args, *, backend, jpeg_decoder, channels_last):
    """utils.data.sources.DataSpec for build_data: the data flags as parsed (parse_args fills mean
    and std with the model's or ImageNet's); backend and jpeg_decoder as
    utils.data.backend.choose_backend settled them, channels_last as settled for this device."""
    return DataSpec(
        data=args.data, batch_size=args.batch_size, workers=args.workers, seed=args.seed,
        image_size=args.image_size, crop_pct=args.crop_pct, train_sizes=train_sizes(args), val_crop=args.val_crop_size,
        val_resize=args.val_resize_size, ra_reps=args.ra_reps, min_scale=args.min_scale, hflip=args.hflip,
        interpolation=args.interpolation, aa=args.aa, mean=tuple(args.mean or IMAGENET_MEAN),
        std=tuple(args.std or IMAGENET_STD), channels_last=bool(channels_last), num_classes=args.num_classes,
        steps_per_epoch=args.steps_per_epoch, train_split=args.train_split, val_split=args.val_split,
        image_column=args.image_column, label_column=args.label_column, backend=backend,
        jpeg_decoder=jpeg_decoder)


def train_sizes(args):
    """utils.data.sizes.TrainSizes: FFCV's progressive schedule (--min-res ...), else the one size
    --train-crop-size or --image-size gives."""
    if args.min_res is not None:
        return TrainSizes(args.min_res, args.max_res, args.start_ramp, args.end_ramp, args.res_step)
    return TrainSizes.fixed(args.train_crop_size or args.image_size)
