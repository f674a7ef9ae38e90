"""--blurpool (FFCV's blur before strided convolutions, utils/models.py) and --bce-loss /
--bce-target-thresh (timm's binary cross-entropy, utils/ingredients.py), through train.py and eval.py."""
import csv
import math

import numpy as np
import pytest
import torch
from conftest import FINAL, TINY, run_script
from test_train import usage_error  # noqa: F401  (the in-process refusal fixture)
from torch import nn

from utils.ingredients import build_criterion, build_mixup
from utils.models import BlurPoolConv2d, apply_blurpool, build_model, check_blurpool
from utils.precision import cast_model
from utils.run.errors import UsageError

CPU = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
SHORT = [*TINY, "-b", "16", "--epochs", "1", "--steps-per-epoch", "3"]
BINOMIAL = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16


def plain_and_blurred(arch, num_classes=10):
    """(plain model, the same weights with --blurpool), both in eval mode."""
    torch.manual_seed(0)
    plain = build_model(arch, num_classes).eval()
    blurred = build_model(arch, num_classes).eval()
    blurred.load_state_dict(plain.state_dict())
    return plain, apply_blurpool(blurred, arch)


def blurred_names(model):
    return sorted(name for name, module in model.named_modules() if isinstance(module, BlurPoolConv2d))


# --- --blurpool ------------------------------------------------------------------------------------

def test_blurpool_blurs_resnet50s_strided_convolutions_and_keeps_its_weight_names():
    plain, blurred = plain_and_blurred("resnet50")
    # torchvision's ResNet-50 strides the 3x3 conv2 and the 1x1 downsample of layer2-4's first block;
    # the stem's conv1 (3 input channels) stays plain.
    assert blurred_names(blurred) == sorted(f"layer{i}.0.{conv}" for i in (2, 3, 4)
                                            for conv in ("conv2", "downsample.0"))
    assert type(blurred.conv1) is nn.Conv2d
    assert list(blurred.state_dict()) == list(plain.state_dict())
    assert not any("blur" in key for key in blurred.state_dict())
    # Checkpoints load both ways, strictly.
    plain.load_state_dict(blurred.state_dict())
    blurred.load_state_dict(plain.state_dict())
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out_plain, out_blurred = plain(images), blurred(images)
    assert out_blurred.shape == out_plain.shape == (2, 10)
    assert not torch.allclose(out_plain, out_blurred, atol=1e-3)


def test_blurpool_convolution_blurs_its_input_with_the_binomial_filter_first():
    _, blurred = plain_and_blurred("resnet18")
    conv = blurred.layer2[0].conv1  # resnet18 (BasicBlock) strides conv1
    assert isinstance(conv, BlurPoolConv2d) and conv.stride == (2, 2) and conv.in_channels == 64
    assert conv.blur_filter.shape == (64, 1, 3, 3)
    assert torch.equal(conv.blur_filter, BINOMIAL.expand(64, 1, 3, 3))
    x = torch.randn(1, 64, 9, 9)
    blurred_input = nn.functional.conv2d(x, BINOMIAL.expand(64, 1, 3, 3), padding=1, groups=64)
    expected = nn.functional.conv2d(blurred_input, conv.weight, None, stride=2, padding=1)
    with torch.no_grad():
        out = conv(x)
        assert out.shape == expected.shape == (1, 128, 5, 5)
        assert torch.allclose(out, expected, atol=1e-5)
        # A constant image stays constant away from the zero-padded border: the filter sums to 1.
        flat = nn.functional.conv2d(torch.ones(1, 64, 6, 6), conv.blur_filter, padding=1, groups=64)
    assert torch.allclose(flat[..., 1:-1, 1:-1], torch.ones(()))


def test_blurpool_filter_follows_casts_memory_format_and_autocast():
    _, blurred = plain_and_blurred("resnet18")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = blurred(images)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 10) and torch.isfinite(out).all()
    conv = blurred.layer3[0].conv1
    blurred.to(memory_format=torch.channels_last)
    assert conv.blur_filter.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert blurred(images.to(memory_format=torch.channels_last)).shape == (2, 10)
    blurred.half()  # O3's cast and Module.half(): non-persistent buffers are cast too
    assert conv.blur_filter.dtype == torch.float16 and conv.weight.dtype == torch.float16
    with torch.no_grad():
        assert conv(torch.randn(1, 128, 8, 8, dtype=torch.float16)).dtype == torch.float16
    cast_model(blurred.float(), torch.bfloat16, keep_bn_fp32=True)  # O2's cast
    assert conv.blur_filter.dtype == torch.bfloat16


def test_blurpool_refuses_models_other_than_torchvision_resnets():
    for arch in ("resnext50_32x4d", "wide_resnet50_2", "resnet18"):
        check_blurpool(arch)
    for arch in ("mobilenet_v3_small", "vit_b_16", "timm/resnet50"):
        with pytest.raises(UsageError, match=rf"-a {arch} .*resnet\*, resnext\* and wide_resnet\*"):
            check_blurpool(arch)
    with pytest.raises(UsageError, match="mobilenet_v3_small"):
        apply_blurpool(build_model("mobilenet_v3_small", 10), "mobilenet_v3_small")


def test_train_refuses_blurpool_for_a_mobilenet(usage_error):
    usage_error(["--blurpool", "-a", "mobilenet_v3_small", "--epochs", "1", "--steps-per-epoch", "1", "-j", "0"],
                "--blurpool", "mobilenet_v3_small", "torchvision ResNet")


def test_eval_rebuilds_the_blur_from_the_checkpoint_and_repeats_trains_top1(cache_dir, tmp_path):
    out = tmp_path / "blur"
    run = run_script("train.py", "--blurpool", *SHORT, "--output-dir", out, env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    result = run_script("eval.py", "--resume", out / "checkpoint.pth.tar", env=CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    assert FINAL.findall(result.stdout)[-1] == FINAL.findall(run.stdout)[-1]
    # The blur is no weight: scored without it, the same weights give other logits.
    checkpoint = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=False)
    assert checkpoint["args"]["blurpool"] is True
    plain, blurred = plain_and_blurred("resnet18")
    plain.load_state_dict(checkpoint["state_dict"])
    blurred.load_state_dict(checkpoint["state_dict"])
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(plain(images), blurred(images), atol=1e-3)


# --- --bce-loss ------------------------------------------------------------------------------------

def manual_bce(logits, targets):
    """The mean over batch and classes of -(t log sigmoid(x) + (1 - t) log(1 - sigmoid(x)))."""
    total = 0.0
    for row, target_row in zip(logits.tolist(), targets.tolist()):
        for x, t in zip(row, target_row):
            p = 1 / (1 + math.exp(-x))
            total -= t * math.log(p) + (1 - t) * math.log(1 - p)
    return total / logits.numel()


def test_bce_on_hard_labels_smooths_the_one_hot_as_timm():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 5), torch.tensor([0, 3, 4, 3])
    smoothed = torch.full((4, 5), 0.1 / 5)
    smoothed[torch.arange(4), labels] = 1 - 0.1 + 0.1 / 5
    loss = build_criterion(0.1, bce=True, num_classes=5)(logits, labels)
    assert loss.item() == pytest.approx(manual_bce(logits, smoothed), rel=1e-5)
    unsmoothed = build_criterion(0.0, bce=True, num_classes=5)(logits, labels)
    assert unsmoothed.item() == pytest.approx(manual_bce(logits, nn.functional.one_hot(labels, 5)), rel=1e-5)
    assert unsmoothed.item() != pytest.approx(loss.item(), rel=1e-3)
    # Half logits (autocast's) still give an fp32 loss, with a gradient for them.
    half = logits.bfloat16().requires_grad_()
    loss = build_criterion(0.1, bce=True, num_classes=5)(half, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and half.grad.dtype == torch.bfloat16


def test_bce_takes_mixups_soft_targets_as_they_are():
    torch.manual_seed(0)
    np.random.seed(0)  # Mixup draws its lambda from NumPy
    mixup = build_mixup(mixup_alpha=1.0, label_smoothing=0.1, num_classes=5)
    images, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    _, soft = mixup(images, labels)
    assert soft.shape == (4, 5) and torch.allclose(soft.sum(1), torch.ones(4))
    assert ((soft > 1.5 * 0.1 / 5).sum(1) == 2).all()  # each row mixes two classes above the smoothing's floor
    logits = torch.randn(4, 5)
    loss = build_criterion(0.1, mixup_active=True, bce=True, num_classes=5)(logits, soft)
    assert loss.item() == pytest.approx(manual_bce(logits, soft), rel=1e-5)  # not smoothed a second time


def test_bce_target_threshold_makes_targets_zero_or_one():
    torch.manual_seed(0)
    logits = torch.randn(3, 4)
    soft = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]])
    loss = build_criterion(0.0, mixup_active=True, bce=True, target_thresh=0.3, num_classes=4)(logits, soft)
    assert loss.item() == pytest.approx(manual_bce(logits, (soft > 0.3).float()), rel=1e-5)
    # After smoothing (off 0.025, on 0.925), a threshold between the two gives back the plain one-hot.
    labels = torch.tensor([1, 0, 3])
    thresholded = build_criterion(0.1, bce=True, target_thresh=0.2, num_classes=4)(logits, labels)
    assert thresholded.item() == pytest.approx(manual_bce(logits, nn.functional.one_hot(labels, 4)), rel=1e-5)


def test_bce_matches_timms_binary_cross_entropy():
    from timm.loss import BinaryCrossEntropy
    torch.manual_seed(0)
    logits, labels, soft = torch.randn(6, 10), torch.randint(0, 10, (6,)), torch.softmax(torch.randn(6, 10), 1)
    for smoothing, thresh in ((0.1, None), (0.1, 0.2), (0.3, 0.05), (0.0, None)):
        timm_loss = BinaryCrossEntropy(smoothing=smoothing, target_threshold=thresh)
        ours = build_criterion(smoothing, bce=True, target_thresh=thresh, num_classes=10)
        assert ours(logits, labels).item() == pytest.approx(timm_loss(logits, labels).item(), rel=1e-6)
        mixed = build_criterion(smoothing, mixup_active=True, bce=True, target_thresh=thresh, num_classes=10)
        assert mixed(logits, soft).item() == pytest.approx(timm_loss(logits, soft).item(), rel=1e-6)


def first_summary_row(out):
    with open(out / "summary.csv", newline="") as handle:
        return next(csv.DictReader(handle))


def test_train_with_bce_loss_trains_on_another_loss_and_validates_with_cross_entropy(cache_dir, tmp_path):
    rows = {}
    for name, extra in (("ce", []), ("bce", ["--bce-loss"])):
        run = run_script("train.py", *SHORT, "--label-smoothing", "0.1", *extra, "--output-dir", tmp_path / name,
                         env=CPU)
        assert run.returncode == 0, run.stderr[-3000:]
        rows[name] = first_summary_row(tmp_path / name)
    ce_train, bce_train = float(rows["ce"]["train_loss"]), float(rows["bce"]["train_loss"])
    # 10 near-uniform logits: cross-entropy starts near ln 10 = 2.3, each sigmoid's BCE near ln 2 = 0.69.
    assert bce_train < 1.2 < ce_train, rows
    assert float(rows["bce"]["val_loss"]) > 1.2, rows  # validation still reports cross-entropy


def test_bce_target_thresh_without_bce_loss_is_refused(usage_error):
    usage_error(["--bce-target-thresh", "0.2"], "--bce-target-thresh", "--bce-loss")
