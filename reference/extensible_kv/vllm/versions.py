"""The vLLM version gate: which vLLM releases the patch set serves, and what ``enable()`` and the plugin do at each.

=================  ============================================================================================
vLLM               what ``enable()`` / the ``vllm.general_plugins`` entry do
=================  ============================================================================================
0.26.0             patch (the release the patch set was written against)
0.27.x - 0.33.x    patch where every patch point is present with the signature the patch set wraps, read from
                   the installed vLLM's source (``check_patch_points``); else refuse, naming the first point
0.34.x             no KV patch: vLLM's own extensible KV cache is used; one log line says so and what is checked
                   instead (``extensible-kv check-driver vllm`` and ``--tensor vllm``; the budget cases)
anything else      refuse in one line naming the version and this table; vLLM runs untouched
=================  ============================================================================================

Note [Patch points read, not imported]
    Whether a release still has the functions the patch set wraps is read from its source with ``ast``: the
    module file, the class, the function and its parameter names, and the names the wrappers call on vLLM's
    objects (``PATCH_POINTS``, ``CALLED_NAMES``). Importing vLLM's worker modules needs a GPU build of torch and
    vLLM's kernels; reading them needs neither, so the same check runs at ``enable()`` on the installed vLLM and
    on a CPU against every release's wheel (``tests/unit/test_vllm_versions.py``, ``nox -s vllm_versions``). A
    parameter renamed or added is a refusal: the wrapper would pass the wrong arguments.

Note [A refusal leaves vLLM untouched]
    A refusal is a warning of one line and ``enable()`` returns without touching vLLM: raising from the plugin
    entry would stop ``vllm serve`` in every process for a feature that is opt-in. Releases newer than the
    table's newest are refused too (0.99.0 is not "0.34 and later"): a release joins the table once checked.
"""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("extensible_kv.vllm")

PATCH = "patch"
CHECKED_PATCH = "patch where the patch points match"
NATIVE = "native"
REFUSE = "refuse"


@dataclass(frozen=True)
class Row:
    first: tuple[int, int, int]
    last: tuple[int, int, int]  # inclusive; patch numbers up to 999
    action: str
    checked_on_cpu: str  # what was checked, against which release's source


TABLE = (
    Row((0, 26, 0), (0, 26, 0), PATCH, "0.26.0: every patch point (the patch set's release)"),
    Row((0, 27, 0), (0, 33, 999), CHECKED_PATCH, "0.28.0, 0.30.0, 0.32.0, 0.33.0 (and 0.27.0, 0.29.0, 0.31.0)"),
    Row((0, 34, 0), (0, 34, 999), NATIVE, "0.34.0: vllm/utils/vmm_driver.py, extensible_tensor.py present"),
)
"""The supported releases, oldest first (README, "vLLM versions")."""

TABLE_LINE = "0.26.0 patched; 0.27-0.33 patched where the patch points match; 0.34.x native"

PATCH_POINTS: dict[tuple[str, str | None, str], tuple[str, ...]] = {
    ("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches"): ("self", "vllm_config"),
    ("vllm.v1.engine.core", "EngineCore", "collective_rpc"): ("self", "method", "timeout", "args", "kwargs"),
    ("vllm.v1.worker.gpu_worker", "Worker", "determine_available_memory"): ("self",),
    ("vllm.v1.worker.gpu_worker", None, "warmup_kernels"): (
        "model_runner",
        "worker_execute_model",
        "worker_sample_tokens",
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "initialize_kv_cache_tensors"): (
        "self",
        "kv_cache_config",
        "kernel_block_sizes",
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_allocate_kv_cache_tensors"): ("self", "kv_cache_config"),
    ("vllm.v1.worker.gpu.model_runner", None, "init_kv_cache"): (
        "runner_kv_caches",
        "forward_context",
        "kv_cache_config",
        "attn_groups",
        "device",
        "cache_dtype",
        "kernel_block_sizes",
        "vllm_config",
    ),
    ("vllm.v1.worker.gpu.attn_utils", None, "_allocate_kv_cache"): ("kv_cache_config", "shared_layers", "device"),
}
"""Every function ``patches.PATCHES`` wraps (module, class or None, name) -> the parameters the wrapper passes on."""

CALLED_NAMES: dict[tuple[str, str | None, str], tuple[str, ...] | None] = {
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "profile_run"): None,
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "profile_cudagraph_memory"): None,
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "use_uniform_kv_cache"): None,
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "allocate_uniform_kv_caches"): None,
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_reshape_kv_cache_tensors"): None,
    ("vllm.v1.worker.gpu.attn_utils", None, "get_shared_kv_cache_layers"): None,
    ("vllm.v1.worker.gpu.attn_utils", None, "_reshape_kv_cache"): (
        "attn_groups",
        "kv_cache_raw_tensors",
        "kernel_block_sizes",
        "cache_dtype",
        "shared_kv_cache_layers",
        "kv_cache_config",
    ),
    ("vllm.v1.engine.core", None, "get_kv_cache_capacity"): None,
    ("vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request"): ("request", "timestamp"),
    ("vllm.v1.core.block_pool", "BlockPool", "_maybe_evict_cached_block"): ("block",),
    ("vllm.v1.core.kv_cache_utils", None, "get_max_concurrency_for_kv_cache_config"): None,
}
"""Names the wrappers call on vLLM's objects -> the keyword parameters they pass (None: only that it exists; a
tuple: each must be a parameter)."""


@dataclass(frozen=True)
class Decision:
    version: str
    action: str  # PATCH, NATIVE or REFUSE
    message: str  # one line


def release(version: str) -> tuple[int, int, int] | None:
    """``0.28.1`` -> ``(0, 28, 1)``; ``0.30.0rc1``, ``0.30.0.dev3+g...`` -> ``(0, 30, 0)``; ``None`` when unreadable."""
    found = re.match(r"^(\d+)\.(\d+)\.(\d+)", str(version).strip())
    return tuple(int(x) for x in found.groups()) if found else None  # type: ignore[return-value]


def row_of(version: str) -> Row | None:
    parts = release(version)
    if parts is None:
        return None
    return next((r for r in TABLE if r.first <= parts <= r.last), None)


def _source_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


class _Source:
    """vLLM's modules under ``root``, parsed once each, and lookups that follow imports and base classes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            path = _source_file(self.root, module)
            self.trees[module] = ast.parse(path.read_text(encoding="utf-8")) if path else None
        return self.trees[module]

    def _imported(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module.split(".")
        is_package = (_source_file(self.root, module) or Path()).name == "__init__.py"
        base = package if is_package else package[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def find(self, module: str, owner: str | None, name: str, depth: int = 0) -> ast.AST | bool | None:
        """The function ``owner.name`` (a class's own or inherited) or module-level ``name`` of ``module``, following
        ``from X import name`` and base classes; ``True`` for a definition that is no function; ``None``: absent."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        if owner is not None:
            found = self._class(module, tree, owner, depth)
            if found is None:
                return None
            cls_module, cls = found
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return True
            for base in cls.bases:
                if isinstance(base, ast.Name):
                    inherited = self.find(cls_module, base.id, name, depth + 1)
                    if inherited is not None:
                        return inherited
            return None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find(self._imported(module, node), None, alias.name, depth + 1) or True
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
        return None

    def _class(self, module: str, tree: ast.Module, name: str, depth: int) -> tuple[str, ast.ClassDef] | None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name and depth <= 8:
                        target = self._imported(module, node)
                        sub = self.tree(target)
                        if sub is not None:
                            return self._class(target, sub, alias.name, depth + 1)
        return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    return tuple(p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs])


def check_patch_points(vllm_root: Path | str) -> list[str]:
    """What in the vLLM source under ``vllm_root`` (the folder of ``vllm/__init__.py``) differs from what the patch
    set wraps and calls: one line per difference, empty when every point matches (Note [Patch points read, not
    imported])."""
    source = _Source(Path(vllm_root))
    problems: list[str] = []
    for table, exact in ((PATCH_POINTS, True), (CALLED_NAMES, False)):
        for (module, owner, name), want in table.items():
            where = f"{module}.{owner + '.' if owner else ''}{name}"
            if source.tree(module) is None:
                problems.append(f"{where}: module {module} is absent")
                continue
            found = source.find(module, owner, name)
            if found is None:
                problems.append(f"{where} is absent")
            elif want is not None and found is True:
                problems.append(f"{where} is not a function")
            elif want is not None:
                got = _params(found)  # type: ignore[arg-type]
                if exact and got != want:
                    problems.append(f"{where}{got} differs from the wrapped {want}")
                elif not exact and not set(want) <= set(got):
                    problems.append(f"{where}{got} lacks {sorted(set(want) - set(got))}")
    return problems


def installed_vllm() -> tuple[str, Path | None]:
    """The installed vLLM's version and source folder, without importing its worker modules."""
    import vllm  # only where vLLM is installed

    origin = getattr(vllm, "__file__", None)
    return str(getattr(vllm, "__version__", "unknown")), Path(origin).parent if origin else None


def decide(version: str, source: Path | None = None) -> Decision:
    """What to do with vLLM ``version`` (its source folder ``source`` for the patch-point check)."""
    row = row_of(version)
    if row is None:
        return Decision(
            version,
            REFUSE,
            f"extensible_kv: vLLM {version} is not in the supported table ({TABLE_LINE}); "
            f"nothing patched, vLLM runs untouched",
        )
    if row.action == NATIVE:
        return Decision(
            version,
            NATIVE,
            f"extensible_kv: vLLM {version} has its own extensible KV cache: no KV patch installed; checked instead "
            f"by `extensible-kv check-driver vllm` (its VMM driver) and the tensor rules with --tensor vllm (its "
            f"ExtensibleTensor), and the budget at the measured peak by the integration cases",
        )
    problems = check_patch_points(source) if source is not None else ["the installed vLLM's source was not found"]
    if problems:
        return Decision(
            version,
            REFUSE,
            f"extensible_kv: vLLM {version}: {problems[0]}"
            f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; the supported table is {TABLE_LINE}; "
            f"nothing patched, vLLM runs untouched",
        )
    return Decision(version, PATCH, f"extensible_kv: vLLM {version}: patch points match; patching the KV cache")


def gate() -> Decision:
    """The decision for the installed vLLM, logged: a refusal as one warning line, the native path as one info
    line (Note [A refusal leaves vLLM untouched])."""
    version, source = installed_vllm()
    decision = decide(version, source)
    if decision.action == REFUSE:
        logger.warning(decision.message)
    elif decision.action == NATIVE:
        logger.info(decision.message)
    return decision
