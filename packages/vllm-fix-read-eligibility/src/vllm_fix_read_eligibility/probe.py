"""Does this vLLM's MoRIIO READ consumer claim remote KV it will never load?

Calls the real, currently installed MoRIIOConnectorScheduler.get_num_new_matched_tokens
on an instance built like vLLM's own MoRIIO tests build one (``__new__`` plus the
attributes the method reads), so it needs no mori, config or model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, ProbeReport

PROMPT = 32

PLAIN = {"none": None, "empty": {}, "flag-false": {"do_remote_prefill": False}}
MALFORMED: dict[str, dict[str, Any]] = {
    "no-block-ids": {"do_remote_prefill": True, "remote_engine_id": "p0"},
    "empty-block-ids": {"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "p0"},
    "string-block-ids": {"do_remote_prefill": True, "remote_block_ids": "0,1", "remote_engine_id": "p0"},
    "no-engine-id": {"do_remote_prefill": True, "remote_block_ids": [[0, 1]]},
}
WELL_FORMED = {"do_remote_prefill": True, "remote_block_ids": [[0, 1]], "remote_engine_id": "p0"}


def consumer(read: bool = True, producer: bool = False) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    sched = mc.MoRIIOConnectorScheduler.__new__(mc.MoRIIOConnectorScheduler)
    sched.is_producer = producer
    sched.mode = mc.MoRIIOMode.READ if read else mc.MoRIIOMode.WRITE
    sched._has_mamba = False
    return sched


def request(params: Any, rid: str = "probe") -> Any:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=PROMPT,
        kv_transfer_params=None if params is None else dict(params),
    )


def matched(sched: Any, params: Any) -> tuple[int, bool]:
    return tuple(sched.get_num_new_matched_tokens(request(params), 0))  # type: ignore[return-value]


def probe() -> ProbeReport:
    sched = consumer()
    plain = {name: matched(sched, p) for name, p in PLAIN.items()}
    bad = {name: matched(sched, p) for name, p in MALFORMED.items()}
    good = matched(sched, WELL_FORMED)
    wrong_plain = {k: v for k, v in plain.items() if v != (0, False)}
    wrong_bad = {k: v for k, v in bad.items() if v != (0, False)}
    return ProbeReport(
        (
            Check(
                "plain-request-claims-remote-kv",
                bool(wrong_plain),
                f"claimed {wrong_plain}" if wrong_plain else "",
            ),
            Check(
                "malformed-params-claim-remote-kv",
                bool(wrong_bad),
                f"claimed {wrong_bad}" if wrong_bad else "",
            ),
            # Guard: a real remote prefill must still claim N-1 tokens synchronously.
            Check("remote-prefill-loads", good != (PROMPT - 1, False), f"claimed {good}", guard=True),
        )
    )
