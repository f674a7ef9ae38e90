"""Models: timm data configs as data defaults, --pretrained from local caches only, head resets."""
import os

import pytest
import torch
import yaml
from conftest import make_image_folder, run_script

from utils.flags.parser import build_parser
from utils.flags.precedence import parse_args
from utils.models import build_model, model_data_config
from utils.run.errors import UsageError

TINY_TIMM = "test_resnet.r160_in1k"  # timm's own test model: 0.4M weights, 160 px, mean/std 0.5


def fake_hf_cache(root, repo_id, state_dict, filename="model.safetensors", commit="0" * 40):
    """The layout huggingface_hub leaves after a download: refs/main -> snapshots/<commit>/file."""
    import safetensors.torch

    repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(os.path.join(repo, "snapshots", commit))
    with open(os.path.join(repo, "refs", "main"), "w") as handle:
        handle.write(commit)
    path = os.path.join(repo, "snapshots", commit, filename)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state_dict.items()}, path)
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A private Hugging Face hub cache. huggingface_hub read HF_HUB_CACHE at import, so point its
    constant there (the same constant try_to_load_from_cache consults)."""
    from huggingface_hub import constants

    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # and no stray legacy timm weights
    return path


def test_timm_data_config_fills_what_no_flag_set():
    assert model_data_config("resnet18") == {}
    assert model_data_config("timm/" + TINY_TIMM) == {
        "image_size": 160, "crop_pct": 0.95, "interpolation": "bilinear", "mean": [0.5] * 3, "std": [0.5] * 3}
    parser = build_parser("t")
    args = parse_args(parser, ["/data", "-a", "timm/test_resnet"])
    assert (args.image_size, args.crop_pct, args.interpolation) == (160, 0.95, "bilinear")
    assert args.mean == [0.5] * 3 and args.std == [0.5] * 3
    args = parse_args(parser, ["/data", "-a", "timm/test_resnet", "--image-size", "64", "--crop-pct", "0.8",
                               "--interpolation", "bicubic"])
    assert (args.image_size, args.crop_pct, args.interpolation, args.mean) == (64, 0.8, "bicubic", [0.5] * 3)
    # The digits demo keeps its own small crops; the model still sets normalisation and resampling.
    args = parse_args(parser, ["-a", "timm/test_resnet"])
    assert (args.image_size, args.crop_pct, args.mean) == (32, 0.95, [0.5] * 3)
    # torchvision models: the ImageNet defaults, as before.
    args = parse_args(parser, ["/data", "-a", "resnet18"])
    assert (args.image_size, args.crop_pct, args.interpolation) == (224, 0.875, "bilinear")
    assert args.mean == [0.485, 0.456, 0.406]


def test_the_model_mean_and_std_reach_the_device_normalisation(cache_dir):
    from accelerate import Accelerator

    from utils.data.sources import build_data
    from utils.flags.specs import data_spec

    args = parse_args(build_parser("t"), ["-a", "timm/test_resnet", "-j", "0", "-b", "8"])
    data = build_data(data_spec(args, backend="cpu", jpeg_decoder="auto", channels_last=False), Accelerator(cpu=True),
                      train=False)
    assert torch.allclose(data.val.mean.flatten(), torch.full((3,), 127.5))
    assert torch.allclose(data.val.std.flatten(), torch.full((3,), 127.5))


def test_unknown_timm_names_and_weight_tags_are_usage_errors():
    with pytest.raises(UsageError, match="unknown architecture 'timm/resnet5'.*timm/resnet50"):
        model_data_config("timm/resnet5")
    with pytest.raises(UsageError, match="Invalid pretrained tag.*resnet50.a1_in1k"):
        build_model("timm/resnet50.bogus", 10)


def test_timm_pretrained_loads_from_the_local_cache_and_resets_the_head(hub_cache):
    import timm

    torch.manual_seed(1)
    reference = timm.create_model(TINY_TIMM).state_dict()
    fake_hf_cache(hub_cache, "timm/" + TINY_TIMM, reference)
    same = build_model("timm/test_resnet", 1000, pretrained=True)
    for key, value in same.state_dict().items():
        assert torch.equal(value, reference[key]), key
    resized = build_model("timm/test_resnet", 7, pretrained=True)
    assert resized.fc.out_features == 7
    assert torch.equal(resized.conv1[0].weight, reference["conv1.0.weight"])


def test_timm_pretrained_missing_or_damaged_says_how_to_get_it(hub_cache):
    with pytest.raises(UsageError) as missing:
        build_model("timm/test_resnet", 10, pretrained=True)
    message = str(missing.value)
    assert "no local weights for timm/test_resnet" in message and "never downloads" in message
    assert str(hub_cache) in message and "HF_HOME" in message
    path = fake_hf_cache(hub_cache, "timm/" + TINY_TIMM, {"w": torch.ones(2)})
    with open(path, "wb") as handle:
        handle.write(b"truncated")
    with pytest.raises(UsageError, match="cannot load timm/test_resnet weights"):
        build_model("timm/test_resnet", 10, pretrained=True)


def test_torchvision_pretrained_from_torch_home_and_resized(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(UsageError, match="no local weights for mobilenet_v3_small.*never downloads"):
        build_model("mobilenet_v3_small", 5, pretrained=True)
    torch.manual_seed(2)
    reference = torchvision.models.mobilenet_v3_small().state_dict()
    url = torchvision.models.get_model_weights("mobilenet_v3_small").DEFAULT.url
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(reference, tmp_path / "hub" / "checkpoints" / os.path.basename(url))
    model = build_model("mobilenet_v3_small", 5, pretrained=True)
    assert model.classifier[-1].out_features == 5
    assert torch.equal(model.features[0][0].weight, reference["features.0.0.weight"])


def test_torchvision_pretrained_convolution_head_is_resized(tmp_path, monkeypatch):
    """squeezenet classifies with a 1x1 convolution, no Linear: --pretrained on data with other
    than 1000 classes stopped with "cannot find the classifier ...; drop --num-classes", a flag
    nobody typed (the count comes from the data). Its head is resized like a Linear one."""
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    reference = torchvision.models.squeezenet1_1().state_dict()
    url = torchvision.models.get_model_weights("squeezenet1_1").DEFAULT.url
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(reference, tmp_path / "hub" / "checkpoints" / os.path.basename(url))
    model = build_model("squeezenet1_1", 5, pretrained=True)
    assert model.classifier[1].out_channels == 5
    assert torch.equal(model.features[0].weight, reference["features.0.weight"])
    assert model.eval()(torch.randn(2, 3, 64, 64)).shape == (2, 5)


def test_googlenet_trains_and_evaluates(tmp_path):
    """googlenet's default aux classifiers made its training forward return a tuple, and train.py
    stopped at its first loss with a TypeError; it is built without them, and eval.py takes the
    checkpoint."""
    folder = make_image_folder(tmp_path / "data", classes=3, per_class=4)
    out = tmp_path / "out"
    trained = run_script("train.py", folder, "-a", "googlenet", "--image-size", "64", "-b", "6", "--epochs", "1",
                         "-j", "0", "--output-dir", out)
    assert trained.returncode == 0, trained.stderr[-3000:]
    state = torch.load(out / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    assert not any(key.startswith("aux") for key in state)
    evaluated = run_script("eval.py", "--resume", out / "checkpoint.pth.tar", "-j", "0")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert " * Prec@1" in evaluated.stdout


def test_torchvision_pretrained_takes_the_settings_its_weights_need(tmp_path, monkeypatch):
    """googlenet's published weights expect transform_input=True (torchvision's builder sets it
    when it loads them); loaded into a plain model they scored inputs normalised the wrong way,
    and the aux classifiers they carry made a fine-tuning forward return a tuple."""
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    reference = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False).state_dict()
    url = torchvision.models.get_model_weights("googlenet").DEFAULT.url
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(reference, tmp_path / "hub" / "checkpoints" / os.path.basename(url))
    model = build_model("googlenet", 3, pretrained=True)
    assert model.transform_input is True
    assert torch.equal(model.conv1.conv.weight, reference["conv1.conv.weight"])
    assert isinstance(model.train()(torch.randn(2, 3, 64, 64)), torch.Tensor) and model.fc.out_features == 3


def test_train_with_cached_timm_weights_offline(cache_dir, tmp_path):
    """The whole script: timm weights from a copied cache, the head reset to the data's 3 classes,
    the model's data config in args.yaml, and no network (HF_HUB_OFFLINE left unset on purpose)."""
    import timm

    hub = tmp_path / "hf" / "hub"
    fake_hf_cache(hub, "timm/" + TINY_TIMM, timm.create_model(TINY_TIMM).state_dict())
    folder = make_image_folder(tmp_path / "data", classes=3, per_class=4)
    out = tmp_path / "out"
    result = run_script("train.py", folder, "-a", "timm/test_resnet", "--pretrained", "--image-size", "32",
                        "-b", "4", "--epochs", "1", "-j", "0", "--output-dir", out,
                        env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "timm/test_resnet on" in result.stdout and "| 3 classes |" in result.stdout
    settings = yaml.safe_load((out / "args.yaml").read_text())
    assert (settings["image_size"], settings["crop_pct"], settings["interpolation"]) == (32, 0.95, "bilinear")
    assert settings["mean"] == [0.5, 0.5, 0.5] and settings["pretrained"] is True
    state = torch.load(out / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    assert state["fc.weight"].shape == (3, 96)


@pytest.mark.parametrize("arch", ["mnasnet0_5", "resnet18"])
def test_checkpoint_weights_load_into_models_that_check_module_versions(arch):
    """A checkpoint's state_dict is a plain dict of fp32 copies, without the per-module versions;
    MNASNet refuses such a dict (version None), so the loader supplies the model's own."""
    import torchvision

    from utils.run.checkpoint import load_model_weights
    source = torchvision.models.get_model(arch, num_classes=10)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.5)  # weights a fresh model does not start with
    saved = {key: value.clone() for key, value in source.state_dict().items()}  # plain dict, as saved
    target = torchvision.models.get_model(arch, num_classes=10)
    load_model_weights(target, saved, arch, "checkpoint.pth.tar")
    for key, value in target.state_dict().items():
        assert torch.equal(value, source.state_dict()[key]), key


def test_fixed_size_models_refuse_another_image_size_before_any_step():
    """ViT-style models fail at their first forward on another size; refused up front instead,
    naming the size they take. Models of any size (ResNets) pass whatever the size."""
    from utils.models import check_input_size, fixed_input_size
    tiny_vit = build_model("timm/vit_tiny_patch16_224", 10)
    assert fixed_input_size(tiny_vit) == 224
    check_input_size(tiny_vit, "timm/vit_tiny_patch16_224", 224)
    with pytest.raises(UsageError, match=r"takes 224x224 images only .* not --image-size 32; pass --image-size 224"):
        check_input_size(tiny_vit, "timm/vit_tiny_patch16_224", 32)
    assert fixed_input_size(build_model("vit_b_16", 10)) == 224  # torchvision's VisionTransformer
    resnet = build_model("resnet18", 10)
    assert fixed_input_size(resnet) is None
    check_input_size(resnet, "resnet18", 32)
