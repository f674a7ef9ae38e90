"""configs/*.yaml: each recipe file, parsed by train.py's own flag resolution, holds the values its
source published (torchvision's ResNet50_Weights.IMAGENET1K_V2, FFCV's rn50_*_epochs.yaml, timm's
ResNet-strikes-back A3, Apex's main_amp.py), converted where this project counts differently (LR
per 256 images, EMA decay per step); each digits version runs; the FFCV-style digits recipe reaches
95 % top-1."""
import glob
import math
import os

import numpy as np
import pytest
from conftest import FINAL, ROOT, run_script

from utils.data.sizes import TrainSizes
from utils.engine import Schedule, learning_rate
from utils.flags.parser import add_log_args, build_parser
from utils.flags.precedence import check_ingredient_flags, parse_args

CONFIGS = os.path.join(ROOT, "configs")
IMAGENET_TRAIN = 1281167  # ImageNet-1k's train split


def resolve(name, data="/data/imagenet"):
    """The flags `train.py --config configs/NAME DATA` runs with: parsed for real (precedence,
    source and model defaults, the checks train.py makes before it builds anything). DATA is the
    launch command's ImageFolder path (not read at parse time), so ImageNet's defaults apply."""
    args = parse_args(add_log_args(build_parser("train")), ["--config", os.path.join(CONFIGS, name), data])
    check_ingredient_flags(args)
    return args


def header(name):
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as handle:
        return "".join(line for line in handle if line.startswith("#"))


def global_lr(args, processes):
    """The LR train.py sets: --lr is per 256 images, scaled by the global batch."""
    return args.lr * args.batch_size * processes / 256.0


def test_every_config_is_checked_here():
    """A recipe added to configs/ needs its published values asserted below."""
    shipped = {os.path.basename(path) for path in glob.glob(os.path.join(CONFIGS, "*.yaml"))}
    checked = ({"apex_resnet50_90ep.yaml", "resnet50_torchvision_v2.yaml", "resnet50_rsb_a3.yaml"}
               | {f"resnet50_ffcv_{epochs}ep.yaml" for epochs in FFCV} | set(DIGITS))
    assert shipped == checked


@pytest.mark.parametrize("name", sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))))
def test_each_header_names_its_launch_command(name):
    """Every file says how it is launched, with its own name in the command."""
    text = header(name)
    assert f"--config configs/{name}" in text
    if name.startswith("resnet50_"):
        assert "accelerate launch --config_file accelerate_configs/8gpu.yaml train.py" in text
        assert "Differences" in text
        assert os.path.exists(os.path.join(ROOT, "accelerate_configs", "8gpu.yaml"))


def test_apex_recipe():
    args = resolve("apex_resnet50_90ep.yaml")
    assert (args.arch, args.epochs, args.lr_schedule, args.lr_steps) == ("resnet50", 90, "step", [30, 60, 80])
    assert math.isclose(global_lr(args, 8), 0.1 * 2048 / 256) and args.weight_decay == 1e-4 and args.opt_level == "O1"


def torchvision_ema_decay_per_step():
    """torchvision's EMA (references/classification/train.py): decay 0.99998 adjusted to
    1 - (1 - 0.99998) x world x batch x model_ema_steps / epochs, applied every 32nd step of an
    epoch; its RASampler's epoch is floor(N / 256) x 256 / world images a process. As a per-step
    decay with the same decay per epoch: d ** (updates an epoch / steps an epoch)."""
    world, batch, ema_steps, epochs = 8, 128, 32, 600
    alpha = min(1.0, (1.0 - 0.99998) * world * batch * ema_steps / epochs)
    steps = math.ceil(IMAGENET_TRAIN // 256 * 256 // world / batch)
    updates = math.ceil(steps / ema_steps)  # i % 32 == 0 for i in 0..steps-1
    assert (steps, updates) == (1251, 40)
    return (1.0 - alpha) ** (updates / steps)


def test_torchvision_v2_recipe():
    """pytorch/vision's ResNet50 new recipe (80.858 %), flag for flag."""
    args = resolve("resnet50_torchvision_v2.yaml")
    assert "80.858" in header("resnet50_torchvision_v2.yaml")
    assert (args.arch, args.epochs, args.batch_size, args.opt) == ("resnet50", 600, 128, "sgd")
    assert math.isclose(global_lr(args, 8), 0.5)  # --lr 0.5 at 8 x 128
    assert (args.momentum, args.weight_decay, args.no_wd_norm_bias) == (0.9, 2e-5, True)
    assert (args.lr_schedule, args.warmup_epochs, args.min_lr) == ("cosine", 5, 0.0)
    assert (args.label_smoothing, args.mixup, args.cutmix, args.mixup_switch_prob) == (0.1, 0.2, 1.0, 0.5)
    assert (args.aa, args.reprob, args.ra_reps) == ("ta_wide", 0.1, 4)
    assert (args.train_crop_size, args.val_resize_size, args.val_crop_size) == (176, 232, 224)
    assert args.interpolation == "bilinear" and (args.hflip, args.min_scale) == (0.5, 0.08)
    assert args.model_ema and args.model_ema_best
    assert math.isclose(args.model_ema_decay, torchvision_ema_decay_per_step(), rel_tol=0, abs_tol=5e-9)
    assert args.opt_level == "O0"  # the published command has no --amp
    assert args.tta == "none" and not args.blurpool and not args.bce_loss and args.drop_path == 0.0


# FFCV's rn50_configs: epochs -> (start_ramp, end_ramp, top-1 %); README's table for the top-1.
FFCV = {16: (11, 13, 73.8), 24: (17, 20, 75.6), 32: (23, 27, 76.6), 40: (29, 34, 77.2), 56: (41, 48, 78.0),
        88: (65, 76, 78.4)}


def ffcv_resolution(epoch, min_res, max_res, end_ramp, start_ramp):
    """libffcv/ffcv-imagenet train_imagenet.py's get_resolution, verbatim in effect."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


def ffcv_lr(epoch, step, iters, lr, epochs, lr_peak_epoch=2):
    """train_imagenet.py's get_cyclic_lr at epoch and epoch + 1, interpolated over the epoch's steps."""
    def cyclic(at):
        return np.interp([at], [0, lr_peak_epoch, epochs], [1e-4 * lr, lr, 0])[0]
    return np.interp([step], [0, iters], [cyclic(epoch), cyclic(epoch + 1)])[0]


@pytest.mark.parametrize("epochs", sorted(FFCV))
def test_ffcv_recipe(epochs):
    name = f"resnet50_ffcv_{epochs}ep.yaml"
    start, end, top1 = FFCV[epochs]
    args = resolve(name)
    text = header(name)
    assert f"{top1} % top-1" in text and f"rn50_{epochs}_epochs.yaml" in text
    assert (args.arch, args.epochs, args.batch_size, args.opt, args.momentum) == ("resnet50", epochs, 512, "sgd", 0.9)
    assert math.isclose(global_lr(args, 8), 1.7)  # lr 1.7 at 512 x 8, unscaled in FFCV's code
    assert (args.weight_decay, args.no_wd_norm_bias, args.label_smoothing) == (1e-4, True, 0.1)
    assert (args.lr_schedule, args.warmup_epochs, args.min_lr) == ("linear", 2, 0.0)
    assert (args.min_res, args.max_res, args.start_ramp, args.end_ramp, args.res_step) == (160, 192, start, end, 32)
    assert (args.val_crop_size, args.crop_pct, args.val_resize_size) == (256, 0.875, None)
    assert args.blurpool and args.tta == "flip" and args.opt_level == "O1" and args.interpolation == "bilinear"
    assert args.mixup == args.cutmix == args.reprob == 0.0 and args.aa == "none" and not args.model_ema
    assert args.ra_reps == 1 and (args.min_scale, args.hflip) == (0.08, 0.5)
    # the training sizes are FFCV's, epoch by epoch
    sizes = TrainSizes(args.min_res, args.max_res, args.start_ramp, args.end_ramp, args.res_step)
    assert [sizes.size(e) for e in range(epochs)] == [ffcv_resolution(e, 160, 192, end, start) for e in range(epochs)]
    # the LR at every step: FFCV's triangle from epoch 2 on, one step ahead of it during the warmup
    iters = IMAGENET_TRAIN // 4096
    schedule = Schedule(args.lr, args.epochs, args.lr_schedule, (), args.min_lr, args.warmup_epochs)
    for epoch in range(epochs):
        for step in (0, iters // 2, iters - 1):
            ours = learning_rate(schedule, epoch, step, iters, 4096)
            theirs = ffcv_lr(epoch, step, iters, 1.7, epochs)
            gap = 1.7 / (2 * iters) + 1e-4 * 1.7 if epoch < 2 else 1e-9
            assert abs(ours - theirs) <= gap, (epoch, step, ours, theirs)


def test_rsb_a3_recipe():
    """timm's ResNet strikes back A3 (arXiv 2110.00476, Table 1): 78.1 % at 224 after 160 px training."""
    args = resolve("resnet50_rsb_a3.yaml")
    assert "78.1 %" in header("resnet50_rsb_a3.yaml")
    assert (args.arch, args.epochs, args.batch_size, args.opt) == ("timm/resnet50", 100, 256, "lamb")
    assert math.isclose(global_lr(args, 8), 8e-3)  # LR 8e-3 at batch 2048
    assert (args.weight_decay, args.no_wd_norm_bias, args.lr_schedule, args.warmup_epochs) == (0.02, True, "cosine", 5)
    assert args.min_lr == 1e-6
    assert (args.bce_loss, args.bce_target_thresh, args.label_smoothing) == (True, 0.2, 0.0)
    assert (args.mixup, args.cutmix, args.mixup_switch_prob) == (0.1, 1.0, 0.5)
    assert args.aa == "rand-m6-mstd0.5-inc1" and args.reprob == 0.0 and args.drop_path == 0.0
    assert (args.train_crop_size, args.val_crop_size, args.crop_pct, args.interpolation) == (160, 224, 0.95, "bicubic")
    assert math.floor(args.val_crop_size / args.crop_pct) == 235  # timm's resize before the 224 crop
    assert not args.model_ema and args.ra_reps == 1 and args.opt_level == "O1" and args.clip_grad is None


# The digits versions: file -> what each must hold, beside the demo's own defaults (resnet18, 32 px,
# hflip 0: a mirrored digit is another glyph).
DIGITS = {
    "digits_torchvision_v2.yaml": dict(epochs=16, lr_schedule="cosine", aa="ta_wide", mixup=0.2, cutmix=1.0,
                                       reprob=0.1, model_ema=True, label_smoothing=0.1),
    "digits_ffcv.yaml": dict(lr_schedule="linear", min_res=16, max_res=32, blurpool=True, tta="none",
                             label_smoothing=0.1),
    "digits_rsb_a3.yaml": dict(opt="lamb", bce_loss=True, bce_target_thresh=0.2, mixup=0.1, cutmix=1.0,
                               aa="rand-m6-mstd0.5-inc1", crop_pct=0.95, interpolation="bicubic"),
}


@pytest.mark.parametrize("name", sorted(DIGITS))
def test_digits_recipe_values(name):
    args = parse_args(add_log_args(build_parser("train")), ["--config", os.path.join(CONFIGS, name)])
    check_ingredient_flags(args)
    assert args.data in (None, "digits") and args.arch == "resnet18" and (args.image_size, args.hflip) == (32, 0.0)
    for dest, value in DIGITS[name].items():
        assert getattr(args, dest) == value, dest


def test_digits_ffcv_is_shorter_than_the_demo():
    """Fewer epochs than the demo's 12, most of them at low resolution, validated at 32 px or more."""
    args = parse_args(add_log_args(build_parser("train")), ["--config", os.path.join(CONFIGS, "digits_ffcv.yaml")])
    sizes = TrainSizes(args.min_res, args.max_res, args.start_ramp, args.end_ramp, args.res_step)
    pixels = sum(sizes.size(epoch) ** 2 for epoch in range(args.epochs))
    assert args.epochs < 12 and pixels < 12 * 32 ** 2 / 2 and (args.val_crop_size or args.image_size) >= 32


def finals(stdout):
    return [float(match.group(1)) for match in FINAL.finditer(stdout)]


@pytest.mark.parametrize("name", sorted(set(DIGITS) - {"digits_ffcv.yaml"}))
def test_digits_recipe_runs(name, cache_dir, tmp_path):
    """Two short epochs of each digits version run to the end, validation included (8 steps an
    epoch: every ingredient of the recipe is in the step by then). digits_ffcv runs whole in
    test_digits_ffcv_reaches_95_percent."""
    result = run_script("train.py", "--config", os.path.join(CONFIGS, name), "--epochs", "2",
                        "--steps-per-epoch", "8", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(finals(result.stdout)) >= 2, result.stdout[-2000:]


def test_digits_ffcv_with_a_ramp_past_the_run_is_refused(cache_dir, tmp_path):
    result = run_script("train.py", "--config", os.path.join(CONFIGS, "digits_ffcv.yaml"), "--epochs", "2",
                        "--output-dir", tmp_path)
    assert result.returncode == 2 and "--start-ramp" in result.stderr


@pytest.mark.first  # about 40 s on 2 busy cores (the plain 12-epoch demo: about 110 s there)
def test_digits_ffcv_reaches_95_percent(cache_dir, tmp_path):
    result = run_script("train.py", "--config", os.path.join(CONFIGS, "digits_ffcv.yaml"), "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(" * Prec@1")]
    assert lines, result.stdout[-2000:]
    assert float(FINAL.search(lines[-1]).group(1)) >= 95.0, result.stdout[-2000:]
