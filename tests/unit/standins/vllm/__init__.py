"""A stand-in for vLLM where vLLM cannot run (no GPU, not installed): ``LLM`` and ``SamplingParams`` with vLLM's
call shapes, recording every call, so that the README's vLLM snippet runs as written in CI
(``tests/unit/test_readme.py``). Its version is in no supported row: ``extensible_kv.vllm.enable()`` refuses it in one
log line and patches nothing, as it does any vLLM release it does not know. The calls are written as JSON to the file
named by ``EXTENSIBLE_KV_STANDIN_VLLM_CALLS`` when the process exits."""

from __future__ import annotations

import atexit
import json
import os
from dataclasses import dataclass, field
from typing import Any

__version__ = "0.0.0+standin"
CALLS: list[dict[str, Any]] = []


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        CALLS.append({"call": "SamplingParams", "kwargs": sorted(kwargs)})
        self.kwargs = kwargs


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    prompt: str
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        if not isinstance(model, str):
            raise TypeError(f"LLM(model=...): expected a model name or path, got {model!r}")
        CALLS.append({"call": "LLM", "model": model, "kwargs": sorted(kwargs)})

    def generate(self, prompts: str | list[str], sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        CALLS.append({"call": "LLM.generate", "prompts": len(prompts)})
        return [RequestOutput(p, [CompletionOutput(" (stand-in output)")]) for p in prompts]

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        """The engine core's answers to the resize names of ``extensible_kv.vllm.resize`` (an engine of 1,000 blocks
        out of 4,000 reserved, 64 KiB each), recorded; any other name is refused as vLLM's workers would."""
        CALLS.append({"call": "LLM.collective_rpc", "method": method, "args": [str(a) for a in args]})
        if method == "extensible_kv_kv_state":
            return [{"num_blocks": 1000, "reserved_blocks": 4000, "floor_blocks": 33, "bytes_per_block": 65536}]
        if method in ("extensible_kv_resize", "extensible_kv_resize_bytes"):
            blocks = int(args[0]) if method == "extensible_kv_resize" else min(4000, int(args[0]) // 65536)
            return [{"old_blocks": 1000, "num_blocks": blocks}]
        raise AttributeError(f"stand-in LLM: no collective_rpc method {method!r}")


def _write_calls() -> None:
    path = os.environ.get("EXTENSIBLE_KV_STANDIN_VLLM_CALLS")
    if path:
        with open(path, "w") as f:
            json.dump(CALLS, f)


atexit.register(_write_calls)
