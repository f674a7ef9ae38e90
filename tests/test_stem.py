"""--stem-channels 4 (MLPerf's ResNet-50 input padded to 4 channels, utils/models.py): the plain
model's weights and outputs, the padding's memory format, the refusals, and train.py to eval.py."""
import pytest
import torch
from conftest import FINAL, TINY, run_script
from test_train import usage_error  # noqa: F401  (the in-process refusal fixture)
from torch import nn

from utils.models import PaddedStemConv2d, apply_stem_channels, build_model, pad_channels
from utils.run.errors import UsageError

CPU = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
SHORT = [*TINY, "-b", "16", "--epochs", "1", "--steps-per-epoch", "3"]
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def plain_and_padded(arch, num_classes=10):
    """(plain model, the same weights with --stem-channels 4), both in eval mode."""
    torch.manual_seed(0)
    plain = build_model(arch, num_classes).eval()
    padded = build_model(arch, num_classes).eval()
    padded.load_state_dict(plain.state_dict())
    return plain, apply_stem_channels(padded, arch, 4)


def padded_names(model):
    return [name for name, module in model.named_modules() if isinstance(module, PaddedStemConv2d)]


def spy_on_convolution(conv):
    """Record the (input, weight) conv's forward hands to the convolution itself."""
    seen, convolve = [], conv._conv_forward

    def record(x, weight, bias):
        seen.append((x, weight))
        return convolve(x, weight, bias)
    conv._conv_forward = record
    return seen


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_padded_stem_keeps_the_plain_models_weights_and_checkpoints_load_both_ways(arch):
    plain, padded = plain_and_padded(arch)
    assert padded_names(padded) == ["conv1"] and type(plain.conv1) is nn.Conv2d
    plain_state, padded_state = plain.state_dict(), padded.state_dict()
    assert list(padded_state) == list(plain_state)
    assert {k: v.shape for k, v in padded_state.items()} == {k: v.shape for k, v in plain_state.items()}
    assert padded_state["conv1.weight"].shape == (64, 3, 7, 7)
    torch.manual_seed(1)
    other = build_model(arch, 10)  # other weights, so a load that did nothing would show
    padded.load_state_dict(other.state_dict(), strict=True)
    assert torch.equal(padded.conv1.weight, other.conv1.weight)
    plain.load_state_dict(padded.state_dict(), strict=True)
    assert all(torch.equal(value, other.state_dict()[key]) for key, value in plain.state_dict().items())


@pytest.mark.parametrize("layout", FORMATS)
def test_padded_stem_gives_the_plain_models_output_and_gradient(layout):
    plain, padded = plain_and_padded("resnet50")
    memory_format = FORMATS[layout]
    plain, padded = plain.to(memory_format=memory_format), padded.to(memory_format=memory_format)
    seen = spy_on_convolution(padded.conv1)
    torch.manual_seed(0)
    images = torch.randn(2, 3, 64, 64).to(memory_format=memory_format)
    out_plain, out_padded = plain(images), padded(images)
    torch.testing.assert_close(out_padded, out_plain, atol=1e-5, rtol=1e-5)
    # The convolution itself ran on 4 channels, in the input's memory format.
    (x, weight), = seen
    assert x.shape == (2, 4, 64, 64) and weight.shape == (64, 4, 7, 7)
    assert x.is_contiguous(memory_format=memory_format) and weight.is_contiguous(memory_format=memory_format)
    assert torch.equal(x[:, 3], torch.zeros(2, 64, 64)) and torch.equal(weight[:, 3], torch.zeros(64, 7, 7))
    out_plain.square().mean().backward()
    out_padded.square().mean().backward()
    assert padded.conv1.weight.grad.shape == (64, 3, 7, 7) and padded.conv1.weight.grad.abs().sum() > 0
    torch.testing.assert_close(padded.conv1.weight.grad, plain.conv1.weight.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("layout", FORMATS)
def test_pad_channels_appends_zero_channels_in_the_inputs_memory_format(layout):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6).to(memory_format=FORMATS[layout]).requires_grad_()
    padded = pad_channels(x, 4)
    assert padded.shape == (2, 4, 5, 6)
    assert padded.is_contiguous(memory_format=FORMATS[layout])
    if layout == "channels_last":
        assert not padded.is_contiguous()
    assert torch.equal(padded[:, :3], x) and torch.equal(padded[:, 3], torch.zeros(2, 5, 6))
    (padded * torch.arange(4.0).view(1, 4, 1, 1)).sum().backward()
    assert torch.equal(x.grad, torch.arange(3.0).view(1, 3, 1, 1).expand(2, 3, 5, 6))


def test_padded_stem_takes_an_input_padded_already_as_it_is():
    plain, padded = plain_and_padded("resnet18")
    seen = spy_on_convolution(padded.conv1)
    torch.manual_seed(0)
    images = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        out = padded.conv1(pad_channels(images, 4))
        torch.testing.assert_close(out, plain.conv1(images), atol=1e-5, rtol=1e-5)
    assert seen[0][0].shape == (1, 4, 16, 16)


def test_stem_channels_3_leaves_any_model_and_4_refuses_all_but_torchvision_resnets():
    mobilenet = build_model("mobilenet_v3_small", 10)
    before = [type(module) for module in mobilenet.modules()]
    assert apply_stem_channels(mobilenet, "mobilenet_v3_small", 3) is mobilenet
    assert [type(module) for module in mobilenet.modules()] == before
    _, resnet = plain_and_padded("resnet18")
    conv1 = resnet.conv1
    assert apply_stem_channels(resnet, "resnet18", 4).conv1 is conv1  # a second call pads once
    for arch in ("resnext50_32x4d", "wide_resnet50_2"):
        with torch.device("meta"):  # no weights drawn: the structure is all that is checked
            model = build_model(arch, 10)
        assert padded_names(apply_stem_channels(model, arch, 4)) == ["conv1"]
    for arch in ("mobilenet_v3_small", "timm/resnet50", "vit_b_16"):
        with pytest.raises(UsageError, match=rf"--stem-channels 4: -a {arch} .*resnet\*, resnext\* and "
                                             r"wide_resnet\*.*drop --stem-channels"):
            apply_stem_channels(mobilenet, arch, 4)


def test_train_refuses_stem_channels_for_a_mobilenet_and_other_counts(usage_error):  # noqa: F811 (the fixture)
    usage_error(["--stem-channels", "4", "-a", "mobilenet_v3_small", "--epochs", "1", "--steps-per-epoch", "1",
                 "-j", "0"], "--stem-channels", "mobilenet_v3_small", "torchvision ResNet")
    usage_error(["--stem-channels", "5"], "--stem-channels", "invalid choice: 5")


def test_a_padded_stem_checkpoint_is_a_plain_models_and_eval_repeats_trains_top1(cache_dir, tmp_path):
    out = tmp_path / "stem"
    run = run_script("train.py", "--stem-channels", "4", *SHORT, "--output-dir", out, env=CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    # eval.py builds the plain model: the zero channel added nothing, so it scores the same.
    result = run_script("eval.py", "--resume", out / "checkpoint.pth.tar", env=CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    assert FINAL.findall(result.stdout)[-1] == FINAL.findall(run.stdout)[-1]
    checkpoint = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=False)
    assert checkpoint["args"]["stem_channels"] == 4
    assert checkpoint["state_dict"]["conv1.weight"].shape == (64, 3, 7, 7)
    plain, padded = plain_and_padded("resnet18")
    initial = plain.conv1.weight.detach().clone()  # train.py's seed 0 drew the same weights
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    padded.load_state_dict(checkpoint["state_dict"], strict=True)
    assert not torch.allclose(plain.conv1.weight, initial)  # the padded stem's gradient reached it
    torch.manual_seed(0)
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(padded(images), plain(images), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_padded_stem_matches_the_plain_one_in_fp16_channels_last_on_cuda_eager_and_compiled():
    plain, padded = plain_and_padded("resnet50", 1000)
    plain = plain.cuda().to(memory_format=torch.channels_last)
    padded = padded.cuda().to(memory_format=torch.channels_last)
    stem = {name: nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
            for name, model in (("plain", plain), ("padded", padded))}
    torch.manual_seed(0)
    images = torch.randn(8, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(stem["padded"])
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        conv_plain, conv_padded = plain.conv1(images), padded.conv1(images)
        stem_plain, stem_padded, stem_compiled = stem["plain"](images), stem["padded"](images), compiled(images)
        out_plain, out_padded = plain(images), padded(images)
    assert conv_padded.dtype == torch.float16 and conv_padded.shape == (8, 64, 112, 112)
    assert conv_padded.is_contiguous(memory_format=torch.channels_last)
    # fp16 outputs (about 1e-3 apart per unit) of the same fp16 products, summed in another order.
    torch.testing.assert_close(conv_padded.float(), conv_plain.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(stem_padded.float(), stem_plain.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(stem_compiled.float(), stem_plain.float(), atol=1e-2, rtol=1e-2)
    # The whole network carries the stem's rounding through 50 layers: compared as a whole.
    assert torch.isfinite(out_plain).all()
    relative = (out_padded.float() - out_plain.float()).norm() / out_plain.float().norm()
    assert relative < 1e-2, relative.item()
