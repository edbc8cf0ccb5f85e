"""Mutation testing of the reference core against the conformance suite (``nox -s mutation``).

mutmut mutates a package under ``./``, ``src/`` or ``source/``; the reference lives under ``reference/``, so the run
happens in a work folder that holds ``src/extensible_kv`` (a copy), the rules (``conformance/``) and the tests
(``tests/``). Each mutant runs the tests that cover the mutated function (rules and unit tests on the ``host-4k``
driver; the meta-tests in ``tests/meta/`` are left out: they re-run the suite in child processes, as do the tests in
``NOT_UNDER_MUTMUT``), with the ``extensible-kv-meta`` Hypothesis profile (derandomized, so a rerun gives the same
verdicts: a mutant must be killed by a worked example or a fixed-seed one, not by luck). A mutant whose tests run past
four times their measured time plus 40 s (wall clock; twice that in CPU time) is stopped and counted killed (it hangs
or loops). Note [A tight timeout kills survivors on a busy machine]: mutmut's wall limit is ``(time + constant) x
multiplier``; with a multiplier of 2 and mutmut's 1 s constant, survivors whose tests ran 2.1 times slower than when
they were measured (three runs sharing two cores) were stopped and counted killed. The score per file is killed /
(mutants - equivalent); ``ci/mutation-equivalent.json`` lists the mutants that cannot change behaviour, each with a
one-line reason. Writes ``reports/mutation.json``.

Usage: ``python ci/mutation.py [--files granules.py,tensor.py] [--max-children N] [--out PATH] [--time-limit S]
[--resume]``, or ``python ci/mutation.py --merge A.json B.json ... [--out PATH]`` to join runs made over disjoint
files (split over machines or calls) into one result. ``--time-limit`` stops mutmut after S seconds and scores what
was tested (the rest counts as not checked); ``--resume`` keeps the verdicts in the work folder, so mutants already
tested there (also verdicts copied in from another machine's ``mutants/`` folder) are not run again.
``--rules-only`` kills with ``conformance`` alone (Note [The rules alone]); ``--model-only`` kills with the lifecycle
model alone (``conformance/test_lifecycle_model.py`` on ``host-4k``, the same profile) and writes
``reports/mutation-model.json`` unless ``--out`` names another file: how much of a file's behaviour the model checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tensor.py", "granules.py", "layout.py", "kv_cache.py", "drivers/host.py", "drivers/ledger.py")
EQUIVALENT = ROOT / "ci" / "mutation-equivalent.json"
OUTSIDE = ROOT / "ci" / "mutation-outside-rules.json"
"""With ``--rules-only``: mutants of code the protocol does not speak of (the host driver's constructor arguments, its
messages where it cannot run), each with a one-line reason; left out of the rules-alone score and counted apart."""
WORK = ROOT / "reports" / "out" / "mutation-work"
RESULT = re.compile(r"^\s*(extensible_kv\.\S+): (.+)$")
KILLED = {"killed", "timeout", "segfault"}
# Tests that run the package in child processes (which import the unmutated copy), whose hypothesis machine faults
# the interpreter under mutmut's trampolines, or that read the checkout (the noxfile, this script). A mutant whose
# tests fault or hang is detected too.
NOT_UNDER_MUTMUT = (
    "conformance/test_stateful_use.py",
    "tests/unit/test_hostile_host.py",
    "tests/unit/test_check_driver.py",
    "tests/unit/test_cli_bad_input.py",
    "tests/unit/test_bad_input.py",
    "tests/unit/test_agreement.py",
    "tests/unit/test_plugin.py",
    "tests/unit/test_noxfile.py",
    "tests/unit/test_report.py",
    "tests/unit/test_mutation_score.py",
)
COPIED = ("conformance", "tests")  # the rules and the tests, beside src/ (the selection leaves tests/meta/ out)

CONFIG = """
[tool.mutmut]
source_paths = ["src/extensible_kv"]
only_mutate = {only}
also_copy = {copied}
pytest_add_cli_args = ["--driver", "host-4k", "-p", "no:cacheprovider", "-q", "-x",
                       "--hypothesis-profile=extensible-kv-meta"]
timeout_multiplier = 4.0
timeout_constant = 10.0
pytest_add_cli_args_test_selection = [{selection}, {ignored}]
"""
ONCE_PER_PROCESS = ("x__lib__", "x_probe__", "ǁ__init____")
"""Mutants of functions whose effect is fixed once per process (the libc binding cached in a module global, the
probe and the constructor of the driver the rules share): Note [Built once, tested once]."""
FRESH_LIMIT_S = 900
MODEL = "conformance/test_lifecycle_model.py"
"""The test selection of ``--model-only``: the stateful model of the tensor's and the KV buffers' life, alone."""
RULES_ONLY_FILES = ("drivers/host.py", "drivers/records.py")
"""What ``--rules-only`` mutates by default: the host driver and its record checks, the code a backend team's driver
stands in for. Note [The rules alone]."""

# Note [The rules alone]
#     ``check-driver`` runs the rules of ``conformance/`` and nothing else: a team's driver never meets the unit
#     tests in ``tests/unit``. A mutant of the host driver that only a unit test kills is a broken driver the rules
#     would pass. ``--rules-only`` scores the rules as ``check-driver`` runs them: the test selection is
#     ``conformance`` alone (the stateful rules included), and the result is written under ``rules_only`` in
#     ``reports/mutation.json``, beside the full run's files.


def _module_file(mutant: str) -> str:
    """``extensible_kv.granules.x_merge__mutmut_3`` or ``extensible_kv.drivers.host.xǁHostDriverǁmap__mutmut_3``
    -> ``granules.py`` or ``drivers/host.py``."""
    return "/".join(mutant.split(".")[1:-1]) + ".py"


def _prepare(files: list[str], resume: bool = False, rules_only: bool = False, model_only: bool = False) -> None:
    """A fresh work folder; with ``resume``, only the package, the rules and the tests are copied again (the
    ``mutants/`` folder keeps its verdicts; mutmut tests again the mutants of functions that changed)."""
    if WORK.exists() and not resume:
        shutil.rmtree(WORK)
    # Note [mutmut's test map goes stale]: mutmut keeps which tests call each function in mutmut-stats.json and, on a
    # later run, maps only tests it has not seen; a file mutated for the first time (drivers/host.py after a run over
    # drivers/records.py alone) then got only the two tests added since: 103 of its mutants had no test and 297
    # survived in 15 minutes, where the rules call every one of those functions. The map is built again every run.
    (WORK / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    for part in ("src", *COPIED):
        if (WORK / part).exists():
            shutil.rmtree(WORK / part)
    (WORK / "src").mkdir(parents=True)
    shutil.copytree(
        ROOT / "reference" / "extensible_kv",
        WORK / "src" / "extensible_kv",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for path in COPIED:
        shutil.copytree(ROOT / path, WORK / path, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text().replace('{"" = "reference",', '{"" = "src",')
    only = json.dumps([f"src/extensible_kv/{f}" for f in files])
    skipped = [path for path in NOT_UNDER_MUTMUT if not (rules_only and path.startswith("conformance/"))]
    ignored = ", ".join(f'"--ignore", "{path}"' for path in skipped)
    selection = '"conformance"' if rules_only else '"conformance", "tests/unit"'  # Note [The rules alone]
    selection = f'"{MODEL}"' if model_only else selection
    (WORK / "pyproject.toml").write_text(
        pyproject + CONFIG.format(only=only, ignored=ignored, selection=selection, copied=json.dumps(list(COPIED)))
    )


def _forget_survivors() -> None:
    """Drop the verdict of every mutant whose tests did not fail or fault (survivors and timeouts), so the next run
    tests it again."""
    from mutmut.stats import status_by_exit_code  # the verdict names mutmut gives exit codes

    for meta in (WORK / "mutants").rglob("*.meta"):
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        for key, code in codes.items():
            if status_by_exit_code[code] not in KILLED - {"timeout"}:
                codes[key] = None
        meta.write_text(json.dumps(data))


# Note [Built once, tested once]
#     mutmut runs the tests once in its own process, then forks a child per mutant that runs the tests calling the
#     mutated function. Code that runs once per process escapes that: the parent has bound libc already (a mutant of
#     ``_lib`` never runs), and the shared driver is built by the first rule that asks for it, so a mutant of its
#     constructor meets that rule alone (a held count of 1 survived, which the first mem_info rule would catch).
#     With ``--rules-only``, every surviving mutant of such a function not listed as equivalent is tested again in a
#     fresh interpreter (``MUTANT_UNDER_TEST`` set, the whole rule selection, ``-x``, as ``check-driver`` runs
#     them); one the rules fail there is killed.
def _fresh_process(results: dict[str, str], listed: dict[str, str], limit_s: float) -> dict[str, str]:
    """``results`` with every once-per-process survivor not ``listed`` (equivalent, or outside the protocol) that
    the whole rule selection kills in a fresh process marked killed; each run stops at ``limit_s`` (counted killed,
    as mutmut counts a timeout)."""
    out = dict(results)
    mutants = WORK / "mutants"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(mutants / "src"), str(mutants)]))
    for name, status in sorted(results.items()):
        if status != "survived" or name in listed or not any(p in name for p in ONCE_PER_PROCESS):
            continue
        args = [sys.executable, "-m", "pytest", "conformance", "--driver", "host-4k", "-p", "no:cacheprovider",
                "-q", "-x", "--hypothesis-profile=extensible-kv-meta", "-n", "2"]  # fmt: skip
        try:
            code = subprocess.run(
                args, cwd=mutants, env={**env, "MUTANT_UNDER_TEST": name}, capture_output=True, timeout=limit_s
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
        out[name] = "survived" if code == 0 else "killed"
        print(f"fresh process: {name}: {out[name]} (exit {code})", flush=True)
    return out


def _results() -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=WORK,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {m.group(1): m.group(2).strip() for m in map(RESULT.match, out.splitlines()) if m}


def score(
    results: dict[str, str], equivalent: dict[str, str], files: list[str], outside: dict[str, str] | None = None
) -> dict:
    """Per-file counts and score, and every surviving mutant not listed as equivalent (or, where ``outside`` is
    given, as outside the protocol: counted apart, left out of the score like an equivalent)."""
    rows, survivors = {}, []
    outside = outside or {}
    for f in files:
        mine = {m: s for m, s in results.items() if _module_file(m) == f}
        counts = Counter("killed" if s in KILLED else s for s in mine.values())
        eq = sorted(m for m in mine if m in equivalent and mine[m] not in KILLED)
        out = sorted(m for m in mine if m in outside and m not in equivalent and mine[m] not in KILLED)
        considered = len(mine) - len(eq) - len(out)
        rows[f] = {
            "mutants": len(mine),
            "killed": counts["killed"],
            "equivalent": len(eq),
            **({"outside_protocol": len(out)} if outside else {}),
            "survived": counts["survived"] - sum(mine[m] == "survived" for m in eq + out),
            "no_tests": counts["no tests"] - sum(mine[m] == "no tests" for m in eq + out),
            "not_checked": counts["not checked"],
            "score": round(counts["killed"] / considered, 4) if considered else None,
        }
        survivors += [
            {"mutant": m, "status": s}
            for m, s in sorted(mine.items())
            if s not in KILLED and m not in equivalent and m not in outside
        ]
    return {"files": rows, "survivors": survivors}


def merge(paths: list[str]) -> dict:
    """One result from runs over disjoint files; a file scored by two runs is refused, naming both."""
    merged: dict = {"tool": None, "driver": None, "files": {}, "survivors": []}
    seen: dict[str, str] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        for key in ("tool", "driver"):
            if merged[key] not in (None, part[key]):
                raise SystemExit(f"--merge: {path} has {key} {part[key]!r}, the others {merged[key]!r}")
            merged[key] = part[key]
        for f, row in part["files"].items():
            if f in seen:
                raise SystemExit(f"--merge: {f} is scored in both {seen[f]} and {path}")
            seen[f] = path
            merged["files"][f] = row
        merged["survivors"] += part["survivors"]
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/mutation.py")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join results of runs over disjoint files")
    parser.add_argument(
        "--files",
        default=None,
        help="files under reference/extensible_kv to mutate (default: the "
        "reference core; with --rules-only, the host driver's files)",
    )
    parser.add_argument(
        "--rules-only",
        action="store_true",
        help="kill mutants with the rules alone, as check-driver runs them (Note [The rules alone])",
    )
    parser.add_argument(
        "--model-only",
        action="store_true",
        help=f"kill mutants with the lifecycle model alone ({MODEL}); writes reports/mutation-model.json",
    )
    parser.add_argument("--max-children", default="2")
    parser.add_argument("--out", default=None, help="the result (default: reports/mutation.json)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop mutmut after this many seconds")
    parser.add_argument("--resume", action="store_true", help="keep the work folder and the verdicts in it")
    parser.add_argument(
        "--retest-survivors",
        action="store_true",
        help="with --resume: test again every mutant whose tests did not fail or fault (survivors, "
        "timeouts), e.g. after adding tests",
    )
    args = parser.parse_args(argv)
    if args.rules_only and args.model_only:
        parser.error("--rules-only and --model-only select different tests: give one")
    args.out = args.out or str(ROOT / "reports" / ("mutation-model.json" if args.model_only else "mutation.json"))
    if args.merge:
        report = merge(args.merge)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"{len(report['files'])} file(s) from {len(args.merge)} run(s); written {args.out}")
        return 0
    default = RULES_ONLY_FILES if args.rules_only else FILES
    files = [f.strip() for f in (args.files or ",".join(default)).split(",") if f.strip()]
    unknown = [f for f in files if not (ROOT / "reference" / "extensible_kv" / f).is_file()]
    if unknown:
        parser.error(f"no such file under reference/extensible_kv: {', '.join(unknown)}")
    _prepare(files, resume=args.resume, rules_only=args.rules_only, model_only=args.model_only)
    if args.retest_survivors:
        _forget_survivors()
    # Note [OpenMP does not survive fork]: mutmut runs the tests once in its own process (to map tests to functions),
    # then forks a child per mutant. torch's CPU kernels run on an OpenMP thread pool; a child forked after the pool
    # started blocks forever in libgomp at its first parallel kernel (seen: count_nonzero over a KV view), and the
    # mutant is counted killed by timeout whatever its tests would have said. One thread: no pool to inherit.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    log = WORK / "mutmut.log"  # mutmut's own output: why it stopped, when it stops early
    with open(log, "w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "mutmut", "run", "--max-children", args.max_children],
            cwd=WORK,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            run.wait(timeout=args.time_limit)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)  # mutmut and its forked workers
            run.wait()
            print(f"mutmut stopped after {args.time_limit:.0f} s; scoring the mutants tested so far")
        else:
            if run.returncode != 0:  # stats or clean tests failed: the verdicts on disk are not this run's
                tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-20:]
                print(
                    f"mutmut run exited {run.returncode} before testing the mutants; nothing scored, "
                    f"{args.out} left as it was. The end of {log}:",
                    *tail,
                    sep="\n",
                    file=sys.stderr,
                )
                return run.returncode
    equivalent = json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}
    results = _results()
    outside = json.loads(OUTSIDE.read_text()) if args.rules_only and OUTSIDE.exists() else None
    if args.rules_only:  # Note [Built once, tested once]
        results = _fresh_process(results, {**equivalent, **(outside or {})}, FRESH_LIMIT_S)
    report = {"tool": "mutmut", "driver": "host-4k", **score(results, equivalent, files, outside)}
    if args.rules_only:  # beside the full run's result, in the same file
        out = Path(args.out)
        whole = json.loads(out.read_text()) if out.exists() else {}
        whole["rules_only"] = {**report, "selection": "conformance"}
        Path(args.out).write_text(json.dumps(whole, indent=2) + "\n")
    elif args.model_only:  # a file of its own: the full run's result is left as it was
        Path(args.out).write_text(json.dumps({**report, "selection": MODEL}, indent=2) + "\n")
    else:
        kept = json.loads(Path(args.out).read_text()).get("rules_only") if Path(args.out).exists() else None
        Path(args.out).write_text(json.dumps({**report, **({"rules_only": kept} if kept else {})}, indent=2) + "\n")
    for f, row in report["files"].items():
        print(
            f"{f:<20} {row['mutants']:>5} mutants {row['killed']:>5} killed {row['equivalent']:>4} equivalent "
            f"score {row['score']}"
        )
    print(f"{len(report['survivors'])} survivor(s) not listed as equivalent; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
