"""The type check (``.venv/bin/mypy``: pyproject's ``[tool.mypy]``, ``.ci/run types``) covers
every module behind jddp's public names: a name that jddp/__init__.py's ``_EXPORTS`` takes from
a module the check does not list fails here, not silently unchecked. (The check itself runs in
its CI lane, not in the suite.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

import jddp

ROOT = Path(__file__).resolve().parent.parent


def test_the_type_check_covers_every_public_names_module():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    files = [Path(f) for f in config["files"]]
    modules = {"jddp"} | {spec.partition(":")[0] for spec in jddp._EXPORTS.values()}
    missing = []
    for module in sorted(modules):
        path = Path(*module.split("."))
        source = path / "__init__.py" if (ROOT / path).is_dir() else path.with_suffix(".py")
        assert (ROOT / source).exists(), source
        if not any(source == f or f in source.parents for f in files):
            missing.append(str(source))
    assert not missing, f"pyproject.toml [tool.mypy] files leaves out {missing}"
