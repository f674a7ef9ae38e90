"""JPEG decoders for the gpu backend (--jpeg-decoder): `cuda`, torchvision's batched
decode_jpeg(list, device="cuda"), and `hardware`, nvImageCodec with its hardware-only backend
(optional: `pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg`, cu12 for CUDA 12 builds). Both
reach the JPEG engines that A100/H100/H200-class GPUs carry beside the SMs. In training on an
H200 `cuda` was the faster of the two in every same-run benchmark (docs/speed.md), so auto takes
it, except under --deterministic (settle_jpeg_decoder). `hardware` exists for control (a decoder
that never falls back to the SMs silently) and for builds of torchvision without that path. An
image the engines refuse is decoded by nvJPEG, then by PIL. Also the CUDA work queues the
decoders' small kernels need (CUDA_WORK_QUEUES, narrow_queues_caveat)."""
import collections
import contextlib
import os
import sys

import torch

from utils.run.errors import UsageError, first_line

# Largest retired nvImageCodec image kept for reuse (HardwareJpeg): 1 MiB holds a 590 x 590 RGB
# picture, above ImageNet's typical 500 x 375; a larger one is decoded into a buffer of its own.
SPARE_BYTES = 2 ** 20


# CUDA multiplexes every stream of a process onto this many hardware work queues (default 8).
# Streams that share a queue run in submission order, so a small kernel of the gpu backend's
# JPEG decoder (nvJPEG / nvImageCodec run one per image, each followed by a host wait) can sit
# behind a whole queued training step. On an H200 with a CUDA-graphed ResNet-50 step replaying
# beside it, batched decode fell from ~9,000 to ~250 img/s with 8 queues and ran at ~3,700 with 32
# (docs/speed.md). 32 is CUDA's maximum; a value the user set is kept (utils.device sets it).
CUDA_WORK_QUEUES = "32"


def narrow_queues_caveat():
    """For the gpu backend's start-up line: a word where the environment keeps fewer queues."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_WORK_QUEUES)
    if value.strip().isdigit() and int(value) >= int(CUDA_WORK_QUEUES):
        return ""
    return (f"; CUDA_DEVICE_MAX_CONNECTIONS={value} from the environment: the decoder may wait behind "
            f"the training step (unset it or use {CUDA_WORK_QUEUES}, docs/speed.md)")


NVIMGCODEC_INSTALL = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (-cu12 for a CUDA 12 build of torch)"


@contextlib.contextmanager
def _stderr_kept_aside():
    """Hold the process's stderr (fd 2) in a temporary file; yields a function returning it.

    nvImageCodec loads every codec extension it ships and prints an error line for each library
    it does not find (JPEG 2000, TIFF), although JPEG decoding needs neither: users would see
    "[ERROR]" lines on every run. The text is kept and shown only when creating the decoder fails.
    """
    import tempfile
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield lambda: (held.seek(0), held.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class HardwareJpeg:
    """Batched JPEG decode on the GPU's hardware JPEG engines through nvImageCodec.

    __call__(payloads, stream, shapes) -> per payload a uint8 CHW tensor on the device, or None
    where the engines refused the file. Decoding is ordered on `stream` (the GpuBatchDecoder's own). The
    engines take no SM time, so they decode the next batch while the training step runs
    (torchvision's batched decode reaches the same engines for baseline files; see the module
    docstring).
    Raises RuntimeError (with nvImageCodec's own words) where no hardware decoder can be made:
    nvImageCodec missing, or a GPU without JPEG engines.
    """

    def __init__(self, device):
        try:
            from nvidia import nvimgcodec
        except ImportError:
            raise RuntimeError("nvImageCodec is not installed") from None
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        with _stderr_kept_aside() as held:
            try:
                backend = nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)
                self.decoder = nvimgcodec.Decoder(device_id=index, backends=[backend])
            except Exception as err:  # nvImageCodec's RuntimeError on a GPU without JPEG engines
                detail = " ".join(line for line in held().splitlines() if "ERROR" in line)[:300]
                raise RuntimeError(f"nvImageCodec found no hardware JPEG decoder: {first_line(err)}"
                                   + (f" ({detail})" if detail else "")) from None
        self.nvimgcodec = nvimgcodec
        # As PIL and torchvision decode for the cpu backend: RGB, 8 bits, EXIF orientation not applied.
        # Planar (CHW) output, as the canvas gather reads it: interleaved output would cost a
        # contiguous copy per picture (decode + hand-over 15,682 vs 13,393 img/s on the H200).
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                              allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.P_RGB)
        self.recent = collections.deque(maxlen=4)
        self.spare = []  # images of retired batches, decoded into again
        self.reused = 0  # pictures decoded into a retired image's buffer (the tests read it)

    def __call__(self, payloads, stream, shapes=None):
        """shapes: per payload its (height, width) from the header, to match spares by size."""
        sources = [self.nvimgcodec.CodeStream(payload.numpy()) for payload in payloads]
        # Decoding into retired images: a new image per picture allocates device memory and frees
        # it when the image goes, and with those calls the decode thread could not keep up with a
        # CUDA-graphed step (H200, train.py O1: the step waited ~17 ms a batch for its input; with
        # reuse it never waits once the first steps of an epoch are past, docs/speed.md). Spares
        # are matched to the pictures by size, so one is grown (a free and an allocation) only
        # where no spare left is large enough; the leftovers go.
        reuse = None
        if len(self.spare) >= len(sources):
            needs = [3 * height * width for height, width in shapes] if shapes is not None else [0] * len(sources)
            reuse = [self.spare[i] for i in pair_by_size(needs, [image.capacity for image in self.spare])]
            self.spare = []
            self.reused += len(reuse)
        images = self.decoder.decode(sources, images=reuse, params=self.params, cuda_stream=stream.cuda_stream)
        # An image's memory is freed or written again unordered with the streams that read it
        # (record_stream cannot see it), so each batch stays referenced for three more calls
        # before it retires. That is enough in GpuBatches: decode k+4 starts only after batch k+3
        # was queued, hence after k+2 left that queue, hence after the resampling of k+1 was
        # queued, which first synchronised the resampling stream, so k's resampling is done.
        if len(self.recent) == self.recent.maxlen:
            # Only ordinary sizes are kept: one huge photo would otherwise pin its buffer for good.
            self.spare += [image for image in self.recent[0] if image is not None and image.capacity <= SPARE_BYTES]
        self.recent.append(images)
        return [None if image is None else torch.as_tensor(image, device=self.device) for image in images]


def pair_by_size(needs, capacities):
    """For each need (the bytes a picture takes), the index of a distinct spare to decode it into,
    chosen so that as many needs as possible fit their spare's capacity (the rest must grow one:
    a free and an allocation). Smallest needs first, each taking the smallest spare it fits;
    the needs that fit none take the largest spares left. needs: no more than capacities."""
    by_capacity = sorted(range(len(capacities)), key=capacities.__getitem__)
    chosen, used, position = [None] * len(needs), set(), 0
    for need in sorted(range(len(needs)), key=needs.__getitem__):
        while position < len(by_capacity) and capacities[by_capacity[position]] < needs[need]:
            position += 1
        if position == len(by_capacity):
            break
        chosen[need] = by_capacity[position]
        used.add(by_capacity[position])
        position += 1
    left = (k for k in reversed(by_capacity) if k not in used)
    return [k if k is not None else next(left) for k in chosen]


# Why auto leaves nvJPEG under --deterministic, shown on the start-up line (docs/speed.md).
NVJPEG_REPEATS = ("nvJPEG's runs did not always repeat bit for bit on an H200 while other processes "
                  "decoded on it; the hardware decoder's did")


def settle_jpeg_decoder(wanted, device, deterministic=False):
    """(decoder name, why) for --jpeg-decoder. auto is cuda, torchvision's nvJPEG, which trained
    faster than the hardware-only decoder in every same-run benchmark on an H200 (docs/speed.md);
    under --deterministic it is hardware where one can be made (NVJPEG_REPEATS). hardware asked
    for and impossible is a UsageError naming what is missing."""
    if wanted == "cuda":
        return "cuda", "--jpeg-decoder" + (f" (--deterministic: {NVJPEG_REPEATS})" if deterministic else "")
    if wanted == "auto" and not deterministic:
        return "cuda", "auto: nvJPEG measured faster in training"
    try:
        HardwareJpeg(device)
    except RuntimeError as err:
        if wanted == "hardware":
            raise UsageError(f"--jpeg-decoder hardware: no hardware JPEG decoder here ({err}); it needs "
                             f"nvImageCodec ({NVIMGCODEC_INSTALL}) and a GPU with JPEG engines (A100, "
                             "H100, H200, ...); use --jpeg-decoder cuda") from None
        return "cuda", f"auto: no hardware decoder ({err}), so nvJPEG even with --deterministic ({NVJPEG_REPEATS})"
    return "hardware", "--jpeg-decoder" if wanted == "hardware" else f"auto: --deterministic ({NVJPEG_REPEATS})"
