"""jddp's XLA defaults: the XLA:CPU flag only where it is known and wanted, and the persistent
compilation cache. (Their speed is measured in experiments/bench_xla.py, not tested here.)"""

import pytest

from jddp import xla_setup
from jddp.xla_setup import CPU_CONV_OFF_YNNPACK, YNN_FLAG, apply_cpu_flags


def test_cpu_flag_is_added_on_cpu_once():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_foo=1"}
    assert apply_cpu_flags(env) == [CPU_CONV_OFF_YNNPACK]
    assert env["XLA_FLAGS"] == f"--xla_foo=1 {CPU_CONV_OFF_YNNPACK}"
    assert apply_cpu_flags(env) == []  # already there: untouched


@pytest.mark.parametrize(
    "env",
    [
        {"JAX_PLATFORMS": "cpu", "JDDP_XLA_DEFAULTS": "0"},  # opted out
        {"JAX_PLATFORMS": "cuda"},  # a GPU run: XLA:CPU flags do not matter
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{YNN_FLAG}=default"},  # the user's own choice
    ],
)
def test_cpu_flag_is_left_out(env):
    before = dict(env)
    assert apply_cpu_flags(env) == []
    assert env == before


def test_the_flag_is_only_used_where_xla_knows_it(monkeypatch):
    monkeypatch.setattr(xla_setup, "KNOWN_JAXLIB_SERIES", ())  # force the library scan
    assert xla_setup._xla_knows(YNN_FLAG)  # the installed jaxlib (0.10) defines it
    assert not xla_setup._xla_knows("--xla_cpu_no_such_flag_in_any_release")
    monkeypatch.setattr(xla_setup, "_xla_knows", lambda flag: False)
    assert apply_cpu_flags({"JAX_PLATFORMS": "cpu"}) == []
