"""Reproducers of what reading vLLM 0.34.0's ``vllm/utils/extensible_tensor.py`` and ``vmm_driver.py`` suggests, each
with vLLM's API only (a fault is injected by wrapping a method of vLLM's own driver object), each in its own process
(some end the CUDA context). Needs a GPU and vLLM's modules on PYTHONPATH (``ci/vllm_native_check.sh``).

    python3 ci/vllm_native_repro.py OUT.json     # prints one line per finding: reproduced / not reproduced / crashed
"""

from __future__ import annotations

import json
import subprocess
import sys

PRELUDE = """
import gc, torch
torch.zeros(1, device="cuda")  # vLLM's driver does not call cuInit
from vllm.utils.extensible_tensor import ExtensibleTensor
from vllm.utils.vmm_driver import get_vmm_driver
drv = get_vmm_driver()
g = 2 << 20
def fail_once(name, exc=RuntimeError("GPU driver error 2: injected")):
    real = getattr(drv, name)
    state = {"armed": True}
    def wrapped(*a, **k):
        if state["armed"]:
            state["armed"] = False
            raise exc
        return real(*a, **k)
    setattr(drv, name, wrapped)
"""

FINDINGS = {
    "F1 failed growth keeps what it mapped": (
        "A growth that fails in its last segment (out of memory) leaves the earlier segments' new pages mapped: "
        "num_bytes stays old, physical_bytes does not.",
        """
free, _ = torch.cuda.mem_get_info()
seg = (free * 4 // 10) // g * g
t = ExtensibleTensor(3 * seg, num_segments=3)
try:
    t.resize_per_segment_(seg)
except RuntimeError as e:
    print("REPRODUCED" if t.physical_bytes > 0 and t.num_bytes == 0 else "NOT", t.num_bytes, t.physical_bytes, e)
else:
    print("NOT grew", t.num_bytes)
""",
    ),
    "F2 a failed set_access blocks every later growth": (
        "set_access failing once leaves the run mapped but not recorded: every later growth over it maps again and "
        "fails, until release_physical.",
        """
t = ExtensibleTensor(4 * g)
fail_once("set_access")
try:
    t.resize_per_segment_(2 * g)
except RuntimeError:
    pass
try:
    t.resize_per_segment_(2 * g)
    print("NOT retry grew", t.num_bytes)
except RuntimeError as e:
    print("REPRODUCED retry failed:", e)
""",
    ),
    "F3 an interrupt between create and map leaks the handle": (
        "_map_chunk_at catches RuntimeError only: a KeyboardInterrupt in map leaves the created handle unreleased.",
        """
free0, _ = torch.cuda.mem_get_info()
t = ExtensibleTensor(64 * g)
fail_once("map", KeyboardInterrupt())
try:
    t.resize_per_segment_(64 * g)
except KeyboardInterrupt:
    pass
t.free(); del t; gc.collect(); torch.cuda.synchronize()
free1, _ = torch.cuda.mem_get_info()
print("REPRODUCED" if free0 - free1 >= 64 * g else "NOT", "held after free:", free0 - free1)
""",
    ),
    "F4 a view outlives the tensor's memory": (
        "Views hold no reference to the buffer: once the tensor is collected its pages are unmapped under a live "
        "view, and a later tensor may be mapped at the same address (a write through the old view lands there).",
        """
t = ExtensibleTensor(g); t.resize_per_segment_(g, zero_new=True)
v = t.segment_view(0); va = v.data_ptr()
del t; gc.collect()
t2 = ExtensibleTensor(g); t2.resize_per_segment_(g, zero_new=True)
print("same address" if t2.base_ptr == va else "other address", flush=True)
v.fill_(7); torch.cuda.synchronize()
s = int(t2.segment_view(0).sum())
print("REPRODUCED old view wrote into the new tensor" if s else "REPRODUCED view dangles (no write seen)", s)
""",
    ),
    "F5 full_view after free is a tensor at address 0": (
        "free() leaves full_view() usable: a uint8 tensor of max_num_bytes at address 0; touching it ends the CUDA "
        "context (illegal address) instead of raising.",
        """
t = ExtensibleTensor(g); t.resize_per_segment_(g); t.free()
f = t.full_view()
print("view at", hex(f.data_ptr()), "of", f.numel(), flush=True)
f[0] = 1; torch.cuda.synchronize()
print("NOT no fault")
""",
    ),
    "F6 growth after free calls the driver": (
        "resize after free() is not refused: it creates a handle and maps it at address 0 + offset (the driver "
        "refuses), surfacing as a driver error.",
        """
t = ExtensibleTensor(2 * g); t.free()
try:
    t.resize_per_segment_(g)
    print("NOT grew")
except RuntimeError as e:
    print("REPRODUCED driver error instead of a closed-tensor refusal:", e)
except ValueError as e:
    print("NOT refused:", e)
""",
    ),
    "F7 a float size is taken": (
        "resize_per_segment_(4096.0) at 4096 bytes is accepted; the committed sizes become floats and the next "
        "segment_view raises TypeError.",
        """
t = ExtensibleTensor(2 * g); t.resize_per_segment_(4096)
t.resize_per_segment_(4096.0)
try:
    t.segment_view(0); print("NOT view made")
except TypeError as e:
    print("REPRODUCED", e)
""",
    ),
    "F9 one handle per segment, not per contiguous run": (
        "Segments whose new ranges touch get one handle each (ensure_committed_range per segment).",
        """
seg = g * 13 // 4 // 256 * 256
t = ExtensibleTensor(4 * seg, num_segments=4)
t.resize_per_segment_(seg)
print("REPRODUCED" if t.num_physical_chunks > 1 else "NOT", "chunks:", t.num_physical_chunks)
""",
    ),
    "F11 release_physical failing midway releases handles twice on retry": (
        "release_physical unmaps and releases handle by handle and clears its list only at the end: an unmap that "
        "fails midway, then a retry, releases the first handles again (CUDA hands released handle values to later "
        "allocations).",
        """
t = ExtensibleTensor(2 * g, num_segments=2); t.resize_per_segment_(g)
calls = []
real_release = drv.release
drv.release = lambda h: (calls.append(h), real_release(h))[1]
real_unmap = drv.unmap
state = {"n": 0}
def unmap(ptr, size):
    state["n"] += 1
    if state["n"] == 2:
        raise RuntimeError("GPU driver error 1: injected")
    return real_unmap(ptr, size)
drv.unmap = unmap
try:
    t.release_physical()
except RuntimeError:
    pass
try:
    t.release_physical()
except RuntimeError as e:
    print("retry raised", e)
print("REPRODUCED" if len(calls) != len(set(calls)) else "NOT", "released:", calls)
""",
    ),
    "F12 a size past 2**64 reserves the size modulo 2**64": (
        "VmmDriver.reserve passes the size through ctypes.c_size_t, which keeps its low 64 bits: ExtensibleTensor("
        "2**64 + g) reserves one granule while its capacity reads 2**64 + g, and growth is checked against the "
        "capacity. Seen on the H100 (2026-12-06) as no refusal of 2**64 + 4096 bytes; nothing is mapped here.",
        """
t = ExtensibleTensor(2**64 + g)
print("REPRODUCED" if t.capacity_bytes > 2**64 else "NOT", "capacity", t.capacity_bytes, "base", hex(t.base_ptr))
t.free()
""",
    ),
}


def main(out: str) -> int:
    results = []
    for name, (what, code) in FINDINGS.items():
        try:
            done = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=120)
            text = (done.stdout + done.stderr).strip()
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            if last.startswith("REPRODUCED"):
                outcome = "reproduced"
            elif last.startswith("NOT"):
                outcome = "not reproduced"
            else:
                outcome = f"crashed (exit {done.returncode})"
        except subprocess.TimeoutExpired as exc:
            outcome, text = "timed out", str(exc)
        results.append({"finding": name, "what": what, "outcome": outcome, "output": text[-3000:], "code": code})
        print(f"{outcome:<24} {name}", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
