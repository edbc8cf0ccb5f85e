"""The per-rule results of ``ci/vllm_native_check.sh run``: each step's junit XML as ``rules-<step>.json`` (one entry
per rule), the same results as a conformance summary (``conformance-vllm.json``, ``conformance-vllm-tensor.json``,
the ``ConformanceSummary`` format of ``extensible_kv_lab.measurements`` that ``extensible-kv report`` reads), and the
table the script prints last. Plain ``json`` and ``xml``: the GPU image has no pydantic; the report validates on read.

    python3 ci/vllm_native_rules.py OUT RC_DRIVER RC_TENSOR    # after both steps: every file above, then the table
    python3 ci/vllm_native_rules.py --from-rules OUT [TORCH]   # conformance-*.json again from OUT's rules-*.json

Note [A rule is one entry]
    pytest's junit XML writes a rule that failed and then failed its teardown (the leak guard) as two ``testcase``
    elements; a rule is one entry here, failed, its reason the call's failure then the teardown's. A rule a profile
    or ``--tensor vllm`` leaves out ("not held: ..." skips) is ``not held`` in ``rules-*.json`` and ``skipped`` with
    that reason in the conformance summary, as ``--summary-json`` writes it.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DRIVER = "vllm"
STEPS = (  # (step, junit XML, rules JSON, conformance summary)
    ("check-driver vllm", "junit-driver.xml", "rules-driver.json", "conformance-vllm.json"),
    ("tensor rules, --tensor vllm", "junit-tensor*.xml", "rules-tensor.json", "conformance-vllm-tensor.json"),
)
OUTCOMES = ("passed", "failed", "not held", "skipped")


def rules(xml_path: Path) -> list[dict]:
    """One entry per rule of the junit XML at ``xml_path``, or of every file its name matches when it is a pattern
    (one process per rule file: ``ci/vllm_native_check.sh``) (Note [A rule is one entry])."""
    paths = sorted(xml_path.parent.glob(xml_path.name)) if "*" in xml_path.name else [xml_path]
    cases = []
    try:
        if not paths:
            raise OSError(f"no junit XML matches {xml_path}")
        for path in paths:
            cases.extend(ET.parse(path).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        return [{"test": None, "outcome": "not run", "reason": str(exc)}]
    found: dict[str, dict] = {}
    for case in cases:
        outcome, reason = "passed", None
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[kind]
                reason = (el.get("message") or "")[:2000]
                break
        if outcome == "skipped" and reason and "not held:" in reason:
            outcome = "not held"
        test = f"{case.get('classname')}::{case.get('name')}"
        seen = found.get(test)
        if seen is None:
            found[test] = {"test": test, "outcome": outcome, "reason": reason}
        elif outcome == "failed":  # the teardown of a rule already listed
            why = "; ".join(r for r in (seen["reason"], reason) if r)
            found[test] = {"test": test, "outcome": "failed", "reason": why[:4000]}
    return list(found.values())


def counts(found: list[dict]) -> dict[str, int]:
    return {k: sum(r["outcome"] == k for r in found) for k in OUTCOMES}


def _test_path(test: str) -> str:
    """``conformance.test_x::test_y[vllm]`` (junit's class name) -> ``conformance/test_x.py::test_y[vllm]``."""
    module, _, name = test.partition("::")
    return f"{module.replace('.', '/')}.py::{name}"


def conformance(found: list[dict], exit_status: int | None, torch: str | None) -> dict:
    """``found`` (``rules``' entries) as a conformance summary of the ``vllm`` driver."""
    ran = [r for r in found if r["test"] is not None]
    c = counts(ran)
    tests = [
        {
            "driver": DRIVER,
            "test": _test_path(r["test"]),
            "outcome": "skipped" if r["outcome"] == "not held" else r["outcome"],
            "reason": r["reason"],
        }
        for r in ran
    ]
    driver = {"driver": DRIVER, "passed": c["passed"], "failed": c["failed"], "skipped": c["not held"] + c["skipped"]}
    if not ran:
        driver["unavailable"] = found[0]["reason"] if found else "no rules recorded"
    return {"exitstatus": exit_status, "torch": torch, "drivers": [driver], "tests": tests}


def _torch(out: Path) -> str | None:
    """torch's version from the run's ``probe.txt`` (``torch 2.11.0+cu130 NVIDIA H100 80GB HBM3``)."""
    try:
        for line in (out / "probe.txt").read_text().splitlines():
            if line.startswith("torch "):
                return line.split()[1]
    except OSError:
        pass
    return None


def _write(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def after_run(out: Path, rc_driver: int, rc_tensor: int) -> None:
    table = []
    for (step, xml, name, summary), rc in zip(STEPS, (rc_driver, rc_tensor)):
        found = rules(out / xml)
        _write(out / name, {"step": step, "exit_status": rc, "rules": found})
        _write(out / summary, conformance(found, rc, _torch(out)))
        table.append((step, counts(found), [r["test"] for r in found if r["outcome"] in ("failed", "not run")]))
    print(f"{'step':<30} {'passed':>6} {'failed':>6} {'not held':>8} {'skipped':>7}")
    for step, c, _ in table:
        print(f"{step:<30} {c['passed']:>6} {c['failed']:>6} {c['not held']:>8} {c['skipped']:>7}")
    for step, _, failed in table:
        for test in failed:
            print(f"FAILED [{step}] {test}")
    try:
        for f in json.loads((out / "findings.json").read_text()):
            print(f"{f['outcome']:<24} {f['finding']}")
    except (OSError, ValueError) as exc:
        print("findings: not run", exc)


def from_rules(out: Path, torch: str | None) -> None:
    for _, _, name, summary in STEPS:
        data = json.loads((out / name).read_text())
        _write(out / summary, conformance(data["rules"], data["exit_status"], torch or _torch(out)))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) in (2, 3) and args[0] == "--from-rules":
        from_rules(Path(args[1]), args[2] if len(args) == 3 else None)
    elif len(args) == 3 and args[0] != "--from-rules":
        after_run(Path(args[0]), int(args[1]), int(args[2]))
    else:
        sys.exit(__doc__)
