"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in the engine and in every worker process."""

from __future__ import annotations

from . import enable, env_enabled


def register() -> None:
    """Install the extensible KV cache patches when ``EXTENSIBLE_KV_CACHE=1`` and the version gate says to patch this
    vLLM (``versions``: otherwise one log line, and vLLM runs untouched); do nothing otherwise."""
    if env_enabled():
        enable()
