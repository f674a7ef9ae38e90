"""utils/max_pool.py's GatherMaxPool2d, which compile_model swaps in on CUDA: nn.MaxPool2d's values
and gradients in both memory formats and under torch.compile, no state, one fused backward kernel,
and swapped in only where it was measured."""
import copy
import re

import pytest
import torch
import torchvision

from utils.compiled import compile_model, plain_module
from utils.max_pool import GatherMaxPool2d, use_gather_max_pool

POOLS = [dict(kernel_size=3, stride=2, padding=1),  # ResNet's stem
         dict(kernel_size=2),  # stride None: the kernel size
         dict(kernel_size=3, stride=1, padding=1),  # windows overlapping three deep
         dict(kernel_size=3, stride=3),
         dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0))]


def output_and_input_grad(pool, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    out = pool(x)
    out.backward(grad_out)
    return out, x.grad


def relu_input(shape, memory_format, seed=0):
    """A ReLU output, as in ResNet's stem: many zeros, so windows with equal maxima (ties) abound."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).relu().to(memory_format=memory_format)


@pytest.mark.parametrize("arguments", POOLS)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_same_output_and_input_gradient_as_nn_max_pool(arguments, memory_format, compiled):
    x = relu_input((2, 5, 11, 12), memory_format)
    reference = torch.nn.MaxPool2d(**arguments)
    grad_out = torch.randn_like(reference(x))
    out_ref, grad_ref = output_and_input_grad(reference, x, grad_out)
    pool = GatherMaxPool2d(**arguments)
    if compiled:
        torch._dynamo.reset()
        pool = torch.compile(pool, dynamic=False)
    out, grad = output_and_input_grad(pool, x, grad_out)
    assert torch.equal(out, out_ref)
    # fp32 sums of the same terms, in another order where windows overlap
    torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-6)
    assert grad.shape == x.shape and grad.is_contiguous(memory_format=memory_format)


def test_a_wrong_window_offset_is_caught():
    """The comparison above can fail: gradients routed one place off inside the window differ."""
    from utils.max_pool import max_pool2d_backward, window_offsets
    x = relu_input((1, 2, 8, 8), torch.contiguous_format, seed=1)
    out, indices = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])
    offsets = window_offsets(indices, 8, [3, 3], [2, 2], [1, 1])
    grad = torch.ones_like(out)
    right = max_pool2d_backward(grad, offsets, list(x.shape), False, [3, 3], [2, 2], [1, 1])
    wrong = max_pool2d_backward(grad, (offsets + 1) % 9, list(x.shape), False, [3, 3], [2, 2], [1, 1])
    _, reference = output_and_input_grad(torch.nn.MaxPool2d(3, 2, 1), x, grad)
    assert torch.equal(right, reference) and not torch.equal(wrong, reference)


@pytest.mark.parametrize("arguments", [dict(kernel_size=3, stride=2, ceil_mode=True),
                                       dict(kernel_size=3, dilation=2), dict(kernel_size=2, return_indices=True)])
def test_pools_it_does_not_cover_run_as_nn_max_pool(arguments):
    x = relu_input((1, 2, 9, 9), torch.contiguous_format)
    pool = GatherMaxPool2d(**arguments)
    assert not pool.covered(x)
    out, out_ref = pool(x), torch.nn.MaxPool2d(**arguments)(x)
    for mine, theirs in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, out_ref))):
        assert torch.equal(mine, theirs)


def test_swap_keeps_the_modules_and_the_state_dict():
    model = torchvision.models.resnet18(num_classes=10)
    keys = list(model.state_dict())
    pool = model.maxpool
    assert use_gather_max_pool(model) == 1
    assert model.maxpool is pool and type(pool) is GatherMaxPool2d
    assert list(model.state_dict()) == keys
    assert use_gather_max_pool(model) == 0  # already swapped: nothing more to do
    assert pool.extra_repr() == torch.nn.MaxPool2d(3, 2, 1).extra_repr()  # the same arguments


def test_inductor_writes_the_stem_backward_as_one_kernel():
    """ReLU + max pool, channels_last, compiled: the backward is one fused kernel writing one
    buffer (the gradient, channels_last), where inductor's own takes a scatter or recomputes."""
    from torch._inductor.utils import run_and_get_code

    stem = torch.nn.Sequential(torch.nn.ReLU(), GatherMaxPool2d(3, 2, 1))
    x = torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last).requires_grad_(True)
    torch._dynamo.reset()
    compiled = torch.compile(stem, dynamic=False)
    out = compiled(x)
    _, codes = run_and_get_code(lambda: out.backward(torch.ones_like(out)))
    backward = codes[-1]
    calls = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)(?:\.run)?\(", backward, flags=re.M)
    assert len(calls) == 1, calls
    buffers = re.findall(r"empty_strided_cpu\((\(.*?\)), (\(.*?\))", backward)
    assert buffers == [("(2, 16, 16, 8)", "(2048, 128, 8, 1)")], buffers  # (n, h, w, c): channels_last


def test_compile_model_swaps_only_on_cuda():
    """Measured on CUDA only, so only done there: on the CPU the pool stays nn.MaxPool2d."""
    model = torchvision.models.resnet18(num_classes=10)
    compiled = compile_model(model, "inductor", lambda line: None)
    assert type(plain_module(compiled).maxpool) is torch.nn.MaxPool2d


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compiled_stem_on_cuda_matches_eager_nn_max_pool(dtype):
    """On CUDA compile_model swaps the pool in; ResNet-50's stem shape, compiled, channels_last,
    gives eager nn.MaxPool2d's output and input gradient."""
    stem = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)).cuda()
    x = relu_input((16, 64, 112, 112), torch.channels_last).to("cuda", dtype)
    grad_out = torch.randn(16, 64, 56, 56, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    out_ref, grad_ref = output_and_input_grad(copy.deepcopy(stem), x, grad_out)
    stem.register_parameter("on_cuda", torch.nn.Parameter(torch.zeros(1, device="cuda")))  # what compile_model checks
    torch._dynamo.reset()
    compiled = compile_model(stem, "inductor", lambda line: None)
    assert type(stem[1]) is GatherMaxPool2d
    out, grad = output_and_input_grad(compiled, x, grad_out)
    assert torch.equal(out, out_ref)
    tolerance = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, **tolerance)  # fp32 sums; eager adds in another order
    assert grad.is_contiguous(memory_format=torch.channels_last)
