"""Paths, the shared ``benchlib`` helpers and the reply tag, for the driver and the workers.

Standard library only. Other modules read the paths as ``common.RESULTS_DIR`` (at call time), so
a test can point them elsewhere by setting this module's attributes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
EXPERIMENTS = PACKAGE_DIR.parent


def _import_benchlib():
    """``experiments/benchlib.py``: imported by name when ``experiments/`` is on ``sys.path`` (the
    command line, the workers), loaded from its path otherwise (tests load this package by
    path)."""
    try:
        import benchlib
    except ModuleNotFoundError as e:
        if e.name != "benchlib":
            raise
        path = EXPERIMENTS / "benchlib.py"
        spec = importlib.util.spec_from_file_location("benchlib", path)
        benchlib = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = benchlib
        spec.loader.exec_module(benchlib)
    return benchlib


benchlib = _import_benchlib()
REPO, RESULTS_DIR = benchlib.REPO, benchlib.RESULTS_DIR
RESULTS_MD = EXPERIMENTS / "RESULTS.md"
PEERS_DIR = EXPERIMENTS / "peers"
TAG = "@@BENCH "  # a worker's reply line on stdout starts with this


def importable(module: str) -> bool:
    """Whether ``module`` can be found, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
