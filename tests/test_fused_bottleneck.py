"""bench/fused_bottleneck.py: the fused Bottleneck's decomposition (forward statistics, finalize,
the hand-written backward) gives eager's training step, checked here with every piece in torch; on
CUDA the same run times the cuDNN graphs (GPU-marked)."""
import copy

import pytest
import torch

from bench.fused_bottleneck import FusedBottleneck, Kernels, Pieces, check_block, resnet50_blocks

CL = torch.channels_last


@pytest.mark.parametrize("name", ["layer1.0", "layer2.0", "layer3.1"])
def test_the_decomposed_step_matches_eager_in_fp32(name):
    """Output, input gradient, every parameter gradient and the running statistics (the block with
    a downsample branch, a strided one, a plain one) within fp32 rounding of eager's."""
    torch.manual_seed(0)
    _, plain, shape, _ = next(row for row in resnet50_blocks(32) if row[0] == name)
    x = torch.relu(torch.randn(3, *shape)).contiguous(memory_format=CL)
    (label, errors, _), = check_block(name, plain, x, Pieces("cpu"), Kernels("cpu"), torch.float32,
                                      use_autocast=False)
    assert label == "fused" and max(errors.values()) < 1e-4, errors


def test_the_fused_block_keeps_the_plain_blocks_state_dict_and_evaluates_as_it():
    _, plain, shape, _ = resnet50_blocks(32)[0]
    fused = FusedBottleneck(copy.deepcopy(plain), Pieces("cpu"), Kernels("cpu"), torch.float32)
    assert [key.removeprefix("plain.") for key in fused.state_dict()] == list(plain.state_dict())
    x = torch.randn(2, *shape)
    assert torch.equal(fused.eval()(x), copy.deepcopy(plain).eval()(x))


def test_a_wrong_backward_is_caught():
    """The check can fail: a fused step whose conv2 weight gradient is off by 1 % is reported."""
    torch.manual_seed(0)
    _, plain, shape, _ = resnet50_blocks(32)[2]
    pieces = Pieces("cpu")
    wgrad = pieces.wgrad
    pieces.wgrad = lambda x, dy, w_shape, *rest: wgrad(x, dy, w_shape, *rest) * (1.01 if w_shape[2] == 3 else 1)
    x = torch.relu(torch.randn(3, *shape)).contiguous(memory_format=CL)
    (_, errors, worst), = check_block("layer2.0", plain, x, pieces, Kernels("cpu"), torch.float32,
                                      use_autocast=False)
    assert errors["dparams"] > 5e-3 and worst == "conv2.weight"


@pytest.mark.gpu
def test_the_fused_block_on_cuda_is_within_autocasts_error():
    """fp16 NHWC on the GPU (cuDNN graphs where cuDNN takes them): the fused step's error against
    fp32 eager stays within 3x autocast's own (and under 2 %), for every quantity."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    _, plain, shape, _ = resnet50_blocks(224)[2]
    x = torch.relu(torch.randn(32, *shape, device="cuda")).half().contiguous(memory_format=CL)
    rows = dict((label, errors) for label, errors, _ in
                check_block("layer2.0", plain.cuda(), x, Pieces("cuda"), Kernels("cuda"), torch.float16,
                            use_autocast=True))
    for key, fused_error in rows["fused"].items():
        assert fused_error < max(3 * rows["autocast"][key], 1e-3) and fused_error < 2e-2, (key, rows)
