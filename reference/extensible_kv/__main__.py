"""Command line: ``python -m extensible_kv drivers | check-driver | validate-backend | environment | report |
bench-summary``."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from . import drivers


class _Parser(argparse.ArgumentParser):
    """Bad arguments are answered with one line on stderr (the error, without the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _backend_spec(text: str) -> str:
    from .backend_check import BackendLoadError, check_spec  # noqa: PLC0415

    try:
        return check_spec(text)
    except BackendLoadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _drivers(_: argparse.Namespace) -> int:
    for name in drivers.registered():
        reason = drivers.probe(name)
        print(f"{name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print(f"best available: {drivers.best_available()}")
    return 0


def _rules():
    """The conformance suite's package: installed (``extensible_kv_conformance``) or, in a source checkout whose root
    is on the path, ``conformance``; ``None`` when neither is importable."""
    for name in ("extensible_kv_conformance", "conformance"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, "check_driver", None)):
            return module
    return None


def _check_driver(args: argparse.Namespace) -> int:
    rules = _rules()
    if rules is None:
        print("error: the conformance rules are not importable: install the package (pip install extensible-kv) or "
              "put the checkout's root on PYTHONPATH", file=sys.stderr)
        return 2
    return rules.check_driver(args.driver, args.pytest_args)


def _validate_backend(args: argparse.Namespace) -> int:
    from .backend_check import validate_many  # noqa: PLC0415

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        print(f"error: --dtype {args.dtype!r} is not a torch dtype", file=sys.stderr)
        return 2
    layouts = ["NHD", "HND"] if args.layout == "both" else [args.layout]
    reports = validate_many(args.backend, layouts, driver=args.driver, num_kv_heads=args.num_kv_heads,
                            head_size=args.head_size, block_size=args.block_size, dtype=dtype,
                            cache_dtype_str=args.cache_dtype)
    if args.json:
        from dataclasses import asdict  # noqa: PLC0415

        from .measurements import BackendResult, BackendValidation, write  # noqa: PLC0415

        results = [BackendResult(**{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(r).items()},
                                 ok=r.ok) for r in reports]
        try:
            write(args.json, BackendValidation(results=results))
        except OSError as exc:
            print(f"error: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
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
    from .measurements import Environment, write  # noqa: PLC0415

    try:
        print(write(f"{args.out_dir}/environment.json", Environment.collect()).as_posix())
    except OSError as exc:
        print(f"error: cannot write {args.out_dir}/environment.json: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m extensible_kv")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("drivers", help="list the registered drivers and why any cannot run here").set_defaults(
        run=_drivers)
    cd = sub.add_parser("check-driver", help="run every conformance rule on a driver (exit 0: conformant)",
                        description="Run every conformance rule on DRIVER in a pytest-xdist worker (a driver that "
                                    "faults fails the rule it faulted in, the run goes on); the exit status is "
                                    "pytest's: 0 when every rule passes.")
    cd.add_argument("driver", help="registered driver name (host, host-4k, cuda, hip) or module:factory")
    rest = cd.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed to pytest (e.g. -k zero, -x, -q)")
    rest.required = False  # none is fine; argparse would name it among the missing arguments beside the driver
    cd.set_defaults(run=_check_driver)
    vb = sub.add_parser("validate-backend", help="check that attention backends' KV layouts work with block-prefix "
                                                 "commits")
    vb.add_argument("backend", nargs="+", type=_backend_spec,
                    help="vLLM AttentionBackendEnum name (e.g. FLASH_ATTN) or module:Class")
    vb.add_argument("--layout", choices=["NHD", "HND", "both"], default="NHD",
                    help="vLLM KV cache layout (VLLM_KV_CACHE_LAYOUT) to check under; 'both' runs NHD and HND")
    vb.add_argument("--driver", default=None, help="driver name or module:factory (default: best available)")
    vb.add_argument("--num-kv-heads", type=_positive_int, default=4)
    vb.add_argument("--head-size", type=_positive_int, default=64)
    vb.add_argument("--block-size", type=_positive_int, default=16)
    vb.add_argument("--dtype", default="bfloat16")
    vb.add_argument("--cache-dtype", default="auto", help="vLLM cache_dtype_str passed to get_kv_cache_shape")
    vb.add_argument("--json", metavar="PATH", default=None,
                    help="also write the results as JSON (extensible_kv.measurements.BackendValidation) to PATH")
    vb.set_defaults(run=_validate_backend)
    env = sub.add_parser("environment", help="write OUT_DIR/environment.json: torch, CUDA/HIP, GPU, driver, python, "
                                             "platform (extensible_kv.measurements.Environment)")
    env.add_argument("out_dir", metavar="OUT_DIR")
    env.set_defaults(run=_environment)
    from .report import register as register_report  # noqa: PLC0415 - matplotlib loads only when it draws

    register_report(sub)  # report, bench-summary
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
