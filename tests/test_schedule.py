"""The LR schedule: --lr-steps milestones, the warmup cap for short runs, and their usage errors."""
import argparse

import pytest

from utils.engine import learning_rate as engine_learning_rate
from utils.flags.parser import build_parser
from utils.flags.precedence import parse_args
from utils.flags.specs import training_loop
from utils.run.errors import UsageError


def parse(*argv):
    return parse_args(build_parser("test"), list(argv))


def learning_rate(args, *where):
    """utils.engine.learning_rate of the schedule the flags in args make."""
    return engine_learning_rate(training_loop(args, criterion=None).schedule, *where)


def schedule(lr_steps, warmup_epochs=0, epochs=90, lr_schedule="step"):
    return argparse.Namespace(lr=0.1, lr_schedule=lr_schedule, lr_steps=lr_steps, min_lr=0.0, batch_size=256,
                              seed=0, print_freq=10, accum_steps=1, steps_per_epoch=0, max_nonfinite_steps=None,
                              warmup_epochs=warmup_epochs, epochs=epochs)


def test_each_milestone_passed_multiplies_the_lr_by_a_tenth():
    args = parse("/data/imagenet")  # Apex's ImageNet schedule
    assert args.lr_steps == [30, 60, 80] and args.warmup_epochs == 5
    lrs = {epoch: learning_rate(args, epoch, 0, 100, 256) for epoch in (5, 29, 30, 59, 60, 80, 89)}
    assert lrs == pytest.approx({5: 0.1, 29: 0.1, 30: 0.01, 59: 0.01, 60: 1e-3, 80: 1e-4, 89: 1e-4})
    custom = schedule([2, 4])
    assert [learning_rate(custom, e, 0, 10, 512) for e in range(6)] == pytest.approx(
        [0.2, 0.2, 0.02, 0.02, 0.002, 0.002])  # and the LR scales with the global batch


def test_the_digits_demo_decays_inside_its_epochs():
    args = parse()
    assert args.epochs == 12 and max(args.lr_steps) < args.epochs
    first, last = learning_rate(args, 2, 0, 22, 64), learning_rate(args, args.epochs - 1, 21, 22, 64)
    assert last == pytest.approx(first * 0.1 ** len(args.lr_steps))


def test_warmup_ramps_linearly_then_holds():
    args = schedule([30], warmup_epochs=2)
    ramp = [learning_rate(args, epoch, step, 4, 256) for epoch in range(2) for step in range(4)]
    assert ramp == pytest.approx([0.1 * (i + 1) / 8 for i in range(8)])
    assert learning_rate(args, 2, 0, 4, 256) == pytest.approx(0.1)


@pytest.mark.parametrize("argv, warmup", [
    (["/data/imagenet"], 5),                                         # 90 epochs: Apex's 5
    (["/data/imagenet", "--epochs", "8"], 2),                        # capped at epochs // 4
    (["/data/imagenet", "--epochs", "8", "--warmup-epochs", "5"], 5),  # a given flag always wins
    (["--epochs", "2"], 0),                                          # digits, too short to warm up
])
def test_a_default_warmup_is_capped_for_short_runs(argv, warmup):
    assert parse(*argv).warmup_epochs == warmup


def test_a_warning_when_no_milestone_falls_inside_the_epochs(capsys):
    parse("/data/imagenet", "--epochs", "20")
    assert "warning: no --lr-steps milestone (30 60 80) falls inside --epochs 20" in capsys.readouterr().err
    parse("/data/imagenet", "--epochs", "20", "--lr-steps", "15")
    parse("/data/imagenet", "--epochs", "20", "--lr-schedule", "cosine")
    parse()  # the digits demo's own milestones lie inside its 12 epochs
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("steps", [["0"], ["-3"], ["x"], ["2.5"]])
def test_lr_steps_must_be_positive_integers(capsys, steps):
    with pytest.raises(SystemExit) as exit_info:
        parse("--lr-steps", *steps)
    assert exit_info.value.code == 2
    assert "--lr-steps: expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lr-steps", "30", "20"], "--lr-steps must be increasing epochs, got 30 20"),
    (["--lr-steps", "30", "30"], "--lr-steps must be increasing epochs, got 30 30"),
    (["--lr-schedule", "cosine", "--lr-steps", "5"], "--lr-steps applies to --lr-schedule step, not cosine"),
])
def test_bad_lr_steps_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)
