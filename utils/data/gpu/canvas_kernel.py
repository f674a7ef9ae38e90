"""The resampling's Triton kernels on CUDA: the canvas (what utils/data/gpu/resample.py's
_torch_canvas builds in torch ops) and the last pass that rounds, normalises and places each image
(normalise_into).

Each program copies a tile of one channel of one picture's crop region, read straight from the
picture's own memory (its address and strides come in a small table), into the fp16 canvas, and
writes zeros beyond the region. The torch path first copies every picture whole into one flat
buffer, then gathers the region rows, then converts them to fp16: three passes over the pixels
and ~1 ms of kernels a batch on the H200, where this kernel reads only the regions once.
Imported only on CUDA (Triton comes with torch's CUDA builds); TRITON_INTERPRET=1 runs the same
kernel on CPU tensors, which is how the tests check it without a GPU.
"""
import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLUMNS = 8, 128


@triton.jit(do_not_specialize=["tall", "wide"])  # one compiled kernel for every canvas size
def _copy_regions(table, out, tall, wide, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    picture = tl.program_id(0) // 3
    channel = tl.program_id(0) % 3
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    columns = tl.program_id(2) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)[None, :]
    entry = table + picture * 8  # address, top, left, height, width, channel / row / column strides
    source = tl.load(entry).to(tl.pointer_type(tl.uint8))
    top, left = tl.load(entry + 1), tl.load(entry + 2)
    height, width = tl.load(entry + 3), tl.load(entry + 4)
    stride_channel, stride_row, stride_column = tl.load(entry + 5), tl.load(entry + 6), tl.load(entry + 7)
    inside = (rows < height) & (columns < width)
    pixels = tl.load(source + channel * stride_channel + (top + rows) * stride_row + (left + columns) * stride_column,
                     mask=inside, other=0)
    target = out + ((picture * tall + rows) * 3 + channel).to(tl.int64) * wide + columns
    tl.store(target, pixels.to(out.dtype.element_ty), mask=(rows < tall) & (columns < wide))


def region_table(pictures, regions):
    """The kernel's table, int64 on the CPU: a row per picture (uint8 CHW tensors, any strides)
    with its address, its region (top, left, h, w) and its strides."""
    return torch.tensor([[picture.data_ptr(), top, left, h, w, *picture.stride()]
                         for picture, (top, left, h, w) in zip(pictures, regions)], dtype=torch.int64)


def region_canvas(table, tall, wide, dtype):
    """(n, tall, 3, wide) in dtype on the table's device: each picture's region at the top left of
    its slot, zeros elsewhere. table: region_table's, moved to the pictures' device (the caller
    keeps the pictures alive until the kernel has run)."""
    out = torch.empty(len(table), tall, 3, wide, dtype=dtype, device=table.device)
    grid = (3 * len(table), triton.cdiv(tall, BLOCK_ROWS), triton.cdiv(wide, BLOCK_COLUMNS))
    _copy_regions[grid](table, out, tall, wide, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLUMNS=BLOCK_COLUMNS)
    return out


@triton.jit(do_not_specialize=["size"])
def _normalise_into(source, positions, out, mean, std, size, stride_image, stride_channel, stride_row,
                    stride_column, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    image = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    columns = tl.arange(0, BLOCK_COLUMNS)[None, :]
    inside = (rows < size) & (columns < size)
    target = out + tl.load(positions + image) * stride_image + rows * stride_row + columns * stride_column
    for channel in tl.static_range(3):
        pixels = tl.load(source + ((image * size + rows) * 3 + channel).to(tl.int64) * size + columns, mask=inside,
                         other=0.0).to(tl.float32)
        # Round half to even as torch.round does: adding 1.5 * 2**23 leaves no fraction bits in
        # float32, so the sum rounds to an integer (exact for |x| < 2**22; these are 0..255 give
        # or take the resampling's overshoot).
        pixels = tl.minimum(tl.maximum((pixels + 12582912.0) - 12582912.0, 0.0), 255.0)
        # div_rn: IEEE division as torch's div_ does; Triton's `/` is approximate (2 ulp) on NVIDIA.
        tl.store(target + channel * stride_channel, tl.math.div_rn(pixels - tl.load(mean + channel),
                                                                   tl.load(std + channel)), mask=inside)


def normalise_into(out, chunk, positions, mean, std):
    """out[positions[k]] = (clamp(round(chunk[k]), 0, 255) - mean) / std for each image k of the
    chunk, per channel: the float32 batch out (n, 3, size, size, any strides, e.g. channels_last)
    filled chunk by chunk. chunk: (k, 3, size, size), a view of a contiguous (k, size, 3, size)
    (the resampling's matmul layout); positions: int64 (k,), mean and std: 3 float32 values, all
    on out's device."""
    rows_first = chunk.permute(0, 2, 1, 3)
    assert rows_first.is_contiguous() and out.dtype == torch.float32
    size = chunk.shape[-1]
    grid = (len(chunk), triton.cdiv(size, BLOCK_ROWS))
    _normalise_into[grid](rows_first, positions, out, mean.reshape(3).contiguous(), std.reshape(3).contiguous(),
                          size, *out.stride(), BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLUMNS=triton.next_power_of_2(size))
