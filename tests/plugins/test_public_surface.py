"""The built-ins use only what a third-party plugin can: no private session members,
no private names from the core, no private orbax or jax modules; and loopkit uses orbax
(and every other library) through its public contract only (DESIGN.md, "The house")."""

from __future__ import annotations

import ast
import builtins
import sys
import textwrap
from pathlib import Path


#: the one private import loopkit makes, and why (each entry justified here)
PRIVATE_IMPORTS = {
    # the job's key-value store (each process publishes its step for the hang report,
    # the peers' addresses, the logdir claim's outcome) and the coordinator's address:
    # JAX 0.10 has no public accessor for either (orbax.checkpoint and
    # jax.experimental read them the same way); loopkit/process/job.py alone reaches them
    ("job.py", "jax._src"),
}


def test_built_ins_use_only_the_public_plugin_surface():
    import ast

    plugins_dir = Path(__file__).resolve().parents[2] / "plugins"
    paths = sorted(plugins_dir.rglob("*.py"))
    assert plugins_dir / "checkpoint" / "backends" / "orbax" / "write.py" in paths  # subpackages too
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                base = node.value
                # private members of the session (or what hangs off it) are off limits
                if isinstance(base, ast.Name) and base.id in ("session", "sess"):
                    raise AssertionError(f"{path.name}:{node.lineno}: session.{node.attr}")
                if isinstance(base, ast.Attribute) and base.attr == "session":
                    raise AssertionError(f"{path.name}:{node.lineno}: .session.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loopkit") \
                    and not (node.module or "").startswith("loopkit.plugins"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name}:{node.lineno}: private {private} from {node.module}"
                assert "_src" not in node.module
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
                if (path.name, names[0]) in PRIVATE_IMPORTS:
                    continue
                assert not any("._src" in n for n in names), f"{path.name}:{node.lineno}: {names}"


def test_the_core_imports_no_built_in_plugin_except_to_register_it():
    """loopkit/ reaches loopkit.plugins only through the plugin manager (and the lazy
    re-exports of the checkpoint helpers in `loopkit/__init__.py` and the CLI)."""
    import ast

    core = Path(__file__).resolve().parents[2] / "loopkit"
    allowed = {"__init__.py", "cli.py"}
    for path in sorted(core.glob("*.py")):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.startswith("loopkit.plugins") for n in names), \
                f"{path.name}:{node.lineno} imports {names}"



# -- orbax's public contract (DESIGN.md, "The house"): the AST rules --------------------

_ROOT = Path(__file__).resolve().parents[2]
#: loopkit's sources: the core and the built-in plugins (loopkit/plugins is a link to plugins/)
_SOURCES = sorted([p for p in (_ROOT / "loopkit").rglob("*.py")
                   if "plugins" not in p.relative_to(_ROOT / "loopkit").parts[:1]]
                  + list((_ROOT / "plugins").rglob("*.py")))
#: orbax's own metadata files, which loopkit never reads by hand (it asks `metadata()`)
_ORBAX_FILES = {"_METADATA", "_CHECKPOINT_METADATA"}
#: tests that only look at whether such a file exists (orbax has no public test that
#: does not also read the file, or that does not take a logdir's tf `checkpoint` file for
#: orbax's old msgpack one); reading it would be parsing orbax's format
_EXISTENCE_TESTS = {"exists", "is_file"}
#: `_`-prefixed names that are documented public API, each with where it is documented
_DOCUMENTED = {
    "os._exit": "Python library reference, os: 'Exit the process ... without calling "
                "cleanup handlers' (the watchdog's last resort)",
    "sys._current_frames": "Python library reference, sys: 'Return a dictionary mapping "
                           "each thread's identifier to the topmost stack frame' (the "
                           "watchdog's report of where the main thread waits)",
    "sys._getframe": "Python library reference, sys: 'Return a frame object from the call "
                     "stack' (the exit's status, read from the main thread's outermost frame)",
}
#: the interpreter's own exit, taken over in one place only (the `loopkit run` child's
#: exit while a compile runs in the background: loopkit/process/background_compile.py):
#: the standard library's internals, undocumented but what `multiprocessing` itself calls
#: at a child's end; feature-tested there, with Python's own exit (a wait) as the fallback
_EXIT_INTERNALS = {"threading._shutdown", "atexit._run_exitfuncs"}
_EXIT_MODULE = "loopkit/process/background_compile.py"
#: namedtuple's documented methods and attributes (Python library reference,
#: collections.namedtuple: "the field names start with an underscore" to avoid conflicts)
_NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}
#: class bases that are not another library's classes
_TYPING = {"Protocol", "NamedTuple", "Generic", "TypedDict"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _outside(module: str) -> bool:
    """Whether ``module`` is not loopkit's (a third-party or standard-library module)."""
    return module.split(".")[0] not in ("loopkit", "plugins", "")


def _third_party(module: str) -> bool:
    return _outside(module) and module.split(".")[0] not in sys.stdlib_module_names


class _Module:
    """One source file: what its names stand for, and its parents map."""

    def __init__(self, path: Path, source: str | None = None) -> None:
        self.path = path
        self.tree = ast.parse(source if source is not None else path.read_text())
        self.origin_of: dict[str, str] = {}  # a name -> the module or module.attr it is
        self.classes = {n.name for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        for node in ast.walk(self.tree):  # imports first, aliases of them after
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.origin_of[a.asname or a.name.split(".")[0]] = \
                        a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    self.origin_of[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(self.tree):  # `th = ocp.type_handlers`
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name) \
                    and (origin := self.origin(node.value)) is not None:
                self.origin_of.setdefault(node.targets[0].id, origin)

    def origin(self, expr: ast.AST) -> str | None:
        """``module.attr...`` an expression rooted at an imported name stands for."""
        if isinstance(expr, ast.Name):
            return self.origin_of.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.origin(expr.value)
            return f"{base}.{expr.attr}" if base else None
        return None

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(_ROOT) if self.path.is_absolute() else self.path}" \
               f":{node.lineno}: {ast.unparse(node)[:100]}"

    def base_kind(self, base: ast.AST) -> str:
        """"loopkit", "stdlib" or "third-party" for a class base (unknown: third-party).

        The standard library's classes (threading.Thread, collections.abc.Mapping) are
        not held to rule (b): subclassing them with private helpers is their contract.
        """
        if isinstance(base, ast.Subscript):  # Generic[T], Mapping[str, Any]
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.classes:
            return "loopkit"
        origin = self.origin(base)
        if origin is None:
            if isinstance(base, ast.Name) and hasattr(builtins, base.id):
                return "loopkit"  # object, Exception, dict: no private methods to override
            return "third-party"  # a class made at run time (a parameter): assume the worst
        if not _outside(origin) or origin.split(".")[-1] in _TYPING and \
                origin.split(".")[0] in ("typing", "typing_extensions"):
            return "loopkit"
        return "third-party" if _third_party(origin) else "stdlib"


def _defined_private_names(modules: list[_Module]) -> set[str]:
    """The `_`-prefixed attributes loopkit defines itself: assigned on an object that is
    not another library's, or defined in the body of one of its own classes."""
    names: set[str] = set()
    for m in modules:
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and _private(node.attr) and m.origin(node.value) is None:
                names.add(node.attr)
            if isinstance(node, ast.ClassDef) and all(
                    m.base_kind(b) == "loopkit" for b in node.bases):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                            if isinstance(t, ast.Name):
                                names.add(t.id)
    return {n for n in names if _private(n)}


def _violations(modules: list[_Module]) -> list[str]:
    """What breaks the rules in ``modules`` (see `test_only_orbax_s_public_contract`)."""
    own = _defined_private_names(modules)
    found: list[str] = []
    for m in modules:
        # (a) no `_`-prefixed module or name imported from another library
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if (m.path.name, names[0]) in PRIVATE_IMPORTS:
                continue  # allowed by name, with its reason, at the top of this file
            if any(_outside(n) and n != "__future__" and any(map(_private, n.split(".")))
                   for n in names):
                found.append(f"(a) private import {m.where(node)}")
        # (b) a third-party class subclassed: no `_` method defined, no `_` attribute
        # of self touched (orbax keeps its own private state there)
        checked_self: set[ast.AST] = set()
        for node in ast.walk(m.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            if "third-party" not in {m.base_kind(b) for b in node.bases}:
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and _private(item.name):
                    found.append(f"(b) private method {item.name} defined in a subclass "
                                 f"of a third-party class: {m.where(item)}")
            for sub in ast.walk(node):
                target = _private_target(sub)
                if target and isinstance(target[0], ast.Name) \
                        and target[0].id in ("self", "cls"):
                    checked_self.add(sub)
                    found.append(f"(b) self.{target[1]} in a subclass of a third-party "
                                 f"class: {m.where(sub)}")
        # (c) `x._name`: x self/cls, or the name one loopkit defines (never another library's)
        for node in ast.walk(m.tree):
            target = _private_target(node)
            if target is None or node in checked_self:
                continue
            base, name = target
            origin = m.origin(base)
            if origin is not None and _outside(origin):
                if f"{origin}.{name}" not in _DOCUMENTED and not (
                        f"{origin}.{name}" in _EXIT_INTERNALS
                        and m.where(node).startswith(_EXIT_MODULE + ":")):
                    found.append(f"(c) private member of {origin}: {m.where(node)}")
            elif not (isinstance(base, ast.Name) and base.id in ("self", "cls")) \
                    and name not in own and name not in _NAMEDTUPLE_API:
                found.append(f"(c) private member {name} that loopkit does not define: "
                             f"{m.where(node)}")
        # (d) orbax's metadata files named only to test that they exist
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Constant) and node.value in _ORBAX_FILES:
                div, attr = m.parent.get(node), None
                if isinstance(div, ast.BinOp) and isinstance(div.op, ast.Div) \
                        and div.right is node:
                    attr = m.parent.get(div)
                call = m.parent.get(attr) if attr is not None else None
                if not (isinstance(attr, ast.Attribute) and attr.attr in _EXISTENCE_TESTS
                        and isinstance(call, ast.Call) and call.func is attr):
                    found.append(f"(d) orbax's {node.value} named other than in an existence "
                                 f"test: {m.where(m.parent.get(node, node))}")
    return found


def _private_target(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(object, name) of ``x._name`` or of ``getattr/hasattr/setattr/delattr(x, "_name")``."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        return node.value, node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
            and isinstance(node.args[1].value, str) and _private(node.args[1].value):
        return node.args[0], node.args[1].value
    return None


def test_only_orbax_s_public_contract_and_no_other_library_s_private_members():
    """DESIGN.md, "The house": loopkit/ and plugins/ (a) import no `_`-prefixed module
    or name of another library (``orbax.checkpoint._src``, ``jax._src``); (b) define no
    `_` method in a subclass of a third-party class, and touch no `_` attribute of self
    there (orbax's private state lives there); (c)
    read ``x._name`` only where x is self/cls or the name is one loopkit itself defines
    (never on a name imported from another library, also through `getattr` and kin),
    namedtuple's documented API and the documented names in `_DOCUMENTED` aside; (d)
    name orbax's ``_METADATA`` / ``_CHECKPOINT_METADATA`` only to test that one exists."""
    modules = [_Module(p) for p in _SOURCES]
    assert _ROOT / "plugins" / "checkpoint" / "backends" / "orbax" / "write.py" in _SOURCES
    assert _ROOT / "loopkit" / "loop" / "step.py" in _SOURCES
    assert _violations(modules) == []


def test_the_rules_catch_what_they_forbid():
    """Each rule fails on the code it was written against (the orbax backend before
    it kept to orbax's public API) and passes the public way of doing the same."""
    def check(source: str) -> list[str]:
        src = textwrap.dedent(source)
        return _violations([_Module(Path("snippet.py"), src)])

    assert check("from orbax.checkpoint._src.path import atomicity")[0].startswith("(a)")
    assert check("import jax._src.core as core")[0].startswith("(a)")
    assert check("from orbax.checkpoint import _src")[0].startswith("(a)")
    assert check("from loopkit.state.pytree import _short") == []  # loopkit's own
    overriding = """
        import orbax.checkpoint as ocp
        class H(ocp.type_handlers.NumpyHandler):
            async def _background_serialize(self, values, infos, args=None):
                pass
        """
    assert [v[:3] for v in check(overriding)] == ["(b)"]
    dynamic = """
        def listing(base):
            class Listing(base):
                def _helper(self):
                    return self._store
            return Listing
        """
    assert [v[:3] for v in check(dynamic)] == ["(b)", "(b)"]
    reading = """
        import orbax.checkpoint as ocp
        class R(ocp.path.atomicity.AtomicRenameTemporaryPath):
            async def finalize(self):
                store = getattr(self, "_checkpoint_metadata_store", None)
        """
    assert [v[:3] for v in check(reading)] == ["(b)"]
    assert check("import jax\njax._src.config")[0].startswith("(c)")
    assert check("import orbax.checkpoint as ocp\nth = ocp.type_handlers\nth._x")[0] \
        .startswith("(c)")
    assert check("def f(checkpointer):\n    return checkpointer._handler")[0].startswith("(c)")
    assert check("class A:\n    def __init__(self):\n        self._n = 1\n"
                 "def f(a):\n    return a._n") == []  # loopkit's own attribute
    assert check("import os\nos._exit(1)") == []  # documented
    assert check("def f(rec):\n    return rec._replace(x=1)") == []  # namedtuple's API
    parsing = """
        import json
        def f(path):
            return json.loads((path / "_METADATA").read_text())
        """
    assert check(parsing)[0].startswith("(d)")
    assert check("def f(path):\n    return (path / '_METADATA').is_file()") == []
