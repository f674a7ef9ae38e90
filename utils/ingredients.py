"""Training ingredients (label smoothing, binary cross-entropy, mixup/cutmix, RandAugment/
TrivialAugment, random erasing, EMA of weights, AdamW/LAMB, no weight decay on norms and biases,
gradient accumulation), each built from the torch/timm/torchvision piece that implements it;
nothing here re-implements one (the BCE loss only builds timm's targets for torch's loss).

Each builder returns the ingredient, or None where its flag is off, so the Apex recipe (SGD, hard
targets, crop + flip only) is what a run gets with every flag at its default. Where an ingredient
meets this project's own machinery (uint8 batches normalised on the device, the opt-level shim's
fp32 masters and on-device overflow skip, Accelerate's DDP), the docstring says how to wire it.
"""
import contextlib
import random
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from utils.run.errors import UsageError

OPTIMIZERS = ("sgd", "nesterov", "adamw", "lamb")
# TrivialAugment has no timm policy string; these are torchvision's reference-script spellings.
TRIVIAL_AUGMENT = ("ta_wide", "trivial")


# --- loss ------------------------------------------------------------------------------------

def build_criterion(label_smoothing=0.0, mixup_active=False, bce=False, target_thresh=None, num_classes=None):
    """The training loss.

    Without mixup/cutmix: torch's CrossEntropyLoss(label_smoothing=...) on hard targets. With
    mixup/cutmix on: timm's SoftTargetCrossEntropy, because the Mixup object (build_mixup) has
    already turned the targets into mixed, smoothed distributions; smoothing twice would be wrong.
    bce (--bce-loss, with --bce-target-thresh as target_thresh): BinaryCrossEntropy over
    num_classes outputs instead, on the same targets. Validation always uses plain
    CrossEntropyLoss on hard targets, and top-1/top-5 in training must be measured against the
    hard targets kept from before mixing.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise UsageError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
    if target_thresh is not None and not bce:
        raise ValueError("target_thresh is a threshold of the BCE targets: it needs bce")
    if bce:
        # Mixup's soft targets carry the smoothing already, as for SoftTargetCrossEntropy.
        return BinaryCrossEntropy(num_classes, 0.0 if mixup_active else label_smoothing, target_thresh)
    if mixup_active:
        from timm.loss import SoftTargetCrossEntropy
        return SoftTargetCrossEntropy()
    return nn.CrossEntropyLoss(label_smoothing=label_smoothing)


class BinaryCrossEntropy(nn.Module):
    """timm's BinaryCrossEntropy (the ResNet-strikes-back loss) at its defaults: one sigmoid per
    class against one-hot targets, the mean over batch and classes.

    Hard labels become one-hot targets smoothed as timm (and its Mixup) smooth them, off = s/C,
    on = 1 - s + s/C; soft targets (mixup/cutmix's, of the logits' shape) are taken as they are.
    target_thresh: targets above it become 1, the rest 0, after the smoothing (so a threshold
    between s/C and 1 - s + s/C gives the unsmoothed one-hot, as in timm). Computed in fp32,
    whatever dtype autocast gave the logits."""

    def __init__(self, num_classes, smoothing=0.0, target_thresh=None):
        super().__init__()
        if not num_classes:
            raise ValueError("BinaryCrossEntropy needs num_classes: the model's outputs")
        self.num_classes, self.smoothing, self.target_thresh = num_classes, smoothing, target_thresh

    def targets(self, target, device):
        """The fp32 (batch, num_classes) targets for hard labels or soft targets."""
        if target.ndim == 2:
            target = target.to(device=device, dtype=torch.float32)
        else:
            off = self.smoothing / self.num_classes
            target = torch.full((target.shape[0], self.num_classes), off, device=device).scatter_(
                1, target.long().view(-1, 1).to(device), 1.0 - self.smoothing + off)
        if self.target_thresh is not None:
            target = target.gt(self.target_thresh).float()
        return target

    def forward(self, logits, target):
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), self.targets(target, logits.device))


# --- mixup / cutmix --------------------------------------------------------------------------

def build_mixup(mixup_alpha=0.0, cutmix_alpha=0.0, switch_prob=0.5, label_smoothing=0.0,
                num_classes=1000, batch_size=None):
    """timm.data.Mixup for --mixup/--cutmix, or None when both alphas are 0.

    Call it as `images, soft_targets = mixup(images, targets)` on the normalised float batch the
    DevicePrefetcher yields (after it, on the device: Mixup mixes in place and makes one-hot
    targets on the images' device), before the forward. 'batch' mode draws one lambda per batch
    and mixes each image with the batch flipped, so the batch size must be even (timm asserts it;
    we say so up front). switch_prob: with both alphas set, the chance a batch uses cutmix.
    Label smoothing goes into the soft targets here, so pair it with build_criterion(mixup_active=True).
    """
    if mixup_alpha < 0 or cutmix_alpha < 0:
        raise UsageError(f"--mixup and --cutmix are Beta-distribution alphas >= 0, got {mixup_alpha}, {cutmix_alpha}")
    if not 0.0 <= switch_prob <= 1.0:
        raise UsageError(f"--mixup-switch-prob is a probability in [0, 1], got {switch_prob}")
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    if batch_size is not None and batch_size % 2:
        raise UsageError(f"--mixup/--cutmix mix each image with another of its batch, so -b must be even, "
                         f"got {batch_size}")
    from timm.data import Mixup
    return Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, switch_prob=switch_prob, mode="batch",
                 label_smoothing=label_smoothing, num_classes=num_classes)


# --- augmentation ----------------------------------------------------------------------------

class TorchSeeded:
    """Runs a transform that draws from Python's `random` and NumPy (timm's RandAugment, AugMix,
    AutoAugment do) with those generators seeded from torch's.

    utils.data.batches.SeededSamples seeds only torch's generator from (seed, epoch, index) before each
    sample; drawing the Python/NumPy seeds from it keeps the augmentation a pure function of
    (seed, epoch, index) in whichever worker serves the sample, so runs and resumes still repeat.
    """

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
        random.seed(seed)
        np.random.seed(seed)
        return self.transform(image)

    def __repr__(self):
        return f"TorchSeeded({self.transform!r})"


def augment_transform(aa, image_size, mean, interpolation="bilinear"):
    """The PIL transform for --aa, appended after RandomResizedCrop + flip on the cpu backend, or
    None for --aa none.

    aa: a timm policy string, built as timm's own transforms_factory builds it (translate 45 % of
    the crop, fill with the mean colour): 'rand-m9-mstd0.5-inc1' (RandAugment), 'augmix-m5-w4-d2'
    (AugMix), 'v0' / 'original' / '3a' (AutoAugment policies); or 'ta_wide' / 'trivial' for
    torchvision's TrivialAugmentWide (timm has no TrivialAugment). A bad string is a UsageError
    here, at start-up, not an assertion in a loader worker. The gpu backend decodes on the device
    and cannot run PIL policies: the wiring must refuse --aa there (or route to the cpu path).
    """
    if aa in (None, "", "none"):
        return None
    from torchvision import transforms
    mode = transforms.InterpolationMode(interpolation)
    if aa in TRIVIAL_AUGMENT:
        return transforms.TrivialAugmentWide(interpolation=mode)
    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
    from timm.data.transforms import str_to_pil_interp
    params = dict(translate_const=int(image_size * 0.45), interpolation=str_to_pil_interp(interpolation),
                  img_mean=tuple(min(255, round(255 * m)) for m in mean))
    try:
        if aa.startswith("rand"):
            transform = rand_augment_transform(aa, params)
        elif aa.startswith("augmix"):
            transform = augment_and_mix_transform(aa, dict(params, translate_pct=0.3))
        else:
            transform = auto_augment_transform(aa, params)
    except (AssertionError, ValueError, KeyError) as err:  # timm asserts on unknown sections/policies
        raise UsageError(f"--aa {aa!r} is not a policy timm knows ({type(err).__name__}: {err}); e.g. "
                         "rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, original, or ta_wide for "
                         "TrivialAugmentWide, or none") from None
    return TorchSeeded(zero_bit_posterize_safe(transform))


def posterize_keeping(image, bits_to_keep, **_):
    """timm's posterize, except that keeping 0 bits gives a black image, as Pillow did before 11:
    Pillow now raises ValueError for 0 bits, which timm's policies ask for (PosterizeIncreasing
    at magnitude >= 7.5, so rand-m9-mstd0.5-inc1; Posterize at low levels, so v0), and the run
    would stop with a traceback from a loader worker in its first steps."""
    from PIL import Image, ImageOps
    if bits_to_keep >= 8:
        return image
    if bits_to_keep <= 0:
        return Image.new(image.mode, image.size)
    return ImageOps.posterize(image, bits_to_keep)


def zero_bit_posterize_safe(transform):
    """Point the posterize ops of a timm RandAugment / AugMix (.ops) or AutoAugment (.policy, a
    list of sub-policies) at posterize_keeping."""
    from timm.data import auto_augment
    ops = list(getattr(transform, "ops", ())) + [op for sub in getattr(transform, "policy", ()) for op in sub]
    for op in ops:
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = posterize_keeping
    return transform


def build_random_erasing(reprob, device, mode="pixel", count=1):
    """timm's RandomErasing for --reprob, applied per batch on the device, or None when reprob is 0.

    It works on the normalised float batch (mode 'pixel' fills with N(0, 1) noise, which is what
    normalised pixels look like), so it runs after the DevicePrefetcher, as timm's own
    PrefetchLoader applies it: `images = erase(images)` (in place, per image of the batch). It draws
    its decisions from Python's `random` in the main process, so a --deterministic run must seed
    `random` per step (e.g. from (seed, epoch, step)) for a resume to repeat.
    """
    if not 0.0 <= reprob <= 1.0:
        raise UsageError(f"--reprob is a probability in [0, 1], got {reprob}")
    if reprob == 0:
        return None
    from timm.data.random_erasing import RandomErasing
    return RandomErasing(reprob, mode=mode, max_count=count, device=device)


# --- optimizers ------------------------------------------------------------------------------

class BuiltOptimizer(NamedTuple):
    optimizer: torch.optim.Optimizer
    # True: the optimizer reads `optimizer.found_inf` (a 0/1 device tensor) and leaves params and
    # state untouched when it is 1 (torch's fused kernels). False: step_skipping_overflow must
    # decide on the host whether to call step() at all.
    skips_on_device: bool


def param_groups(model, weight_decay, no_wd_norm_bias=False, param_of=None):
    """Parameter groups for the optimizer: with no_wd_norm_bias, timm's param_groups_weight_decay
    (1-D tensors, i.e. norm weights and biases, and the model's no_weight_decay() names at weight
    decay 0); else one group. param_of maps a model parameter to the tensor the optimizer must
    update instead (the fp32 master at O2: Precision.master_of.get), so the grouping follows the
    model's names while the optimizer holds the masters.
    """
    param_of = param_of or (lambda p: p)
    if not no_wd_norm_bias:
        return [{"params": [param_of(p) for p in model.parameters() if p.requires_grad],
                 "weight_decay": weight_decay}]
    from timm.optim import param_groups_weight_decay
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)
    return [dict(group, params=[param_of(p) for p in group["params"]]) for group in groups]


def build_optimizer(name, params, lr, momentum=0.9, weight_decay=1e-4, no_wd_norm_bias=False, param_of=None,
                    clip_grad=None):
    """--opt: sgd | nesterov (torch SGD, fused) | adamw (torch AdamW, fused) | lamb (timm Lamb).

    params: an nn.Module (grouped by param_groups, so no_wd_norm_bias can use the names), or
    parameters / param groups as torch optimizers take them (then no_wd_norm_bias must be False:
    group them with param_groups first). Returns BuiltOptimizer(optimizer, skips_on_device).

    Overflow skip (the opt-level shim's found_inf): torch's fused SGD and AdamW read
    `optimizer.found_inf` and skip on the device (fused AdamW also takes the step counter back, so
    bias correction does not count a skipped step). timm's Lamb is not fused and ignores it; its
    step counter is a CPU tensor incremented in step(), so a device-side roll-back (torch.where of
    params and moments) would still count the skipped step. So for lamb the step is skipped on the
    host: step_skipping_overflow reads found_inf (one sync per optimizer step, only when a loss
    scaler produced a found_inf: fp16, or O3). Lamb also clips the global grad norm at 1.0 by
    default (NVLAMB's recipe); with clip_grad (--clip-grad, clipped by Precision.step) it gets
    max_grad_norm=None, so the grads are not clipped twice.
    """
    if name not in OPTIMIZERS:
        raise UsageError(f"--opt {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if isinstance(params, nn.Module):
        params = param_groups(params, weight_decay, no_wd_norm_bias, param_of)
    elif no_wd_norm_bias:
        raise ValueError("no_wd_norm_bias needs the model (its parameter names): pass the nn.Module")
    if name in ("sgd", "nesterov"):
        if name == "nesterov" and momentum <= 0:
            raise UsageError("--opt nesterov needs --momentum > 0")
        optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                    nesterov=name == "nesterov", fused=True)
        if momentum:
            # As a fused SGD must: the fused kernel starts a momentum buffer from the first
            # grad it applies, so a skipped first step would leave it unset; zeros are equivalent.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        return BuiltOptimizer(optimizer, True)
    if name == "adamw":
        return BuiltOptimizer(torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True), True)
    from timm.optim import Lamb
    lamb_clip = {"max_grad_norm": None} if clip_grad else {}
    return BuiltOptimizer(Lamb(params, lr=lr, weight_decay=weight_decay, **lamb_clip), False)


def step_skipping_overflow(built, found_inf):
    """One optimizer step that is skipped when found_inf (0/1 device tensor, or None) is 1.

    skips_on_device: hand the flag to the fused kernel, no host sync. Otherwise (lamb) read it on
    the host and do not call step() at all. Returns nothing the caller must read; the loss scaler's
    update(found_inf) and skip counter work the same either way. (utils.precision.Precision.step
    does the `optimizer.found_inf = found_inf; optimizer.step()` half today.)
    """
    optimizer = built.optimizer
    raw = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it
    if built.skips_on_device:
        raw.found_inf = found_inf
        optimizer.step()
        return
    if found_inf is not None and bool(found_inf.item()):  # the host sync: see build_optimizer
        return
    optimizer.step()


# --- EMA of weights --------------------------------------------------------------------------

class _Fp32State:
    """Offers ModelEmaV3.update the fp32 truth of a model: its state_dict with the O2 masters in
    place of the half parameters, and half tensors (O3) cast up, so the EMA stays fp32 at every
    level. ModelEmaV3 only calls state_dict() on what it is given."""

    def __init__(self, model, master_of=None):
        names = {id(p): name for name, p in model.named_parameters()}
        state = model.state_dict()
        for param, master in (master_of or {}).items():
            state[names[id(param)]] = master.detach()
        self._state = {key: value.float() if value.is_floating_point() else value for key, value in state.items()}

    def state_dict(self):
        return self._state


def build_ema(model, decay, device=None):
    """timm.utils.ModelEmaV3 over the (unwrapped, fp32) model, or None when decay is None.

    Build it where utils.training_state.build_training_state has the model on its device in fp32: after
    .to(device), before Precision(...) casts it (O2/O3) and registers its half-cast hooks, which a
    copy made later would inherit. Update after every optimizer step with update_ema (not
    ema.update(model) directly: at O2/O3 that would average the half weights, not the masters).
    Evaluate `ema.module` with validate() beside the raw model; it stays fp32, so at O2/O3 it runs
    without the half casts (at O1 autocast still applies).
    Checkpoints: save `ema_state_dict(ema)` under "state_dict_ema" (fp32, on the CPU, no prefix:
    loadable into the bare model, like "state_dict"); resume with
    `ema.module.load_state_dict(checkpoint["state_dict_ema"])`.
    device: keep the EMA elsewhere (e.g. 'cpu' to save GPU memory; timm then drops foreach).
    """
    if decay is None:
        return None
    if not 0.0 < decay < 1.0:
        raise UsageError(f"--model-ema-decay must be in (0, 1), got {decay}")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("build_ema needs the fp32 model: build it before Precision casts the model")
    from timm.utils import ModelEmaV3
    return ModelEmaV3(model, decay=decay, device=device)


def update_ema(ema, model, master_of=None, step=None):
    """ema <- decay * ema + (1 - decay) * weights (buffers too), from the fp32 values of model."""
    ema.update(_Fp32State(model, master_of), step=step)


def ema_state_dict(ema):
    return {key: value.detach().float().cpu() if value.is_floating_point() else value.detach().cpu()
            for key, value in ema.module.state_dict().items()}


# --- gradient accumulation -------------------------------------------------------------------

def micro_batch_context(accelerator, model, micro_step, accum_steps):
    """The context for the forward AND backward of micro-batch micro_step (0-based within its group
    of accum_steps): accelerator.no_sync(model) for all but the last, so DDP all-reduces only once
    per optimizer step; nothing for the last one, whose backward all-reduces the summed grads.

    What makes --accum-steps N equal one batch of N x b (wiring notes):
    - the loss of each micro-batch is divided by N (CrossEntropy means over b, the big batch over N x b);
    - the LR is scaled by the global batch N x b x processes / 256, and the schedule counts
      optimizer steps (an epoch has N times fewer of them);
    - the loss scale stays fixed across the N backwards; unscale, the found_inf check, the step (or
      its skip) and the scale update happen once, after the last: an inf in any micro-batch is in
      the summed grads, so the whole step is skipped, as the big batch's would be;
    - zero_grad only after the step; --clip-grad clips the summed, unscaled grads;
    - BatchNorm still sees micro-batches of b: exact equivalence holds for models without batch
      statistics (or BN in eval mode), within float tolerance at O0.
    no_sync must wrap the forward too: DDP decides in forward whether the backward all-reduces.
    Outside DDP (one process) accelerator.no_sync does nothing.
    """
    if (micro_step + 1) % accum_steps == 0:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


# --- the batch ingredients, together -------------------------------------------------------

class BatchAugment:
    """Random erasing, then mixup/cutmix, on the normalised device batch (timm's order: erasing
    belongs to the sample, mixing to the batch). `images, soft = augment(images, target)`; the
    hard target stays with the caller for top-1/top-5. Draws from Python's `random` and NumPy
    (timm's pieces do), which utils.engine seeds per step, so a resumed run repeats them."""

    def __init__(self, erase=None, mixup=None):
        self.erase, self.mixup = erase, mixup

    def __call__(self, images, target):
        if self.erase is not None:
            images = self.erase(images)
        if self.mixup is not None:
            images, target = self.mixup(images, target)
        return images, target


@dataclass(frozen=True)
class BatchIngredients:
    """The batch-level flags: --reprob, --mixup, --cutmix, --mixup-switch-prob, --label-smoothing."""
    reprob: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0
    mixup_switch_prob: float = 0.5
    label_smoothing: float = 0.0


def build_batch_augment(ingredients, device, num_classes, batch_size):
    """BatchAugment from BatchIngredients, or None when all are off (the Apex recipe)."""
    erase = build_random_erasing(ingredients.reprob, device)
    mixup = build_mixup(ingredients.mixup, ingredients.cutmix, ingredients.mixup_switch_prob,
                        ingredients.label_smoothing, num_classes, batch_size)
    return BatchAugment(erase, mixup) if erase is not None or mixup is not None else None
