"""utils/ingredients.py: each ingredient builder gives the torch/timm piece with the effect it promises
(smoothed targets, mixed pixels and targets, augmented images, erased pixels, EMA weights, zero
decay on norms/biases, optimizers that step and skip overflowed steps, accumulation without DDP
all-reduce on the micro-batches).

Run as a script under torchrun (`... tests/test_recipe.py accum OUT.json`), this file is the
2-process probe of micro_batch_context.
"""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, leave_together, run_command
from PIL import Image
from torch import nn

from utils.ingredients import (
    augment_transform,
    build_criterion,
    build_ema,
    build_mixup,
    build_optimizer,
    build_random_erasing,
    ema_state_dict,
    micro_batch_context,
    param_groups,
    step_skipping_overflow,
    update_ema,
)
from utils.run.errors import UsageError


def train_transform_extras(aa=None, reprob=0.0, image_size=224, mean=(0.485, 0.456, 0.406),
                           interpolation="bilinear", device="cpu"):
    """(PIL transform for after the crop and flip or None, batch random erasing or None): the two
    places augmentation goes in this project, the loader's PIL images and the device batch."""
    return augment_transform(aa, image_size, mean, interpolation), build_random_erasing(reprob, device)



def small_net():
    """Conv + BatchNorm + Linear: one weight of each kind the decay grouping must tell apart."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


# --- loss ------------------------------------------------------------------------------------

def test_label_smoothing_gives_the_hand_computed_loss():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    log_p = [2.0 - math.log(math.exp(2) + 1 + math.exp(-1)), -math.log(math.exp(2) + 1 + math.exp(-1)),
             -1.0 - math.log(math.exp(2) + 1 + math.exp(-1))]
    eps = 0.3
    # Smoothed target for class 0 of 3: (1 - eps) + eps/3 on it, eps/3 on each other class.
    expected = -((1 - eps + eps / 3) * log_p[0] + eps / 3 * log_p[1] + eps / 3 * log_p[2])
    loss = build_criterion(label_smoothing=eps)(logits, torch.tensor([0]))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    plain = build_criterion(0.0)(logits, torch.tensor([0]))
    assert plain.item() == pytest.approx(-log_p[0], rel=1e-6) and plain.item() < loss.item()
    # With mixup the targets arrive soft (and already smoothed): timm's soft-target loss.
    soft = build_criterion(eps, mixup_active=True)
    target = torch.tensor([[1 - eps + eps / 3, eps / 3, eps / 3]])
    assert soft(logits, target).item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(UsageError, match="--label-smoothing"):
        build_criterion(1.0)


# --- mixup / cutmix --------------------------------------------------------------------------

def test_mixup_mixes_pixels_and_targets_by_the_same_lambda():
    assert build_mixup(0.0, 0.0) is None  # off by default: the Apex recipe
    torch.manual_seed(0)
    np.random.seed(0)
    mixup = build_mixup(mixup_alpha=0.4, cutmix_alpha=0.0, label_smoothing=0.1, num_classes=4)
    images = torch.stack([torch.full((3, 8, 8), 1.0), torch.full((3, 8, 8), -1.0)])
    mixed, target = mixup(images.clone(), torch.tensor([0, 2]))
    lam = (mixed[0, 0, 0, 0].item() + 1) / 2  # lam * 1 + (1 - lam) * -1
    assert 0 < lam < 1 and lam != 0.5
    assert torch.allclose(mixed[0], torch.full_like(mixed[0], 2 * lam - 1))  # every pixel the same blend
    assert torch.allclose(mixed[1], torch.full_like(mixed[1], 1 - 2 * lam))
    off, on = 0.1 / 4, 1 - 0.1 + 0.1 / 4  # smoothed one-hot values
    expected0 = lam * torch.tensor([on, off, off, off]) + (1 - lam) * torch.tensor([off, off, on, off])
    assert torch.allclose(target[0], expected0, atol=1e-6)
    assert torch.allclose(target.sum(1), torch.ones(2))


def test_cutmix_pastes_a_box_and_weights_targets_by_its_area():
    np.random.seed(1)
    cutmix = build_mixup(mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=2)
    images = torch.stack([torch.full((3, 16, 16), 1.0), torch.full((3, 16, 16), -1.0)])
    shares = []
    for _ in range(8):  # a draw of lambda near 1 may paste an empty box: look at several
        mixed, target = cutmix(images.clone(), torch.tensor([0, 1]))
        pasted = (mixed[0, 0] == -1.0).float().mean().item()  # share of image 0 now from image 1
        assert set(mixed.unique().tolist()) <= {-1.0, 1.0}  # pasted, not blended
        assert target[0].tolist() == pytest.approx([1 - pasted, pasted], abs=1e-6)  # correct_lam: by area
        shares.append(pasted)
    assert any(0 < share < 1 for share in shares)


def test_mixup_refuses_what_timm_would_assert_on():
    with pytest.raises(UsageError, match="-b must be even"):
        build_mixup(0.2, 0.0, batch_size=7)
    with pytest.raises(UsageError, match="alphas >= 0"):
        build_mixup(-1.0, 0.0)
    with pytest.raises(UsageError, match="probability"):
        build_mixup(0.2, 1.0, switch_prob=1.5)


# --- augmentation ----------------------------------------------------------------------------

def photo():
    rng = np.random.RandomState(0)
    return Image.fromarray(rng.randint(0, 255, (32, 32, 3), dtype=np.uint8))


@pytest.mark.parametrize("policy", ["rand-m9-n3-mstd0.5-inc1", "augmix-m5-w4-d2", "original", "ta_wide"])
def test_augment_policies_change_pil_images_repeatably(policy):
    transform = augment_transform(policy, 32, (0.485, 0.456, 0.406))
    image = photo()
    outputs = []
    for seed in range(6):
        torch.manual_seed(seed)  # what SeededSamples does per (seed, epoch, index)
        out = transform(image)
        assert isinstance(out, Image.Image) and out.size == image.size
        outputs.append(np.asarray(out))
    assert any(not np.array_equal(out, np.asarray(image)) for out in outputs), "never changed the image"
    torch.manual_seed(3)
    again = np.asarray(transform(image))
    assert np.array_equal(again, outputs[3]), "the same torch seed must give the same augmentation"


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "v0"])
def test_policies_that_posterize_to_zero_bits_run(policy):
    """The README's --aa example and AutoAugment v0 ask for posterize with 0 bits kept, which
    Pillow (>= 11) refuses: such a draw must give the black image older Pillow gave, not stop the run."""
    transform = augment_transform(policy, 32, (0.485, 0.456, 0.406))
    image = photo()
    for seed in range(200):  # rand-m9-mstd0.5-inc1 draws a 0-bit posterize within ~30 images
        torch.manual_seed(seed)
        assert transform(image).size == image.size


def test_zero_bit_posterize_is_black_and_others_are_pillows():
    from PIL import ImageOps

    from utils.ingredients import posterize_keeping
    image = photo()
    assert not np.asarray(posterize_keeping(image, 0)).any()
    assert np.array_equal(np.asarray(posterize_keeping(image, 3)), np.asarray(ImageOps.posterize(image, 3)))
    assert posterize_keeping(image, 8) is image


def test_bad_policy_and_none():
    assert augment_transform("none", 32, (0.5,) * 3) is None and augment_transform(None, 32, (0.5,) * 3) is None
    with pytest.raises(UsageError, match="--aa 'rand-q7'"):
        augment_transform("rand-q7", 32, (0.5,) * 3)
    with pytest.raises(UsageError, match="--aa 'v9'"):
        augment_transform("v9", 32, (0.5,) * 3)


def test_random_erasing_erases_normalised_batches_on_the_device():
    assert build_random_erasing(0.0, "cpu") is None
    aa, erase = train_transform_extras(aa=None, reprob=1.0, device="cpu")
    assert aa is None
    batch = torch.zeros(4, 3, 16, 16)
    out = erase(batch)
    for image in out:  # probability 1: every image has an erased (noise-filled) box, the rest kept
        changed = (image != 0).any(0).float().mean().item()
        assert 0 < changed < 1
    with pytest.raises(UsageError, match="--reprob"):
        build_random_erasing(1.5, "cpu")


# --- optimizers ------------------------------------------------------------------------------

def test_no_wd_norm_bias_puts_norms_and_biases_at_zero_decay():
    net = small_net()
    groups = param_groups(net, 0.05, no_wd_norm_bias=True)
    names = {id(p): name for name, p in net.named_parameters()}
    by_decay = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in groups}
    assert by_decay == {0.0: ["1.bias", "1.weight", "5.bias"], 0.05: ["0.weight", "5.weight"]}
    assert [g["weight_decay"] for g in param_groups(net, 0.05)] == [0.05]  # off: one group

    # In effect: with zero grads, SGD's decay shrinks the conv/linear weights and leaves BN alone.
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    opt = build_optimizer("sgd", net, lr=1.0, momentum=0.0, weight_decay=0.05, no_wd_norm_bias=True).optimizer
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(net.named_parameters())
    assert torch.allclose(after["0.weight"], before["0.weight"] * 0.95)
    for name in ("1.weight", "1.bias", "5.bias"):
        assert torch.equal(after[name], before[name]), name


def test_groups_follow_model_names_but_hold_the_masters():
    net = small_net()
    masters = {p: p.detach().clone().requires_grad_(True) for p in net.parameters()}
    groups = param_groups(net, 1e-4, no_wd_norm_bias=True, param_of=masters.get)
    held = {id(p) for g in groups for p in g["params"]}
    assert held == {id(m) for m in masters.values()}


@pytest.mark.parametrize("name", ["sgd", "nesterov", "adamw", "lamb"])
def test_every_optimizer_steps_and_learns(name):
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    lr = {"sgd": 0.1, "nesterov": 0.1, "adamw": 0.01, "lamb": 0.05}[name]  # lamb: lr x |w| per layer
    built = build_optimizer(name, net, lr=lr, momentum=0.9, weight_decay=1e-4, no_wd_norm_bias=True)
    assert built.skips_on_device == (name != "lamb")
    loss_fn = nn.CrossEntropyLoss()
    first = loss_fn(net(x), y).item()
    for _ in range(30):
        built.optimizer.zero_grad()
        loss_fn(net(x), y).backward()
        step_skipping_overflow(built, torch.zeros(()))
    assert loss_fn(net(x), y).item() < 0.8 * first


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb"])
def test_an_overflowed_step_changes_nothing(name):
    """found_inf = 1 (the loss scaler's verdict): params, moments and step counts stay as they
    were, on the device for the fused optimizers, by the host check for lamb."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    built = build_optimizer(name, net, lr=0.1, momentum=0.9, weight_decay=1e-2)
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.randn(8, 4)).sum().backward()
    step_skipping_overflow(built, torch.ones(()))
    for p, old in zip(net.parameters(), before):
        assert torch.equal(p, old)
    for state in built.optimizer.state.values():
        for key, value in state.items():
            if key == "step":
                assert value.item() == 0  # fused AdamW takes the counter back
            elif torch.is_tensor(value):
                assert not value.any(), key  # momentum / moments untouched (still zero)
    step_skipping_overflow(built, torch.zeros(()))
    assert any(not torch.equal(p, old) for p, old in zip(net.parameters(), before))


def test_unknown_optimizer_and_nesterov_without_momentum():
    with pytest.raises(UsageError, match="--opt 'adam'"):
        build_optimizer("adam", small_net(), 0.1)
    with pytest.raises(UsageError, match="nesterov needs --momentum"):
        build_optimizer("nesterov", small_net(), 0.1, momentum=0.0)


# --- EMA -------------------------------------------------------------------------------------

def test_ema_follows_the_decay_formula_and_goes_into_checkpoints():
    net = small_net()
    ema = build_ema(net, decay=0.9)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x = torch.randn(4, 3, 8, 8)
    net(x).sum().backward()  # train mode: BN running stats move too
    opt.step()
    update_ema(ema, net)
    for key, value in ema.module.state_dict().items():
        raw = net.state_dict()[key]
        if value.is_floating_point():
            assert torch.allclose(value, 0.9 * start[key] + 0.1 * raw, atol=1e-6), key
        else:
            assert torch.equal(value, raw), key  # num_batches_tracked: copied
    assert not torch.allclose(ema.module[0].weight, net[0].weight)
    for _ in range(3):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        update_ema(ema, net)
    assert not torch.allclose(ema.module[5].weight, net[5].weight)
    # The checkpoint entry: fp32, CPU, and loads strictly into a bare model of the arch.
    state = ema_state_dict(ema)
    fresh = small_net()
    fresh.load_state_dict(state, strict=True)
    assert all(v.dtype == torch.float32 for k, v in state.items() if v.is_floating_point())
    assert torch.equal(fresh[0].weight, ema.module[0].weight)


def test_ema_averages_the_fp32_masters_of_a_half_model():
    net = small_net()
    ema = build_ema(net, decay=0.5)
    start = net[0].weight.detach().clone()
    masters = {p: (p.detach() + 1e-3).clone() for p in net.parameters()}  # values bf16 cannot hold
    net.to(torch.bfloat16)
    update_ema(ema, net, master_of=masters)
    assert ema.module[0].weight.dtype == torch.float32
    assert torch.allclose(ema.module[0].weight, 0.5 * start + 0.5 * (start + 1e-3), atol=1e-7)
    with pytest.raises(ValueError, match="fp32 model"):
        build_ema(net, 0.9)
    assert build_ema(small_net(), None) is None
    with pytest.raises(UsageError, match="--model-ema-decay"):
        build_ema(small_net(), 1.0)


# --- accumulation ----------------------------------------------------------------------------

def test_accumulated_micro_batches_equal_one_big_batch(accelerator):
    """N micro-batches of b, each loss / N, give the grads of one batch of N x b (no BatchNorm)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(net(x), y).backward()
    big = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    steps = 4
    for micro, (xs, ys) in enumerate(zip(x.chunk(steps), y.chunk(steps))):
        with micro_batch_context(accelerator, net, micro, steps):
            (loss_fn(net(xs), ys) / steps).backward()
    for p, g in zip(net.parameters(), big):
        assert torch.allclose(p.grad, g, atol=1e-6)


def accum_probe(out_path):
    """Under torchrun: a DDP model prepared by Accelerate, 3 micro-batches per step, each rank its
    own data. Records the grads after each micro-batch, and the grads of the global big batch."""
    import torch.distributed as dist
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    reference = nn.Linear(4, 2)
    reference.load_state_dict(net.state_dict())
    model = accelerator.prepare(net)
    rank, world, steps = accelerator.process_index, accelerator.num_processes, 3
    data = torch.randn(world, steps, 5, 4, generator=torch.Generator().manual_seed(1))
    after = []
    for micro in range(steps):
        with micro_batch_context(accelerator, model, micro, steps):
            (model(data[rank, micro]).pow(2).mean() / steps).backward()
        after.append([p.grad.clone().tolist() for p in accelerator.unwrap_model(model).parameters()])
    # One batch of everything every rank saw: DDP averages over ranks, the micro losses over steps.
    (reference(data.reshape(-1, 4)).pow(2).mean()).backward()
    gathered = [None] * world
    dist.all_gather_object(gathered, after)
    if accelerator.is_main_process:
        with open(out_path, "w") as handle:
            json.dump({"ranks": gathered, "big": [p.grad.tolist() for p in reference.parameters()]}, handle)
    leave_together()


def test_micro_batches_skip_the_ddp_all_reduce_until_the_last(tmp_path):
    out = tmp_path / "accum.json"
    result = run_command([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                          "--nproc_per_node", 2, os.path.join(ROOT, "tests", "test_recipe.py"), "accum", out],
                         env={"ACCELERATE_USE_CPU": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(out.read_text())
    first, second = probe["ranks"]
    tensors = lambda grads: [torch.tensor(g) for g in grads]
    for micro in range(2):  # no_sync: each rank holds only its own grads
        assert any(not torch.allclose(a, b) for a, b in zip(tensors(first[micro]), tensors(second[micro])))
    for a, b, big in zip(tensors(first[2]), tensors(second[2]), tensors(probe["big"])):
        assert torch.allclose(a, b, atol=1e-6)  # the last backward all-reduced the summed grads
        assert torch.allclose(a, big, atol=1e-5)  # = the grads of one batch of 2 ranks x 3 x 5


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "accum":
    accum_probe(sys.argv[2])
