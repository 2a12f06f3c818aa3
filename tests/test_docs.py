"""The front door is not a diary: README.md, CONTRIBUTING.md and docs/*.md carry no commit hash,
no date and no measured duration. Figures live in experiments/RESULTS.md (with their machine,
command and commit), linked from the page that needs them.

A duration counts in prose only: a value in a code block or between backticks (a config
example's ``dist.step_timeout_s: 600``, a line the program prints) is the program's, not a
measurement."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?!\n))*`")  # a code span may wrap a line
# 7-40 hex digits with at least one digit and one letter a-f: a hash, not "added" or "1234567".
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
# A number (approximate, with a decimal point or thousands, or a range) and a unit of time.
DURATION = re.compile(
    r"(?<![\w.])~?\d[\d,.]*(?:\s?[–-]\s?\d[\d,.]*)?\s?"
    r"(?:ms|µs|us|s|sec|seconds?|min|minutes?|h|hours?)\b(?!-)"
)


def prose(text: str) -> str:
    """``text`` without its code blocks and inline code (each replaced by a space, so that line
    numbers hold)."""

    def blank(match: re.Match) -> str:
        return " " + "\n" * match.group().count("\n")

    return INLINE_CODE.sub(blank, FENCE.sub(blank, text))


def diary_entries(text: str) -> list[str]:
    """``line N: what`` for each commit hash or date anywhere in ``text``, and each duration in
    its prose."""
    found = []
    for kind, pattern, where in (("commit hash", HASH, text), ("date", DATE, text),
                                 ("duration", DURATION, prose(text))):  # fmt: skip
        for match in pattern.finditer(where):
            line = where.count("\n", 0, match.start()) + 1
            found.append(f"line {line}: {kind} {match.group().strip()!r}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hash_date_or_duration(page):
    entries = diary_entries(page.read_text())
    assert not entries, (
        f"{page.relative_to(ROOT)} reads as a diary; put figures in experiments/RESULTS.md "
        "and link it:\n" + "\n".join(entries)
    )


def test_the_checker_finds_what_it_must_and_nothing_else():
    diary = (
        "0.9806 in 58 s in a fresh clone at 1f8d348, 2026-11-27; 733 tests, 7 min 49 s–8 min\n"
        "48 s of pytest (the fast lane, ~2 min; a step of 0.62 s, 435 s, 1–11 s, 4.6 min)\n"
    )
    assert [e.split(": ", 1)[1] for e in diary_entries(diary)] == [
        "commit hash '1f8d348'",
        "date '2026-11-27'",
        "duration '58 s'",
        "duration '7 min'",
        "duration '49 s'",
        "duration '8 min'",
        "duration '48 s'",
        "duration '~2 min'",
        "duration '0.62 s'",
        "duration '435 s'",
        "duration '1–11 s'",
        "duration '4.6 min'",
    ]
    fine = (
        "It added a decade of faces, 1234567 steps, 5,541 images/s, ResNet-50, 2 processes,\n"
        "3 steps, 16 hosts, a 10-s timeout, `dist.step_timeout_s=600`, `0x7f3a9c2e`:\n"
        "```yaml\ndist:\n  step_timeout_s: 600   # 10 min\n```\n"
        "the line `jddp: done step=220 ... wall_s=53.2` and every `checkpoint.every_minutes`.\n"
    )
    assert diary_entries(fine) == []
