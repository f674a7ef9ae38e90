"""The opt-level shim: recipe resolution, dtypes after setup, masters, loss scaling, skips."""
import os

import pytest
import torch
from conftest import build_sgd
from torch import nn

from utils.precision import OPT_LEVELS, Precision, cpu_fp16_note, cpu_has_native_bf16, resolve_precision
from utils.run.errors import UsageError

HALVES = [("bf16", torch.bfloat16), ("fp16", torch.float16)]


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))



def setup(level, dtype_name, keep_bn=None, loss_scale=None):
    recipe, _ = resolve_precision(level, keep_bn, loss_scale, dtype_name, "--mixed-precision")
    torch.manual_seed(0)
    model = TinyNet()
    precision = Precision(recipe, model, "cpu")
    optimizer = build_sgd(precision.optimizer_params(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return model, precision, optimizer


def train_step(model, precision, optimizer, accelerator, poison=None, device="cpu"):
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 6, 6, device=device), torch.randint(0, 4, (4,), device=device)
    with precision.autocast():
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
    precision.backward(loss, accelerator)
    if poison is not None:
        grad = next(model.parameters()).grad
        grad[(0,) * grad.dim()] = poison  # indexing, not view(): channels_last grads too
    precision.step(optimizer)
    precision.zero_grad(model, optimizer)
    return out


def snapshot(model, optimizer):
    weights = [p.detach().clone() for p in model.parameters()]
    momenta = [s["momentum_buffer"].clone() for s in optimizer.state.values()]
    return weights, momenta


def test_defaults_follow_the_apex_table():
    expect = {
        ("O0", "fp16"): ("no", False, None),
        ("O1", "fp16"): ("fp16", False, "dynamic"),
        ("O1", "bf16"): ("bf16", False, None),
        ("O2", "fp16"): ("fp16", True, "dynamic"),
        ("O2", "bf16"): ("bf16", True, None),
        ("O3", "fp16"): ("fp16", False, 1.0),
        ("O3", "bf16"): ("bf16", False, 1.0),
    }
    for (level, mp), (dtype, keep_bn, scale) in expect.items():
        recipe, _ = resolve_precision(level, None, None, mp, "the Accelerate config")
        assert (recipe.dtype_name, recipe.keep_bn_fp32, recipe.loss_scale) == (dtype, keep_bn, scale), level


def readme_opt_level_rows():
    """The README's opt-level table as {level: [weights, autocast, optimizer, BN, loss scale]}."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as handle:
        lines = handle.read().split("## Opt levels", 1)[1].split("\n## ", 1)[0].splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| O")]
    return {row[0]: row[1:] for row in cells}


def says(scale):
    return {None: "none", "dynamic": "dynamic"}.get(scale, f"static {scale}")


def test_opt_levels_table_is_the_readme_table():
    rows = readme_opt_level_rows()
    assert sorted(rows) == sorted(OPT_LEVELS)
    for name, level in OPT_LEVELS.items():
        weights, autocast, optimizer, batchnorm, loss_scale = rows[name]
        assert weights.startswith("fp32") == (level.weights == "fp32"), name
        assert autocast.startswith("on") == level.autocast, name
        assert ("fp32 masters" in optimizer) == level.master_weights, name
        if level.half_weights:
            assert batchnorm.startswith("fp32") == level.keep_bn_fp32, name
        fp16, bf16 = says(level.loss_scale_fp16), says(level.loss_scale_bf16)
        assert loss_scale == (fp16 if fp16 == bf16 else f"{fp16} (fp16), {bf16} (bf16)"), name


def test_every_level_describes_itself():
    lines = {level: resolve_precision(level, None, None, "fp16", None)[0].describe() for level in OPT_LEVELS}
    assert lines == {
        "O0": "precision: O0 fp32 | weights fp32, BN fp32, optimizer fp32 | loss scale none",
        "O1": "precision: O1 fp16 | autocast fp16, weights fp32, BN fp32, optimizer fp32 "
              "| loss scale dynamic (65536)",
        "O2": "precision: O2 fp16 | weights half, BN fp32, master fp32 | loss scale dynamic (65536)",
        "O3": "precision: O3 fp16 | weights half, BN half, no master (optimizer on half weights) "
              "| loss scale static 1",
    }
    # eval.py's: what the forward pass uses only (a loss scale or master weights would be untrue there)
    lines = {level: resolve_precision(level, None, None, "bf16", None)[0].describe(evaluation=True)
             for level in OPT_LEVELS}
    assert lines == {"O0": "precision: O0 fp32 | weights fp32, BN fp32",
                     "O1": "precision: O1 bf16 | autocast bf16, weights fp32, BN fp32",
                     "O2": "precision: O2 bf16 | weights half, BN fp32",
                     "O3": "precision: O3 bf16 | weights half, BN half"}


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    with_amx, plain = tmp_path / "amx", tmp_path / "plain"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n")
    assert cpu_has_native_bf16(str(with_amx)) is True
    assert cpu_has_native_bf16(str(plain)) is False
    assert cpu_has_native_bf16(str(tmp_path / "absent")) is None


def test_cpu_fp16_note_only_for_fp16_off_cuda():
    fp16 = resolve_precision("O1", None, None, "fp16", None)[0]
    bf16 = resolve_precision("O1", None, None, "bf16", None)[0]
    note = cpu_fp16_note(fp16, "cpu")
    assert note.startswith("fp16 on a machine without CUDA") and "bf16" in note
    assert cpu_fp16_note(fp16, "cuda") is None and cpu_fp16_note(bf16, "cpu") is None


def test_mixed_precision_alone_picks_the_level():
    assert resolve_precision(None, None, None, "no", "env")[0].opt_level == "O0"
    assert resolve_precision(None, None, None, None, None)[0].opt_level == "O0"
    assert resolve_precision(None, None, None, "bf16", "env")[0].opt_level == "O1"
    # An opt level with Accelerate's default 'no' in the environment means Apex's fp16.
    assert resolve_precision("O2", None, None, "no", "the Accelerate config")[0].dtype_name == "fp16"


def test_flag_conflicts_and_no_effect_notes():
    with pytest.raises(UsageError, match="O1"):
        resolve_precision("O1", True, None, "fp16", None)
    with pytest.raises(UsageError, match="contradicts"):
        resolve_precision("O2", None, None, "no", "--mixed-precision")
    recipe, notes = resolve_precision("O0", None, 128.0, None, None)
    assert recipe.loss_scale is None and any("no effect" in n for n in notes)
    recipe, _ = resolve_precision("O3", True, "dynamic", "fp16", None)
    assert recipe.keep_bn_fp32 and recipe.loss_scale == "dynamic"
    assert "precision: O2 fp16 | weights half, BN fp32, master fp32 | loss scale dynamic (65536)" == \
        resolve_precision("O2", None, None, "fp16", None)[0].describe()


@pytest.mark.parametrize("dtype_name,half", HALVES)
def test_dtypes_after_setup(dtype_name, half):
    model, precision, optimizer = setup("O0", dtype_name)
    assert all(p.dtype == torch.float32 for p in optimizer.param_groups[0]["params"])
    assert all(p.dtype == torch.float32 for p in model.parameters())

    model, precision, optimizer = setup("O1", dtype_name)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with precision.autocast():
        assert model.conv(torch.randn(1, 3, 4, 4)).dtype == half

    model, precision, optimizer = setup("O2", dtype_name)
    assert model.conv.weight.dtype == half and model.fc.weight.dtype == half
    assert model.bn.weight.dtype == torch.float32 and model.bn.running_mean.dtype == torch.float32
    opt_params = optimizer.param_groups[0]["params"]
    assert all(p.dtype == torch.float32 for p in opt_params)
    assert not any(p is model.conv.weight for p in opt_params)  # a master, not the half weight
    assert any(p is model.bn.weight for p in opt_params)        # fp32 BN is its own master
    assert model(torch.randn(2, 3, 4, 4)).dtype == torch.float32  # logits come back fp32

    model, precision, optimizer = setup("O3", dtype_name)
    assert all(p.dtype == half for p in model.parameters())
    assert model.bn.running_var.dtype == half
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters()))

    model, precision, optimizer = setup("O3", dtype_name, keep_bn=True)
    assert model.bn.weight.dtype == torch.float32 and model.conv.weight.dtype == half


@pytest.mark.parametrize("dtype_name,half", HALVES)
def test_o2_half_weights_are_rounded_masters_after_steps(accelerator, dtype_name, half):
    model, precision, optimizer = setup("O2", dtype_name)
    before = model.conv.weight.detach().clone()
    for _ in range(3):
        out = train_step(model, precision, optimizer, accelerator)
    assert out.dtype == torch.float32
    assert not torch.equal(before, model.conv.weight)
    for param, master in precision.master_of.items():
        assert master.dtype == torch.float32
        assert torch.equal(param.detach(), master.detach().to(half))
    state = precision.fp32_state_dict(model)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    assert torch.equal(state["conv.weight"], precision.master_of[model.conv.weight])


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype_name,half", HALVES)
def test_static_scale_never_changes_and_overflow_is_skipped(accelerator, level, dtype_name, half):
    model, precision, optimizer = setup(level, dtype_name, loss_scale=128.0)
    train_step(model, precision, optimizer, accelerator)
    weights, momenta = snapshot(model, optimizer)
    masters = [m.detach().clone() for m in precision.master_of.values()]
    train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    after_weights, after_momenta = snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(weights, after_weights))
    assert all(torch.equal(a, b) for a, b in zip(momenta, after_momenta))
    assert all(torch.equal(a, b) for a, b in zip(masters, precision.master_of.values()))
    train_step(model, precision, optimizer, accelerator, poison=float("nan"))
    assert int(precision.skipped_steps()) == 2
    assert float(precision.loss_scale_value()) == 128.0
    train_step(model, precision, optimizer, accelerator)
    assert not all(torch.equal(a, b) for a, b in zip(weights, snapshot(model, optimizer)[0]))
    assert int(precision.skipped_steps()) == 2 and float(precision.loss_scale_value()) == 128.0


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype_name,half", HALVES)
def test_dynamic_scale_halves_on_overflow_and_grows_after_clean_steps(accelerator, level, dtype_name, half):
    model, precision, optimizer = setup(level, dtype_name, loss_scale="dynamic")
    precision.scaler.growth_interval = 3
    assert float(precision.loss_scale_value()) == 65536.0
    train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    assert float(precision.loss_scale_value()) == 32768.0
    assert int(precision.skipped_steps()) == 1
    for _ in range(3):
        train_step(model, precision, optimizer, accelerator)
    assert float(precision.loss_scale_value()) == 65536.0
    assert int(precision.skipped_steps()) == 1


def test_skipped_first_step_leaves_momentum_clean(accelerator):
    """An overflow on the very first step must not leave garbage momentum behind."""
    model, precision, optimizer = setup("O1", "fp16")
    train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    assert all(torch.count_nonzero(s["momentum_buffer"]) == 0 for s in optimizer.state.values())
    train_step(model, precision, optimizer, accelerator)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_loss_scale_state_round_trips(accelerator):
    model, precision, optimizer = setup("O2", "fp16")
    train_step(model, precision, optimizer, accelerator, poison=float("inf"))
    state = precision.state_dict()
    _, fresh, _ = setup("O2", "fp16")
    fresh.load_state_dict(state)
    assert float(fresh.loss_scale_value()) == 32768.0 and int(fresh.skipped_steps()) == 1


def test_o2_masters_keep_the_fp32_bits_they_were_built_from():
    recipe, _ = resolve_precision("O2", None, None, "bf16", None)
    torch.manual_seed(0)
    model = TinyNet()
    original = model.conv.weight.detach().clone()
    precision = Precision(recipe, model, "cpu")
    assert torch.equal(precision.master_of[model.conv.weight], original)
    assert not torch.equal(original.to(torch.bfloat16).float(), original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_portable_unscale_matches_the_fused_kernel(dtype):
    """The fallback used where torch's fused kernel lacks a dtype (bf16 on CUDA) agrees with it."""
    from utils.loss_scale import unscale_and_check_foreach
    inv_scale = torch.full((), 1 / 128.0)
    for poison in (None, float("inf"), float("nan")):
        torch.manual_seed(0)
        grads = [torch.randn(5, 3).to(dtype) * 128, torch.randn(7).to(dtype) * 128]
        if poison is not None:
            grads[1][3] = poison
        fused = [g.clone() for g in grads]
        found_fused, found_portable = torch.zeros(()), torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(fused, found_fused, inv_scale)
        unscale_and_check_foreach(grads, found_portable, inv_scale)
        assert float(found_portable) == float(found_fused) == (0.0 if poison is None else 1.0)
        if poison is None:
            assert all(torch.equal(a, b) for a, b in zip(grads, fused))
