"""tools/matrix.py record: what fails a release-matrix cell (answers and per-target proofs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matrix

RELEASE = "0.31.0"


def verify_result(answer: str = "affected → fixed") -> dict[str, Any]:
    return {
        "vllm": {"version": RELEASE},
        "results": [
            {
                "fix": "demo",
                "answer": answer,
                "reason": "r",
                "shape": "s",
                "checks": [{"check": "symptom", "answer": answer}],
            }
        ],
    }


def cell(tmp_path: Path, targets: dict[str, str], answer: str = "affected → fixed") -> tuple[Path, Path]:
    result = tmp_path / "verify.json"
    result.write_text(json.dumps(verify_result(answer)))
    hostile = tmp_path / "targets.json"
    hostile.write_text(json.dumps([{"fix": "demo", "answer": "would fix", "targets": targets}]))
    return result, hostile


def test_observed_targets_are_stored_and_then_match(tmp_path: Path) -> None:
    result, hostile = cell(tmp_path, {"A.f": "observed", "B.g": "observed"})
    store = tmp_path / "store"
    assert matrix.record(RELEASE, result, store, write=True, hostile=hostile) == 0
    stored = json.loads((store / f"{RELEASE}.json").read_text())
    assert stored["fixes"]["demo"]["targets"] == {"A.f": "observed", "B.g": "observed"}
    assert matrix.record(RELEASE, result, store, write=False, hostile=hostile) == 0
    assert "each seen by verification: `A.f`, `B.g`" in matrix.render(store)


def test_an_unobserved_target_fails_the_cell_even_when_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result, hostile = cell(tmp_path, {"A.f": "observed", "B.g": "NOT observed: the ladder said fixed"})
    store = tmp_path / "store"
    assert matrix.record(RELEASE, result, store, write=True, hostile=hostile) == 1
    assert matrix.record(RELEASE, result, store, write=False, hostile=hostile) == 1
    assert "demo: patched target not observed: B.g: NOT observed" in capsys.readouterr().out


def test_a_changed_set_of_patched_targets_is_a_difference(tmp_path: Path) -> None:
    result, hostile = cell(tmp_path, {"A.f": "observed"})
    store = tmp_path / "store"
    assert matrix.record(RELEASE, result, store, write=True, hostile=hostile) == 0
    result, hostile = cell(tmp_path, {"A.f": "observed", "C.h": "observed"})
    assert matrix.record(RELEASE, result, store, write=False, hostile=hostile) == 1


def test_failed_to_fix_fails_whatever_is_stored(tmp_path: Path) -> None:
    result, hostile = cell(tmp_path, {}, answer="failed to fix")
    store = tmp_path / "store"
    assert matrix.record(RELEASE, result, store, write=True, hostile=hostile) == 1


def _judge(store: Path, answer: str) -> None:
    store.mkdir(parents=True, exist_ok=True)
    (store / "judgements.toml").write_text(
        f'["{RELEASE}".demo]\nanswer = "{answer}"\nwhy = "read from the release\'s source"\n',
        encoding="utf-8",
    )


def test_an_answer_that_contradicts_its_judgement_is_neither_stored_nor_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result, hostile = cell(tmp_path, {"A.f": "observed"}, answer="fixed upstream")
    store = tmp_path / "store"
    _judge(store, "affected → fixed")
    assert matrix.record(RELEASE, result, store, write=True, hostile=hostile) == 1
    assert not (store / f"{RELEASE}.json").exists()
    out = capsys.readouterr().out
    assert "demo: answers 'fixed upstream', judged 'affected → fixed' from the source" in out


def test_an_answer_that_matches_its_judgement_is_stored_and_rendered_with_the_reason(tmp_path: Path) -> None:
    result, hostile = cell(tmp_path, {"A.f": "observed"})
    store = tmp_path / "store"
    _judge(store, "affected → fixed")
    assert matrix.record(RELEASE, result, store, write=True, hostile=hostile) == 0
    assert matrix.record(RELEASE, result, store, write=False, hostile=hostile) == 0
    assert "Judged from the release's source: read from the release's source" in matrix.render(store)


def test_a_judgement_without_its_reason_is_an_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "judgements.toml").write_text(
        f'["{RELEASE}".demo]\nanswer = "fixed upstream"\n', encoding="utf-8"
    )
    result, hostile = cell(tmp_path, {"A.f": "observed"})
    with pytest.raises(ValueError, match="lacks why"):
        matrix.record(RELEASE, result, store, write=False, hostile=hostile)
