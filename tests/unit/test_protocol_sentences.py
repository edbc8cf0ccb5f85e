"""The protocol's sentences, its executable model and its rules say the same thing: every promise of
``drivers/_protocol.py`` carries an id (``[P-...]``, written once, where the promise is stated), the model
(``conformance/protocol_model.py``) implements every id and names none the protocol lacks, and some rule of the suite
(a test, or a rule, invariant or initializer of a state machine, in the modules of ``conformance/``) names each id in
its docstring and names no other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conformance import SUITE
from conformance.protocol_model import IMPLEMENTED
from extensible_kv.drivers import DRIVER_METHODS, Driver
from extensible_kv.drivers import _protocol as protocol

DEFINED = re.compile(r"\[(P-[a-z0-9]+(?:-[a-z0-9]+)*)\]")
NAMED = re.compile(r"(?<![\w-])P-[a-z0-9]+(?:-[a-z0-9]+)*")
RULE_DECORATORS = {"rule", "invariant", "initialize", "precondition"}


def protocol_ids() -> list[str]:
    """Every id the protocol defines, in order, duplicates kept."""
    return DEFINED.findall(Path(protocol.__file__).read_text())


def rule_docstrings() -> dict[str, str]:
    """``file::name`` -> docstring of every rule of the suite: a ``test_*`` function, or a method decorated as a state
    machine's rule, invariant or initializer, in any module of the rules' folder."""
    found = {}
    for path in sorted(SUITE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            names = {getattr(d.func if isinstance(d, ast.Call) else d, "id", None) for d in node.decorator_list}
            if node.name.startswith("test_") or names & RULE_DECORATORS:
                found[f"{path.name}::{node.name}"] = ast.get_docstring(node) or ""
    return found


def test_the_protocol_writes_each_id_once_and_each_method_states_its_promises_with_ids():
    ids = protocol_ids()
    twice = sorted({i for i in ids if ids.count(i) > 1})
    bare = [m for m in DRIVER_METHODS if not DEFINED.search(getattr(Driver, m).__doc__ or "")]
    assert (twice, bare, len(ids) > 0) == ([], [], True), (
        f"drivers/_protocol.py: expected every id defined once and an id in every method's docstring, got ids "
        f"defined more than once {twice}, methods without an id {bare}, {len(ids)} ids in all"
    )


def test_the_model_implements_every_protocol_id_and_names_no_other():
    ids = set(protocol_ids())
    named = set(NAMED.findall((SUITE / "protocol_model.py").read_text()))
    got = (sorted(ids - set(IMPLEMENTED)), sorted(set(IMPLEMENTED) - ids), sorted(named - ids))
    assert got == ([], [], []), (
        f"conformance/protocol_model.py: expected a clause for every protocol id and no other id, got ids without "
        f"a clause {got[0]}, clauses of ids the protocol lacks {got[1]}, other ids named {got[2]}"
    )


def test_a_rule_names_every_protocol_id_and_the_rules_name_no_other():
    ids = set(protocol_ids())
    docs = rule_docstrings()
    named = {
        i: sorted(k for k, doc in docs.items() if i in NAMED.findall(doc))
        for i in {n for doc in docs.values() for n in NAMED.findall(doc)}
    }
    got = (sorted(ids - set(named)), {i: where for i, where in sorted(named.items()) if i not in ids})
    assert got == ([], {}), (
        f"conformance/*.py: expected a rule naming every protocol id and none naming another, got ids no "
        f"rule names {got[0]}, unknown ids and the rules naming them {got[1]}"
    )
