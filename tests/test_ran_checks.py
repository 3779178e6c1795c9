"""Every test that builds an SD or SSD engine proves that its path ran (tests/support/ran.py says why).

Read from the test files' source, not by running them: a test function counts as building one when its
text (decorators and parameters included) both builds an engine (`RolloutEngine(...)`, an `*engine*(...)`
helper, a recipe or trainer run, a server fixture) and names SD or SSD (`"sd"`, `"ssd"`,
`spec.method=ssd`, `ssd_engine(`, an `sd_`/`ssd_` fixture), in its own text or in a module-level table
or fixture of its module that it uses. It must then call `assert_ran`, directly or through
functions of its own module that do, or carry a `# ran-check: <why>` comment saying why the
path needs no check (for example: it only tests a refusal, or the engine never samples).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NAMES_SPEC = re.compile(r"""["'](?:sd|ssd)["']|ssd_engine\(|method=(?:sd|ssd)\b|\b(?:sd|ssd)_(?:engine|server)\b""")
BUILDS = re.compile(r"RolloutEngine\b|\b\w*engine\w*\(|\bRLTrainer\(|\brecipe_main\(|\b\w*_server\b")
EXEMPT = re.compile(r"#\s*ran-check:\s*\S.{9,}")
CALLS_CHECK = "assert_ran("


def _segment(lines: list[str], node: ast.AST) -> str:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1:node.end_lineno])


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _module_tables(tree: ast.Module, lines: list[str]) -> dict[str, str]:
    """Module-level assignments by name (`SPECS = {"sd": ...}`): a test parametrized over one names what
    the table holds."""
    out = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name):
                out[target.id] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return out


def _closure(texts: dict[str, str], seed: set[str]) -> set[str]:
    """The functions whose text calls one in `seed`, directly or through others of the module."""
    found = set(seed)
    while True:
        more = {name for name, text in texts.items() if name not in found
                and set(re.findall(r"\b(\w+)\(", text)) & found}
        if not more:
            return found
        found |= more


def unchecked_tests(path: Path) -> list[str]:
    """The test functions in `path` that build an SD or SSD engine and neither check its path nor say why.
    A test names SD or SSD in its own text, in a module-level table it reads, or through a fixture of the
    module it takes (one level: the fixture's own text names it)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    texts = {f.name: _segment(lines, f) for f in _functions(tree)}
    fixtures = {name: text for name, text in texts.items() if "pytest.fixture" in text.split("def ", 1)[0]}
    tables = _module_tables(tree, lines)
    checkers = _closure(texts, {name for name, text in texts.items() if CALLS_CHECK in text})
    out = []
    for name, text in texts.items():
        if not name.startswith("test_"):
            continue
        text = text.replace(f"def {name}(", "def test(", 1)  # its own name builds nothing
        used = set(re.findall(r"\b(\w+)\b", text)) - {name}
        reached = text + "".join(tables[n] for n in used & tables.keys()) \
            + "".join(fixtures[n] for n in used & fixtures.keys())
        if not (NAMES_SPEC.search(reached) and BUILDS.search(reached)):
            continue
        if CALLS_CHECK in text or used & checkers or EXEMPT.search(text):
            continue
        out.append(name)
    return out


def test_every_sd_or_ssd_engine_test_checks_that_its_path_ran():
    missing = {p.name: unchecked_tests(p) for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, ("these tests build an SD or SSD engine without tests.support.ran.assert_ran "
                         f"(or a '# ran-check: <why>' comment): {missing}")


def test_the_sweep_flags_an_unchecked_test_and_accepts_checked_or_explained_ones(tmp_path):
    body = ('def _check(e):\n    assert_ran(e, "ssd")\n\n'
            'def test_a(tmp_path):\n    e = ssd_engine(t, d)\n    e.sample(P)\n\n'
            'def test_b():\n    e = RolloutEngine(t, SpecConfig(method="sd"))\n    assert_ran(e, "sd")\n\n'
            'def test_c():\n    e = ssd_engine(t, d)\n    _check(e)\n\n'
            'def test_d():\n    # ran-check: only the refusal of a bad config is tested\n'
            '    RolloutEngine(t, SpecConfig(method="ssd", k=-1))\n\n'
            'def test_e():\n    RolloutEngine(t, SpecConfig(method="ar")).sample(P)\n\n'
            'SPECS = {"plain": SpecConfig(method="sd")}\n\n'
            '@pytest.mark.parametrize("name", list(SPECS))\n'
            'def test_f(name):\n    RolloutEngine(t, SPECS[name]).sample(P)\n\n'
            '@pytest.fixture\ndef served():\n    yield Served("--method", "sd")\n\n'
            'def test_g(served):\n    served_engine(served).post("/v1/completions")\n\n'
            'def test_an_ssd_engine_note():\n    assert note("ssd") == "x"\n\n'
            'def _outer(e):\n    _check(e)\n\n'
            'def test_h():\n    e = ssd_engine(t, d)\n    _outer(e)\n')
    path = tmp_path / "test_x.py"
    path.write_text(body)
    # a, and the SD of a table (f) and of a fixture (g); h is checked through two helpers
    assert unchecked_tests(path) == ["test_a", "test_f", "test_g"]


def test_assert_ran_fails_where_its_path_did_not_run():
    """The helper itself, on metrics shaped as engine.metrics() gives them: each plan and option passes on
    a run that took the path and fails on one that did not."""

    from tests.support.ran import assert_ran

    ar_only = {"ssd/strategy_rounds": {"ar": 9}, "ssd/rounds": 0, "ssd/hits": 0, "ssd/cold_rounds": 0,
               "ssd/worker_failures": 0, "ssd/fanout": [1, 1]}  # an SSD engine whose rule ran AR only
    ssd = {"ssd/strategy_rounds": {"ar": 2, "ssd+neural": 7}, "ssd/rounds": 21, "ssd/hits": 9,
           "ssd/cold_rounds": 3, "ssd/worker_failures": 0, "spec/proposed_per_round": 2.5,
           "spec/accept_rate": 0.4}
    sd_engine = {"spec/proposed_per_round": 3.0, "spec/accept_rate": 0.0, "spec/accept_length": 1.0}
    assert assert_ran(ssd, "ssd", hits=True, misses=True, accepted=True) is ssd
    assert_ran(ssd, "ssd+neural")
    assert_ran(dict(ssd, **{"ssd/strategy_rounds": str(ssd["ssd/strategy_rounds"])}), "ssd+neural")  # RL rows
    assert_ran(sd_engine, "spec", accepted=False)
    assert_ran(sd_engine, "sd")
    failing = [(ar_only, "ssd", {}), (ar_only, "ssd+neural", {}), (ar_only, "spec", {}), (ar_only, "sd", {}),
               (ssd, "sd", {}), (ssd, "ssd", {"hits": False}), (dict(ssd, **{"ssd/hits": 18}), "ssd", {"misses": True}),
               (sd_engine, "spec", {"accepted": True}), (sd_engine, "ssd", {}),
               (dict(sd_engine, **{"spec/proposed_per_round": 0.0}), "spec", {})]
    for metrics, plan, options in failing:
        with pytest.raises(AssertionError):
            assert_ran(metrics, plan, **options)
    with pytest.raises(AssertionError, match="needs the engine"):
        assert_ran(ssd, "ssd", worker=True)
    with pytest.raises(ValueError, match="unknown plan"):
        assert_ran(ssd, "ssd+tree")


def test_served_reads_what_a_server_ran_between_two_reads_of_its_metrics():
    from tests.support.ran import assert_ran, served

    before = {"vllm:spec_decode_num_drafts_total": 4.0, "vllm:spec_decode_num_draft_tokens_total": 12.0,
              "vllm:spec_decode_num_accepted_tokens_total": 5.0}
    idle = dict(before)
    busy = {"vllm:spec_decode_num_drafts_total": 10.0, "vllm:spec_decode_num_draft_tokens_total": 30.0,
            "vllm:spec_decode_num_accepted_tokens_total": 5.0,
            'rollout_ssd:ssd_strategy_rounds_total{"strategy": "sd"}': 3.0}
    assert served(before, busy) == {"spec/proposed_per_round": 3.0, "spec/accept_rate": 0.0,
                                    "ssd/strategy_rounds": {"sd": 3.0}}
    assert_ran(served(before, busy), "sd", accepted=False)
    with pytest.raises(AssertionError):  # nothing ran between the reads, whatever ran before them
        assert_ran(served(before, idle), "spec")
