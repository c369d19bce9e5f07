"""PatchSet: layering, composition in either order, exact revert, idempotence."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_fix_core.patching import PatchConflict, PatchSet, layers_of


def make_target() -> type:
    class Target:
        def method(self, x: int) -> int:
            return x + 1

        @classmethod
        def cm(cls, x: int) -> str:
            return f"{cls.__name__}:{x}"

        @staticmethod
        def sm(x: int) -> int:
            return x * 2

    return Target


def adder(n: int) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs) + n

    return wrapper


def test_wrap_and_exact_revert() -> None:
    T = make_target()
    original = T.__dict__["method"]
    p = PatchSet("a")
    p.wrap(T, "method", adder(10))
    assert T().method(1) == 12
    p.revert()
    assert T.__dict__["method"] is original
    assert T().method(1) == 2


def test_idempotent_per_target() -> None:
    T = make_target()
    p = PatchSet("a")
    p.wrap(T, "method", adder(10))
    p.wrap(T, "method", adder(10))
    assert T().method(1) == 12
    assert layers_of(T, "method") == ["a"]
    p.revert()


@pytest.mark.parametrize("first_reverted", ["a", "b"])
def test_two_fixes_compose_and_revert_in_either_order(first_reverted: str) -> None:
    T = make_target()
    original = T.__dict__["method"]
    pa, pb = PatchSet("a"), PatchSet("b")
    pa.wrap(T, "method", adder(10))
    pb.wrap(T, "method", adder(100))
    assert T().method(1) == 112
    (pa if first_reverted == "a" else pb).revert()
    assert T().method(1) == (102 if first_reverted == "a" else 12)
    (pb if first_reverted == "a" else pa).revert()
    assert T.__dict__["method"] is original


def test_replace_then_wrap_keeps_wrapper_on_top() -> None:
    T = make_target()
    original = T.__dict__["method"]
    pw, pr = PatchSet("w"), PatchSet("r")
    pw.wrap(T, "method", adder(10))

    def body(self: Any, x: int) -> int:
        return x * 3

    pr.replace(T, "method", body)
    assert T().method(2) == 16  # wrapper over the replacement
    assert body.__vllm_fix__ == "r"
    pr.revert()
    assert T().method(2) == 13
    pw.revert()
    assert T.__dict__["method"] is original


def test_two_replacements_conflict() -> None:
    T = make_target()
    PatchSet("r1").replace(T, "method", lambda self, x: 0)
    with pytest.raises(PatchConflict):
        PatchSet("r2").replace(T, "method", lambda self, x: 1)


def test_classmethod_and_staticmethod_descriptors() -> None:
    T = make_target()
    cm, sm = T.__dict__["cm"], T.__dict__["sm"]
    p = PatchSet("a")

    def tag(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return ("tag", instance, wrapped(*args, **kwargs))

    p.wrap(T, "cm", tag)
    p.wrap(T, "sm", adder(1))
    assert T.cm(3) == ("tag", T, "Target:3")
    assert T().sm(3) == 7
    p.revert()
    assert T.__dict__["cm"] is cm and T.__dict__["sm"] is sm


def test_inherited_attribute_reverts_to_absent() -> None:
    Base = make_target()

    class Child(Base):  # type: ignore[misc, valid-type]
        pass

    p = PatchSet("a")
    p.wrap(Child, "method", adder(5))
    assert Child().method(0) == 6 and Base().method(0) == 1
    p.revert()
    assert "method" not in Child.__dict__


def test_foreign_patch_on_top_blocks_revert() -> None:
    T = make_target()
    p = PatchSet("a")
    p.wrap(T, "method", adder(10))
    T.method = lambda self, x: -1  # type: ignore[method-assign]
    with pytest.raises(PatchConflict):
        p.revert()
