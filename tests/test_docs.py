"""The documentation: every flag of every script in the README, every docs/ path and link real."""
import os
import re
import subprocess

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


# docs/ paths as the repo spells them in prose, code and comments; not inside a URL or longer name.
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*[\w/]")
# Relative Markdown link targets: [text](target) or [text](target#anchor), not URLs.
MD_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)(?:#[^)]*)?\)")


def repo_text_files():
    """Tracked files plus new ones git would track (the docs pages may not be committed yet)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for path in sorted(set(listed)):
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            continue  # deleted in the working tree but still in the index
        try:
            with open(full, encoding="utf-8") as handle:
                yield path, handle.read()
        except UnicodeDecodeError:
            continue  # binary: no prose to check


def test_every_docs_path_named_in_the_repo_exists():
    named = {(path, match) for path, text in repo_text_files() for match in DOCS_PATH.findall(text)}
    assert any(match == "docs/distributed.md" for _, match in named), "the scan found none of the known paths"
    missing = sorted(f"{path}: {match}" for path, match in named if not os.path.exists(os.path.join(ROOT, match)))
    assert not missing, f"docs/ paths named but missing: {missing}"


def test_relative_markdown_links_resolve():
    checked, broken = 0, []
    for path, text in repo_text_files():
        if not path.endswith(".md"):
            continue
        for target in MD_LINK.findall(text):
            checked += 1
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(path), target)):
                broken.append(f"{path}: {target}")
    assert checked, "no relative links found: the pattern no longer matches the docs"
    assert not broken, f"broken links: {broken}"
