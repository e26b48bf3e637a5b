"""Every ```python block of README.md and docs/*.md pastes into the plain Python REPL (issue
42.4: 5 of 18 failed in Python 3.11's). The REPL runs a compound statement when a blank line
ends it, so a block may hold no blank line inside an indented body (what follows it is then
an unexpected indent), and needs one after a body before the next top-level statement (else
that statement is a syntax error). ``codeop.compile_command``, the REPL's own test of
whether its input is complete, is fed each block line by line here, as a paste does."""

from __future__ import annotations

import codeop

import pytest

from tests.test_readme import DOCS, README, ROOT, python_blocks

PAGES = [README, *DOCS]


def repl_errors(code: str) -> list[str]:
    """What the interactive interpreter says, line by line, to ``code`` pasted into it."""
    errors, pending = [], []
    for number, line in enumerate([*code.splitlines(), ""], 1):
        pending.append(line)
        try:
            compiled = codeop.compile_command("\n".join(pending), "<stdin>", "single")
        except SyntaxError as exc:  # IndentationError too
            errors.append(f"line {number}: {exc.msg}: {line.strip()!r}")
            pending = []
            continue
        if compiled is not None:  # a complete statement: the REPL runs it
            pending = []
    return errors


def blank_then_indented(code: str) -> list[int]:
    """Lines (1-based) that are indented and follow a blank line: a body the REPL ends."""
    lines = code.splitlines()
    return [
        i + 1 for i in range(1, len(lines)) if not lines[i - 1].strip() and lines[i][:1].isspace()
    ]


def test_the_checks_see_what_the_repl_trips_on():
    assert repl_errors("x = 1\nfor i in range(2):\n    x += i\n\nprint(x)\n") == []
    assert repl_errors("for i in range(2):\n    x = i\nprint(x)\n")  # no blank line after
    assert repl_errors("for i in range(2):\n    x = i\n\n    y = i\n")  # a blank line inside
    assert blank_then_indented("if x:\n    a = 1\n\n    b = 2\n") == [4]
    assert repl_errors("d = {\n    'a': 1,\n\n    'b': 2,\n}\n") == []  # brackets continue


@pytest.mark.parametrize(
    "page",
    PAGES,
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_block_pastes_into_the_repl(page):
    failing = {}
    for block in python_blocks(page.read_text(), str(page.relative_to(ROOT))):
        errors = repl_errors(block.code)
        inside = blank_then_indented(block.code)
        if errors or inside:
            failing[block.where] = errors + [f"line {i}: blank line inside a body" for i in inside]
    assert not failing, failing
