"""The fallback reservation's socket semantics, verified on loopback (spec §1.4.2).

No vLLM needed except for the one check that vLLM's own get_open_port() scan
skips a held port (it runs against the installed vLLM).
"""

from __future__ import annotations

import errno
import socket

import pytest

from vllm_fix_listener_port.reserve import hold, hold_scanning, reserve_port
from vllm_fix_testing.mori_io import mori_listen

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _plain_bind(host: str, port: int) -> None:
    """A probe like vLLM's _get_open_port: bind without SO_REUSEADDR, then close."""
    with socket.socket() as sock:
        sock.bind((host, port))


def test_second_exclusive_reservation_is_refused() -> None:
    with reserve_port(HOST) as first:
        with pytest.raises(OSError) as err:
            hold(HOST, first.port)
        assert err.value.errno == errno.EADDRINUSE


def test_plain_probe_cannot_take_a_held_port() -> None:
    with reserve_port(HOST) as held:
        for host in (HOST, ""):  # specific address and wildcard
            with pytest.raises(OSError) as err:
                _plain_bind(host, held.port)
            assert err.value.errno == errno.EADDRINUSE


def test_wildcard_reservation_blocks_specific_address() -> None:
    with reserve_port("") as held, pytest.raises(OSError):
        _plain_bind(HOST, held.port)


def test_mori_style_listener_binds_while_reserved() -> None:
    with reserve_port(HOST) as held:
        listener = mori_listen(HOST, held.port)
        try:
            assert listener.getsockname()[1] == held.port
            with pytest.raises(OSError):  # and now nobody else can
                hold(HOST, held.port)
        finally:
            listener.close()


def test_mori_style_listener_binds_on_wildcard_reservation() -> None:
    with reserve_port("") as held:
        listener = mori_listen(HOST, held.port)
        listener.close()


def test_without_reuseaddr_switched_on_the_native_bind_fails() -> None:
    """Why step 2 matters: an exclusive holder that never enables SO_REUSEADDR blocks MORI."""
    sock = socket.socket()
    try:
        sock.bind((HOST, 0))
        with pytest.raises(OSError) as err:
            mori_listen(HOST, sock.getsockname()[1]).close()
        assert err.value.errno == errno.EADDRINUSE
    finally:
        sock.close()


def test_trap_reuseaddr_before_bind_lets_two_reservers_share() -> None:
    """The trap: SO_REUSEADDR set before bind -> two 'reservations' of one port both succeed."""
    first = socket.socket()
    second = socket.socket()
    try:
        for sock in (first, second):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind((HOST, 0))
        port = first.getsockname()[1]
        second.bind((HOST, port))  # no error: the trap
        assert second.getsockname()[1] == port
    finally:
        first.close()
        second.close()
    # ...whereas the helper's exclusive bind refuses the second reserver.
    with reserve_port(HOST) as held, pytest.raises(OSError):
        hold(HOST, held.port)


def test_bind_zero_never_returns_a_held_port() -> None:
    with reserve_port(HOST) as held:
        seen = set()
        for _ in range(200):
            with socket.socket() as sock:
                sock.bind((HOST, 0))
                seen.add(sock.getsockname()[1])
        assert held.port not in seen


def test_released_on_success_and_on_error() -> None:
    with reserve_port(HOST) as held:
        port = held.port
        assert held.held
    assert not held.held
    _plain_bind(HOST, port)  # free again
    with pytest.raises(RuntimeError), reserve_port(HOST) as failed:
        port = failed.port
        raise RuntimeError("native listener start failed")
    assert not failed.held
    _plain_bind(HOST, port)


def test_scanning_skips_held_ports_and_holds() -> None:
    with reserve_port(HOST) as first, reserve_port(HOST, first.port, scan=50) as second:
        assert second.port > first.port
        with pytest.raises(OSError):
            _plain_bind(HOST, second.port)


def test_scanning_exhausted_is_a_clear_error() -> None:
    with reserve_port(HOST) as held, pytest.raises(OSError, match="no free port"):
        hold_scanning(HOST, held.port, attempts=1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        hold(HOST, 70000)
    with pytest.raises(ValueError):
        hold_scanning(HOST, _free_port(), attempts=0)


def test_vllm_get_open_port_scan_skips_a_held_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own VLLM_PORT scan (real get_open_port) does not return a reserved port."""
    from vllm.utils.network_utils import get_open_port

    with reserve_port("") as held:
        monkeypatch.setenv("VLLM_PORT", str(held.port))
        assert get_open_port() != held.port


# ---- the fallback as the fix uses it (older MORI): held on the wildcard, MORI binds the host ----


def test_wildcard_hold_lets_mori_bind_the_host_and_nobody_else(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_fix_listener_port.reserve import hold_for_listener

    monkeypatch.delenv("VLLM_PORT", raising=False)
    reservation = hold_for_listener("127.0.0.1")
    try:
        assert reservation.port != 0
        for host in ("", "127.0.0.1"):  # vLLM's get_open_port binds the wildcard
            with socket.socket() as other, pytest.raises(OSError) as err:
                other.bind((host, reservation.port))
            assert err.value.errno == errno.EADDRINUSE
        listener = mori_listen("127.0.0.1", reservation.port)  # MORI: SO_REUSEADDR, bind, listen
    finally:
        reservation.release()
    try:
        assert listener.getsockname()[1] == reservation.port
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("", reservation.port))  # the listener holds it now
    finally:
        listener.close()


def test_hold_for_listener_scans_from_vllm_port(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_fix_listener_port.reserve import hold_for_listener

    with reserve_port("127.0.0.1") as first:
        monkeypatch.setenv("VLLM_PORT", str(first.port))
        second = hold_for_listener("127.0.0.1")
        try:
            assert second.port > first.port  # the held port is skipped, like a busy one
        finally:
            second.release()
    monkeypatch.setenv("VLLM_PORT", "not-a-port")
    with pytest.raises(ValueError, match="VLLM_PORT='not-a-port'"):
        hold_for_listener("127.0.0.1")


def test_hold_kept_for_an_owner_ends_with_release_or_collection() -> None:
    from vllm_fix_listener_port.reserve import held_ports, hold, keep_until_released, release_for

    class Owner:
        pass

    owner, other = Owner(), Owner()
    first, second = hold("127.0.0.1"), hold("127.0.0.1")
    keep_until_released(owner, first)
    keep_until_released(other, second)
    assert {first.port, second.port} <= set(held_ports())
    release_for(owner)
    assert not first.held and second.held
    release_for(owner)  # twice: a no-op
    del other  # collected: the hold ends with it
    assert not second.held
    assert not {first.port, second.port} & set(held_ports())
