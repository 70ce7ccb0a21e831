"""The built-ins use only what a third-party plugin can: no private session members,
no private names from the core, no private orbax or jax modules."""

from __future__ import annotations

from pathlib import Path


#: the one private import a built-in makes, and why (each entry justified here)
PRIVATE_IMPORTS = {
    # DESIGN ("A hang is a failure") has each process publish its step in
    # jax.distributed's key-value store; JAX 0.10 has no public accessor for that
    # client (orbax.checkpoint and jax.experimental read it the same way)
    ("hang_peers.py", "jax._src"),
}


def test_built_ins_use_only_the_public_plugin_surface():
    import ast

    plugins_dir = Path(__file__).resolve().parents[2] / "plugins"
    paths = sorted(plugins_dir.rglob("*.py"))
    assert plugins_dir / "checkpoint" / "backends" / "orbax.py" in paths  # subpackages too
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

