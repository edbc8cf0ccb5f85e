"""The extensible KV cache for vLLM 0.26.0's V1 and V2 model runners (opt-in; vLLM is untouched when off).

Which vLLM releases are patched is the version gate's (``versions``): 0.26.0, and 0.27 to 0.33 where every patch
point matches; 0.34 has its own extensible KV cache and is left to it; any other release is refused in one log line
and runs untouched. ``enable()`` and the plugin entry both go through the gate.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)::

    from extensible_kv.vllm import extensible_kv_cache
    with extensible_kv_cache():
        llm = LLM(...)          # reserve, warm up and capture, measure, commit the final size

Across processes (``vllm serve``, multiprocess engines, TP workers): the ``vllm.general_plugins`` entry point
``extensible_kv`` installs the patches in every vLLM process when ``EXTENSIBLE_KV_CACHE=1``.

Sleep mode (``enable_sleep_mode=True``) stays on the extensible path: ``sleep(level=1|2)`` releases the KV pages,
``wake_up()`` and ``wake_up(tags=["kv_cache"])`` recommit them, zeroed, at the same addresses (``sleep``).

A running engine resizes its KV cache under the same addresses (``resize``: ``resize_kv_cache(llm, n)``, or the
dev-mode ``/collective_rpc`` route of ``vllm serve``); ``coordinator`` moves KV memory between engines on one GPU.

KV connectors (``kv_transfer_config``) are registered after the final commit, with views of exactly the committed
blocks at stable addresses (``connector``, Note [The contract for connector authors]).

Refused with ``ExtensibleKVUnsupported``: platforms other than CUDA and ROCm; packed KV layouts; a KV connector
together with sleep mode, with a K/V-split layout (ROCM_ATTN alone), or asked to grow after registration.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from . import versions
from .worker_kv import ExtensibleKVUnsupported

ENV_VAR = "EXTENSIBLE_KV_CACHE"

__all__ = ["ENV_VAR", "ExtensibleKVUnsupported", "enable", "disable", "extensible_kv_cache", "env_enabled"]


def enable() -> versions.Decision:
    """Install the patches in this process (idempotent) where the version gate says to patch the installed vLLM;
    otherwise log its one line (a refusal, or vLLM's native path) and leave vLLM untouched. Returns the decision."""
    decision = versions.gate()
    if decision.action == versions.PATCH:
        from . import patches

        patches.install()
    return decision


def disable() -> None:
    """Remove the patches from this process; engines already built keep their extensible KV cache."""
    from . import patches

    patches.uninstall()


@contextmanager
def extensible_kv_cache() -> Iterator[None]:
    """Enable the extensible KV cache for engines built inside the block (in-process engines only)."""
    enable()
    try:
        yield
    finally:
        disable()


def env_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``EXTENSIBLE_KV_CACHE`` asks for the extensible path: ``1`` yes, ``0`` or unset no, else an error
    (spaces included: a value that is not exactly one of the two is a typo, not a choice)."""
    value = (environ if environ is not None else os.environ).get(ENV_VAR, "0")
    if value not in ("0", "1"):
        raise ExtensibleKVUnsupported(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"
