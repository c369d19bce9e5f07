"""The native carry: ``MoRIIOConnectorWorker._build_shared_kv_mr`` builds the registration by the rule.

One file, ``moriio_connector.py``: the body of ``MoRIIOConnectorWorker._build_shared_kv_mr``
(its signature, decorators and docstring stay) becomes the rule of ``rule.py`` written in the
tree's own terms: every region ``iter_layer_registration_regions`` gives for every layer, all on
the first layer's storage and device (else a ValueError naming both layers) and inside it; base =
the lowest region aligned down to 4 KiB, never before the storage start; end = the highest region
end, exactly; the registration is a ``uint8`` view of the storage from base to end, and each
layer's offset is its data pointer minus base. Same return contract as vLLM's body.

The tree is recognised as the runtime patch recognises the installed method (``patch.recognize``):
the method's normalized AST has exactly one of ``patch.KNOWN_SHAPES`` (read from the tree's source
instead of the imported function), and the module imports ``iter_layer_registration_regions``.
"""

from __future__ import annotations

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_mr_extent.declaration import MODULE
from vllm_fix_mr_extent.patch import KNOWN_SHAPES
from vllm_fix_mr_extent.rule import PAGE_SIZE

PR = 60639
QUALNAME = "MoRIIOConnectorWorker._build_shared_kv_mr"
MARK = marker("mr-extent", PR, "every region, exact extent")
# Names the written body uses from the connector module's own namespace.
MODULE_NAMES = ("torch", "iter_layer_registration_regions")

BODY = f"""
page_size = {PAGE_SIZE}
first_layer, first_cache = next(iter(kv_caches.items()))
device = first_cache.device
storage = first_cache.untyped_storage()
storage_start = storage.data_ptr()
storage_end = storage_start + storage.nbytes()
lowest: tuple[int, str] | None = None
end = storage_start
with_regions: set[str] = set()
for layer_name, cache in kv_caches.items():
    regions = iter_layer_registration_regions(
        layer_name, cache, self.layer_to_spec
    )
    for index, (region, region_len) in enumerate(regions):
        ptr = region.data_ptr()
        where = (
            f"layer {{layer_name!r}} region {{index}} "
            f"[{{ptr:#x}}, {{ptr + region_len:#x}})"
        )
        region_storage = region.untyped_storage()
        if (
            region_storage.data_ptr() != storage_start
            or region_storage.nbytes() != storage.nbytes()
            or region.device != device
        ):
            raise ValueError(
                f"{{where}} is not on the KV storage of layer {{first_layer!r}} "
                f"([{{storage_start:#x}}, {{storage_end:#x}}) on {{device}}): "
                "every transfer layer must sit on the same KV allocation "
                "and device to share one memory region"
            )
        if not storage_start <= ptr <= ptr + region_len <= storage_end:
            raise ValueError(f"{{where}} is not inside its KV storage")
        if lowest is None or ptr < lowest[0]:
            lowest = (ptr, layer_name)
        end = max(end, ptr + region_len)
        with_regions.add(layer_name)
if lowest is None:
    raise ValueError("no registration regions: nothing to put on a shared MR")
# The lowest region's page, never before the allocation; the extent is exact.
base = lowest[0] - lowest[0] % page_size
if base < storage_start:
    raise ValueError(
        f"layer {{lowest[1]!r}} starts in the first, partial page of its KV "
        f"storage ({{storage_start % page_size}} bytes past a page boundary): "
        "a page-aligned memory region would begin before the allocation; "
        "allocate the KV cache page-aligned"
    )
for layer_name, cache in kv_caches.items():
    if layer_name not in with_regions:
        raise ValueError(f"layer {{layer_name!r}} has no registration region")
    if not base <= cache.data_ptr() <= end:
        raise ValueError(
            f"layer {{layer_name!r}} starts at {{cache.data_ptr():#x}}, outside "
            f"the memory region [{{base:#x}}, {{end:#x}}) built from its regions"
        )
reg = torch.empty(0, dtype=torch.uint8, device=device)
reg.set_(storage, base - storage_start, (end - base,), (1,))
return reg, {{name: cache.data_ptr() - base for name, cache in kv_caches.items()}}
"""


def recognize(tree: SourceTree) -> str:
    """The shape's name, or CannotCarry where the runtime fix would not patch the tree."""
    source = tree.read(MODULE)
    shape = c.known_shape(source, QUALNAME, KNOWN_SHAPES)
    missing = [name for name in MODULE_NAMES if name not in c.module_names(source)]
    if missing:
        raise CannotCarry(f"{tree.relpath(MODULE)} no longer imports {', '.join(missing)}")
    return shape


def _docstring(func: cst.FunctionDef) -> list[cst.BaseStatement]:
    body = c.body_statements(func)
    return body[:1] if body and c.is_docstring(body[0]) else []


def _by_rule(func: cst.FunctionDef) -> cst.FunctionDef:
    new = c.statements(BODY)
    return c.with_body(func, [*_docstring(func), c.with_comment(new[0], MARK), *new[1:]])


def transform(tree: SourceTree) -> list[NativeEdit]:
    recognize(tree)
    return [tree.edit(MODULE, lambda source: c.change_function(source, QUALNAME, _by_rule))]


__all__ = ["recognize", "transform"]
