"""Which input pipeline a run uses (--data-backend, --jpeg-decoder) and the words of the start-up
line that say why.

choose_backend depends only on its arguments (the source kind, the two flags, the device type,
--deterministic), but for two looks at the machine where the gpu backend is chosen: whether a
hardware JPEG decoder can be made (settle_jpeg_decoder, under --deterministic or
--jpeg-decoder hardware) and CUDA_DEVICE_MAX_CONNECTIONS (narrow_queues_caveat). The device
start-up (utils.device) calls it once the device is known; the scripts put its result into the
data spec (utils.flags.specs.data_spec).
"""
from dataclasses import dataclass

from utils.data.gpu.decoders import narrow_queues_caveat, settle_jpeg_decoder
from utils.run.errors import UsageError


@dataclass(frozen=True)
class InputBackend:
    backend: str       # "gpu", "cpu", or "none" (synthetic data is made on the device)
    jpeg_decoder: str  # the gpu backend's: "cuda" or "hardware"; otherwise the flag's value ("auto")
    line: str          # "=> input: gpu backend (...), auto: ImageFolder data on CUDA": the start of
                       # the start-up line, before its " | channels_last ..." part


def choose_backend(kind, wanted_backend, wanted_decoder, device_type, deterministic=False, pil_policy=False):
    """InputBackend for a source of kind (utils.data.sources.source_kind), --data-backend
    wanted_backend and --jpeg-decoder wanted_decoder ("auto", "cpu"/"gpu", "cuda"/"hardware") on
    device_type ("cuda", "cpu", ...). pil_policy: an --aa policy is asked for, which only the cpu
    backend's workers can run (auto then picks cpu). A combination that cannot run is a UsageError
    saying what to change."""
    cuda = device_type == "cuda"
    if kind == "synthetic":
        backend, why = "none", "synthetic tensors are made on the device"
        if wanted_backend != "auto":
            raise UsageError(f"--data-backend {wanted_backend}: synthetic data has no input pipeline; drop the flag")
    elif wanted_backend == "gpu" and not cuda:
        raise UsageError("--data-backend gpu decodes with nvJPEG on CUDA, and this run has no CUDA device; "
                         "use --data-backend cpu (or auto)")
    elif wanted_backend == "gpu" and kind == "datasets":
        raise UsageError("--data-backend gpu reads ImageFolder files; Hugging Face datasets sources use "
                         "--data-backend cpu (or auto)")
    elif wanted_backend == "auto":
        backend = "gpu" if cuda and kind != "datasets" and not pil_policy else "cpu"
        why = ("auto: ImageFolder data on CUDA" if backend == "gpu" else
               "auto: Hugging Face datasets are decoded in the workers" if cuda and kind == "datasets" else
               "auto: --aa runs its PIL policy in the workers" if cuda else "auto: no CUDA")
    else:
        backend, why = wanted_backend, "--data-backend"
    if backend != "gpu" and wanted_decoder != "auto":
        raise UsageError(f"--jpeg-decoder {wanted_decoder} applies to the gpu data backend only, and this run uses "
                         f"{'no input pipeline' if backend == 'none' else 'the cpu backend'}; drop the flag")
    decoder = wanted_decoder
    if backend == "gpu":
        decoder, decoder_why = settle_jpeg_decoder(wanted_decoder, "cuda", deterministic)
        engines = "hardware JPEG engines" if decoder == "hardware" else "nvJPEG"
        decode = (f"{engines} batch decode + crops on the GPU; jpeg decoder {decoder}, {decoder_why}"
                  + narrow_queues_caveat())
    else:
        decode = {"cpu": "decode + crops in workers", "none": ""}[backend]
    line = f"=> input: {backend} backend" + (f" ({decode})" if decode else "") + f", {why}"
    return InputBackend(backend, decoder, line)
