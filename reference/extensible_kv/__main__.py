"""Command line: ``extensible-kv`` (or ``python -m extensible_kv``) ``drivers | check-driver | validate-backend |
environment | report | bench-summary``; without a command it lists them.

The runtime needs torch and numpy only: what a command needs beyond them (the conformance suite and pytest for
``check-driver``, the lab, ``extensible_kv_lab``, for ``report`` and ``bench-summary``) is looked for when that
command runs, and its absence is one line saying how to install it. ``environment`` and ``validate-backend --json``
write plain JSON (``record``).
"""

from __future__ import annotations

import sys

try:  # torch takes seconds to load: an interrupt meanwhile is one line too (the package itself loads nothing heavy)
    import argparse
    import importlib.util
    import os
    from importlib.machinery import ModuleSpec
    from pathlib import Path
    from typing import NoReturn

    import torch

    from . import boundaries, drivers
    from .boundaries import numbers, outputs
    from .errors import ExtensibleKVError
except KeyboardInterrupt:
    print("error: interrupted while starting; no command ran", file=sys.stderr)
    sys.exit(130)

SCRIPT = "extensible-kv"  # the console script (pyproject.toml)
SUITE_NEEDS = ("pytest", "xdist", "hypothesis")  # what the conformance extra brings and the rules import


class _Parser(argparse.ArgumentParser):
    """Bad arguments are answered with one line on stderr (the error, without the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    """A size or count of ``validate-backend``: a positive integer below 2**63 (``boundaries.numbers``)."""
    try:
        return numbers.integer(text, option="the value", what="a positive integer")
    except numbers.BadNumber as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the value ")) from None


def _text(text: str) -> str:
    """A name given on the command line (a backend, a dtype, a driver): UTF-8 text (``boundaries.text``)."""
    try:
        return boundaries.text(text, "the value")
    except boundaries.BoundaryError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the value ")) from None


def _backend_spec(text: str) -> str:
    from .backend_check import BackendLoadError, check_spec

    try:
        return check_spec(_text(text))
    except BackendLoadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _drivers(_: argparse.Namespace) -> int:
    for name in drivers.registered():
        reason = drivers.probe(name)
        print(f"{name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print(f"best available: {drivers.best_available()}")
    return 0


def _find(name: str) -> ModuleSpec | None:
    """``importlib.util.find_spec(name)`` for a top-level name, which runs no code of it; ``None`` if absent."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def suite() -> str | None:
    """The module name of the conformance suite, found without importing it: installed (``extensible_kv_conformance``)
    or, in a source checkout, the ``conformance`` folder beside ``reference/`` (only that one: another project's
    package of that name is not the suite); ``None`` when neither is there."""
    found = _find("extensible_kv_conformance")
    if found is not None and found.origin:
        return "extensible_kv_conformance"
    found = _find("conformance")
    checkout = Path(__file__).resolve().parents[2] / "conformance"
    if found is not None and found.origin and Path(found.origin).resolve() == checkout / "__init__.py":
        return "conformance"
    return None


def _check_driver(args: argparse.Namespace) -> int:
    """Hand over to the suite's own command (``python -m <suite>``) in this process: the runtime never imports the
    suite, and the suite's command, not this one, owns the children it starts and the signals it is sent."""
    name = suite()
    missing = [m for m in SUITE_NEEDS if _find(m) is None]
    if name is None or missing:
        what = (
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"
            if missing
            else "the conformance suite is not installed"
        )
        print(
            f"error: check-driver needs the conformance extra ({what}): {drivers.install_command('conformance')}",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, "-m", name, args.driver, *args.pytest_args])
    except OSError as exc:
        print(f"error: cannot start {sys.executable} -m {name}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 2  # not reached: execv replaced this process


LAB = "extensible_kv_lab"  # the lab's package (lab/ in a checkout), which ``report`` and ``bench-summary`` need
LAB_NEEDS = (LAB, "pydantic", "matplotlib", "jinja2", "markdown_it", "mdit_py_plugins")  # it and what it requires


def lab_install_command() -> str:
    """How to install the lab: it is not on an index, only in a checkout (``lab/``, beside the runtime's
    ``pyproject.toml``)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "lab" / "pyproject.toml").is_file():
        where = "./lab" if Path(os.getcwd()).resolve() == root else str(root / "lab")
        return f"pip install -e {where}"
    return "pip install ./lab from a checkout of extensible-kv"


def _needs_lab(exc: ModuleNotFoundError, command: str) -> int:
    """One line for a command of the lab when the lab, or a package it requires, is not installed."""
    name = (exc.name or "").split(".")[0]
    what = "the lab (extensible-kv-lab)" if name == LAB else name
    print(f"error: {command} needs {what}, which is not installed: {lab_install_command()}", file=sys.stderr)
    return 2


def _validate_backend(args: argparse.Namespace) -> int:
    from .backend_check import validate_many

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        print(f"error: --dtype {args.dtype!r} is not a torch dtype", file=sys.stderr)
        return 2
    if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):  # torch warns, then fails
        print(f"error: --dtype {args.dtype!r} is a quantized dtype; a KV cache holds plain elements", file=sys.stderr)
        return 2
    if args.json:  # before any work (Note [An output is a regular file or a new path, checked first])
        outputs.output_file(args.json, option="--json")
    layouts = ["NHD", "HND"] if args.layout == "both" else [args.layout]
    driver = drivers.resolve(args.driver)  # a bad spec or a driver that cannot run: one line, before any backend
    reports = validate_many(
        args.backend,
        layouts,
        driver=driver,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        dtype=dtype,
        cache_dtype_str=args.cache_dtype,
    )
    if args.json:
        from dataclasses import asdict

        from . import record

        results = [
            {**{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(r).items()}, "ok": r.ok} for r in reports
        ]
        try:
            record.write(args.json, {"results": results})
        except OSError as exc:
            print(f"error: cannot write {boundaries.shown(args.json)}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    for report in reports:
        print("\n".join(report.lines()))
    failed = [r for r in reports if not r.ok]
    names = ", ".join(f"{r.backend}/{r.kv_layout}" for r in failed)
    print(f"{len(reports) - len(failed)} of {len(reports)} passed" + (f"; failed: {names}" if failed else ""))
    if not failed:
        return 0
    sys.stdout.flush()
    reasons = "; ".join(f"{r.backend}/{r.kv_layout} ({r.failure})" for r in failed)
    print(" ".join(f"error: {len(failed)} of {len(reports)} failed: {reasons}".split()), file=sys.stderr)
    return 1


def _environment(args: argparse.Namespace) -> int:
    from . import record

    outputs.output_folder(args.out_dir, option="OUT_DIR", files=["environment.json"])
    path = os.path.join(args.out_dir, "environment.json")
    try:
        print(boundaries.named(record.write(path, record.environment()).as_posix()))
    except OSError as exc:
        print(f"error: cannot write {boundaries.shown(path)}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def _register_report(sub: argparse._SubParsersAction) -> None:
    """``report`` and ``bench-summary``, the lab's; without the lab, each answers with the line that says so."""
    try:
        from extensible_kv_lab.report import register  # pydantic loads here, matplotlib when it draws
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in LAB_NEEDS:
            raise
        for name in ("report", "bench-summary"):
            stub = sub.add_parser(name, help=f"(needs the lab: {lab_install_command()})")
            stub.add_argument("args", nargs=argparse.REMAINDER)
            stub.set_defaults(run=lambda args, exc=exc, name=name: _needs_lab(exc, name))
        return
    register(sub)


def prog() -> str:
    """How this command was started: ``extensible-kv`` (the console script) or ``python -m extensible_kv``."""
    return SCRIPT if Path(sys.argv[0]).name == SCRIPT else "python -m extensible_kv"


def main(argv: list[str] | None = None) -> int:
    """Run a command; without one, list the commands on stdout and return 2 (nothing was run). An interrupt while
    the command line is read is one line too (130)."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print("error: interrupted before any command ran", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    parser = _Parser(
        prog=prog(),
        description="Growable, virtual-memory-backed tensors and KV caches: the drivers, "
        "their conformance rules, backend checks and measurement reports.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.add_parser("drivers", help="list the registered drivers and why any cannot run here").set_defaults(run=_drivers)
    cd = sub.add_parser(
        "check-driver",
        help="run every conformance rule on a driver (exit 0: conformant)",
        description="Build DRIVER once in a child process (within --build-timeout, default 60 s), "
        "then run every conformance rule on it in a pytest-xdist worker: a driver that "
        "faults or runs past --rule-timeout (default 300 s) fails the rule it was in and "
        "the run goes on to its summary. This process never imports DRIVER's module. "
        "Exit status: 0 when every rule passes, 1 when one fails or the driver cannot be "
        "built, 2 for a spec that names no driver. Needs the conformance extra.",
    )
    cd.add_argument("driver", help="registered driver name (host, host-4k, cuda, hip) or module:factory")
    rest = cd.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="passed to pytest (e.g. -k zero, -x, -q, --build-timeout 30, --rule-timeout 120, --summary-json PATH)",
    )
    rest.required = False  # none is fine; argparse would name it among the missing arguments beside the driver
    cd.set_defaults(run=_check_driver)
    vb = sub.add_parser(
        "validate-backend", help="check that attention backends' KV layouts work with block-prefix commits"
    )
    vb.add_argument(
        "backend",
        nargs="+",
        type=_backend_spec,
        help="vLLM AttentionBackendEnum name (e.g. FLASH_ATTN) or module:Class",
    )
    vb.add_argument(
        "--layout",
        choices=["NHD", "HND", "both"],
        default="NHD",
        help="vLLM KV cache layout (VLLM_KV_CACHE_LAYOUT) to check under; 'both' runs NHD and HND",
    )
    vb.add_argument(
        "--driver", type=_text, default=None, help="driver name or module:factory (default: best available)"
    )
    vb.add_argument("--num-kv-heads", type=_positive_int, default=4)
    vb.add_argument("--head-size", type=_positive_int, default=64)
    vb.add_argument("--block-size", type=_positive_int, default=16)
    vb.add_argument("--dtype", type=_text, default="bfloat16")
    vb.add_argument(
        "--cache-dtype", type=_text, default="auto", help="vLLM cache_dtype_str passed to get_kv_cache_shape"
    )
    vb.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the results as JSON (the lab's measurements.BackendValidation) to PATH",
    )
    vb.set_defaults(run=_validate_backend)
    env = sub.add_parser(
        "environment",
        help="write OUT_DIR/environment.json: torch, CUDA/HIP, GPU, driver, python, "
        "platform (the lab's measurements.Environment)",
    )
    env.add_argument("out_dir", metavar="OUT_DIR")
    env.set_defaults(run=_environment)
    _register_report(sub)
    if not argv:
        print(parser.format_help(), end="")
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:  # options but no command
        print(parser.format_help(), end="")
        return 2
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """``args.run(args)``, every way it can end as one line: a value refused at a boundary or a typed error of this
    package (exit 2), an interrupt (130), any other exception, named with its type (2). Nothing is half-written:
    every output is written whole or not at all (``boundaries.outputs``)."""
    try:
        return args.run(args)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in LAB_NEEDS:
            return _failed(args, exc)
        return _needs_lab(exc, args.command)
    except ExtensibleKVError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: {args.command} interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    except Exception as exc:  # a command line answers with one line, never a traceback
        return _failed(args, exc)


def _failed(args: argparse.Namespace, exc: BaseException) -> int:
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    print(f"error: {args.command} failed: {boundaries.shown(reason, 300)[1:-1]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
