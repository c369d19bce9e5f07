from __future__ import annotations

import importlib.util
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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs an installed vLLM")
def test_locate_finds_modules_without_importing_them() -> None:
    name = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
    already = name in sys.modules
    assert locate(name) is True
    assert (name in sys.modules) is already
    assert locate("vllm.distributed.no_such_module") is False


def test_locate_a_missing_top_level_package() -> None:
    assert locate("no_such_top_level_pkg.sub") is False
    assert "no_such_top_level_pkg" not in sys.modules


def test_locate_honours_blocked_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "blocked_mod_for_test", None)
    assert locate("blocked_mod_for_test") is False


@pytest.mark.parametrize("raw", ["2", "maybe", "enable"])
def test_invalid_strict_value_is_an_error_not_off(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_fix_core import InvalidSetting

    monkeypatch.setenv("VLLM_FIXES_STRICT", raw)
    with pytest.raises(InvalidSetting, match="VLLM_FIXES_STRICT"):
        Settings.from_env()


@pytest.mark.parametrize("raw,strict", [("1", True), ("on", True), ("0", False), ("off", False), ("", False)])
def test_strict_values(raw: str, strict: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_FIXES_STRICT", raw)
    assert Settings.from_env().strict is strict


def test_unknown_disable_ids_are_named_with_the_valid_ones(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_fix_core import settings as settings_mod

    monkeypatch.setenv("VLLM_FIXES_DISABLE", "read_eligiblity,mr-extent")
    s = Settings.from_env()
    assert s.unknown_ids(["read-eligibility", "mr-extent"]) == ["read-eligiblity"]
    text = settings_mod.unknown_ids_message(["read-eligiblity"], ["read-eligibility", "mr-extent"])
    assert "read-eligiblity" in text and "read-eligibility, mr-extent" not in text
    assert "mr-extent, read-eligibility" in text  # the valid ids, sorted


def test_switches_registered_with_vllms_environment_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM treats every VLLM_* variable missing from vllm.envs.environment_variables as unknown."""
    import types

    from vllm_fix_core.environment import register_switches
    from vllm_fix_core.settings import SWITCHES

    fake_envs = types.ModuleType("vllm.envs")
    fake_envs.environment_variables = {"VLLM_PLUGINS": lambda: None}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", fake_envs)
    monkeypatch.setenv("VLLM_FIXES_STRICT", "1")
    register_switches()
    table = fake_envs.environment_variables  # type: ignore[attr-defined]
    assert set(SWITCHES) <= set(table) and table["VLLM_FIXES_STRICT"]() == "1"


def test_switches_not_registered_when_vllm_envs_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_fix_core.environment import register_switches

    monkeypatch.delitem(sys.modules, "vllm.envs", raising=False)
    register_switches()  # imports nothing, raises nothing
    assert "vllm.envs" not in sys.modules
