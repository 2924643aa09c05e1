"""The house rules of docs/architecture.md, checked on the source: imports run one way (no circle
among lightning_snip's modules), no function over 80 lines, no module over 600, a thin SNIPCallback, and benchmarks on
the public API (no private lightning_snip name, nothing from tests/) with no function over 80 lines either."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_snip"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _package_graph() -> dict[str, set[str]]:
    """module -> the lightning_snip modules it imports (at any depth of its code)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in _imports(path):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module else [])
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps - {"lightning_snip"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path + [node, dep]
            if dep not in state and (found := visit(dep, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_no_import_circle_in_the_package():
    graph = _package_graph()
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"
    # and the checker sees one where there is one
    assert _cycle({**graph, "lightning_snip.formats": graph["lightning_snip.formats"] | {"lightning_snip.quantize"}})


def test_formats_and_the_planner_import_no_torch():
    for name in ("formats", "plan", "planner", "baselines", "aggregate", "config", "spike_guard"):
        modules = {a.name.split(".")[0] for n in _imports(PACKAGE / f"{name}.py") if isinstance(n, ast.Import)
                   for a in n.names}
        modules |= {n.module.split(".")[0] for n in _imports(PACKAGE / f"{name}.py")
                    if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in modules, name


def test_no_module_longer_than_600_lines():
    """A module a newcomer reads in one sitting: the estimator is split along its concepts (issue 53)."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's length: its source lines from its ``def`` line to its last line."""
    return node.end_lineno - node.lineno + 1


def test_no_function_longer_than_80_lines_and_a_thin_callback():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _function_lines(node) > 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
            if isinstance(node, ast.ClassDef) and node.name == "SNIPCallback":
                assert node.end_lineno - node.lineno + 1 < 200
    assert not long, long


def test_benchmarks_use_the_public_api_only():
    bad = []
    for path in (ROOT / "benchmarks").glob("*.py"):
        source = path.read_text()
        assert "sys.path" not in source, f"{path.name} edits sys.path"
        for node in _imports(path):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("lightning_snip"):
                    bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                    bad += [f"{path.name}: {node.module}" for part in node.module.split(".") if part.startswith("_")]
                if node.module.split(".")[0] in ("tests", "conftest") or node.module.startswith("test_"):
                    bad.append(f"{path.name}: from {node.module}")
            elif isinstance(node, ast.Import):
                bad += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith(("test_", "tests"))]
    assert not bad, bad


def _private_names_from_other_benchmarks(path: Path, benchmarks: set[str]) -> list[str]:
    """``from other import _name`` and ``other._name`` (other: a benchmark script imported by this one)."""
    tree, aliases, bad = ast.parse(path.read_text()), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in benchmarks - {path.stem}})
        elif isinstance(node, ast.ImportFrom) and node.module in benchmarks - {path.stem}:
            bad += [f"{path.name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"{path.name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return bad


def test_benchmarks_share_helpers_by_public_names_only(tmp_path):
    """What one benchmark takes from another (compare_policies' protocol, harness) is public: a private helper that
    another benchmark needs is made public where it lives (issue 62)."""
    scripts = list((ROOT / "benchmarks").glob("*.py"))
    names = {p.stem for p in scripts}
    bad = [b for p in scripts for b in _private_names_from_other_benchmarks(p, names)]
    assert not bad, bad
    # and the check sees one
    probe = ROOT / "benchmarks" / "quality_long.py"
    assert _private_names_from_other_benchmarks(probe, names) == []
    fake = tmp_path / "probe_bench.py"
    fake.write_text("import compare_policies as cp\nfrom harness import _x\ncp._truth_model(1)\n")
    assert len(_private_names_from_other_benchmarks(fake, names)) == 2


def _long_functions(path: Path, limit: int = 80) -> list[str]:
    """``file:line name (n lines)`` of each function in path longer than limit lines (methods and nested
    functions too), counted as the package's rule counts them."""
    return [f"{path.name}:{node.lineno} {node.name} ({_function_lines(node)} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _function_lines(node) > limit]


def test_benchmark_functions_are_at_most_80_lines(tmp_path):
    """The package's 80-line rule holds for the benchmark scripts too: a long function is split into named
    helpers."""
    long = [f for p in sorted((ROOT / "benchmarks").glob("*.py")) for f in _long_functions(p)]
    assert not long, long
    # and the check sees one: a method of 81 lines, not one of 80
    fake = tmp_path / "probe_bench.py"
    fake.write_text("class Probe:\n    def short(self):\n" + "        pass\n" * 79
                    + "    def long(self):\n" + "        pass\n" * 80)
    assert _long_functions(fake) == ["probe_bench.py:82 long (81 lines)"]
