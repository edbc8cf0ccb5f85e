"""``ci/mutation.py``'s arithmetic: the per-file score (killed / (mutants - equivalent)), the survivors it lists, and
the merge of runs made over disjoint files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "ci" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation)

HOST = "extensible_kv.drivers.host.xǁHostDriverǁmap__mutmut_{}"
GRANULES = "extensible_kv.granules.x_merge__mutmut_{}"


def test_score_counts_timeouts_and_faults_as_killed_and_leaves_equivalents_out():
    results = {
        HOST.format(1): "killed",
        HOST.format(2): "timeout",
        HOST.format(3): "segfault",
        HOST.format(4): "survived",
        HOST.format(5): "survived",
        HOST.format(6): "not checked",
        GRANULES.format(1): "killed",
        GRANULES.format(2): "no tests",
    }
    got = mutation.score(results, {HOST.format(5): "cannot change behaviour"}, ["drivers/host.py", "granules.py"])
    host = got["files"]["drivers/host.py"]
    expected = {
        "mutants": 6,
        "killed": 3,
        "equivalent": 1,
        "survived": 1,
        "no_tests": 0,
        "not_checked": 1,
        "score": round(3 / 5, 4),
    }
    assert host == expected, f"score(drivers/host.py): expected {expected}, got {host}"
    assert got["files"]["granules.py"]["score"] == 0.5, got["files"]["granules.py"]
    listed = [s["mutant"] for s in got["survivors"]]
    assert listed == [HOST.format(4), HOST.format(6), GRANULES.format(2)], (
        f"survivors: expected the unkilled mutants not listed as equivalent, got {listed}"
    )


def test_score_with_the_rules_alone_counts_mutants_outside_the_protocol_apart():
    results = {
        HOST.format(1): "killed",
        HOST.format(2): "survived",
        HOST.format(3): "no tests",
        HOST.format(4): "killed",
    }
    outside = {HOST.format(2): "constructor argument", HOST.format(3): "constructor argument", HOST.format(4): "x"}
    got = mutation.score(results, {}, ["drivers/host.py"], outside)
    host = got["files"]["drivers/host.py"]
    expected = {
        "mutants": 4,
        "killed": 2,
        "equivalent": 0,
        "outside_protocol": 2,
        "survived": 0,
        "no_tests": 0,
        "not_checked": 0,
        "score": 1.0,
    }
    assert (host, got["survivors"]) == (expected, []), (
        f"score(drivers/host.py) with two survivors outside the protocol and one listed there but killed: "
        f"expected {expected} and no survivor, got {host} and {got['survivors']}"
    )


def test_merge_joins_runs_over_disjoint_files_and_refuses_a_file_scored_twice(tmp_path):
    a = {"tool": "mutmut", "driver": "host-4k", "files": {"granules.py": {"score": 1.0}}, "survivors": []}
    b = {
        "tool": "mutmut",
        "driver": "host-4k",
        "files": {"drivers/host.py": {"score": 0.99}},
        "survivors": [{"mutant": HOST.format(4), "status": "survived"}],
    }
    paths = []
    for name, part in (("a.json", a), ("b.json", b), ("c.json", a)):
        (tmp_path / name).write_text(json.dumps(part))
        paths.append(str(tmp_path / name))
    merged = mutation.merge(paths[:2])
    assert set(merged["files"]) == {"granules.py", "drivers/host.py"} and merged["survivors"] == b["survivors"], (
        f"merge(a, b): expected both files and b's survivor, got {merged}"
    )
    with pytest.raises(SystemExit, match=r"granules.py is scored in both .*a.json and .*c.json"):
        mutation.merge([paths[0], paths[2]])


def test_a_mutmut_run_that_exits_early_is_reported_with_its_output_and_nothing_is_scored(tmp_path, monkeypatch, capsys):
    # mutmut exits 1 when its stats or clean-test run fails; the verdicts left on disk are then an earlier run's.
    class FailingRun:
        def __init__(self, argv, cwd, stdout, stderr, start_new_session, env):
            stdout.write("Running clean tests\rFAILED tests/unit/test_x.py::test_y\nFailed to run clean test\n")
            stdout.flush()
            self.pid, self.returncode = 0, 1

        def wait(self, timeout=None):
            return self.returncode

    monkeypatch.setattr(mutation, "WORK", tmp_path)
    monkeypatch.setattr(mutation, "_prepare", lambda files, **modes: None)
    monkeypatch.setattr(mutation.subprocess, "Popen", FailingRun)
    monkeypatch.setattr(mutation, "_results", lambda: pytest.fail("scored the verdicts of a run that did not happen"))
    out = tmp_path / "score.json"
    code = mutation.main(["--files", "granules.py", "--out", str(out)])
    err = capsys.readouterr().err
    assert (code, out.exists()) == (1, False), (
        f"ci/mutation.py after mutmut exited 1: expected (1, no {out}), got ({code}, {out.exists()})"
    )
    assert "mutmut run exited 1" in err and "Failed to run clean test" in err and "test_x.py::test_y" in err, (
        f"ci/mutation.py after mutmut exited 1: expected the exit code and mutmut's last lines on stderr, got {err!r}"
    )


@pytest.mark.parametrize(
    "modes,selection",
    [
        ({"rules_only": True}, '["conformance", '),
        ({"model_only": True}, '["conformance/test_lifecycle_model.py", '),
        ({}, '["conformance", "tests/unit", '),
    ],
)
def test_the_rules_only_and_model_only_modes_select_their_tests_alone(tmp_path, monkeypatch, modes, selection):
    monkeypatch.setattr(mutation, "WORK", tmp_path / "work")
    monkeypatch.setattr(mutation, "COPIED", ())  # the package only: the selection is what is checked
    mutation._prepare(["drivers/host.py"], **modes)
    config = (tmp_path / "work" / "pyproject.toml").read_text()
    line = next(x for x in config.splitlines() if x.startswith("pytest_add_cli_args_test_selection"))
    assert line.startswith(f"pytest_add_cli_args_test_selection = {selection}"), (
        f"_prepare({modes}): expected the test selection to start {selection!r}, got {line!r}"
    )


def test_the_model_only_mode_writes_a_file_of_its_own(tmp_path, monkeypatch):
    class CleanRun:
        def __init__(self, argv, cwd, stdout, stderr, start_new_session, env):
            self.pid, self.returncode = 0, 0

        def wait(self, timeout=None):
            return self.returncode

    (tmp_path / "reference" / "extensible_kv").mkdir(parents=True)
    (tmp_path / "reference" / "extensible_kv" / "tensor.py").write_text("")
    (tmp_path / "reports").mkdir()
    whole = tmp_path / "reports" / "mutation.json"
    whole.write_text('{"tool": "mutmut"}\n')
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "WORK", tmp_path / "work")
    monkeypatch.setattr(mutation, "EQUIVALENT", tmp_path / "none.json")
    monkeypatch.setattr(mutation, "_prepare", lambda files, **modes: (tmp_path / "work").mkdir())
    monkeypatch.setattr(mutation.subprocess, "Popen", CleanRun)
    mutant = "extensible_kv.tensor.xǁExtensibleTensorǁclose__mutmut_1"
    monkeypatch.setattr(mutation, "_results", lambda: {mutant: "killed"})
    assert mutation.main(["--model-only", "--files", "tensor.py"]) == 0
    written = tmp_path / "reports" / "mutation-model.json"
    got = json.loads(written.read_text()) if written.exists() else None
    assert got is not None and got["selection"] == "conformance/test_lifecycle_model.py", (
        f"ci/mutation.py --model-only: expected {written} naming the model as its selection, got {got}"
    )
    assert got["files"]["tensor.py"]["score"] == 1.0 and whole.read_text() == '{"tool": "mutmut"}\n', (
        f"ci/mutation.py --model-only: expected tensor.py scored 1.0 and {whole} left as it was, got {got} and "
        f"{whole.read_text()!r}"
    )


def test_the_rules_only_and_model_only_modes_are_not_given_together(capsys):
    with pytest.raises(SystemExit):
        mutation.main(["--rules-only", "--model-only"])
    assert "--rules-only and --model-only" in capsys.readouterr().err
