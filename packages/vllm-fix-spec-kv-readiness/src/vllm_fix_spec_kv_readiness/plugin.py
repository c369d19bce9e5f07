"""vLLM general-plugin entry point (loaded in every vLLM process). Imports nothing heavy."""


def register() -> None:
    from vllm_fix_core import install
    from vllm_fix_spec_kv_readiness.declaration import FIX

    install(FIX)
