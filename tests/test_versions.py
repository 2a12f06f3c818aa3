"""A known-broken jax/flax pair is one clear error naming both versions and the fix
(jddp.proc.versions)."""

import pytest

from jddp.errors import JddpError
from jddp.proc import versions


@pytest.mark.parametrize(
    "jax_v, flax_v, broken",
    [("0.11.2", "0.12.8", True), ("0.11.0", "0.12.9", True), ("0.11.2", "0.12.10", False),
     ("0.10.2", "0.12.8", False), ("0.12.0rc1", "0.12.9.dev3", True),
     ("0.11.0", "0.12.10rc1", False), ("0.10.9", "0.12.1", False)],
)  # fmt: skip
def test_known_broken_pairs(monkeypatch, jax_v, flax_v, broken):
    installed = {"jax": jax_v, "flax": flax_v}
    monkeypatch.setattr(versions.metadata, "version", installed.__getitem__)
    if not broken:
        versions.check_versions()
        return
    with pytest.raises(JddpError) as e:
        versions.check_versions()
    assert str(e.value) == (
        f"flax {flax_v} does not work with jax {jax_v} (jax.experimental.hijax.HiPrimitive is "
        "gone in jax 0.11): pip install 'flax>=0.12.10'"
    )


def test_installed_versions_pass():
    versions.check_versions()  # the lock's jax 0.10.2 + flax 0.12.8
