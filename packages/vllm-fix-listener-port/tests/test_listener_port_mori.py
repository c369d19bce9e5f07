"""Which MORI is installed decides the strategy: port 0 (auto-bind reported) or a held reservation."""

from __future__ import annotations

import pytest

from vllm_fix_listener_port import mori_support
from vllm_fix_testing.mori_io import installed_mori


@pytest.mark.parametrize(
    ("version", "auto_bind"),
    [
        ("0.1.0", True),
        ("1.2.2", True),
        ("0.1.1.dev3+gabc", True),
        ("0.1.dev40+gf23efd7", False),  # setuptools-scm before the first tag
        ("0.0.1", False),
        ("not a version", None),
        (None, None),
    ],
)
def test_auto_bind_from_the_version(version: str | None, auto_bind: bool | None) -> None:
    assert mori_support.supports_auto_bind(version) is auto_bind


def test_installed_mori_reads_the_importable_module() -> None:
    assert not mori_support.installed_mori().present  # this machine has no MORI
    with installed_mori("1.2.2"):
        found = mori_support.installed_mori()
        assert (found.present, found.version, found.auto_bind) == (True, "1.2.2", True)
    with installed_mori("0.0.1.dev20+g0000000"):
        found = mori_support.installed_mori()
        assert found.present and found.auto_bind is False
        assert "cannot report" in found.describe()
    with installed_mori(None):
        found = mori_support.installed_mori()
        assert found.present and found.auto_bind is None
    assert not mori_support.installed_mori().present  # restored


def test_strategy_per_mori() -> None:
    from vllm_fix_listener_port.patch import HELD_RESERVATION, PORT_ZERO, strategy

    assert strategy()[0] == PORT_ZERO  # no MORI: no worker can start; the default
    with installed_mori("1.2.2"):
        assert strategy()[0] == PORT_ZERO
    with installed_mori("0.0.1.dev20+g0000000"):
        assert strategy()[0] == HELD_RESERVATION
    with installed_mori(None):
        assert strategy()[0] == HELD_RESERVATION  # unknown: never a certain failure
