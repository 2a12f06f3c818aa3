"""Write the table of every config key (type and range, default, meaning) into docs/config.md,
between its ``<!-- keys -->`` markers, from the schema itself (what ``python -m jddp.train
--help`` lists).

    .venv/bin/python scripts/config_reference.py          # rewrite the table
    .venv/bin/python scripts/config_reference.py --check  # exit 1 if it is out of date

tests/test_front_door.py runs the check, so the reference cannot drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "config.md"
BEGIN, END = "<!-- keys -->", "<!-- /keys -->"


def table() -> str:
    """The markdown table of every key, in declaration order."""
    sys.path.insert(0, str(ROOT))
    from jddp.config.parse import iter_keys, type_and_range

    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, tp, default, meaning in iter_keys():
        flow = isinstance(default, list)
        shown = yaml.safe_dump(default, default_flow_style=flow).strip().removesuffix("...").strip()
        cells = [f"`{key}`", type_and_range(key, tp), f"`{shown}`", meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def rewritten(text: str) -> str:
    """``text`` with the table between the markers replaced by :func:`table`."""
    head, found, rest = text.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"{PAGE}: no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{table()}\n{END}{rest.partition(END)[2]}"


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print(f"{PAGE} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
