"""Models by name: any torchvision classification model, or timm/<name> for any timm model."""
import difflib
import os

import torch
from torch import nn

from utils.run.errors import UsageError, first_line

REFUSED = {
    "inception_v3": "inception_v3 needs 299 px crops and auxiliary logits in training, which this "
                    "script does not handle; pick another architecture (e.g. resnet50), or "
                    "timm/inception_v3 with --image-size 299",
}


def torchvision_names():
    import torchvision
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _unknown(arch, names):
    close = difflib.get_close_matches(arch, names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return UsageError(f"unknown architecture {arch!r}.{hint} Use a torchvision classification model "
                      "name (e.g. resnet50) or timm/<name> (e.g. timm/resnet50)")


def _replace_classifier(model, num_classes):
    """Swap the last Linear layer for one with num_classes outputs (pretrained body kept); a model
    without one (squeezenet) classifies with a 1x1 convolution, the last Conv2d: swapped alike."""
    last_name, last = None, None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_name, last = name, module
    if last is None:
        for name, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                last_name, last = name, module
        if last is None or last.kernel_size != (1, 1):
            raise UsageError("cannot find the classifier of this model to resize it to the data's classes; "
                             "evaluate or train on data with the weights' classes, or drop --pretrained")
    new = (nn.Linear(last.in_features, num_classes) if isinstance(last, nn.Linear)
           else nn.Conv2d(last.in_channels, num_classes, kernel_size=1))
    parent = model.get_submodule(last_name.rpartition(".")[0]) if "." in last_name else model
    setattr(parent, last_name.rpartition(".")[2], new)
    if hasattr(model, "num_classes"):  # squeezenet's record of its head, kept true
        model.num_classes = num_classes


# Constructor keywords a model needs to train here: googlenet's default aux classifiers make its
# training forward return a tuple of logits, which the loss cannot take (its pretrained builder
# drops them itself).
TRAINABLE = {"googlenet": {"aux_logits": False}}


def _torchvision_model(arch, num_classes, pretrained, **extra):
    import torchvision
    if arch not in torchvision_names():
        raise _unknown(arch, torchvision_names())
    if not pretrained:
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes,
                                            **TRAINABLE.get(arch, {}), **extra)
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    filename = os.path.basename(weights.url)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", filename)
    if not os.path.isfile(path):
        raise UsageError(f"--pretrained: no local weights for {arch} at {path}; this script never "
                         f"downloads. Copy {weights.url} there (or set TORCH_HOME), or drop --pretrained")
    try:
        # Built with its weights, not loaded into a plain model: the builder sets what the weights
        # need (googlenet's transform_input, vit_h_14's 518 px). The file is in torch's hub cache,
        # where torchvision looks first, so nothing is downloaded.
        model = torchvision.models.get_model(arch, weights=weights, **extra)
    except TypeError:
        raise  # a keyword the model does not take (--drop-path): build_model says so
    except Exception as err:  # truncated download, another model's file, not a torch file
        raise UsageError(f"--pretrained: cannot load {arch} weights from {path} ({first_line(err, 200)}); the "
                         "file is damaged or of another model: delete it and copy it again") from None
    if num_classes != len(weights.meta["categories"]):
        _replace_classifier(model, num_classes)
    return model


def _import_timm():
    try:
        import timm
    except ImportError:
        raise UsageError("timm/ models need the timm package: pip install timm") from None
    return timm


def _timm_pretrained_cfg(name):
    """timm's config for name (a tag, as in resnet50.a1_in1k, picks that weight set), or None."""
    timm = _import_timm()
    if not timm.is_model(name):
        raise _unknown(f"timm/{name}", [f"timm/{n}" for n in timm.list_models()])
    try:
        return timm.models.get_pretrained_cfg(name)
    except RuntimeError as err:  # "Invalid pretrained tag (x) for y."
        tags = timm.list_pretrained(name.partition(".")[0] + ".*")
        raise UsageError(f"timm/{name}: {err} Known weight sets: {', '.join(tags) or 'none'}") from None


def _safetensors_first(filename):
    """The names timm tries for a hub weight file, safetensors first (as load_state_dict_from_hf)."""
    if filename.endswith(".safetensors"):
        return [filename]
    safe = "model.safetensors" if filename == "pytorch_model.bin" else filename.rsplit(".", 1)[0] + ".safetensors"
    return [safe, filename]


def cached_timm_weights(name):
    """(path of timm/<name>'s pretrained weights in the local cache or None, places looked).

    Never downloads: looks where timm itself would load from, the Hugging Face hub cache
    (HF_HOME / HF_HUB_CACHE) for the config's hf_hub_id, then torch's hub cache (TORCH_HOME) for
    its legacy url. Asking the cache directly works whatever HF_HUB_OFFLINE was when
    huggingface_hub was imported (setting it later has no effect).
    """
    from huggingface_hub import constants, try_to_load_from_cache

    cfg = _timm_pretrained_cfg(name)
    if cfg is None:
        return None, []
    looked = []
    if cfg.hf_hub_id:
        repo, _, revision = cfg.hf_hub_id.partition("@")
        filenames = _safetensors_first(cfg.hf_hub_filename or "pytorch_model.bin")
        for filename in filenames:
            found = try_to_load_from_cache(repo, filename, revision=revision or None)
            if isinstance(found, str):  # else None, or a marker for "known to be missing"
                return found, looked
        looked.append(f"{repo} ({' or '.join(filenames)}) in the Hugging Face cache {constants.HF_HUB_CACHE}")
    if cfg.url:
        path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(cfg.url))
        if os.path.isfile(path):
            return path, looked
        looked.append(path)
    return None, looked


def _timm_model(name, num_classes, pretrained, **extra):
    timm = _import_timm()
    if not pretrained:
        _timm_pretrained_cfg(name)  # an unknown name or weight tag is a usage error, not a traceback
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **extra)
    path, looked = cached_timm_weights(name)
    if path is None:
        where = "; looked for " + ", ".join(looked) if looked else " (timm lists no weights for it)"
        raise UsageError(f"--pretrained: no local weights for timm/{name}{where}. This script never "
                         "downloads: fetch them once where there is network (python -c \"import timm; "
                         f"timm.create_model('{name}', pretrained=True)\") and copy the Hugging Face "
                         "cache (HF_HOME) here, or drop --pretrained")
    try:
        # Load that file and nothing else; timm drops the pretrained head when num_classes differs.
        return timm.create_model(name, pretrained=True, num_classes=num_classes,
                                 pretrained_cfg_overlay={"file": path, "source": ""}, **extra)
    except TypeError:
        raise  # a keyword the model does not take (--drop-path): build_model says so
    except Exception as err:  # truncated file (SafetensorError), another model's weights, not a weight file
        raise UsageError(f"--pretrained: cannot load timm/{name} weights from {path} ({first_line(err, 200)}); "
                         "the file is damaged or of another model: delete it and fetch it again") from None


def build_model(arch, num_classes, pretrained=False, drop_path=0.0):
    """drop_path (--drop-path): timm's drop_path_rate, torchvision's stochastic_depth_prob; 0 keeps
    the model's own default. A model whose constructor takes neither is refused."""
    if arch in REFUSED:
        raise UsageError(REFUSED[arch])
    timm_model = arch.startswith("timm/")
    key = "drop_path_rate" if timm_model else "stochastic_depth_prob"
    extra = {key: drop_path} if drop_path else {}
    try:
        if timm_model:
            return _timm_model(arch[len("timm/"):], num_classes, pretrained, **extra)
        return _torchvision_model(arch, num_classes, pretrained, **extra)
    except TypeError as err:  # the constructor does not take the keyword
        if extra and key in str(err):
            raise UsageError(f"--drop-path: {arch} has no drop-path / stochastic depth (its constructor takes "
                             f"no {key}); drop the flag, or pick a model that has it (timm models such as "
                             "timm/resnet50, torchvision convnext_*, efficientnet_*, swin_*)") from None
        raise


# --- --blurpool: FFCV's anti-aliased downsampling ---------------------------------------------

# torchvision's ResNet class builds these; their strided convolutions are where FFCV's recipe blurs,
# and their stem (conv1) is the one --stem-channels knows.
BLURPOOL_ARCHS = ("resnet", "resnext", "wide_resnet")
BLURPOOL_MIN_CHANNELS = 16  # FFCV's bound: the 3-channel stem sees raw pixels and stays plain


def _binomial_filter(channels, device=None, dtype=None):
    """([1,2,1] outer [1,2,1]) / 16 for each of channels, as a depthwise (channels, 1, 3, 3) weight."""
    row = torch.tensor([1.0, 2.0, 1.0], device=device)
    blur = torch.outer(row, row) / 16
    return blur.expand(channels, 1, 3, 3).to(dtype or torch.float32).clone()


def _same_conv_as(cls, conv):
    """A cls (an nn.Conv2d subclass) with conv's settings, sharing conv's parameters (pretrained or
    loaded weights are kept). Built on the meta device so no weight is initialised: the RNG draws
    of the model build stay those of the plain model."""
    with torch.device("meta"):
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                  conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode)
    new.weight, new.bias = conv.weight, conv.bias
    return new.train(conv.training)


class BlurPoolConv2d(nn.Conv2d):
    """A Conv2d that first blurs its input, channel by channel, with a fixed binomial 3x3 filter
    (stride 1, zero padding 1), so its stride samples a low-passed signal (FFCV's BlurPoolConv2d).

    The filter is a non-persistent buffer: the state_dict holds the plain Conv2d's keys only, so
    checkpoints load into either model, while .to(), .half(), channels_last and the opt levels'
    casts (Module._apply) still move and cast it with the weights. forward casts it to the
    input's dtype too, so a half input meets a half filter wherever the model was cast."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("blur_filter", _binomial_filter(self.in_channels, self.weight.device, self.weight.dtype),
                             persistent=False)

    @classmethod
    def from_conv(cls, conv):
        """The same convolution, blurred, sharing conv's parameters (_same_conv_as)."""
        new = _same_conv_as(cls, conv)
        new.blur_filter = _binomial_filter(conv.in_channels, conv.weight.device, conv.weight.dtype)
        return new

    def forward(self, x):
        blurred = nn.functional.conv2d(x, self.blur_filter.to(x.dtype), padding=1, groups=self.in_channels)
        return super().forward(blurred)


def check_torchvision_resnet(arch, flag, drop=None):
    """Refuse flag for any model but torchvision's ResNets (BLURPOOL_ARCHS); drop: what the message
    says to drop (default: flag)."""
    if arch.startswith("timm/") or not arch.startswith(BLURPOOL_ARCHS):
        raise UsageError(f"{flag}: -a {arch} is not a torchvision ResNet; {flag} supports torchvision's "
                         f"resnet*, resnext* and wide_resnet* models only: drop {drop or flag} or pick one of those")


def check_blurpool(arch):
    """Refuse --blurpool for any model but torchvision's ResNets, the models FFCV's recipe was made for."""
    check_torchvision_resnet(arch, "--blurpool")


def apply_blurpool(model, arch):
    """--blurpool on a built model, in place: every Conv2d with a stride > 1 and at least
    BLURPOOL_MIN_CHANNELS input channels becomes a BlurPoolConv2d with the same weights (resnet50:
    the strided 3x3 and 1x1 downsample convolution of layer2-4's first block, 6 in all). Returns model."""
    check_blurpool(arch)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if (type(child) is nn.Conv2d and max(child.stride) > 1
                    and child.in_channels >= BLURPOOL_MIN_CHANNELS):
                setattr(parent, name, BlurPoolConv2d.from_conv(child))
    return model


# --- --stem-channels 4: MLPerf's ResNet-50 input, padded to 4 channels ---------------------------

def pad_channels(x, channels):
    """x (N, C, H, W) with zero channels appended up to channels, in x's memory format: a
    channels_last input must stay channels_last, or the stem would get the NCHW kernels the
    padding is there to avoid. Differentiable (the pad's backward slices the gradient back)."""
    padded = nn.functional.pad(x, (0, 0, 0, 0, 0, channels - x.shape[1]))
    if x.is_contiguous(memory_format=torch.channels_last):  # ATen's pad keeps it already; not promised
        padded = padded.contiguous(memory_format=torch.channels_last)
    return padded


class PaddedStemConv2d(nn.Conv2d):
    """The stem convolution run with padded_channels input channels: the input gets zero channels
    and the weight zero input-channel slices, on the fly. MLPerf's ResNet-50 pads its input to 4
    channels because cuDNN's fast NHWC half-precision kernels want a channel count divisible by 4,
    and 3 is not. The parameters stay the plain 3-channel conv's, so state_dicts load into either
    model and the gradient reaches the 3-channel weight; zero channels add nothing to the sums, so
    the output is the plain conv's."""

    padded_channels = 4

    @classmethod
    def from_conv(cls, conv, channels=4):
        new = _same_conv_as(cls, conv)
        new.padded_channels = channels
        return new

    def forward(self, x):
        if x.shape[1] == self.in_channels:  # a pipeline that pads its own input needs no second pad
            x = pad_channels(x, self.padded_channels)
        return self._conv_forward(x, pad_channels(self.weight, self.padded_channels), self.bias)

    def extra_repr(self):
        return f"{super().extra_repr()}, padded_channels={self.padded_channels}"


STEM_CHANNELS = (3, 4)


def apply_stem_channels(model, arch, channels):
    """--stem-channels on a built model, in place: with 4, the stem convolution (torchvision ResNets'
    conv1) becomes a PaddedStemConv2d with the same weights; 3 leaves any model as it is. Returns model."""
    if channels == 3:
        return model
    if channels not in STEM_CHANNELS:
        raise UsageError(f"--stem-channels {channels}: choose one of {', '.join(map(str, STEM_CHANNELS))}")
    check_torchvision_resnet(arch, f"--stem-channels {channels}", drop="--stem-channels")
    if type(model.conv1) is nn.Conv2d:  # applied twice, it still pads once
        model.conv1 = PaddedStemConv2d.from_conv(model.conv1, channels)
    return model


def fixed_input_size(model):
    """The one square image size a model takes (ViT-style: position embeddings fix it), or None.
    torchvision's VisionTransformer keeps it in .image_size; timm marks such models'
    pretrained_cfg with fixed_input_size."""
    size = getattr(model, "image_size", None)
    if isinstance(size, int):
        return size
    cfg = getattr(model, "pretrained_cfg", None) or {}
    input_size = cfg.get("input_size") or ()
    if cfg.get("fixed_input_size") and len(input_size) == 3 and input_size[1] == input_size[2]:
        return int(input_size[1])
    return None


def check_input_size(model, arch, image_size):
    """Refuse, before any step runs, an --image-size a fixed-size model would fail on at its first
    forward (an assertion deep inside the model)."""
    size = fixed_input_size(model)
    if size is not None and size != image_size:
        raise UsageError(f"-a {arch} takes {size}x{size} images only (its position embeddings fix the size), "
                         f"not --image-size {image_size}; pass --image-size {size}")


def timm_data_config(arch, model=None):
    """timm's resolved data config (input_size, mean, std, crop_pct, interpolation, ...) or None.

    From the model when given, else from timm's pretrained config for the name (no model built).
    """
    if not arch.startswith("timm/"):
        return None
    import timm.data
    if model is not None:
        return timm.data.resolve_data_config({}, model=model)
    cfg = _timm_pretrained_cfg(arch[len("timm/"):]) or timm.models.PretrainedCfg()  # timm's defaults
    return timm.data.resolve_data_config({}, pretrained_cfg=cfg.to_dict())


def model_data_config(arch):
    """The input a model expects, as defaults for the data flags: image_size, crop_pct,
    interpolation, mean, std; an empty dict for torchvision models (the ImageNet defaults fit).

    A timm model's own config (e.g. 160 px, crop 0.95, bilinear, mean/std 0.5 for test_resnet),
    so pretrained weights see the input they were trained on. train.py and eval.py both get it
    through utils.flags.precedence.parse_args -> apply_source_defaults; a flag given on the
    command line wins. timm's crop_mode 'squash' is not reproduced (we always resize the short side).
    """
    config = timm_data_config(arch)
    if config is None:
        return {}
    return {"image_size": int(config["input_size"][-2]), "crop_pct": float(config["crop_pct"]),
            "interpolation": config["interpolation"], "mean": [float(m) for m in config["mean"]],
            "std": [float(s) for s in config["std"]]}


def has_2d_convolutions(arch):
    """Whether the model holds nn.Conv2d layers (channels_last pays for those), found by building
    it on the meta device: no memory, no weights, a fraction of a second."""
    with torch.device("meta"):
        model = build_model(arch, num_classes=10)
    return any(isinstance(module, nn.Conv2d) for module in model.modules())
