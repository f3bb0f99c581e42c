"""vLLM general plugin of pagedkv (entry point ``vllm.general_plugins: pagedkv``, pyproject.toml).

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the front end, the engine core it
spawns, the workers). This one does nothing unless ``PAGEDKV_VLLM=1`` is in the environment (pagedkv.vllm.install()
sets it, so processes started afterwards inherit it): then it runs pagedkv.vllm.install() there, so the engine core
builds its Scheduler on pagedkv.vllm.KVCacheManager. Importing this module imports neither vLLM nor the extension.
"""
import os


def register() -> None:
    """Entry point: pagedkv.vllm.install() in this process when PAGEDKV_VLLM=1 (no-op otherwise)."""
    if os.environ.get("PAGEDKV_VLLM", "") != "1":
        return
    from . import vllm

    vllm.install()
