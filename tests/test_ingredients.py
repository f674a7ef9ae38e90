"""The training ingredients wired into the loop (utils/ingredients.py through utils/engine.py, utils/
precision.py and train.py): each test asserts the ingredient's effect, on CPU, on tiny runs."""
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import FINAL, QUICK, run_script
from test_train import usage_error  # noqa: F401  (the in-process refusal fixture)
from torch import nn

from utils.engine import Watch, train_one_epoch
from utils.flags.specs import training_loop, training_specs
from utils.ingredients import BatchAugment, build_criterion, build_mixup, build_optimizer
from utils.loss_scale import clip_grad_norm_fp32
from utils.precision import Precision, resolve_precision
from utils.run.errors import UsageError
from utils.training_state import TrainingState


class Batches:
    """data.train for train_one_epoch: fixed (images, target) batches, as the prefetcher yields."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def run_engine(accelerator, batches, accum=1, lr=0.1, clip=None, criterion=None, momentum=0.0, opt="sgd"):
    """One epoch of train_one_epoch at O0 over a bias-free-of-BN linear model; returns (model, result)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    recipe, _ = resolve_precision("O0", None, None, None)
    precision = Precision(recipe, model, "cpu")
    precision.clip_grad = clip
    built = build_optimizer(opt, model, lr, momentum=momentum, weight_decay=0.0)
    precision.skips_on_device = built.skips_on_device
    args = SimpleNamespace(batch_size=batches[0][0].size(0), accum_steps=accum, lr=lr * 256 / (
        batches[0][0].size(0) * accum), lr_schedule="step", lr_steps=[100], epochs=1, warmup_epochs=0,
        min_lr=0.0, steps_per_epoch=0, print_freq=1, seed=0, max_nonfinite_steps=None)
    data = SimpleNamespace(train=Batches(batches), num_classes=3)
    state = TrainingState(model, built.optimizer, precision, accelerator)
    result = train_one_epoch(state, data, 0, training_loop(args, criterion or nn.CrossEntropyLoss()),
                             Watch(log=lambda line: None))
    return model, result


def batches_of(n, b, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 2, 2, generator=g), torch.randint(0, 3, (b,), generator=g)) for _ in range(n)]


def test_accumulation_of_n_micro_batches_equals_one_big_batch(accelerator):
    micro = batches_of(4, 4)
    big = [(torch.cat([micro[0][0], micro[1][0]]), torch.cat([micro[0][1], micro[1][1]])),
           (torch.cat([micro[2][0], micro[3][0]]), torch.cat([micro[2][1], micro[3][1]]))]
    accumulated, result = run_engine(accelerator, micro, accum=2, momentum=0.9)
    one_batch, _ = run_engine(accelerator, big, accum=1, momentum=0.9)
    assert result.count == 16
    for a, b in zip(accumulated.parameters(), one_batch.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    untrained, _ = run_engine(accelerator, micro[:2], accum=2, lr=1e-12)
    assert not torch.allclose(untrained[1].weight, accumulated[1].weight)  # it did train


def test_label_smoothing_changes_the_loss_by_the_smoothed_term(accelerator):
    batch = batches_of(1, 8)
    _, hard = run_engine(accelerator, batch, lr=1e-12)
    _, smooth = run_engine(accelerator, batch, lr=1e-12, criterion=build_criterion(0.1))
    torch.manual_seed(0)
    logits = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))(batch[0][0])
    expected = nn.functional.cross_entropy(logits, batch[0][1], label_smoothing=0.1).item()
    assert smooth.loss == pytest.approx(expected, rel=1e-5)
    assert smooth.loss != pytest.approx(hard.loss, rel=1e-3)


def test_clip_grad_bounds_the_update(accelerator):
    batch = [(100 * x, y) for x, y in batches_of(1, 8)]  # large inputs: large grads
    lr = 0.5
    torch.manual_seed(0)
    before = [p.detach().clone() for p in nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).parameters()]
    clipped, _ = run_engine(accelerator, batch, lr=lr, clip=0.01)
    free, _ = run_engine(accelerator, batch, lr=lr)
    step = lambda model: torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), before)]).norm()
    assert step(clipped) <= lr * 0.01 * 1.001
    assert step(free) > 10 * lr * 0.01


def test_clip_grad_at_o3_fp16_sums_the_norm_in_fp32():
    """A finite fp16 gradient whose norm passes fp16's 65,504: the norm is summed in fp32, so the
    step is clipped, not scaled to nothing by an inf total (torch sums in the gradient's dtype)."""
    param = nn.Parameter(torch.zeros(300, 300, dtype=torch.float16))
    param.grad = torch.full((300, 300), 300.0, dtype=torch.float16)  # norm 90,000
    with torch.no_grad():
        assert torch.isinf(torch.linalg.vector_norm(torch.stack(torch._foreach_norm([param.grad]))))
    total = clip_grad_norm_fp32([param], 1.0)
    assert total.item() == pytest.approx(90000.0, rel=1e-3)
    assert param.grad.float().norm().item() == pytest.approx(1.0, rel=1e-2)


@pytest.mark.parametrize("opt", ["adamw", "lamb", "nesterov"])
def test_other_optimizers_train(accelerator, opt):
    batches = batches_of(1, 8) * 6
    _, first = run_engine(accelerator, batches[:1], lr=1e-12, opt=opt, momentum=0.9)
    _, trained = run_engine(accelerator, batches, lr=0.05, opt=opt, momentum=0.9)
    assert trained.loss < first.loss  # the mean over 6 steps of the same batch falls


def test_mixup_and_erasing_change_pixels_and_targets():
    g = torch.Generator().manual_seed(0)
    images, target = torch.randn(8, 3, 16, 16, generator=g), torch.arange(8) % 4
    augment = BatchAugment(mixup=build_mixup(1.0, 0.0, num_classes=4, batch_size=8, label_smoothing=0.1))
    mixed, soft = augment(images.clone(), target)
    assert not torch.allclose(mixed, images)
    assert soft.shape == (8, 4) and torch.allclose(soft.sum(1), torch.ones(8))
    assert (soft.max(1).values < 1.0).all()  # mixed and smoothed, never one-hot


def test_aa_refused_on_the_gpu_backend():
    from utils.data.batches import sharded_data
    from utils.data.sources import DataSpec
    spec = DataSpec(data=None, batch_size=2, workers=0, seed=0, image_size=32, aa="rand-m9-mstd0.5", backend="gpu")
    accel = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1)
    with pytest.raises(UsageError, match="--data-backend cpu"):
        sharded_data(list(range(4)), list(range(4)), 2, spec, accel)


def test_ema_is_evaluated_and_saved_beside_the_raw_model(cache_dir, tmp_path):
    result = run_script("train.py", *QUICK, "--epochs", "1", "--model-ema", "--model-ema-decay", "0.5",
                        "--opt", "adamw", "--lr", "0.01", "--no-wd-norm-bias", "--label-smoothing", "0.1",
                        "--mixup", "0.2", "--cutmix", "1.0", "--reprob", "0.25", "--aa", "ta_wide",
                        "--clip-grad", "5", "--accum-steps", "2", "--min-lr", "1e-5", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    raw = [i for i, line in enumerate(lines) if FINAL.match(line)]
    ema = [i for i, line in enumerate(lines) if line.startswith(" * EMA Prec@1")]
    assert raw and ema and raw[0] < ema[0]  # the Apex line for the raw model comes first
    checkpoint = torch.load(tmp_path / "checkpoint.pth.tar", map_location="cpu", weights_only=False)
    raw_w, ema_w = checkpoint["state_dict"]["fc.weight"], checkpoint["state_dict_ema"]["fc.weight"]
    assert ema_w.shape == raw_w.shape and not torch.allclose(ema_w, raw_w)
    assert checkpoint["global_batch"] == 32  # -b 16 x 1 process x --accum-steps 2
    # eval.py --ema scores the EMA weights: the training's own EMA line, to the printed digit
    evaluated = run_script("eval.py", "--resume", tmp_path / "checkpoint.pth.tar", "--ema")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "(its EMA weights)" in evaluated.stdout
    assert re.findall(r" \* Prec@1 ([\d.]+) Prec@5", evaluated.stdout) == \
        re.findall(r" \* EMA Prec@1 ([\d.]+) Prec@5", result.stdout)


def test_ingredient_flags_refused_where_they_cannot_work(usage_error):
    usage_error([*QUICK, "--model-ema-best"], "--model-ema")
    usage_error([*QUICK, "--aa", "nonsense-policy"], "--aa")
    usage_error([*QUICK, "-b", "15", "--mixup", "0.2"], "even")


def test_drop_path_reaches_the_model_or_is_refused(usage_error):
    from utils.models import build_model
    model = build_model("timm/resnet18", 10, drop_path=0.1)
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    assert rates and max(rates) == pytest.approx(0.1)
    usage_error([*QUICK, "--drop-path", "0.1"], "--drop-path", "resnet18")


def test_min_lr_floors_cosine_and_step_schedules():
    from dataclasses import replace

    from utils.engine import Schedule, learning_rate
    schedule = Schedule(lr=0.1, epochs=3, lr_schedule="cosine", lr_steps=(1, 2), min_lr=0.01)
    assert learning_rate(schedule, 2, 99, 100, 256) == pytest.approx(0.01, rel=1e-3)
    assert learning_rate(schedule, 0, 0, 100, 256) == pytest.approx(0.1)
    schedule = replace(schedule, lr_schedule="step")
    assert learning_rate(schedule, 2, 0, 100, 256) == pytest.approx(0.01)  # 0.001 without the floor
    schedule = replace(schedule, min_lr=0.0)
    assert learning_rate(schedule, 2, 0, 100, 256) == pytest.approx(0.001)


def test_no_wd_norm_bias_reaches_the_optimizer(accelerator, cache_dir):
    from utils.flags.parser import add_log_args, build_parser
    from utils.flags.precedence import parse_args
    from utils.training_state import build_training_state
    args = parse_args(add_log_args(build_parser("t")), [*QUICK, "--no-wd-norm-bias", "--opt", "lamb"])
    plan, _ = resolve_precision("O0", None, None, None)
    model_spec, optimizer_spec, _ = training_specs(args, channels_last=False, compile=False)
    model, optimizer, precision, _ = build_training_state(model_spec, optimizer_spec, accelerator, plan, 10)
    decays = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        assert decays[id(param)] == (0.0 if param.ndim <= 1 else args.weight_decay), name
    assert type(optimizer.optimizer).__name__ == "Lamb" and not precision.skips_on_device


def test_ema_is_restored_on_resume(cache_dir, tmp_path):
    first = run_script("train.py", *QUICK, "--epochs", "1", "--model-ema", "--model-ema-decay", "0.5",
                       "--output-dir", tmp_path)
    assert first.returncode == 0, first.stderr
    saved = torch.load(tmp_path / "checkpoint.pth.tar", map_location="cpu", weights_only=False)["state_dict_ema"]
    second = run_script("train.py", *QUICK, "--epochs", "2", "--model-ema", "--model-ema-decay", "0.5",
                        "--lr", "1e-9", "--resume", tmp_path / "checkpoint.pth.tar", "--output-dir", tmp_path)
    assert second.returncode == 0, second.stderr
    after = torch.load(tmp_path / "checkpoint.pth.tar", map_location="cpu", weights_only=False)
    # lr ~0: the weights stay; the EMA continued from the saved EMA rather than from the weights
    raw, ema = after["state_dict"]["fc.weight"], after["state_dict_ema"]["fc.weight"]
    assert not torch.allclose(ema, raw)
    assert torch.allclose(ema, 0.5 ** 4 * saved["fc.weight"] + (1 - 0.5 ** 4) * raw, atol=1e-5)


def test_the_batch_after_a_print_step_is_taken_before_the_print_steps_sync(accelerator):
    """At a print step the loop reads its figures from the device (a sync that empties the GPU's
    queue); the next step's batch is taken before that read, so the step after it is queued the
    moment the sync returns. No batch is taken beyond the epoch's last step."""
    events = []

    class Logged(Batches):
        def __iter__(self):
            for k, batch in enumerate(self.batches):
                events.append(f"take {k}")
                yield batch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    precision = Precision(resolve_precision("O0", None, None, None)[0], model, "cpu")
    built = build_optimizer("sgd", model, 0.1, momentum=0.0, weight_decay=0.0)
    precision.skips_on_device = built.skips_on_device
    args = SimpleNamespace(batch_size=4, accum_steps=1, lr=0.1, lr_schedule="step", lr_steps=[100], epochs=1,
                           warmup_epochs=0, min_lr=0.0, steps_per_epoch=0, print_freq=2, seed=0,
                           max_nonfinite_steps=None)
    data = SimpleNamespace(train=Logged(batches_of(5, 4)), num_classes=3)
    state = TrainingState(model, built.optimizer, precision, accelerator)
    result = train_one_epoch(state, data, 0, training_loop(args, nn.CrossEntropyLoss()),
                             Watch(log=lambda line: events.append(re.match(r"Epoch: \[0\]\[(\d+)/5\]", line).group(0))))
    assert result.count == 20
    assert events == ["take 0", "take 1", "take 2", "Epoch: [0][2/5]", "take 3", "take 4", "Epoch: [0][4/5]",
                      "Epoch: [0][5/5]"]
