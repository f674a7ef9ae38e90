#!/usr/bin/env python3
"""One torchvision Bottleneck's training step with BatchNorm fused into cuDNN's convolutions, against
the eager block and torch.compile of it: does the fusion MLPerf's ResNet-50 relies on pay here?

    python bench/fused_bottleneck.py                         # ResNet-50's bottlenecks, batch 256 (CUDA)
    python bench/fused_bottleneck.py --device cpu -b 4 --image-size 32 --check-only   # the maths alone

The fused block holds the Bottleneck's own parameters and buffers and runs it in fp16 NHWC:

    forward   conv1 with BN statistics (sum, sum of squares) in its epilogue; relu(bn1) applied in
              conv2's prologue, conv2 + statistics; the same into conv3; bn3 + residual + relu in
              one pointwise kernel. A BN's "finalize" (mean, 1/std, scale, bias, running statistics)
              is a tiny compiled kernel on C values. relu(bn) outputs are never written to memory.
    backward  relu + bn3 backward in one cuDNN graph; each conv's weight gradient with relu(bn) of its
              input recomputed in the wgrad's prologue; data gradients by cuDNN dgrad; relu(bn)
              backward (recomputing the forward, then the BN backward) as one cuDNN graph per BN.

Each piece is a cuDNN frontend graph (`pip install nvidia-cudnn-frontend`) where cuDNN supports it on
this GPU, else the same maths in torch; the report says which ran where. Without CUDA (or with
--no-cudnn) every piece runs in torch: that checks the decomposition's maths against the eager block.

Per block the tool prints: the fused block's errors next to autocast's, both against an fp32 eager
reference (output, input gradient, every parameter gradient, running statistics), and ms per
forward + backward for eager (autocast fp16, channels_last), torch.compile of it, and the fused block,
as wall time (CUDA events) and as the sum of its GPU kernels' durations (torch.profiler): the
latter is what the step would take with launch gaps removed (CUDA graphs), since the fused block's
Python dispatch is slower than a compiled graph's. A ResNet-50 total weights each block by how
many times the network repeats it.
"""
import argparse
import copy
import functools
import json
import os
import statistics
import sys
import tempfile
import traceback

import torch
import torch.nn.functional as F
import torchvision

try:
    import cudnn
except ImportError:  # the torch pieces still run
    cudnn = None

CL = torch.channels_last


def nhwc_stride(shape):
    """Element strides of a channels_last tensor of NCHW shape."""
    n, c, h, w = shape
    return [c * h * w, 1, w * c, c]


def first_line(err):
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:160]


def vec(t, c):
    """A per-channel vector as cuDNN and broadcasting both read it: shape (1, C, 1, 1)."""
    return t.reshape(1, c, 1, 1)


# --- the pieces: cuDNN graphs, and the same maths in torch ---------------------------------------

class Pieces:
    """Builds, caches and runs the cuDNN graphs; falls back to torch per (piece, shape) where cuDNN
    refuses a graph, and counts where each piece ran (report())."""

    def __init__(self, device, use_cudnn=True):
        self.use_cudnn = bool(use_cudnn and cudnn is not None and torch.device(device).type == "cuda")
        self.plans = {}
        self.where = {}  # piece -> {"cudnn": shapes built, "torch": shapes refused, "why": first refusal}
        self.handle = cudnn.create_handle() if self.use_cudnn else None
        self.workspace = torch.empty(0, dtype=torch.uint8, device=device)

    def report(self):
        parts = []
        for piece, seen in self.where.items():
            text = f"{piece}: cudnn {seen['cudnn']}, torch {seen['torch']}"
            parts.append(text + (f" (refused: {seen['why']})" if seen["why"] else ""))
        return "; ".join(parts) if parts else "every piece in torch (no cuDNN frontend or no CUDA)"

    def _plan(self, piece, key, build):
        if not self.use_cudnn:
            return None
        full = (piece,) + tuple(key)
        if full not in self.plans:
            seen = self.where.setdefault(piece, {"cudnn": 0, "torch": 0, "why": ""})
            plan = None
            for intermediate in (cudnn.data_type.HALF, cudnn.data_type.FLOAT):
                try:
                    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=intermediate,
                                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
                    tensors = build(graph)
                    graph.validate()
                    graph.build_operation_graph()
                    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                    graph.check_support()
                    graph.build_plans()
                    plan = (graph, tensors, graph.get_workspace_size())
                    break
                except Exception as err:  # noqa: BLE001 (a refused graph: torch does this piece)
                    seen["why"] = seen["why"] or first_line(err)
            seen["cudnn" if plan else "torch"] += 1
            self.plans[full] = plan
        return self.plans[full]

    def _run(self, plan, **buffers):
        graph, tensors, workspace_size = plan
        if self.workspace.numel() < workspace_size:
            self.workspace = torch.empty(workspace_size, dtype=torch.uint8, device=self.workspace.device)
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute({tensors[name]: value for name, value in buffers.items()}, self.workspace, handle=self.handle)

    # Graph inputs: fp16 NHWC activations and weights; fp16 prologue scale/bias (as conv2d reads
    # them); fp32 per-channel statistics and BN parameters.
    @staticmethod
    def _act(graph, name, shape):
        return graph.tensor(name=name, dim=list(shape), stride=nhwc_stride(shape), data_type=cudnn.data_type.HALF)

    @staticmethod
    def _chan(graph, name, c, half=False):
        kind = cudnn.data_type.HALF if half else cudnn.data_type.FLOAT
        return graph.tensor(name=name, dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=kind)

    def _prologue(self, graph, x, c, tensors):
        """relu(x * scale + bias) inside the graph (never written to memory)."""
        tensors["S"], tensors["B"] = self._chan(graph, "S", c, half=True), self._chan(graph, "B", c, half=True)
        scaled = graph.scale(name="scale", input=x, scale=tensors["S"])
        return graph.relu(name="relu", input=graph.bias(name="bias", input=scaled, bias=tensors["B"]))

    def conv_stats(self, x, w, stride, pad, scale=None, bias=None):
        """y = conv(x, or relu(x * scale + bias)), and y's per-channel sum and sum of squares (fp32)."""
        n, c, h, wd = x.shape
        k = w.shape[0]
        y_shape = (n, k, (h + 2 * pad - w.shape[2]) // stride + 1, (wd + 2 * pad - w.shape[3]) // stride + 1)

        def build(graph):
            t = {"X": self._act(graph, "X", x.shape), "W": self._act(graph, "W", w.shape)}
            image = t["X"] if scale is None else self._prologue(graph, t["X"], c, t)
            t["Y"] = graph.conv_fprop(image=image, weight=t["W"], padding=[pad, pad], stride=[stride, stride],
                                      dilation=[1, 1], name="conv")
            t["Y"].set_output(True).set_dim(list(y_shape)).set_stride(nhwc_stride(y_shape)).set_data_type(
                cudnn.data_type.HALF)
            t["SUM"], t["SQ"] = graph.genstats(name="stats", input=t["Y"])
            t["SUM"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["SQ"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            return t

        plan = self._plan("conv+stats" if scale is None else "relu(bn) conv+stats",
                          (x.shape, w.shape, stride, pad), build)
        if plan is None:
            image = x if scale is None else torch.relu(x * scale + bias)
            y = F.conv2d(image, w, None, stride, pad).contiguous(memory_format=CL)
            y32 = y.float()
            return y, vec(y32.sum((0, 2, 3)), k), vec(y32.square().sum((0, 2, 3)), k)
        y = torch.empty(y_shape, dtype=x.dtype, device=x.device, memory_format=CL)
        total, squares = (torch.empty(1, k, 1, 1, dtype=torch.float32, device=x.device) for _ in range(2))
        buffers = {"X": x, "W": w, "Y": y, "SUM": total, "SQ": squares}
        if scale is not None:
            buffers.update(S=scale, B=bias)
        self._run(plan, **buffers)
        return y, total, squares

    def dgrad(self, dy, w, x_shape, stride, pad):
        """The convolution's input gradient."""
        def build(graph):
            t = {"DY": self._act(graph, "DY", dy.shape), "W": self._act(graph, "W", w.shape)}
            t["DX"] = graph.conv_dgrad(loss=t["DY"], filter=t["W"], padding=[pad, pad], stride=[stride, stride],
                                       dilation=[1, 1], name="dgrad")
            t["DX"].set_output(True).set_dim(list(x_shape)).set_stride(nhwc_stride(x_shape)).set_data_type(
                cudnn.data_type.HALF)
            return t

        plan = self._plan("dgrad", (dy.shape, w.shape, tuple(x_shape), stride, pad), build)
        if plan is None:
            return torch.nn.grad.conv2d_input(tuple(x_shape), w, dy, stride, pad).contiguous(memory_format=CL)
        dx = torch.empty(tuple(x_shape), dtype=dy.dtype, device=dy.device, memory_format=CL)
        self._run(plan, DY=dy, W=w, DX=dx)
        return dx

    def wgrad(self, x, dy, w_shape, stride, pad, scale=None, bias=None):
        """The weight gradient; with scale/bias the input is relu(x * scale + bias), recomputed."""
        c = x.shape[1]

        def build(graph):
            t = {"X": self._act(graph, "X", x.shape), "DY": self._act(graph, "DY", dy.shape)}
            image = t["X"] if scale is None else self._prologue(graph, t["X"], c, t)
            t["DW"] = graph.conv_wgrad(image=image, loss=t["DY"], padding=[pad, pad], stride=[stride, stride],
                                       dilation=[1, 1], name="wgrad")
            t["DW"].set_output(True).set_dim(list(w_shape)).set_stride(nhwc_stride(w_shape)).set_data_type(
                cudnn.data_type.HALF)
            return t

        plan = self._plan("wgrad" if scale is None else "relu(bn) wgrad",
                          (x.shape, dy.shape, tuple(w_shape), stride, pad), build)
        if plan is None:
            image = x if scale is None else torch.relu(x * scale + bias)
            return torch.nn.grad.conv2d_weight(image, tuple(w_shape), dy, stride, pad)
        dw = torch.empty(tuple(w_shape), dtype=dy.dtype, device=dy.device, memory_format=CL)
        buffers = {"X": x, "DY": dy, "DW": dw}
        if scale is not None:
            buffers.update(S=scale, B=bias)
        self._run(plan, **buffers)
        return dw

    def relu_bn_backward(self, da, y, stats, gamma, beta):
        """Backward of relu(bn(y)) from the gradient of its output: (dy, dgamma, dbeta). The forward
        is recomputed from y (its relu mask); fp32 statistics."""
        c = y.shape[1]

        def build(graph):
            t = {"DA": self._act(graph, "DA", da.shape), "X": self._act(graph, "X", y.shape)}
            for name in ("M", "V", "G", "BETA"):
                t[name] = self._chan(graph, name, c)
            z = graph.batchnorm_inference(input=t["X"], mean=t["M"], inv_variance=t["V"], scale=t["G"],
                                          bias=t["BETA"], name="bn")
            dz = graph.relu_backward(loss=t["DA"], input=z, name="drelu")
            t["DX"], t["DG"], t["DB"] = graph.batchnorm_backward(grad=dz, input=t["X"], scale=t["G"], mean=t["M"],
                                                                 inv_variance=t["V"], name="dbn")
            t["DX"].set_output(True).set_dim(list(y.shape)).set_stride(nhwc_stride(y.shape)).set_data_type(
                cudnn.data_type.HALF)
            t["DG"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["DB"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            return t

        plan = self._plan("relu(bn) backward", (y.shape,), build)
        if plan is None:
            mask = (y.float() - stats.mean) * stats.invstd * vec(gamma, c) + vec(beta, c) > 0
            return bn_backward_torch(da * mask, y, stats, gamma)
        dy = torch.empty_like(y, memory_format=CL)
        dgamma, dbeta = (torch.empty(1, c, 1, 1, dtype=torch.float32, device=y.device) for _ in range(2))
        self._run(plan, DA=da, X=y, M=stats.mean, V=stats.invstd, G=vec(gamma, c), BETA=vec(beta, c), DX=dy,
                  DG=dgamma, DB=dbeta)
        return dy, dgamma, dbeta

    def dgrad_relu_bn_backward(self, dy, w, y, stride, pad, stats, gamma, beta):
        """dgrad into relu(bn(y)), then that relu + BN's backward: (the BN input's gradient, dgamma,
        dbeta). --dgrad-dbn: one C++ cuDNN graph (dgrad, relu backward, the BN backward's terms)
        and one compiled pointwise kernel applying them; else dgrad, then relu_bn_backward."""
        if DGRAD_DBN is not None:
            key = ("dgrad+drelu+dbn", tuple(dy.shape), tuple(w.shape), tuple(y.shape), stride, pad)
            seen = self.where.setdefault("dgrad+drelu+dbn (C++)", {"cudnn": 0, "torch": 0, "why": ""})
            if key not in self.plans:
                why = DGRAD_DBN.refused(dy, w, y, stride, pad)
                self.plans[key] = not why
                seen["cudnn" if not why else "torch"] += 1
                seen["why"] = seen["why"] or why
            if self.plans[key]:
                stream = torch.cuda.current_stream().cuda_stream
                dz, dgamma, dbeta, eq_dy, eq_x, eq_bias = DGRAD_DBN.dgrad_drelu_dbn(
                    dy, w, y, stats.mean, stats.invstd, gamma, beta, stride, pad, stream)
                return DBN_APPLY(dz, y, eq_dy, eq_x, eq_bias), dgamma, dbeta
        da = self.dgrad(dy, w, y.shape, stride, pad)
        return self.relu_bn_backward(da, y, stats, gamma, beta)

    def out_backward_mask(self, dout, mask, out, y, stats, gamma):
        """out_backward from relu's bit-packed mask (pack_mask): dz = dout * mask written, and
        batchnorm_backward of bn3 from dz, as one graph (cuDNN's "DBN add relu" sample); where
        cuDNN refuses it, out_backward."""
        c = y.shape[1]

        def build(graph):
            t = {"DOUT": self._act(graph, "DOUT", dout.shape), "X": self._act(graph, "X", y.shape),
                 "MASK": graph.tensor(name="MASK", dim=list(out.shape), stride=nhwc_stride(out.shape),
                                      data_type=cudnn.data_type.BOOLEAN)}
            for name in ("M", "V", "G"):
                t[name] = self._chan(graph, name, c)
            t["DZ"] = graph.mul(a=t["DOUT"], b=t["MASK"], name="drelu")
            t["DZ"].set_output(True).set_stride(nhwc_stride(out.shape)).set_data_type(cudnn.data_type.HALF)
            t["DX"], t["DG"], t["DB"] = graph.batchnorm_backward(grad=t["DZ"], input=t["X"], scale=t["G"],
                                                                 mean=t["M"], inv_variance=t["V"], name="dbn")
            t["DX"].set_output(True).set_dim(list(y.shape)).set_stride(nhwc_stride(y.shape)).set_data_type(
                cudnn.data_type.HALF)
            t["DG"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["DB"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            return t

        plan = self._plan("relu mask + bn3 backward", (y.shape,), build)
        if plan is None:
            return self.out_backward(dout, out, y, stats, gamma)
        dz, dy = torch.empty_like(out, memory_format=CL), torch.empty_like(y, memory_format=CL)
        dgamma, dbeta = (torch.empty(1, c, 1, 1, dtype=torch.float32, device=y.device) for _ in range(2))
        self._run(plan, DOUT=dout, MASK=mask, X=y, M=stats.mean, V=stats.invstd, G=vec(gamma, c), DZ=dz, DX=dy,
                  DG=dgamma, DB=dbeta)
        return dz, dy, dgamma, dbeta

    def out_backward(self, dout, out, y, stats, gamma):
        """The block's last relu and bn3 (out = relu(bn3(y) + identity)): (dz, dy, dgamma, dbeta),
        dz being the gradient of relu's input, which the identity branch also receives."""
        c = y.shape[1]

        def build(graph):
            t = {"DOUT": self._act(graph, "DOUT", dout.shape), "OUT": self._act(graph, "OUT", out.shape),
                 "X": self._act(graph, "X", y.shape)}
            for name in ("M", "V", "G"):
                t[name] = self._chan(graph, name, c)
            t["DZ"] = graph.relu_backward(loss=t["DOUT"], input=t["OUT"], name="drelu")  # out > 0 iff its input > 0
            t["DZ"].set_output(True).set_stride(nhwc_stride(out.shape)).set_data_type(cudnn.data_type.HALF)
            t["DX"], t["DG"], t["DB"] = graph.batchnorm_backward(grad=t["DZ"], input=t["X"], scale=t["G"],
                                                                 mean=t["M"], inv_variance=t["V"], name="dbn")
            t["DX"].set_output(True).set_dim(list(y.shape)).set_stride(nhwc_stride(y.shape)).set_data_type(
                cudnn.data_type.HALF)
            t["DG"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["DB"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            return t

        plan = self._plan("relu + bn3 backward", (y.shape,), build)
        if plan is None and OUT_BACKWARD is not None:  # --compiled-fallback: one torch.compile'd function
            return OUT_BACKWARD(dout, out, y, stats.mean, stats.invstd, gamma)
        if plan is None:
            dz = dout * (out > 0)
            return (dz, *bn_backward_torch(dz, y, stats, gamma))
        dz, dy = torch.empty_like(out, memory_format=CL), torch.empty_like(y, memory_format=CL)
        dgamma, dbeta = (torch.empty(1, c, 1, 1, dtype=torch.float32, device=y.device) for _ in range(2))
        self._run(plan, DOUT=dout, OUT=out, X=y, M=stats.mean, V=stats.invstd, G=vec(gamma, c), DZ=dz, DX=dy,
                  DG=dgamma, DB=dbeta)
        return dz, dy, dgamma, dbeta

    def bn_backward(self, dz, y, stats, gamma):
        """A lone BN's backward (the downsample branch's): (dy, dgamma, dbeta)."""
        c = y.shape[1]

        def build(graph):
            t = {"DZ": self._act(graph, "DZ", dz.shape), "X": self._act(graph, "X", y.shape)}
            for name in ("M", "V", "G"):
                t[name] = self._chan(graph, name, c)
            t["DX"], t["DG"], t["DB"] = graph.batchnorm_backward(grad=t["DZ"], input=t["X"], scale=t["G"],
                                                                 mean=t["M"], inv_variance=t["V"], name="dbn")
            t["DX"].set_output(True).set_dim(list(y.shape)).set_stride(nhwc_stride(y.shape)).set_data_type(
                cudnn.data_type.HALF)
            t["DG"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["DB"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            return t

        plan = self._plan("bn backward", (y.shape,), build)
        if plan is None:
            return bn_backward_torch(dz, y, stats, gamma)
        dy = torch.empty_like(y, memory_format=CL)
        dgamma, dbeta = (torch.empty(1, c, 1, 1, dtype=torch.float32, device=y.device) for _ in range(2))
        self._run(plan, DZ=dz, X=y, M=stats.mean, V=stats.invstd, G=vec(gamma, c), DX=dy, DG=dgamma, DB=dbeta)
        return dy, dgamma, dbeta


def bn_backward_torch(dz, y, stats, gamma):
    """Training-mode BN backward (batch statistics), in fp32: (dy in y's dtype, dgamma, dbeta)."""
    c = y.shape[1]
    count = y.numel() // c
    dz32 = dz.float()
    xhat = (y.float() - stats.mean) * stats.invstd
    dbeta = vec(dz32.sum((0, 2, 3)), c)
    dgamma = vec((dz32 * xhat).sum((0, 2, 3)), c)
    dy = vec(gamma, c) * stats.invstd * (dz32 - dbeta / count - xhat * dgamma / count)
    return dy.to(y.dtype).contiguous(memory_format=CL), dgamma, dbeta


def out_backward_torch(dout, out, y, mean, invstd, gamma):
    """relu + bn3 backward as out_backward's torch fallback computes it, tensors only (compilable)."""
    dz = dout * (out > 0)
    return (dz, *bn_backward_torch(dz, y, Stats(mean, invstd, None, None), gamma))


OUT_BACKWARD = None
DGRAD_DBN = None  # --dgrad-dbn: the C++ extension (bench/fused/build.py)


def dbn_apply(dz, y, eq_dy, eq_x, eq_bias):
    """The BN input's gradient from cuDNN's dbn_weight terms: eq_dy * dz + eq_x * y + eq_bias."""
    return (eq_dy * dz.float() + eq_x * y.float() + eq_bias).to(dz.dtype).contiguous(memory_format=CL)


DBN_APPLY = None


def pack_mask(out, msb_first=False):
    """relu's mask (out > 0) of an NHWC tensor as cuDNN's BOOLEAN tensor holds it: one bit per
    element in memory order (channels fastest), 8 to a byte, least significant bit first (or
    most significant first: --mask-msb, should the check say otherwise)."""
    n, c, h, w = out.shape
    bits = (out > 0).permute(0, 2, 3, 1).reshape(n, h, w, c // 8, 8).to(torch.uint8)
    shifts = torch.arange(8, device=out.device, dtype=torch.uint8)
    if msb_first:
        shifts = 7 - shifts
    return (bits << shifts).sum(-1, dtype=torch.uint8)


PACK_MASK = None  # --mask-bn3


# --- BN finalize and the block's last pointwise step ---------------------------------------------

class Stats:
    """One BN's batch statistics (fp32, (1, C, 1, 1)) and the scale/bias its prologue applies."""

    def __init__(self, mean, invstd, scale, bias):
        self.mean, self.invstd, self.scale, self.bias = mean, invstd, scale, bias


def finalize(total, squares, count, gamma, beta, running_mean, running_var, momentum: float, eps: float):
    """Mean and 1/std from the sums; scale = gamma/std and bias = beta - mean*scale for the next
    prologue; running statistics updated in place as nn.BatchNorm2d does (unbiased variance)."""
    c = total.shape[1]
    mean = total / count
    var = (squares / count - mean * mean).clamp_min(0)
    invstd = torch.rsqrt(var + eps)
    scale = vec(gamma, c) * invstd
    bias = vec(beta, c) - mean * scale
    running_mean.mul_(1 - momentum).add_(mean.reshape(c), alpha=momentum)
    running_var.mul_(1 - momentum).add_(var.reshape(c) * (count / (count - 1)), alpha=momentum)
    return mean, invstd, scale, bias


def bn_add_relu(y, scale, bias, identity):
    return torch.relu(y.float() * scale + bias + identity.float()).to(y.dtype)


def bn_bn_add_relu(y, scale, bias, yd, scale_d, bias_d):
    return torch.relu(y.float() * scale + bias + yd.float() * scale_d + bias_d).to(y.dtype)


class Kernels:
    """finalize and the last pointwise step: compiled on CUDA (one kernel each), plain elsewhere."""

    def __init__(self, device):
        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if torch.device(device).type == "cuda" else (lambda fn: fn)
        self.finalize, self.bn_add_relu, self.bn_bn_add_relu = wrap(finalize), wrap(bn_add_relu), wrap(bn_bn_add_relu)


# --- the fused block -----------------------------------------------------------------------------

class _FusedBottleneckStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, x, *params):
        pieces, kernels, dtype = block.pieces, block.kernels, block.dtype
        plain, stride = block.plain, block.plain.conv2.stride[0]
        bns = [plain.bn1, plain.bn2, plain.bn3] + ([plain.downsample[1]] if block.has_downsample else [])
        weights = [w.to(dtype, memory_format=CL) for w in params[0::3]]  # autocast's cast, once a step
        xh = x.to(dtype, memory_format=CL)

        def stats_of(y, total, squares, bn):
            if bn.training and bn.track_running_stats:
                bn.num_batches_tracked.add_(1)
            mean, invstd, scale, bias = kernels.finalize(total, squares, y.numel() // y.shape[1], bn.weight, bn.bias,
                                                         bn.running_mean, bn.running_var, bn.momentum, bn.eps)
            return Stats(mean, invstd, scale, bias)

        y1, s, q = pieces.conv_stats(xh, weights[0], 1, 0)
        st1 = stats_of(y1, s, q, bns[0])
        y2, s, q = pieces.conv_stats(y1, weights[1], stride, 1, st1.scale.to(dtype), st1.bias.to(dtype))
        st2 = stats_of(y2, s, q, bns[1])
        y3, s, q = pieces.conv_stats(y2, weights[2], 1, 0, st2.scale.to(dtype), st2.bias.to(dtype))
        st3 = stats_of(y3, s, q, bns[2])
        yd, std = None, None
        if block.has_downsample:
            yd, s, q = pieces.conv_stats(xh, weights[3], stride, 0)
            std = stats_of(yd, s, q, bns[3])
            out = kernels.bn_bn_add_relu(y3, st3.scale, st3.bias, yd, std.scale, std.bias)
        else:
            out = kernels.bn_add_relu(y3, st3.scale, st3.bias, xh)
        out = out.contiguous(memory_format=CL)
        ctx.block, ctx.stats, ctx.dtypes = block, (st1, st2, st3, std), (x.dtype, [p.dtype for p in params])
        ctx.mask = PACK_MASK(out) if PACK_MASK is not None else None  # --mask-bn3: relu's mask, 1 bit each
        ctx.save_for_backward(xh, y1, y2, y3, *([yd] if yd is not None else []), out, *weights)
        return out

    @staticmethod
    def backward(ctx, dout):
        block, (st1, st2, st3, std) = ctx.block, ctx.stats
        pieces, dtype, plain = block.pieces, block.dtype, block.plain
        stride = plain.conv2.stride[0]
        saved = list(ctx.saved_tensors)
        xh, y1, y2, y3 = saved[:4]
        yd = saved[4] if block.has_downsample else None
        out, *weights = saved[5 if block.has_downsample else 4:]
        dout = dout.to(dtype).contiguous(memory_format=CL)
        g = [plain.bn1.weight, plain.bn2.weight, plain.bn3.weight]
        b = [plain.bn1.bias, plain.bn2.bias]
        if ctx.mask is not None:
            dz, dy3, dg3, db3 = pieces.out_backward_mask(dout, ctx.mask, out, y3, st3, g[2])
        else:
            dz, dy3, dg3, db3 = pieces.out_backward(dout, out, y3, st3, g[2])
        dw3 = pieces.wgrad(y2, dy3, weights[2].shape, 1, 0, st2.scale.to(dtype), st2.bias.to(dtype))
        dy2, dg2, db2 = pieces.dgrad_relu_bn_backward(dy3, weights[2], y2, 1, 0, st2, g[1], b[1])
        dw2 = pieces.wgrad(y1, dy2, weights[1].shape, stride, 1, st1.scale.to(dtype), st1.bias.to(dtype))
        dy1, dg1, db1 = pieces.dgrad_relu_bn_backward(dy2, weights[1], y1, stride, 1, st1, g[0], b[0])
        dw1 = pieces.wgrad(xh, dy1, weights[0].shape, 1, 0)
        dx = pieces.dgrad(dy1, weights[0], xh.shape, 1, 0)
        grads = [dw1, dg1, db1, dw2, dg2, db2, dw3, dg3, db3]
        if block.has_downsample:
            dyd, dgd, dbd = pieces.bn_backward(dz, yd, std, plain.downsample[1].weight)
            grads += [pieces.wgrad(xh, dyd, weights[3].shape, stride, 0), dgd, dbd]
            dx = dx + pieces.dgrad(dyd, weights[3], xh.shape, stride, 0)
        else:
            dx = dx + dz
        x_dtype, param_dtypes = ctx.dtypes
        shaped = [grad.reshape(p.shape).to(p_dtype) for grad, p, p_dtype in
                  zip(grads, [p for p in block.params()], param_dtypes)]
        return (None, dx.to(x_dtype), *shaped)


class FusedBottleneck(torch.nn.Module):
    """A torchvision Bottleneck (`plain`, whose parameters and buffers it uses: same state_dict
    under the `plain.` prefix) trained through _FusedBottleneckStep; eval mode runs the plain block."""

    def __init__(self, plain, pieces, kernels, dtype):
        super().__init__()
        self.plain, self.pieces, self.kernels, self.dtype = plain, pieces, kernels, dtype
        self.has_downsample = plain.downsample is not None

    def params(self):
        p = self.plain
        names = [(p.conv1, p.bn1), (p.conv2, p.bn2), (p.conv3, p.bn3)]
        if self.has_downsample:
            names.append((p.downsample[0], p.downsample[1]))
        return [t for conv, bn in names for t in (conv.weight, bn.weight, bn.bias)]

    def forward(self, x):
        if not self.training:
            return self.plain(x)
        return _FusedBottleneckStep.apply(self, x, *self.params())


# --- checks and timings --------------------------------------------------------------------------

def resnet50_blocks(image_size):
    """(name, block, input shape without batch, how many times ResNet-50 has a block like it)."""
    model = torchvision.models.resnet50()
    side, rows = image_size // 4, []
    for index, (layer, count) in enumerate(zip([model.layer1, model.layer2, model.layer3, model.layer4],
                                                [3, 4, 6, 3]), start=1):
        first, later = layer[0], layer[1]
        rows.append((f"layer{index}.0", first, (first.conv1.in_channels, side, side), 1))
        side //= first.conv2.stride[0]
        rows.append((f"layer{index}.1", later, (later.conv1.in_channels, side, side), count - 1))
    return rows


def rel_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def step_results(block, x, dout, autocast_dtype=None):
    """(output, input grad, parameter grads by name, buffers by name) of one training step."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = block(x)
    out.backward(dout.to(out.dtype))
    named = block.plain if isinstance(block, FusedBottleneck) else block
    grads = {name: p.grad.detach().clone() for name, p in named.named_parameters()}
    buffers = {name: t.detach().clone() for name, t in named.named_buffers() if t.is_floating_point()}
    return out.detach(), x.grad.detach(), grads, buffers


def check_block(name, plain, x, pieces, kernels, dtype, use_autocast):
    """Errors of the fused block (and of autocast) against fp32 eager, per quantity: the largest
    relative error over the parameter gradients, and the output, input gradient and buffers."""
    reference = copy.deepcopy(plain).float().to(memory_format=CL).train()
    fused = FusedBottleneck(copy.deepcopy(plain).to(memory_format=CL).train(), pieces, kernels, dtype)
    dout = torch.randn_like(reference(x.float()).detach()).contiguous(memory_format=CL)
    for bn_owner in (reference, fused.plain):  # the probe forward above moved the reference's statistics
        for module in bn_owner.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.reset_running_stats()
    want = step_results(reference, x.float(), dout)
    runs = {"fused": step_results(fused, x, dout)}
    if use_autocast:
        runs["autocast"] = step_results(copy.deepcopy(plain).to(memory_format=CL).train(), x, dout, dtype)
    lines = []
    for label, got in runs.items():
        errors = {"out": rel_error(got[0], want[0]), "dx": rel_error(got[1], want[1]),
                  "dparams": max(rel_error(got[2][k], want[2][k]) for k in want[2]),
                  "buffers": max(rel_error(got[3][k], want[3][k]) for k in want[3])}
        worst_param = max(want[2], key=lambda k: rel_error(got[2][k], want[2][k]))
        lines.append((label, errors, worst_param))
    return lines


TOP = 0


def kernel_ms(fn, iters):
    """Mean summed duration of the GPU kernels of one call of fn, from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    names = {}
    for e in events:
        if e.get("cat") == "kernel":
            names[e["name"][:90]] = names.get(e["name"][:90], 0) + e.get("dur", 0) / 1e3 / iters
    if TOP:
        for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:TOP]:
            print(f"      {ms:7.3f} ms  {name}")
    return sum(names.values())


def wall_ms(fn, iters, rounds=5):
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def time_block(plain, x, pieces, kernels, dtype, iters, compile_too=True):
    """{variant: (wall ms, kernel ms)} for one forward + backward."""
    dout = None
    variants = {"eager": copy.deepcopy(plain).to(memory_format=CL).train()}
    if compile_too:
        variants["compile"] = torch.compile(copy.deepcopy(plain).to(memory_format=CL).train(), dynamic=False)
    variants["fused"] = FusedBottleneck(copy.deepcopy(plain).to(memory_format=CL).train(), pieces, kernels, dtype)
    results = {}
    for label, block in variants.items():
        xg = x.detach().clone().requires_grad_(True)

        def step():
            nonlocal dout
            with torch.autocast("cuda", dtype=dtype, enabled=label != "fused"):
                out = block(xg)
            if dout is None:
                dout = torch.randn_like(out)
            out.backward(dout.to(out.dtype))
            xg.grad = None
            for p in block.parameters():
                p.grad = None

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        if TOP:
            print(f"    {label}: top kernels")
        results[label] = (wall_ms(step, iters), kernel_ms(step, iters))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224, help="the network's input side (blocks at 1/4 .. 1/32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-cudnn", action="store_true", help="every piece in torch (the decomposition alone)")
    parser.add_argument("--check-only", action="store_true", help="gradient checks, no timing")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out of the timings")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=0, help="print each variant's N longest kernels")
    parser.add_argument("--dgrad-dbn", action="store_true", help="dgrad + relu backward + the BN backward's "
                        "terms as one C++ cuDNN graph (DgradDreluBNBwdWeight; bench/fused/dgrad_dbn.cpp)")
    parser.add_argument("--mask-bn3", action="store_true", help="relu's bit-packed mask kept in the forward; the "
                        "relu + bn3 backward as one cuDNN graph over it (fallback: as without)")
    parser.add_argument("--mask-msb", action="store_true", help="with --mask-bn3: pack the mask MSB first")
    parser.add_argument("--compiled-fallback", action="store_true", help="the refused relu + bn3 backward as one "
                        "torch.compile'd function instead of eager fp32 ops")
    parser.add_argument("--blocks", nargs="+", default=None, help="block names (layer1.0 ...); default: all")
    args = parser.parse_args()
    global TOP, OUT_BACKWARD, DGRAD_DBN, DBN_APPLY, PACK_MASK
    TOP = args.top
    if args.mask_bn3:
        PACK_MASK = torch.compile(functools.partial(pack_mask, msb_first=args.mask_msb), dynamic=False)
    if args.dgrad_dbn:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused"))
        import dgrad_dbn
        if not os.path.exists(dgrad_dbn.LIBRARY):
            dgrad_dbn.build()
        DGRAD_DBN = dgrad_dbn.DgradDbn()
        DBN_APPLY = torch.compile(dbn_apply, dynamic=False)
        print(f"dgrad_dbn library (ctypes, heuristics {'A+FALLBACK' if DGRAD_DBN.heur else 'A'}) on cuDNN "
              f"{DGRAD_DBN.backend_version()}", flush=True)
    if args.compiled_fallback:
        OUT_BACKWARD = torch.compile(out_backward_torch, dynamic=False)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # finalize and the pointwise kernels compile once per block shape: more than dynamo's default limit
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    torch.backends.cudnn.benchmark = cuda
    dtype = torch.float16 if cuda else torch.float32
    pieces, kernels = Pieces(device, use_cudnn=not args.no_cudnn), Kernels(device)
    if cuda:
        version = cudnn.backend_version_string() if cudnn is not None else "no frontend"
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {version}, "
              f"frontend {getattr(cudnn, '__version__', 'missing')}", flush=True)
    torch.manual_seed(0)
    totals = {}
    for name, plain, shape, repeats in resnet50_blocks(args.image_size):
        if args.blocks and name not in args.blocks:
            continue
        plain = plain.to(device)
        x = torch.randn(args.batch_size, *shape, device=device).to(dtype).contiguous(memory_format=CL)
        x = torch.relu(x)  # a block's input is a ReLU's output
        try:
            for label, errors, worst in check_block(name, plain, x, pieces, kernels, dtype, use_autocast=cuda):
                print(f"{name} x{repeats} {label:<8} rel. error vs fp32 eager: out {errors['out']:.2e}, dx "
                      f"{errors['dx']:.2e}, params {errors['dparams']:.2e} (worst {worst}), buffers "
                      f"{errors['buffers']:.2e}", flush=True)
            if args.check_only or not cuda:
                continue
            timed = time_block(plain, x, pieces, kernels, dtype, args.iters, compile_too=not args.no_compile)
        except Exception as err:  # noqa: BLE001 (one block's failure: report it, go on with the next)
            print(f"{name}: failed: {type(err).__name__}: {first_line(err)}", flush=True)
            traceback.print_exc(limit=-3)
            continue
        for label, (wall, kern) in timed.items():
            totals.setdefault(label, [0.0, 0.0])
            totals[label][0] += repeats * wall
            totals[label][1] += repeats * kern
        words = ", ".join(f"{label} {wall:.3f} ms wall / {kern:.3f} ms kernels"
                          for label, (wall, kern) in timed.items())
        print(f"{name} x{repeats} fwd+bwd: {words}", flush=True)
    print(f"pieces: {pieces.report()}")
    if totals:
        base = totals.get("compile", totals["eager"])
        print("ResNet-50's 16 bottlenecks, fwd+bwd, batch {}: ".format(args.batch_size) + ", ".join(
            f"{label} {wall:.2f} ms wall / {kern:.2f} ms kernels" for label, (wall, kern) in totals.items()))
        fused = totals["fused"]
        print(f"fused vs {'compile' if 'compile' in totals else 'eager'}: x{base[1] / fused[1]:.2f} in kernel time, "
              f"x{base[0] / fused[0]:.2f} in wall time; vs eager: x{totals['eager'][1] / fused[1]:.2f} kernel time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
