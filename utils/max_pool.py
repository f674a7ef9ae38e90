"""nn.MaxPool2d with a backward that torch.compile turns into one gather kernel.

Inductor's own max-pool backward (torch 2.11) recomputes each window's maximum from the saved
input for every window an input element lies in, and took 1.52 ms of ResNet-50's 42.5 ms training
step at batch 256 on an H100, for a tensor whose gradient is 0.4 GB (docs/speed.md). Here the
forward keeps, per output, where in its window the maximum was (one int8, 0 .. kh*kw-1), and the
backward gives each input element the sum of the gradients of the windows that picked it: at
most ceil(kh/sh) x ceil(kw/sw) windows (4 for ResNet's 3x3, stride 2), looked up by index
arithmetic alone, so inductor fuses it, with the ReLU's backward, into one pointwise kernel
written in the input's memory format. The values are nn.MaxPool2d's; the sum over windows is
taken in fp32, in a fixed order.

compile_model (utils/compiled.py) swaps it in on CUDA; it has no state, so checkpoints do not
change. Eager code keeps nn.MaxPool2d: this backward is only quick once compiled.
"""
import torch


def _pair(value):
    return list(value) if isinstance(value, (tuple, list)) else [value, value]


def window_offsets(indices, width, kernel_size, stride, padding):
    """Where each output's maximum sits inside its window (row-major, int8), from max_pool2d's
    flat input indices (row x width + column of the input plane)."""
    out_row = torch.arange(indices.shape[-2], device=indices.device).view(-1, 1)
    out_col = torch.arange(indices.shape[-1], device=indices.device)
    row = torch.div(indices, width, rounding_mode="floor") + padding[0] - stride[0] * out_row
    col = indices % width + padding[1] - stride[1] * out_col
    return (row * kernel_size[1] + col).to(torch.int8)


def _covering_windows(size, out_size, kernel, stride, padding, device):
    """Along one dimension, for each input position: the windows that may hold it, each as
    (window index clamped into range, the position's place inside it, whether it is real)."""
    position = torch.arange(size, device=device)
    last = torch.div(position + padding, stride, rounding_mode="floor")  # the last window starting at or before
    windows = []
    for back in range(-(-kernel // stride)):
        window = last - back
        inside = position + padding - stride * window
        real = (window >= 0) & (window < out_size) & (inside < kernel)
        windows.append((window.clamp(0, out_size - 1), inside, real))
    return windows


def max_pool2d_backward(grad, offsets, input_shape, channels_last, kernel_size, stride, padding):
    """The input's gradient: for each input element, the sum of grad over the windows whose
    maximum it was (offsets from window_offsets). Shaped input_shape, in the input's layout."""
    rows = _covering_windows(input_shape[2], grad.shape[2], kernel_size[0], stride[0], padding[0], grad.device)
    cols = _covering_windows(input_shape[3], grad.shape[3], kernel_size[1], stride[1], padding[1], grad.device)
    if channels_last:  # gathered in (n, h, w, c) order, the result is channels_last without a copy
        grad, offsets = grad.permute(0, 2, 3, 1), offsets.permute(0, 2, 3, 1)

        def at(row, col):
            return (slice(None), row[:, None], col[None, :])

        def per_plane(mask):  # an (h, w) mask against (n, h, w, c)
            return mask[:, :, None]
    else:
        def at(row, col):
            return (slice(None), slice(None), row[:, None], col[None, :])

        def per_plane(mask):
            return mask
    total = None
    for row, row_inside, row_real in rows:
        for col, col_inside, col_real in cols:
            picked = offsets[at(row, col)] == per_plane(row_inside[:, None] * kernel_size[1] + col_inside[None, :])
            picked &= per_plane(row_real[:, None] & col_real[None, :])
            term = torch.where(picked, grad[at(row, col)].float(), 0.0)
            total = term if total is None else total + term
    total = total.to(grad.dtype)
    return total.permute(0, 3, 1, 2) if channels_last else total


class _MaxPool2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding):
        out, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel_size, stride, padding)
        ctx.save_for_backward(window_offsets(indices, x.shape[3], kernel_size, stride, padding))
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        ctx.pool = (list(x.shape), channels_last, kernel_size, stride, padding)
        return out

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return max_pool2d_backward(grad, offsets, *ctx.pool), None, None, None


class GatherMaxPool2d(torch.nn.MaxPool2d):
    """nn.MaxPool2d (same arguments, no state) with the gather backward above. Pools it does not
    cover (dilation, ceil_mode, return_indices, a window over 127 elements, not 4-d) run as
    nn.MaxPool2d."""

    def covered(self, x):
        kernel = _pair(self.kernel_size)
        return (x.dim() == 4 and not self.return_indices and not self.ceil_mode
                and _pair(self.dilation) == [1, 1] and kernel[0] * kernel[1] <= 127)

    def forward(self, x):
        if not self.covered(x):
            return super().forward(x)
        return _MaxPool2dFunction.apply(x, _pair(self.kernel_size), _pair(self.stride), _pair(self.padding))


def use_gather_max_pool(model):
    """Every nn.MaxPool2d in model becomes a GatherMaxPool2d, in place (the same module object, so
    hooks and the parent's attribute stay). Returns how many."""
    swapped = 0
    for module in model.modules():
        if type(module) is torch.nn.MaxPool2d:
            module.__class__ = GatherMaxPool2d
            swapped += 1
    return swapped
