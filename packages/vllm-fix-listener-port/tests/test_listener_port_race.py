"""Real processes race through vLLM's real MoRIIOConnectorWorker.__init__ on loopback (see conftest.py).

Negative control: unpatched with VLLM_PORT set, ranks get the same port from the released
probe and native binds fail (MORI's exit(-1)); how many depends on timing (a rank whose
listener is already up makes the next probe move on), so the control asserts at least
one and reports the count. Positive check: the same race with the plugin loaded in every
rank has 0 bind failures and N distinct published ports, each equal to the port the
worker and its config report; with a MORI that reports an auto-bound port (port 0) and
with an older one (held reservation).
"""

from __future__ import annotations

from typing import Any

import pytest

NEW_MORI = "1.2.2"
OLD_MORI = "0.0.1.dev20+g0000000"


def _check_patched(result: dict[str, Any], n: int, strategy: str) -> None:
    assert result["bind_failures"] == 0, result["errors"]
    assert result["distinct"] == n
    if strategy == "port 0":
        assert result["allocated"] == [0]  # every rank asked the native listener for port 0
    else:
        assert len(result["allocated"]) == n and 0 not in result["allocated"]  # n held ports
    for report in result["reports"]:
        assert report["published"] != 0
        assert report["worker_port"] == report["config_port"] == report["published"]


def _check_unpatched(result: dict[str, Any]) -> None:
    assert result["bind_failures"] >= 1, "no rank collided: the negative control did not reproduce"
    assert result["errors"] == ["Address already in use"]
    assert result["distinct"] < result["n"]


@pytest.mark.parametrize("n", [8, pytest.param(64, marks=pytest.mark.stress)])
def test_two_ranks_bind_one_released_port_under_vllm_port(
    n: int, race: Any, race_text: Any, fresh_port_base: int
) -> None:
    unpatched = race(n, False, fresh_port_base)
    port_zero = race(n, True, fresh_port_base, NEW_MORI)
    held = race(n, True, fresh_port_base, OLD_MORI)
    print("\n" + "\n".join(race_text(r) for r in (unpatched, port_zero, held)))
    _check_unpatched(unpatched)
    _check_patched(port_zero, n, "port 0")
    _check_patched(held, n, "held reservation")
    assert min(held["allocated"]) >= fresh_port_base  # the held ports follow VLLM_PORT


def test_ephemeral_race_in_private_netns(netns: Any, race_text: Any) -> None:
    """VLLM_PORT unset: a one-port ephemeral range makes the released probe collide."""
    unpatched = netns("race", 2, False, (40000, 40000))
    patched = netns("race", 2, True, (40000, 40001))
    print("\n[netns] " + race_text(unpatched) + "\n[netns] " + race_text(patched))
    assert unpatched["allocated"] == [40000]
    assert unpatched["bind_failures"] >= 1
    assert unpatched["errors"] == ["Address already in use"]
    _check_patched(patched, 2, "port 0")
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
