"""Does this vLLM's MoRIIO READ consumer claim remote KV it will never load?

Asks the installed ``MoRIIOConnectorScheduler.get_num_new_matched_tokens`` (whatever is
installed in the process, our wrapper included) about real vLLM requests, built with
vLLM's own ``Request`` constructor and ``SamplingParams`` (the way the engine core builds
them: ``kv_transfer_params`` arrive in ``extra_args``). The connector scheduler is built
with ``__new__``, like vLLM's own MoRIIO tests build it, with the two attributes its
answer depends on (consumer side, READ mode): a real one needs a model config and a KV
cache config, which the probe cannot have. It needs no mori, no config, no model.
"""

from __future__ import annotations

from typing import Any

from vllm_fix_core import Check, ProbeReport
from vllm_fix_read_eligibility.rule import BlockLayout

PROMPT = 32

PLAIN: dict[str, dict[str, Any] | None] = {
    "none": None,
    "empty": {},
    "flag-false": {"do_remote_prefill": False},
}
ENGINE = {"remote_engine_id": "probe-prefill"}
MALFORMED: dict[str, dict[str, Any]] = {
    "flag-only": {"do_remote_prefill": True},
    "no-block-ids": {"do_remote_prefill": True, **ENGINE},
    "empty-block-ids": {"do_remote_prefill": True, "remote_block_ids": [], **ENGINE},
    "empty-groups": {"do_remote_prefill": True, "remote_block_ids": [[]], **ENGINE},
    "string-block-ids": {"do_remote_prefill": True, "remote_block_ids": "0,1", **ENGINE},
    "no-engine-id": {"do_remote_prefill": True, "remote_block_ids": [[0, 1]]},
}


def well_formed(layout: BlockLayout) -> dict[str, Any]:
    """A remote prefill this vLLM can READ: its block ids in the layout it exchanges."""
    blocks: list[Any] = [[0, 1]] if layout is BlockLayout.PER_GROUP else [0, 1]
    return {"do_remote_prefill": True, "remote_block_ids": blocks, **ENGINE}


def consumer() -> Any:
    """A MoRIIO connector scheduler on the decode (kv_consumer) side, in READ mode."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    sched = mc.MoRIIOConnectorScheduler.__new__(mc.MoRIIOConnectorScheduler)
    sched.is_producer = False
    sched.mode = mc.MoRIIOMode.READ
    return sched


def request(params: dict[str, Any] | None, rid: str = "vllm-fix-probe", num_tokens: int = PROMPT) -> Any:
    """A real vLLM request with `num_tokens` prompt tokens and a copy of `params`."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": None if params is None else dict(params)}
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=SamplingParams(max_tokens=1, extra_args=extra),
        pooling_params=None,
    )


def matched(sched: Any, params: dict[str, Any] | None, num_computed_tokens: int = 0) -> tuple[int, bool]:
    claimed = sched.get_num_new_matched_tokens(request(params), num_computed_tokens)
    return int(claimed[0]), bool(claimed[1])


def probe() -> ProbeReport:
    from vllm_fix_read_eligibility.patch import block_layout

    sched = consumer()
    plain = {name: matched(sched, p) for name, p in PLAIN.items()}
    bad = {name: matched(sched, p) for name, p in MALFORMED.items()}
    good = matched(sched, well_formed(block_layout()))
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
