"""Resampling on the device, separable and batched: per image and axis a (size x length) weight
matrix with PIL's kernels (bilinear/bicubic with antialiasing support scaling, nearest), so a
whole chunk of images is two batched matmuls over a zero-padded canvas. The weights are zero
outside each image's crop region, so the padding never leaks in, and a flip is the horizontal
matrix reversed."""
import functools
import math

import torch
from torch._utils import _flatten_dense_tensors

# Pixels a resampling chunk's canvas may hold (x3 channels, as uint8 and then fp16: 144 MiB). An
# ImageNet batch of 256 takes about three chunks of a few dozen kernels each; a
# smaller canvas keeps the decode stream's share of GPU memory down, and a few huge photos get
# chunks of their own instead of inflating one.
CANVAS_BUDGET = 2 ** 24


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
    one Triton kernel (utils/data/gpu/canvas_kernel.py) where Triton is installed, else torch ops."""
    kernel = _canvas_kernel() if pictures[0].is_cuda else None
    if kernel is not None:
        table = to_device(kernel.region_table(pictures, regions), pictures[0].device)
        return kernel.region_canvas(table, tall, wide, dtype)
    return _torch_canvas(pictures, regions, tall, wide, dtype)


@functools.cache
def _canvas_kernel():
    """utils.data.gpu.canvas_kernel, or None on torch builds without Triton: looked up once, not on every
    chunk of every batch (a failed import searches the path again each time)."""
    try:
        from utils.data.gpu import canvas_kernel
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
