"""Edges of resuming a run: the global-batch note counts --accum-steps on both sides, and
--keep-checkpoints after a resume from an older kept copy keeps the copy it just wrote.
"""
import pytest
import torch

from utils.flags.parser import add_log_args, build_parser
from utils.flags.precedence import parse_args
from utils.flags.specs import training_specs
from utils.run.checkpoint import kept_checkpoints, save_checkpoint
from utils.training_state import check_resume_meaning


def flags(*argv):
    return parse_args(add_log_args(build_parser("t")), list(argv))


def checkpoint_of(args):
    """What check_resume_meaning reads of a one-process run's checkpoint: its flags and world size
    (no opt level: the precision note stays out of the way)."""
    return {"epoch": 1, "arch": args.arch, "args": dict(vars(args)), "world_size": 1}


@pytest.fixture
def note(capsys, accelerator):
    def run(saved_checkpoint, resumed):
        capsys.readouterr()
        _, _, resume = training_specs(resumed, channels_last=False, compile=False)
        check_resume_meaning(resume, saved_checkpoint, None, accelerator)
        return [line for line in capsys.readouterr().err.splitlines() if "global batch" in line]
    return run


def test_another_accum_steps_with_the_same_batch_is_another_global_batch(note):
    saved = checkpoint_of(flags("-b", "8", "--accum-steps", "2"))
    lines = note(saved, flags("-b", "8", "--accum-steps", "4", "--lr", "0.256"))
    assert len(lines) == 1, lines
    assert "resuming with global batch 32 (--batch-size 8 x 1 process(es) x --accum-steps 4)" in lines[0]
    assert "the checkpoint had 16 (8 x 1 x 2)" in lines[0] and "(0.016 -> 0.032 at full rate)" in lines[0]


def test_batch_and_accum_steps_traded_for_the_same_global_batch_say_nothing(note):
    assert note(checkpoint_of(flags("-b", "8", "--accum-steps", "2")), flags("-b", "16")) == []
    assert note(checkpoint_of(flags("-b", "16")), flags("-b", "4", "--accum-steps", "4")) == []


def test_a_checkpoint_without_accum_steps_counts_one(note):
    saved = checkpoint_of(flags("-b", "16"))
    del saved["args"]["accum_steps"]  # written before --accum-steps existed
    assert note(saved, flags("-b", "8", "--accum-steps", "2")) == []
    lines = note(saved, flags("-b", "16", "--accum-steps", "2"))
    assert len(lines) == 1 and "global batch 32" in lines[0] and "had 16 (16 x 1 x 1)" in lines[0], lines


def kept(tmp_path):
    return [epoch for epoch, _ in kept_checkpoints(tmp_path)]


def test_keep_after_resuming_an_older_copy_keeps_the_copy_just_written(tmp_path):
    # A run kept epochs 1..5 with --keep-checkpoints 3, then resumed from checkpoint-epoch003 (the
    # continuation past 3 was abandoned) with --keep-checkpoints 1.
    for epoch in range(1, 6):
        save_checkpoint({"epoch": epoch, "step": 0}, False, tmp_path, keep=3)
    assert kept(tmp_path) == [3, 4, 5]
    written = save_checkpoint({"epoch": 4, "step": 0, "run": "resumed"}, False, tmp_path, keep=1)
    assert str(tmp_path / "checkpoint-epoch004.pth.tar") in written
    # Epoch 3 is pruned; the new epoch 4 stays; the abandoned epoch 5 waits to be overwritten.
    assert kept(tmp_path) == [4, 5]
    assert torch.load(tmp_path / "checkpoint-epoch004.pth.tar", weights_only=True)["run"] == "resumed"
    save_checkpoint({"epoch": 5, "step": 0, "run": "resumed"}, False, tmp_path, keep=1)
    assert kept(tmp_path) == [5]
    assert torch.load(tmp_path / "checkpoint-epoch005.pth.tar", weights_only=True)["run"] == "resumed"


def test_keep_two_after_resuming_an_older_copy(tmp_path):
    for epoch in range(1, 7):
        save_checkpoint({"epoch": epoch, "step": 0}, False, tmp_path, keep=6)
    save_checkpoint({"epoch": 3, "step": 0}, False, tmp_path, keep=2)  # resumed from epoch 2
    assert kept(tmp_path) == [2, 3, 4, 5, 6]  # 1 pruned; 2 and the new 3 kept; 4..6 left alone
    save_checkpoint({"epoch": 4, "step": 0}, False, tmp_path, keep=2)
    assert kept(tmp_path) == [3, 4, 5, 6]
