"""vLLM general-plugin entry point (loaded in every vLLM process). Imports nothing heavy."""


def register() -> None:
    from vllm_fix_completion_ownership.declaration import FIX
    from vllm_fix_core import install

    install(FIX)
