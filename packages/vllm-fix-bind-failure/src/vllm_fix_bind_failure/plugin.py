"""vLLM general-plugin entry point (loaded in every vLLM process). Imports nothing heavy."""


def register() -> None:
    from vllm_fix_bind_failure.declaration import FIX
    from vllm_fix_core import install

    install(FIX)
