"""The front door cannot drift from the code: every command in the README's and docs' code blocks
names a module, config file, script and config keys that exist; every config key is documented;
every shipped config says how to run it and what it gives."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from jddp.config import schema

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
KEY = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)=")


def config_keys() -> set[str]:
    """Every ``section.key`` (and ``workdir``) of the config schema."""
    keys = set()
    for section in dataclasses.fields(schema.Config):
        if dataclasses.is_dataclass(section.type) or isinstance(section.default_factory, type):
            cls = section.default_factory  # type: ignore[misc]
            keys.update(f"{section.name}.{f.name}" for f in dataclasses.fields(cls))
        else:
            keys.add(section.name)
    return keys


def commands(text: str) -> list[list[str]]:
    """The shell commands of ``text``'s fenced code blocks (continuation lines joined, comments
    and prompts dropped, ``a; b`` and ``a && b`` split), as argument lists."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip().removeprefix("$ ")
            for part in re.split(r"\s(?:&&|;|\|)\s", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue  # Python or YAML in the block, not a command
                if words:
                    found.append(words)
    return found


def jddp_invocations(words: list[str]) -> list[tuple[str, list[str]]]:
    """``(module, its arguments)`` for each ``python -m jddp.X`` in a command (a launcher's
    inner command included)."""
    out = []
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1].startswith("jddp."):
            rest = words[i + 2 :]
            inner = rest.index("--") if "--" in rest else len(rest)
            out.append((words[i + 1], rest[:inner]))
    return out


SECTIONS = {f.name for f in dataclasses.fields(schema.Config)}


def problems_in(where: str, words: list[str], keys: set[str]) -> list[str]:
    """What a documented command names that does not exist: a ``jddp`` module, a config key of
    ``python -m jddp.train``, a script, config or example file of this repository."""
    where = f"{where}: {' '.join(words)[:100]}"
    problems = []
    for module, args in jddp_invocations(words):
        if not re.fullmatch(r"jddp(\.[a-z_]+)+", module):
            continue  # prose such as jddp.<name>
        path = ROOT / Path(*module.split("."))
        if not (path.with_suffix(".py").exists() or (path / "__main__.py").exists()):
            problems.append(f"{where}: no module {module}")
        if module != "jddp.train":
            continue
        for arg in args:
            match = KEY.match(arg)
            if match and match.group(1).split(".")[0] in SECTIONS:
                key = match.group(1)
                if key not in keys and not key.startswith(("model.options.", "data.options.")):
                    problems.append(f"{where}: no config key {key}")
    for word in words:  # scripts and files of this repository named by a command
        if re.fullmatch(r"(scripts|experiments|examples|configs)/[\w./-]+\.(py|sh|yaml)", word):
            if not (ROOT / word).exists():
                problems.append(f"{where}: no file {word}")
    return problems


DOC_COMMANDS = [(doc, words) for doc in DOCS if doc.exists() for words in commands(doc.read_text())]


def test_documented_commands_name_real_modules_files_and_keys():
    keys = config_keys()
    problems = [p for doc, words in DOC_COMMANDS for p in problems_in(doc.name, words, keys)]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_the_commands():
    """The checker reads what it must: the README's two set-up commands and a launcher's inner
    command with its config keys."""
    readme = [w for d, w in DOC_COMMANDS if d.name == "README.md"]
    assert ["bash", "scripts/setup.sh"] in [w[:2] for w in readme]
    words = shlex.split("python -m jddp.launch --nproc 2 -- python -m jddp.train optim.lr=0.1")
    assert jddp_invocations(words) == [("jddp.launch", ["--nproc", "2"]),
                                       ("jddp.train", ["optim.lr=0.1"])]  # fmt: skip
    assert "optim.lr" in config_keys() and "workdir" in config_keys()
    wrong = commands("```\npython -m jddp.trian x=1\npython -m jddp.train --config configs/no.yaml "
                     "optim.lerning_rate=1 && bash scripts/nope.sh\n```\n")  # fmt: skip
    found = [p for w in wrong for p in problems_in("t", w, config_keys())]
    assert [p.rsplit(": ", 1)[1] for p in found] == [
        "no module jddp.trian",
        "no config key optim.lerning_rate",
        "no file configs/no.yaml",
        "no file scripts/nope.sh",
    ]


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_each_config_says_how_to_run_it_and_what_it_gives(config):
    header = []
    for line in (ROOT / "configs" / config).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    assert f"--config configs/{config}" in text, f"configs/{config}: no command in its header"
    assert re.search(r"Expected", text), f"configs/{config}: no expected result in its header"


def test_every_config_key_is_in_the_config_reference():
    """docs/config.md holds the generated table of every key (what --help lists), up to date."""
    import subprocess
    import sys

    from jddp.config.parse import iter_keys

    check = [sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"]
    out = subprocess.run(check, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    page = (ROOT / "docs" / "config.md").read_text()
    missing = [key for key, *_ in iter_keys() if f"`{key}`" not in page]
    assert not missing, f"docs/config.md lacks {missing}"
