"""The README is the front page: its table of contents lists every ## and ###
section, in order, with GitHub's anchors; it stays under 250 lines; its links
reach files and sections that exist; its two set-up commands are the docs' and
the CI's; and its example trains (cluster tier). The code cites docs pages, not
README sections (tests/test_docs.py)."""

import glob
import os
import re
import sys

import pytest
from markdown.extensions.toc import slugify

from conftest import ROOT, run_command

README = os.path.join(ROOT, "README.md")
INSTALL_AND_RUN = ('pip install -e ".[examples]" && '
                   "tf-asyncps launch --flagfile=configs/digits_async.flags")
TEST_COMMAND = ('python -m pytest -q -n 2 --dist loadfile -m "not solo and not soak and not long" && '
                "python -m pytest -q -m solo")


def _anchor(title):
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _text(path=README):
    with open(path) as f:
        return f.read()


def _headings(text, levels=("##", "###")):
    """(level, title) of each heading outside code blocks."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^(#+) (.*)$", line)
        if m and m.group(1) in levels:
            out.append((m.group(1), m.group(2)))
    return out


def _links(text):
    """(label, target) of each Markdown link outside code blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    prose = re.sub(r"`[^`\n]+`", "code", prose)  # `x["k"](y)` is code, not a link
    return re.findall(r"\[((?:[^\[\]]|\[[^\]]*\])+)\]\(([^)\s]+)\)", prose)


def test_table_of_contents_lists_every_section():
    text = _text()
    headings = [("  " if level == "###" else "") + f"* [{title}](#{_anchor(title)})"
                for level, title in _headings(text)]
    toc = text.split("**Contents**\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert toc == headings


def test_readme_is_a_front_page_under_250_lines():
    assert len(_text().splitlines()) < 250


def test_every_link_reaches_a_file_and_section_that_exist():
    """Relative links of the README, and of the docs pages to each other, point
    at existing files; a #fragment names a heading of that file (as MkDocs and
    GitHub slug it)."""
    pages = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    checked = 0
    for page in pages:
        for label, target in _links(_text(page)):
            if re.match(r"[a-z]+:", target):
                continue  # https://...
            path, _, fragment = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.isfile(full), f"{os.path.relpath(page, ROOT)}: [{label}]({target})"
            if fragment:
                # The README is read on GitHub, the docs pages on the MkDocs site:
                # each slugs headings its own way (`--x` keeps its hyphens on GitHub).
                slug = _anchor if page == README else lambda t: slugify(t, "-")
                slugs = {slug(t) for _, t in _headings(_text(full), ("#", "##", "###", "####"))}
                assert fragment in slugs, (f"{os.path.relpath(page, ROOT)}: [{label}]({target}): "
                                           f"no heading with that anchor in {path or 'this page'}")
            checked += 1
    assert checked > 60


def test_the_two_set_up_commands_are_the_docs_and_the_ci_commands():
    readme = _text()
    blocks = re.findall(r"^```bash\n(.*?)\n```", readme, flags=re.S | re.M)
    assert blocks == [INSTALL_AND_RUN, 'pip install -e ".[test,examples]" && ' + TEST_COMMAND]
    # Getting started holds the same set-up, and .ci/run runs that test command.
    started = _text(os.path.join(ROOT, "docs", "getting_started.md"))
    assert all(started.count(f"```bash\n{b}\n```") == 1 for b in blocks)
    ci = _text(os.path.join(ROOT, ".ci", "run")).splitlines()
    assert 'python -m pip install -q -e ".[test,examples]"' in ci
    assert ci[-1] == TEST_COMMAND


def _example():
    blocks = re.findall(r"^```python\n(.*?)\n```", _text(), flags=re.S | re.M)
    assert len(blocks) == 1
    return blocks[0]


def test_the_example_is_about_twenty_lines():
    assert 15 <= len(_example().splitlines()) <= 25


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_readme_example_trains_every_scheduled_step():
    pytest.importorskip("sklearn")  # the examples extra
    _, out = run_command([sys.executable, "-c", _example()], timeout=280)
    # async: every worker step (3 epochs x 50) applied, one update each.
    assert "StalenessStats(global_step=150, applied=150, dropped=0, " in out, out[-4000:]
