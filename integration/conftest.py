from __future__ import annotations

import pytest

from vllm_fix_core.registry import Installed, installed_fixes


@pytest.fixture(scope="session")
def fixes() -> list[Installed]:
    items = installed_fixes()
    assert len(items) >= 7, f"the meta-package should install every fix, found {[i.fix.id for i in items]}"
    return items
