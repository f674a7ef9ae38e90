"""The README documents every flag of every script."""
import os
import re

import pytest

from conftest import ROOT


def option_strings(script):
    """Long option names of a script's parser, read from its --help output."""
    from conftest import run_script
    result = run_script(script, "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout, sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]+)", result.stdout)) - {"--help"})


@pytest.mark.parametrize("script", ["train.py", "eval.py", "profile.py"])
def test_readme_lists_every_flag(script):
    if not os.path.exists(os.path.join(ROOT, script)):
        pytest.fail(f"{script} is missing")
    readme = open(os.path.join(ROOT, "README.md")).read()
    _, flags = option_strings(script)
    assert flags, "no flags parsed from --help"
    missing = [flag for flag in flags if f"`{flag}" not in readme]
    assert not missing, f"README does not document {missing}"
