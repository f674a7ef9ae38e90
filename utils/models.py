"""Models by name: any torchvision classification model, or timm/<name> for any timm model."""
import difflib
import os

import torch
from torch import nn

from .errors import UsageError

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
    """Swap the last Linear layer for one with num_classes outputs (pretrained body kept)."""
    last_name, last = None, None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_name, last = name, module
    if last is None:
        raise UsageError("cannot find the classifier of this model to resize it; drop --num-classes")
    parent = model.get_submodule(last_name.rpartition(".")[0]) if "." in last_name else model
    setattr(parent, last_name.rpartition(".")[2], nn.Linear(last.in_features, num_classes))


def _torchvision_model(arch, num_classes, pretrained):
    import torchvision
    if arch not in torchvision_names():
        raise _unknown(arch, torchvision_names())
    if not pretrained:
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    filename = os.path.basename(weights.url)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", filename)
    if not os.path.isfile(path):
        raise UsageError(f"--pretrained: no local weights for {arch} at {path}; this script never "
                         f"downloads. Copy {weights.url} there (or set TORCH_HOME), or drop --pretrained")
    model = torchvision.models.get_model(arch, weights=None)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    if num_classes != len(weights.meta["categories"]):
        _replace_classifier(model, num_classes)
    return model


def _timm_model(name, num_classes, pretrained):
    try:
        import timm
    except ImportError:
        raise UsageError("timm/ models need the timm package: pip install timm") from None
    if not timm.is_model(name):
        raise _unknown(name, timm.list_models())
    if not pretrained:
        return timm.create_model(name, pretrained=False, num_classes=num_classes)
    from huggingface_hub.errors import LocalEntryNotFoundError
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # local cache only: no network at run time
    try:
        return timm.create_model(name, pretrained=True, num_classes=num_classes)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, RuntimeError) as err:
        raise UsageError(f"--pretrained: no local weights for timm/{name} ({type(err).__name__}); this "
                         "script never downloads. Fetch them once where there is network (e.g. "
                         f"python -c \"import timm; timm.create_model('{name}', pretrained=True)\") "
                         "and copy the Hugging Face cache (HF_HOME) here, or drop --pretrained") from None
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def build_model(arch, num_classes, pretrained=False):
    if arch in REFUSED:
        raise UsageError(REFUSED[arch])
    if arch.startswith("timm/"):
        return _timm_model(arch[len("timm/"):], num_classes, pretrained)
    return _torchvision_model(arch, num_classes, pretrained)


def timm_data_config(arch, model):
    """timm's preferred input size, mean/std and crop pct for a timm model, else None."""
    if not arch.startswith("timm/"):
        return None
    import timm.data
    return timm.data.resolve_data_config({}, model=model)
