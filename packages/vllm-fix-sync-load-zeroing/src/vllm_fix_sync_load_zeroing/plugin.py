"""vLLM general-plugin entry point (loaded in every vLLM process). Imports nothing heavy."""


def register() -> None:
    from vllm_fix_core import install
    from vllm_fix_sync_load_zeroing.declaration import FIX

    install(FIX)
