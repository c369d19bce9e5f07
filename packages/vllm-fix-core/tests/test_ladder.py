"""The decision ladder (docs/architecture.md): one decision and one log line per fix per process."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from vllm_fix_core import Answer, FixFailed, FixRefused, Settings, runtime
from vllm_fix_core.patching import layers_of

LAX = Settings(disabled=frozenset(), strict=False)
STRICT = Settings(disabled=frozenset(), strict=True)
Lines = Callable[[str], list[tuple[str, str]]]


def test_applies_verifies_and_reverts_exactly(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    __import__(demo.module)
    original = demo.raw()
    decision = runtime.apply(demo.fix, LAX)
    assert decision.answer is Answer.AFFECTED_FIXED and decision.shape == "demo-1"
    assert demo.widget()().compute(1) == 3
    assert fix_lines(demo.fix.id) == [("INFO", decision.message)]
    assert runtime.apply(demo.fix, LAX) is decision  # idempotent
    assert layers_of(demo.widget(), "compute") == [demo.fix.id]
    assert runtime.revert(demo.fix) is True
    assert demo.raw() is original


def test_disabled_by_id_or_all(demo, fix_lines: Lines, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    for value in (demo.fix.id, "all", demo.fix.entry_point, f"other, {demo.fix.id.upper()}"):
        monkeypatch.setenv("VLLM_FIXES_DISABLE", value)
        monkeypatch.setenv("VLLM_FIXES_STRICT", "1")
        d = runtime.install(demo.fix)
        assert d.answer is Answer.DISABLED, value
        runtime.revert(demo.fix)
    assert [level for level, _ in fix_lines(demo.fix.id)] == ["DEBUG"] * 4
    assert demo.module not in sys.modules  # nothing imported, nothing patched


def test_not_applicable_when_target_module_absent(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from vllm_fix_core.declaration import Target

    missing = replace(demo.fix, targets=(Target("no_such_module_xyz", "A.b", demo.fix.targets[0].process),))
    d = runtime.install(missing, STRICT)
    assert d.answer is Answer.NOT_APPLICABLE
    assert fix_lines(demo.fix.id) == [("DEBUG", d.message)]


def test_upstream_fixed_patches_nothing(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    mod = __import__(demo.module)
    mod.Widget.compute = lambda self, x: x + 2
    d = runtime.apply(demo.fix, STRICT)
    assert d.answer is Answer.FIXED_UPSTREAM and d.patch is None
    assert layers_of(mod.Widget, "compute") == []
    assert fix_lines(demo.fix.id) == [("INFO", d.message)]


@pytest.mark.parametrize("mode", ["unknown-shape", "guard-broken"])
def test_refused_logs_warning_changes_nothing_and_strict_raises(demo, fix_lines: Lines, mode: str) -> None:  # type: ignore[no-untyped-def]
    __import__(demo.module)
    demo.set_mode(mode)
    original = demo.raw()
    d = runtime.apply(demo.fix, LAX)
    assert d.answer is Answer.REFUSED and demo.raw() is original
    # The line says the bug was seen, and which symptom.
    assert "affected, not patched" in d.reason and "off-by-one" in d.reason
    assert fix_lines(demo.fix.id) == [("WARNING", d.message)]
    runtime.revert(demo.fix)
    with pytest.raises(FixRefused):
        runtime.apply(demo.fix, STRICT)
    assert demo.raw() is original


@pytest.mark.parametrize("mode", ["ineffective", "breaks-guard"])
def test_failed_to_fix_is_reverted_and_strict_raises(demo, fix_lines: Lines, mode: str) -> None:  # type: ignore[no-untyped-def]
    __import__(demo.module)
    demo.set_mode(mode)
    original = demo.raw()
    d = runtime.apply(demo.fix, LAX)
    assert d.answer is Answer.FAILED_TO_FIX and demo.raw() is original
    assert fix_lines(demo.fix.id) == [("ERROR", d.message)]
    runtime.revert(demo.fix)
    with pytest.raises(FixFailed):
        runtime.apply(demo.fix, STRICT)
    assert demo.raw() is original


def test_lazy_install_decides_on_import(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    assert demo.module not in sys.modules
    d = runtime.install(demo.fix, LAX)
    assert d.answer is Answer.PENDING and fix_lines(demo.fix.id) == []
    assert demo.module not in sys.modules  # installing imported nothing
    mod = __import__(demo.module)
    assert mod.Widget().compute(1) == 3
    assert runtime.decisions()[demo.fix.id].answer is Answer.AFFECTED_FIXED
    assert len(fix_lines(demo.fix.id)) == 1


def test_lazy_install_reports_failed_import_once(demo, fix_lines: Lines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A target module that exists but fails to import is "cannot check", a WARNING: never
    "not applicable" (the bug may well be there; this environment lacks something else)."""
    (tmp_path / f"{demo.module}.py").write_text("import msgpack_missing_xyz\n")
    runtime.install(demo.fix, STRICT)
    with pytest.raises(ImportError):
        __import__(demo.module)
    assert runtime.decisions()[demo.fix.id].answer is Answer.CANNOT_CHECK
    lines = fix_lines(demo.fix.id)
    assert len(lines) == 1 and lines[0][0] == "WARNING" and "msgpack_missing_xyz" in lines[0][1]


def test_target_that_fails_to_import_cannot_be_checked(demo, fix_lines: Lines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / f"{demo.module}.py").write_text("import gguf_missing_xyz\n")
    d = runtime.apply(demo.fix, LAX)
    assert d.answer is Answer.CANNOT_CHECK and "gguf_missing_xyz" in d.reason
    assert fix_lines(demo.fix.id) == [("WARNING", d.message)]


def test_probe_that_raises_cannot_check(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    __import__(demo.module)
    demo.set_mode("probe-raises")
    original = demo.raw()
    d = runtime.apply(demo.fix, STRICT)  # not a refusal: strict does not raise, nothing is patched
    assert d.answer is Answer.CANNOT_CHECK and "probe exploded" in d.reason and demo.raw() is original
    assert fix_lines(demo.fix.id) == [("WARNING", d.message)]


def test_absent_feature_is_not_applicable(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    __import__(demo.module)
    demo.set_mode("feature-absent")
    d = runtime.apply(demo.fix, STRICT)
    assert d.answer is Answer.NOT_APPLICABLE and "no widgets here" in d.reason
    assert fix_lines(demo.fix.id) == [("DEBUG", d.message)]


def test_missing_method_is_not_applicable_unless_optional(demo) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from vllm_fix_core.declaration import Target

    process = demo.fix.targets[0].process
    absent = Target(demo.module, "Widget.added_in_a_later_release", process)
    d = runtime.apply(replace(demo.fix, targets=(*demo.fix.targets, absent)), LAX)
    assert d.answer is Answer.NOT_APPLICABLE and "added_in_a_later_release" in d.reason
    runtime.revert(demo.fix)
    optional = replace(absent, optional=True)
    d = runtime.apply(replace(demo.fix, targets=(*demo.fix.targets, optional)), LAX)
    assert d.answer is Answer.AFFECTED_FIXED


def test_summary_line_counts_each_answer() -> None:
    from vllm_fix_core import Decision, summary_line

    decisions = [
        Decision("a", Answer.AFFECTED_FIXED, ""),
        Decision("b", Answer.AFFECTED_FIXED, ""),
        Decision("c", Answer.FIXED_UPSTREAM, ""),
    ]
    assert summary_line("0.33.0", decisions) == (
        "vLLM 0.33.0: 3 fixes — 2 affected → fixed, 1 fixed upstream, 0 refused, 0 cannot check"
    )


def test_probe_output_is_silenced_while_probing(demo, fix_lines: Lines) -> None:  # type: ignore[no-untyped-def]
    from vllm_fix_core.log import get_logger, probing

    log = get_logger(demo.fix.id)
    with probing():
        log.warning("from a probe")
    log.warning("outside")
    assert fix_lines(demo.fix.id) == [("WARNING", "outside")]
