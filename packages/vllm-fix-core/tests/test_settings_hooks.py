from __future__ import annotations

import sys

import pytest

from vllm_fix_core.hooks import locate
from vllm_fix_core.settings import Settings, normalize_id, vllm_plugins_filter


@pytest.mark.parametrize(
    "raw",
    ["read-eligibility", "vllm_fix_read_eligibility", "vllm-fix-read-eligibility", " READ_ELIGIBILITY "],
)
def test_normalize_id(raw: str) -> None:
    assert normalize_id(raw) == "read-eligibility"


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_FIXES_DISABLE", "vllm_fix_mr_extent, k3-eof-flush")
    monkeypatch.setenv("VLLM_FIXES_STRICT", "1")
    s = Settings.from_env()
    assert s.strict and s.is_disabled("mr-extent") and s.is_disabled("k3-eof-flush")
    assert not s.is_disabled("read-eligibility")
    monkeypatch.setenv("VLLM_FIXES_DISABLE", "all")
    monkeypatch.delenv("VLLM_FIXES_STRICT")
    s = Settings.from_env()
    assert s.is_disabled("anything") and not s.strict


def test_vllm_plugins_filter_parses_like_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm_plugins_filter() is None
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert vllm_plugins_filter() == [""]
    monkeypatch.setenv("VLLM_PLUGINS", "a,b")
    assert vllm_plugins_filter() == ["a", "b"]


def test_locate_finds_modules_without_importing_them() -> None:
    name = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
    already = name in sys.modules
    assert locate(name) is True
    assert (name in sys.modules) is already
    assert locate("vllm.distributed.no_such_module") is False
    assert locate("no_such_top_level_pkg.sub") is False


def test_locate_honours_blocked_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "blocked_mod_for_test", None)
    assert locate("blocked_mod_for_test") is False
