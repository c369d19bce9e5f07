"""Real processes race through the real from_vllm_config on loopback (see conftest.py).

Negative control: unpatched with VLLM_PORT set, every rank gets the same port and
all but one native bind fail (MORI's exit(-1)). Positive check: the same race with
the plugin loaded in every rank has 0 bind failures and N distinct published ports,
each equal to the port the worker and its config report.
"""

from __future__ import annotations

from typing import Any

import pytest


def _check_patched(result: dict[str, Any], n: int) -> None:
    assert result["bind_failures"] == 0, result["errors"]
    assert result["distinct"] == n
    assert result["allocated"] == [0]  # every rank asked the native listener for port 0
    for report in result["reports"]:
        assert report["published"] != 0
        assert report["worker_port"] == report["config_port"] == report["published"]


def _check_unpatched(result: dict[str, Any], n: int) -> None:
    assert len(result["allocated"]) == 1  # VLLM_PORT scanning: everyone got the same number
    assert result["bind_failures"] == n - 1
    assert result["errors"] == ["Address already in use"]
    assert result["distinct"] == 1


@pytest.mark.parametrize("n", [8, pytest.param(64, marks=pytest.mark.stress)])
def test_vllm_port_race(n: int, race: Any, race_text: Any, fresh_port_base: int) -> None:
    unpatched = race(n, False, fresh_port_base)
    patched = race(n, True, fresh_port_base)
    print("\n" + race_text(unpatched) + "\n" + race_text(patched))
    _check_unpatched(unpatched, n)
    _check_patched(patched, n)


def test_ephemeral_race_in_private_netns(netns: Any, race_text: Any) -> None:
    """VLLM_PORT unset: a one-port ephemeral range makes the released probe collide."""
    unpatched = netns("race", 2, False, (40000, 40000))
    patched = netns("race", 2, True, (40000, 40001))
    print("\n[netns] " + race_text(unpatched) + "\n[netns] " + race_text(patched))
    assert unpatched["allocated"] == [40000]
    assert unpatched["bind_failures"] == 1
    assert unpatched["errors"] == ["Address already in use"]
    _check_patched(patched, 2)
    assert sorted(patched["published"]) == [40000, 40001]


def test_outgoing_connect_takes_the_probed_port_in_private_netns(netns: Any) -> None:
    """An unrelated connect() between the probe and the native bind takes the probed port."""
    unpatched = netns("connect", 1, False, (40000, 40000))
    patched = netns("connect", 1, True, (40000, 40001))
    print(f"\n[netns connect] unpatched: {unpatched}\n[netns connect] patched: {patched}")
    assert unpatched["allocated"] == unpatched["client_port"] == 40000
    assert unpatched["error"] == "Address already in use"
    assert patched["allocated"] == 0
    assert patched["error"] is None
    assert patched["published"] == patched["worker_port"]
    assert {patched["published"], patched["client_port"]} == {40000, 40001}
