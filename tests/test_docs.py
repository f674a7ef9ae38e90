"""The documentation: docs/flags.md is the scripts' --help, every docs/ path and link is real."""
import importlib.util
import os
import re
import subprocess

import pytest
from conftest import ROOT


def load_make_flags():
    """docs/make_flags.py as a module (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_flags", os.path.join(ROOT, "docs", "make_flags.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_flags():
    return load_make_flags()


@pytest.fixture(scope="module")
def help_texts(make_flags):
    """Each script's --help, run once for the tests below."""
    try:
        return make_flags.help_texts()
    except SystemExit as err:  # a script whose --help fails: its message, not a bare exit
        pytest.fail(str(err))


def test_flags_md_is_what_make_flags_writes(make_flags, help_texts):
    with open(make_flags.FLAGS_MD, encoding="utf-8") as handle:
        written = handle.read()
    assert written == make_flags.render(help_texts), \
        "docs/flags.md is out of date: run python docs/make_flags.py"


@pytest.mark.parametrize("script", ["train.py", "eval.py", "profile.py"])
def test_flags_md_lists_every_flag(script, help_texts):
    flags = sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]+)", help_texts[script])) - {"--help"})
    assert flags, "no flags parsed from --help"
    with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as handle:
        section = handle.read().split(f"\n## {script}\n", 1)
    assert len(section) == 2, f"docs/flags.md has no section for {script}"
    section = section[1].split("\n## ", 1)[0]
    missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", section)]
    assert not missing, f"docs/flags.md's {script} section lacks {missing}: run python docs/make_flags.py"


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
