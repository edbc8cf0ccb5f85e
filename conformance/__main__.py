"""``python -m extensible_kv_conformance DRIVER [pytest arguments]``: ``check_driver`` as a command, the one that
``extensible-kv check-driver`` runs once it has found the suite installed."""

from __future__ import annotations

import sys

from . import check_driver

USAGE = "usage: extensible-kv check-driver DRIVER [pytest arguments]  (DRIVER: a registered name or module:factory)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        print(f"error: the driver is required; {USAGE}", file=sys.stderr)
        return 2
    try:
        return check_driver(argv[0], argv[1:])
    except KeyboardInterrupt:
        print("check-driver: interrupted; its child processes were ended", file=sys.stderr)
        return 130
    except Exception as exc:  # a command line answers with one line, never a traceback
        from extensible_kv.boundaries import shown
        from extensible_kv.errors import ExtensibleKVError

        what = str(exc) if isinstance(exc, ExtensibleKVError) else f"check-driver failed: {type(exc).__name__}: {exc}"
        print(f"error: {shown(' '.join(what.split()), 400)[1:-1]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
