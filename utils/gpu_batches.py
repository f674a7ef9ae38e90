"""The gpu input backend: loader workers read file bytes, the main process decodes whole batches
with nvJPEG and crops, flips, resizes and normalises them on the device as batched tensor work.

Worker side: ByteSamples reads a file, sniffs its JPEG header (jpeg_header) and returns the bytes
with the crop box utils/crops.py draws for (seed, epoch, index); files nvJPEG cannot take (PNG
inside .JPEG, CMYK, grayscale, progressive, truncated, ...) are decoded there by PIL instead, so
the main process never spends time on them. pack_bytes collates a batch into one uint8 buffer +
offsets (five tensors through the worker queue, not 256).
Main-process side: GpuBatchDecoder turns a Packed batch into normalised float NCHW images and
int64 targets on the device; GpuBatches iterates a loader through it (the prefetcher contract:
len() and (images, targets) batches). Everything runs on CPU tensors as well (torchvision's CPU
decode_jpeg in place of nvJPEG), which is how the tests cover it without a GPU.

Two decoders for the JPEG payloads (--jpeg-decoder): `cuda`, torchvision's batched
decode_jpeg(list, device="cuda"), and `hardware`, nvImageCodec with its hardware-only backend
(optional: `pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg`, cu12 for CUDA 12 builds). Both
reach the JPEG engines that A100/H100/H200-class GPUs carry beside the SMs: torchvision creates
nvJPEG with its hardware backend where the GPU has one and sends the baseline files of a batch
there (the rest through nvJPEG's hybrid path). In training on an H200 `cuda` was the faster
of the two in every same-run benchmark (docs/speed.md), so auto takes it, except under
--deterministic (settle_jpeg_decoder). `hardware` exists for control (a decoder that never
falls back to the SMs silently) and for builds of torchvision without that path. An image the
engines refuse is decoded by nvJPEG, then by PIL.

Resampling is separable and batched: per image and axis a (size x length) weight matrix with
PIL's kernels (bilinear/bicubic with antialiasing support scaling, nearest), so a whole chunk of
images is two batched matmuls over a zero-padded canvas. The weights are zero outside each
image's crop region, so the padding never leaks in, and a flip is the horizontal matrix reversed.
"""
import collections
import contextlib
import functools
import math
import os
import queue
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from .errors import UnreadableInput, UsageError, first_line
from .image_files import GPU, jpeg_header, pil_rgb, read_file

# Pixels a resampling chunk's canvas may hold (x3 channels, as uint8 and then fp16: 144 MiB). An
# ImageNet batch of 256 takes about three chunks of a few dozen kernels each; a
# smaller canvas keeps the decode stream's share of GPU memory down, and a few huge photos get
# chunks of their own instead of inflating one.
CANVAS_BUDGET = 2 ** 24
# Largest retired nvImageCodec image kept for reuse (HardwareJpeg): 1 MiB holds a 590 x 590 RGB
# picture, above ImageNet's typical 500 x 375; a larger one is decoded into a buffer of its own.
SPARE_BYTES = 2 ** 20


# ----------------------------------------------------------------------------- worker side

class ByteSamples(torch.utils.data.Dataset):
    """(where, label) samples -> (payload, label, box, index, height, width, raw) for pack_bytes.

    key is (index, epoch) as the train sampler yields it, or a bare index (epoch 0, validation).
    boxes is utils.crops.TrainBoxes or CenterBoxes; read(where) -> bytes (default: a file path;
    a Hugging Face source passes its own). payload is the file's bytes when the header routes it
    to nvJPEG (raw False), else PIL's RGB pixels flattened (raw True).
    """

    def __init__(self, samples, boxes, read=read_file):
        self.samples, self.boxes, self.read = samples, boxes, read

    def __len__(self):
        return len(self.samples)

    def name(self, index):
        return str(self.samples[index][0])

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        where, label = self.samples[index]
        try:
            data = self.read(where)
        except OSError as err:
            raise UnreadableInput(f"cannot read image {str(where)!r} ({err}); remove or replace that file") from None
        route, width, height = jpeg_header(data)
        if route == GPU:
            payload, raw = np.frombuffer(data, dtype=np.uint8), False
        else:
            pixels = pil_rgb(data, where)
            (height, width), payload, raw = pixels.shape[:2], pixels.reshape(-1), True
        return payload, label, self.boxes(width, height, epoch, index), index, height, width, raw


class Packed(NamedTuple):
    """One batch as the workers hand it over: every payload in one buffer."""
    buffer: torch.Tensor   # uint8 (total,): the payloads back to back
    offsets: torch.Tensor  # int64 (n+1,): payload i is buffer[offsets[i]:offsets[i+1]]
    shapes: torch.Tensor   # int64 (n, 2): image height, width
    raw: torch.Tensor      # bool (n,): payload is HWC RGB pixels (PIL-decoded), not JPEG bytes
    boxes: torch.Tensor    # float64 (n, 5): top, left, height, width, flip (source pixels)
    labels: torch.Tensor   # int64 (n,)
    indices: torch.Tensor  # int64 (n,): dataset indices, to name a file in an error

    def __reduce__(self):
        # Between processes only the buffer goes through shared memory; the small fields travel
        # inside the pickle. Each shared tensor costs the receiver (the decode thread) a socket
        # connection to the worker to fetch its file descriptor: receiving a batch of 64 took
        # 6.2 ms with seven of them and 3.4 ms with one (2-core box; on the H200 the change was
        # within the noise of train.py's throughput).
        return _unpickle_packed, (self.buffer, *(field.numpy() for field in self[1:]))


def _unpickle_packed(buffer, *small):
    return Packed(buffer, *(torch.from_numpy(field) for field in small))


def _empty_buffer(size):
    """A uint8 tensor; inside a loader worker in shared memory already, as default_collate does,
    so the queue does not copy the batch's bytes a second time."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(size, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).new(storage)


def pack_bytes(batch):
    """collate_fn for ByteSamples: a list of samples -> Packed."""
    payloads = [sample[0] for sample in batch]
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum([len(payload) for payload in payloads], out=offsets[1:])
    buffer = _empty_buffer(int(offsets[-1]))
    if len(buffer):
        np.concatenate(payloads, out=buffer.numpy())
    return Packed(buffer, torch.from_numpy(offsets),
                  torch.tensor([(sample[4], sample[5]) for sample in batch], dtype=torch.int64),
                  torch.tensor([sample[6] for sample in batch], dtype=torch.bool),
                  torch.tensor([sample[2] for sample in batch], dtype=torch.float64),
                  torch.tensor([sample[1] for sample in batch], dtype=torch.int64),
                  torch.tensor([sample[3] for sample in batch], dtype=torch.int64))


def unpack(buffer, offsets):
    """The payloads of a Packed buffer as uint8 tensors (views of the buffer, no copy)."""
    # One split call makes every view; slicing in a loop cost a host call per image while the
    # training loop waited for the GIL.
    return list(buffer[int(offsets[0]):int(offsets[-1])].split(offsets.diff().tolist()))


# ----------------------------------------------------------------------------- resampling

def _bilinear(x):
    return (1 - x.abs()).clamp_(min=0)


def _bicubic(x, a=-0.5):  # PIL's bicubic (a = -0.5), support 2
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


KERNELS = {"bilinear": _bilinear, "bicubic": _bicubic}


SUPPORT = {"bilinear": 1, "bicubic": 2, "nearest": 0}  # kernel half-width in source pixels at scale 1


def axis_weights(start, length, size, clip, reach, interpolation, flip=None):
    """Per image and output sample the source taps and their weights: (taps, weights), both
    (n, size, 2 * reach + 1), resampling [start, start+length) of each row onto size samples.

    PIL's coefficients (Resample.c precompute_coeffs): output i is centred at
    start + (i + 0.5) * scale; when downscaling the kernel is stretched by scale (antialiasing);
    taps are limited to [0, clip) and renormalised, so a row with no tap is 0 (CenterCrop's
    zero padding). nearest takes the tap at floor(centre), as PIL's nearest resize does. Only the
    taps within reach of floor(centre) are listed (reach from axis_reach), a few per output where a
    dense row would hold the whole span. flip: bool (n,) mirroring the outputs of those images.
    start, length, clip: float64 (n,) tensors on the device the weights are wanted on.
    """
    # Centres in float64 (n x size, tiny) so a centre that is an exact integer stays one; the taps'
    # offsets from floor(centre) are then small integers, exact in float32.
    scale = (length.double() / size)[:, None, None]
    centres = start.double()[:, None, None] + (torch.arange(size, device=start.device, dtype=torch.float64)
                                                [None, :, None] + 0.5) * scale
    base = centres.floor()
    relative = torch.arange(-reach, reach + 1, device=start.device)[None, None, :]
    taps = base.long() + relative
    inside = (taps >= 0) & (taps < clip[:, None, None])
    if interpolation == "nearest":
        # PIL takes floor(centre) too, but accumulates centre += scale in double, so where the
        # centre is an exact integer it may land one pixel lower: a rare column or row differs.
        weights = ((relative == 0) & inside).float()
    else:
        offsets = relative.float() + 0.5 - (centres - base).float()
        weights = KERNELS[interpolation](offsets / scale.clamp(min=1).float()) * inside
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total != 0, weights / total.where(total != 0, torch.ones_like(total)), 0.0)
    if flip is not None:
        mirrored = flip[:, None, None]
        taps, weights = torch.where(mirrored, taps.flip(1), taps), torch.where(mirrored, weights.flip(1), weights)
    return taps, weights


def axis_reach(lengths, size, interpolation):
    """Taps either side of floor(centre) that can carry weight, for the longest of lengths (host
    floats): the kernel's support stretched by the downscale, plus one for rounding."""
    return SUPPORT[interpolation] * math.ceil(max(1.0, max(lengths) / size)) + 1


def dense_weights(taps, weights, span, dtype):
    """(n, size, span) contiguous matrix in dtype from axis_weights' taps and weights: zeros but
    for the taps. span must exceed every image's clip, so the last column is beyond them all:
    taps outside [0, span) carry weight 0 and go there, and every position a weight reaches is
    written by exactly one tap (scatter_'s duplicates only ever write zeros)."""
    taps = torch.where((taps >= 0) & (taps < span), taps, span - 1)
    matrix = torch.zeros(*taps.shape[:2], span, dtype=dtype, device=taps.device)
    return matrix.scatter_(2, taps, weights.to(dtype))


def _gemm_span(length):
    """A canvas side for regions up to length: one more (dense_weights' spare column), rounded up
    to a multiple of 8 so the half-precision matmuls get aligned leading dimensions (unaligned
    ones fall back to slow kernels: the H200 profile showed sm75 "align1" GEMMs)."""
    return -(-(length + 1) // 8) * 8


def to_device(tensor, device):
    """A small CPU tensor on device: on CUDA through pinned memory, so the copy is queued like a
    kernel instead of first waiting for the stream's queued work, as a copy from pageable memory
    does (the resampling thread's host time)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _regions(boxes, shapes, train):
    """Per image the pixels the kernels may read: the crop box itself for training (torchvision
    crops, then resizes), the whole image for validation (resize, then crop); cut to the image."""
    if not train:
        return [(0, 0, h, w) for h, w in shapes.tolist()]
    return [(int(t), int(l), min(int(h), full_h - int(t)), min(int(w), full_w - int(l)))
            for (t, l, h, w), (full_h, full_w) in zip(boxes[:, :4].tolist(), shapes.tolist())]


def _chunks(regions, budget):
    """Image indices grouped so no group's padded canvas exceeds budget pixels (smallest first)."""
    order = sorted(range(len(regions)), key=lambda i: regions[i][2] * regions[i][3])
    groups, group, tall, wide = [], [], 0, 0
    for i in order:
        h, w = regions[i][2:]
        if group and (len(group) + 1) * max(tall, h) * max(wide, w) > budget:
            groups.append(group)
            group, tall, wide = [], 0, 0
        group.append(i)
        tall, wide = max(tall, h), max(wide, w)
    return groups + [group] if group else groups


def resample_chunks(pictures, boxes, shapes, size, train=True, interpolation="bilinear",
                    dtype=torch.float32, budget=CANVAS_BUDGET):
    """resample_batch before its last touches: per chunk (its batch indices, their images
    (k, 3, size, size) in dtype, not yet rounded; a view of a contiguous (k, size, 3, size))."""
    regions = _regions(boxes, shapes, train)
    return [(group, _resample_chunk([pictures[i] for i in group], boxes[group], [regions[i] for i in group],
                                    size, interpolation, dtype))
            for group in _chunks(regions, budget)]


def resample_batch(pictures, boxes, shapes, size, train=True, interpolation="bilinear",
                   dtype=torch.float32, budget=CANVAS_BUDGET):
    """Crop every picture (uint8 CHW, any size, one device) to its box, resize to size x size,
    flip where the box says; returns (n, 3, size, size) in dtype, rounded to integers 0..255 as
    the uint8 images of the cpu backend are. boxes: float64 (n, 5) CPU; shapes: int64 (n, 2) CPU.
    """
    device = pictures[0].device
    chunks = resample_chunks(pictures, boxes, shapes, size, train, interpolation, dtype, budget)
    order = [i for group, _ in chunks for i in group]
    out = torch.cat([images for _, images in chunks]) if len(chunks) > 1 else chunks[0][1]
    if order != sorted(order):  # back to batch order (index_select: deterministic on CUDA)
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        out = out.index_select(0, to_device(inverse, device))
    return out.round_().clamp_(0, 255)


def _canvas(pictures, regions, tall, wide, dtype):
    """(n, tall, 3, wide) in dtype holding each picture's region (top, left, h, w) at the top left
    of its slot; what lies beyond the region is finite and never counts (zero weights). On CUDA
    one Triton kernel (utils/canvas_kernel.py) where Triton is installed, else torch ops."""
    kernel = _canvas_kernel() if pictures[0].is_cuda else None
    if kernel is not None:
        table = to_device(kernel.region_table(pictures, regions), pictures[0].device)
        return kernel.region_canvas(table, tall, wide, dtype)
    return _torch_canvas(pictures, regions, tall, wide, dtype)


@functools.cache
def _canvas_kernel():
    """utils.canvas_kernel, or None on torch builds without Triton: looked up once, not on every
    chunk of every batch (a failed import searches the path again each time)."""
    try:
        from . import canvas_kernel
    except ImportError:
        return None
    return canvas_kernel


def _torch_canvas(pictures, regions, tall, wide, dtype):
    """_canvas in torch ops: row y of channel c of image k holds wide source pixels from
    row top + y, column left of its picture. Inside each region (top, left, h, w) that is the
    region itself; beyond it (rows past h repeat row h - 1, columns past w run on into the
    picture's memory) it is whatever finite bytes lie there: the resampling weights are zero
    outside the region, so they never count. Built by one cat of the pictures and one row gather
    from a sliding view, so the index is a small (n, tall, 3) tensor; copying region by region
    launched a few kernels per picture and computing a per-pixel index cost several passes over
    the canvas (both measured on the H200)."""
    device = pictures[0].device
    # Each picture flattened in CHW order, whatever its strides, and room for the last rows'
    # overrun, in one call and one copy (a cat of the flattened pictures copied them all again:
    # an eighth of the resampling's kernel time on the H200).
    flat = _flatten_dense_tensors([*pictures, torch.zeros(wide, dtype=torch.uint8, device=device)])
    sizes = torch.tensor([p.numel() for p in pictures], dtype=torch.int64)
    meta = torch.tensor([[p.shape[1], p.shape[2], top, left, h] for p, (top, left, h, w) in zip(pictures, regions)],
                        dtype=torch.int64)
    meta = torch.cat([(sizes.cumsum(0) - sizes)[:, None], meta], 1).to(device)
    start, full_h, full_w, top, left, h = (column.view(-1, 1, 1) for column in meta.unbind(1))
    ys = torch.minimum(torch.arange(tall, device=device).view(1, tall, 1), h - 1)
    channels = torch.arange(3, device=device).view(1, 1, 3)
    row_starts = start + channels * full_h * full_w + (top + ys) * full_w + left  # (n, tall, 3)
    rows = flat.unfold(0, wide, 1).index_select(0, row_starts.view(-1))
    return rows.view(len(pictures), tall, 3, wide).to(dtype)


def _resample_chunk(pictures, boxes, regions, size, interpolation, dtype):
    """Two batched matmuls: (size x tall row weights) @ canvas (tall x 3*wide), then the three
    channels' rows @ (wide x size column weights). Returns (n, 3, size, size) in dtype."""
    device = pictures[0].device
    n, tall, wide = len(pictures), _gemm_span(max(r[2] for r in regions)), _gemm_span(max(r[3] for r in regions))
    canvas = _canvas(pictures, regions, tall, wide, dtype).view(n, tall, 3 * wide)
    local = boxes.clone()
    local[:, 0] -= torch.tensor([r[0] for r in regions], dtype=torch.float64)
    local[:, 1] -= torch.tensor([r[1] for r in regions], dtype=torch.float64)
    clips = torch.tensor([r[2:] for r in regions], dtype=torch.float64)
    reach_rows = axis_reach(local[:, 2].tolist(), size, interpolation)
    reach_cols = axis_reach(local[:, 3].tolist(), size, interpolation)
    local, clips = to_device(torch.cat([local, clips], 1), device).split([5, 2], 1)  # float64: edges stay exact
    rows = dense_weights(*axis_weights(local[:, 0], local[:, 2], size, clips[:, 0], reach_rows, interpolation),
                         tall, dtype)
    cols = dense_weights(*axis_weights(local[:, 1], local[:, 3], size, clips[:, 1], reach_cols, interpolation,
                                       flip=local[:, 4] > 0.5), wide, dtype)  # hflip: mirrored output columns
    out = torch.bmm(rows, canvas).view(n, size * 3, wide)  # (n, size rows, 3, wide)
    out = torch.bmm(out, cols.transpose(1, 2))  # (n, size rows x 3, size columns)
    return out.view(n, size, 3, size).permute(0, 2, 1, 3)


def reference_crop(picture, box, size, train=True, interpolation="bilinear"):
    """One image through torchvision's tensor transforms (antialiased): the per-image path the
    batched resample_batch is checked against. Returns uint8 (3, size, size)."""
    top, left, height, width, flip = box
    mode = InterpolationMode(interpolation)
    if train:
        out = F.resized_crop(picture, int(top), int(left), int(height), int(width), [size, size],
                             interpolation=mode, antialias=True)
    else:
        full_h, full_w = picture.shape[-2:]
        new_h, new_w = round(full_h * size / height), round(full_w * size / width)
        out = F.resize(picture, [new_h, new_w], interpolation=mode, antialias=True)
        out = F.crop(out, round(top * new_h / full_h), round(left * new_w / full_w), size, size)
    return F.hflip(out) if flip else out


# ----------------------------------------------------------------------------- JPEG decoders

JPEG_DECODERS = ("auto", "cuda", "hardware")
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


# ----------------------------------------------------------------------------- main-process side

class GpuBatchDecoder:
    """Packed batch -> (images float (n, 3, S, S) normalised, channels_last if asked; targets int64).

    device cuda: nvJPEG (torchvision.io.decode_jpeg on a list) for the JPEG payloads, fp16
    resampling matmuls; device cpu: the same with torchvision's CPU decoder and fp32 (the tests).
    name_of(index) names a dataset file in errors; cpu_fallback(bytes, name) -> HWC uint8 decodes
    a file nvJPEG refused although its header looked fine. train selects where the resampling
    kernels stop: at the crop box (train: crop, then resize) or at the image edge (val: resize,
    then centre crop; give it utils.crops.CenterBoxes boxes).
    """

    def __init__(self, device, image_size, mean, std, channels_last=False, cpu_fallback=pil_rgb,
                 name_of=str, interpolation="bilinear", train=True, jpeg_decoder="cuda"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.size, self.train, self.interpolation = image_size, train, interpolation
        self.cpu_fallback, self.name_of = cpu_fallback, name_of
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # fp16 holds 0..255 exactly and halves the canvas traffic; the CPU has no fast fp16 matmul.
        self.dtype = torch.float16 if self.cuda else torch.float32
        self.mean = torch.tensor([m * 255 for m in mean], device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in std], device=self.device).view(1, 3, 1, 1)
        # High priority: the decode path's few small kernels are then not queued behind a whole
        # training step's, so the next batch is ready when the step ends.
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        # JPEG decode has a stream of its own, so a batch's decode and the previous batch's
        # resampling can run from two threads at once (GpuBatches).
        self.decode_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.hardware = HardwareJpeg(self.device) if self.cuda and jpeg_decoder == "hardware" else None
        self.in_use = []  # the pictures the resampling stream may still be reading (resample)
        self.canvas_budget = CANVAS_BUDGET  # pixels one chunk's canvas may hold (_chunks)

    def __call__(self, packed):
        return self.resample(*self.decode_stage(packed))

    def decode_stage(self, packed):
        """First half: the batch's pictures decoded on the decode stream. Returns (packed,
        pictures, ready): ready is an event after the decode (None on the CPU)."""
        if not self.cuda:
            return packed, self.decode(packed), None
        # Stream ordering, pytorch/vision#9606: decode_jpeg(device="cuda") allocates its outputs
        # on the current stream, then lets nvJPEG write them from a private stream that does not
        # wait for that stream, so a block freed there while queued kernels still read it can be
        # overwritten. We therefore decode on a stream of our own and synchronise it first (the
        # only work queued on it is the previous decode's copies; decode_jpeg blocks the host
        # anyway, so the wait costs nothing); the kernels that read the pictures run on another
        # stream, and the pictures stay referenced until that stream is done with them (resample),
        # so no block they still read is handed out again. The training stream is never
        # host-synchronised.
        with torch.cuda.stream(self.decode_stream):
            self.decode_stream.synchronize()
            pictures = self.decode(packed)
            ready = torch.cuda.Event()
            ready.record(self.decode_stream)
        return packed, pictures, ready

    def resample(self, packed, pictures, ready):
        """Second half: crop, resize, flip, normalise on the resampling stream; returns (images,
        targets), ordered before later work on the stream current at the call (hand_over)."""
        return self.hand_over(self.resample_ahead(packed, pictures, ready))

    def resample_ahead(self, packed, pictures, ready):
        """resample, leaving the order with the consumer's stream to hand_over: (images, targets,
        done), done an event after their kernels (None on the CPU).

        A decode thread works batches ahead of the step. Had it made the consumer's stream wait
        here, that wait would land in the stream's queue wherever the training loop happened to
        be, mid-way through an earlier step, and hold that step's later kernels until this
        batch's resampling had run. hand_over, in the consumer's thread when it takes the batch,
        puts the wait just before the first step that reads it."""
        if not self.cuda:
            return (*self._finish(packed, pictures), None)
        with torch.cuda.stream(self.stream):
            self.stream.synchronize()  # the previous batch's resampling: bounds what is queued
            # The pictures were allocated on the decode stream and are read on this one. Rather than
            # a record_stream per picture (hundreds of host calls a batch, each taking the GIL
            # from the training loop), the batch is kept referenced until the synchronize above,
            # in the next call, has seen its resampling finish.
            self.in_use = pictures
            self.stream.wait_event(ready)
            images, targets = self._finish(packed, pictures)
            done = torch.cuda.Event()
            done.record(self.stream)
        return images, targets, done

    @staticmethod
    def hand_over(staged):
        """(images, targets, done) from resample_ahead -> (images, targets), ordered before later
        work on the calling thread's current stream (the step's), with record_stream keeping our
        allocator from reusing their memory until that stream is done with them."""
        images, targets, done = staged
        if done is not None:
            consumer = torch.cuda.current_stream(images.device)
            consumer.wait_event(done)
            images.record_stream(consumer)
            targets.record_stream(consumer)
        return images, targets

    def _finish(self, packed, pictures):
        kernels = _canvas_kernel() if self.cuda else None
        if kernels is None:
            pixels = resample_batch(pictures, packed.boxes, packed.shapes, self.size, self.train,
                                    self.interpolation, self.dtype, self.canvas_budget)
            images = pixels.float().contiguous(memory_format=self.memory_format)
            images.sub_(self.mean).div_(self.std)
        else:
            # One pass per chunk rounds, clamps, normalises and writes each image at its place in
            # the batch and layout; the torch ops above take seven passes over the batch (a cat,
            # the reordering, round, clamp, the fp32 channels_last copy, sub, div).
            images = torch.empty(len(pictures), 3, self.size, self.size, device=self.device,
                                 memory_format=self.memory_format)
            for group, chunk in resample_chunks(pictures, packed.boxes, packed.shapes, self.size, self.train,
                                                self.interpolation, self.dtype, self.canvas_budget):
                kernels.normalise_into(images, chunk, to_device(torch.tensor(group), self.device), self.mean,
                                       self.std)
        return images, packed.labels.to(self.device, non_blocking=True)

    def decode(self, packed):
        """The batch's images as uint8 CHW tensors on the device, in batch order."""
        payloads = unpack(packed.buffer, packed.offsets)
        raw, shapes = packed.raw.tolist(), packed.shapes.tolist()
        pictures = [None] * len(payloads)
        jpegs = [i for i, is_raw in enumerate(raw) if not is_raw]
        if jpegs:
            decoded = self._decode_jpegs([payloads[i] for i in jpegs], packed.indices[jpegs].tolist(),
                                         [shapes[i] for i in jpegs])
            for i, picture in zip(jpegs, decoded):
                pictures[i] = picture
        by_pil = [i for i, is_raw in enumerate(raw) if is_raw]  # the workers' PIL pixels
        if by_pil:
            # One copy for all of them: a copy per image from the loader's memory is a host call
            # (and a wait) each.
            parts = [payloads[i] for i in by_pil]
            on_device = torch.cat(parts).to(self.device, non_blocking=True).split([len(part) for part in parts])
            for i, pixels in zip(by_pil, on_device):
                height, width = shapes[i]
                pictures[i] = pixels.view(height, width, 3).permute(2, 0, 1)
        return pictures

    def _decode_jpegs(self, payloads, indices, shapes):
        if self.hardware is None:
            return self._nvjpeg(payloads, indices)
        pictures = self.hardware(payloads, self.decode_stream, shapes)
        refused = [k for k, picture in enumerate(pictures) if picture is None]
        if refused:  # the engines take baseline 4:2:0/4:2:2/4:4:4 files; nvJPEG or PIL the rest
            again = self._nvjpeg([payloads[k] for k in refused], [indices[k] for k in refused])
            for k, picture in zip(refused, again):
                pictures[k] = picture
        return pictures

    def _nvjpeg(self, payloads, indices):
        try:
            return decode_jpeg(payloads, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            # One file the decoder refuses fails the whole batched call: retry one by one, and give
            # the refused ones to the CPU decoder (which raises the UsageError if PIL cannot either).
            return [self._decode_one(payload, index) for payload, index in zip(payloads, indices)]

    def _decode_one(self, payload, index):
        try:
            return decode_jpeg(payload, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pixels = self.cpu_fallback(payload.numpy().tobytes(), self.name_of(index))
            return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).to(self.device)


class GpuBatches:
    """A loader of Packed batches seen through a GpuBatchDecoder: len() and (images, targets),
    the contract utils.batches.DevicePrefetcher offers.

    On CUDA two threads work ahead of the training loop: one decodes (decode_jpeg holds its
    thread until nvJPEG is done, tens of ms a batch, and torchvision lets one decode run at a
    time), the other crops and resizes the batch decoded before, AHEAD batches ahead of the step.
    In the main thread that time would be taken from launching the training step; torch ops
    release the GIL, so the threads overlap. Order on the device is kept by streams: as the
    training loop takes a batch, its current stream (the step's) is made to wait for the event
    after that batch's resampling (GpuBatchDecoder.hand_over, in the loop's thread), so the step
    queued next reads finished pixels and no earlier step waits for them. An error in a thread
    (a corrupt file: UsageError) is raised again in the training loop. threads: 2 as above, 1 for
    one thread doing both halves, 0 for none (all in the caller's); default 2 on CUDA, 0 on the
    CPU (tools/decode_overlap.py compares them).
    """

    AHEAD = 2

    def __init__(self, loader, decoder, threads=None):
        self.loader, self.decoder = loader, decoder
        self.threads = (2 if decoder.cuda else 0) if threads is None else threads

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        # iter(loader) here, in the caller's thread: a DataLoader forks its workers on its first
        # iteration, and that must not happen in a decode thread beside other CUDA work
        packed_batches = iter(self.loader)
        if self.threads == 0:
            return (self.decoder(packed) for packed in packed_batches)
        decoder = self.decoder
        if self.threads == 1:
            return WorkAhead(packed_batches, lambda packed: decoder.resample_ahead(*decoder.decode_stage(packed)),
                             self.AHEAD, decoder.hand_over)
        decoded = WorkAhead(packed_batches, decoder.decode_stage, 1)
        return WorkAhead(decoded, lambda staged: decoder.resample_ahead(*staged), self.AHEAD, decoder.hand_over)


class WorkAhead:
    """decode(item) for the loader's items, computed in a thread up to depth items ahead, each
    passed through hand_over (if given) in the thread that takes it. The thread starts at
    construction, so creating one starts the work (train.py starts the next epoch's batches
    before validating). close() stops the thread and waits for it; closing a later stage closes
    the stage it reads from."""

    _DONE = object()

    def __init__(self, loader, decode, depth, hand_over=None):
        self._hand_over = hand_over
        self._results = results = queue.Queue(maxsize=depth)
        self._stop = stop = threading.Event()
        done = self._DONE

        def work():  # a closure, not a method: the thread must not keep self alive (__del__)
            try:
                for item in loader:
                    if stop.is_set():
                        return
                    results.put((decode(item), None))
            except BaseException as err:  # handed to the consumer, raised there
                results.put((None, err))
                return
            finally:
                close = getattr(loader, "close", None)
                if close is not None:  # a WorkAhead stage before this one: stop its thread here
                    close()
            results.put((done, None))

        self._thread = threading.Thread(target=work, name="gpu-decode", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        value, err = self._results.get()
        if err is not None:
            self.close()
            raise err
        if value is self._DONE:
            self.close()
            raise StopIteration
        return value if self._hand_over is None else self._hand_over(value)

    def close(self):
        self._stop.set()
        while self._thread.is_alive():  # let the worker see the flag, emptying what it still puts
            try:
                self._results.get(timeout=0.1)
            except queue.Empty:
                pass

    def __del__(self):  # dropped unfinished: let the thread see the flag and end, without waiting here
        self._stop.set()
        try:
            while True:  # room for the put it may be blocked in
                self._results.get_nowait()
        except Exception:  # queue.Empty, or anything at interpreter exit
            pass
