from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core import runtime
from vllm_fix_read_eligibility import FIX


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends on unpatched vLLM, with a fresh warning budget."""
    from vllm_fix_read_eligibility import patch

    monkeypatch.setattr(patch, "WARN_LIMIT", patch._WarnLimit())
    runtime.revert(FIX)
    yield
    runtime.revert(FIX)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_fix_testing import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture
def new_read_consumer_scheduler(tiny_model: Path) -> Callable[[], Any]:
    """Builds real vLLM Schedulers whose connector is a real MoRIIO READ consumer."""
    from vllm_fix_testing import MORIIO_EXTRA_CONFIG, real_scheduler

    def build() -> Any:
        return real_scheduler(
            tiny_model,
            kv_connector="MoRIIOConnector",
            kv_role="kv_consumer",
            extra_config={**MORIIO_EXTRA_CONFIG, "read_mode": True},
        )

    return build


@pytest.fixture
def read_consumer_scheduler(new_read_consumer_scheduler: Callable[[], Any]) -> Any:
    return new_read_consumer_scheduler()
