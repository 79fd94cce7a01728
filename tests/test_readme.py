"""The README's table of contents lists every ## and ### section, in order,
with GitHub's anchors."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _anchor(title):
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_table_of_contents_lists_every_section():
    text = open(os.path.join(ROOT, "README.md")).read()
    headings, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^(##|###) (.*)$", line)
        if m:
            headings.append(("  " if m.group(1) == "###" else "") +
                            f"* [{m.group(2)}](#{_anchor(m.group(2))})")
    toc = text.split("**Contents**\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert toc == headings
