"""The house rules that keep the code readable (CONTRIBUTING.md, "Limits"): no module of the package over
400 lines, no function over 80, no import cycle, every package listed for the wheel, and every document
the code cites is in the repository, with the sections and theorems it names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rollout_ssd"
KERNELS = REPO / "kernels"  # rollout_ssd.kernels: rollout_ssd/kernels links to it (pyproject.toml)
CITING = [PACKAGE, KERNELS, REPO / "bench", REPO / "recipes", REPO / "tests"]


def _sources(roots):
    for root in roots:
        yield from sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts)


def test_no_module_over_400_lines_and_no_function_over_80():
    too_long = []
    for path in _sources([PACKAGE, KERNELS]):
        text = path.read_text()
        lines = text.count("\n")
        if lines > 400:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


def _headings(doc: Path) -> str:
    return "\n".join(line for line in doc.read_text().splitlines() if line.startswith("#"))


def test_every_cited_document_section_and_theorem_exists():
    cited = 0
    theory = _headings(REPO / "docs" / "THEORY.md")
    for path in [p for p in _sources(CITING) if p != Path(__file__).resolve()] + [REPO / "README.md", REPO / "CONTRIBUTING.md"]:
        text = path.read_text()
        for name in re.findall(r"\b((?:docs/)?[A-Z]+\.md)\b", text):
            cited += 1
            assert name.startswith("docs/") or name in ("README.md", "CONTRIBUTING.md", "RESULTS.md",
                                                        "PROVENANCE.md"), f"{path}: cites {name} outside docs/"
            if name.startswith("docs/"):
                assert (REPO / name).is_file(), f"{path}: cites {name}, which is not in the repository"
        for section in re.findall(r"docs/THEORY\.md §(\d+)", text):
            assert re.search(rf"^## {section}\. ", theory, re.M), f"{path}: THEORY §{section} has no heading"
        for kind, number in re.findall(r"\b(Theorem|Corollary|Definition) (\d+)\b", text):
            assert re.search(rf"{kind} {number}\b", theory), f"{path}: cites {kind} {number}, not in docs/THEORY.md"
    assert cited > 20  # the scan saw the citations it exists for


def test_every_package_is_listed_for_the_wheel():
    """pyproject.toml lists packages explicitly: a new subpackage missing there works in the editable
    install and is absent from a wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found - listed == set() and "rollout_ssd.kernels" in listed


def test_the_kernels_folder_is_the_packages_and_never_a_top_level_kernels():
    """kernels/ is imported as rollout_ssd.kernels through the link rollout_ssd/kernels, and has no __init__.py:
    from the checkout's root `import kernels` must find the PyPI package of that name (transformers imports
    it), which a regular package here would shadow."""
    link = PACKAGE / "kernels"
    assert link.is_symlink() and link.resolve() == KERNELS.resolve()
    assert not (KERNELS / "__init__.py").exists() and (KERNELS / "csrc").is_dir()


def _modules() -> dict[str, Path]:
    """Every module of the installed package by its import name (kernels/ as rollout_ssd.kernels)."""
    found = {}
    for root, prefix in ((PACKAGE, ("rollout_ssd",)), (KERNELS, ("rollout_ssd", "kernels"))):
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its body (inside functions too; not under
    `if TYPE_CHECKING:`), each as the most specific module the import names."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def module_of(target: str) -> str:  # the most specific module a dotted name lies in
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {module_of(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out |= {module_of(f"{base}.{alias.name}") for alias in node.names}  # a module, or a name in base's
    return {target for target in out if target.startswith("rollout_ssd") and target != name}


def test_the_package_has_no_import_cycle():
    """Layers point down only (CONTRIBUTING.md, "Layers"): no module reaches itself through the imports it
    makes, counting imports inside functions (a deferred import hides a cycle, it does not remove it)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    done, on_path, cycles = set(), [], []

    def visit(name):
        on_path.append(name)
        for nxt in sorted(graph[name]):
            if nxt in on_path:
                cycles.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    kernels = "rollout_ssd.kernels"  # the bottom of the models: a kernel imports only kernels
    assert {(a, b) for a in graph if a.startswith(kernels) for b in graph[a] if not b.startswith(kernels)} == set()
