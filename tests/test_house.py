"""The house rules a reader relies on: no import cycle, the core apart from the built-ins,
modules of a readable size, and the loop and plugin API within their line budget."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "loopkit"
PLUGINS = ROOT / "plugins"


def _modules() -> dict[str, Path]:
    """Every module of the distribution by its import name (plugins/ is loopkit.plugins)."""
    found = {}
    for base, package in ((CORE, "loopkit"), (PLUGINS, "loopkit.plugins")):
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `path` imports, `TYPE_CHECKING` and function-level imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` depends on that module; any other name
            # imported from a module is that module's
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif node.module in modules:
                    out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and node.args[0].value in modules):
            out.add(node.args[0].value)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # `loopkit` (the package's public names) imports everything: leave it out
    return {name: _imports(path, modules) - {name, "loopkit"}
            for name, path in modules.items() if name != "loopkit"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_type_checking_imports_included():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_imports_nothing_from_the_built_ins_but_to_register_them():
    registering = {"loopkit.plugin.manager"}  # imports each built-in by name
    wrong = {name: sorted(d for d in deps if d.startswith("loopkit.plugins"))
             for name, deps in _graph().items()
             if not name.startswith("loopkit.plugins") and name not in registering}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_a_function_over_60_lines_says_why():
    """A function longer than 60 lines carries a ``# long:`` comment saying why."""
    long = []
    for path in _modules().values():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[node.lineno - 1:node.end_lineno]
                if len(body) > 60 and not any(line.strip().startswith("# long:")
                                              for line in body):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_the_loop_and_the_plugin_api_read_in_one_sitting():
    lines = sum(len(p.read_text().splitlines())
                for folder in ("loop", "plugin") for p in (CORE / folder).rglob("*.py"))
    assert lines <= 3000, f"loopkit/loop + loopkit/plugin are {lines} lines (budget ~3,000)"
