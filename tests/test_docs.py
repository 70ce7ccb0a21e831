"""Docs stay true: every Python block in docs/ and README.md runs, every hook is documented."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for path in DOCS:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            line = path.read_text()[: match.start()].count("\n") + 1
            yield pytest.param(path, match.group(1), id=f"{path.name}:{line}")


@pytest.mark.parametrize("path, code", list(_blocks()))
def test_code_block_runs(path, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    exec(compile(code, f"{path.name}", "exec"), namespace)


def test_every_hook_is_in_the_hooks_reference():
    import importlib

    # the module, not the `loopkit.hookspec` marker the package re-exports
    spec = importlib.import_module("loopkit.plugin.hookspec")
    text = (ROOT / "docs" / "hooks.md").read_text()
    hooks = [n for n, f in vars(spec).items()
             if inspect.isfunction(f) and hasattr(f, "loopkit_spec")]
    assert len(hooks) >= 8
    for name in hooks:
        assert f"`{name}(" in text, f"hook {name} is not documented in docs/hooks.md"
        assert inspect.getdoc(getattr(spec, name)), f"hook {name} has no docstring"


def test_docs_link_targets_exist():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_every_documented_session_attribute_exists(tmp_path):
    """`session.x` and `session.x.y` named in the docs are there on a live session."""
    import loopkit

    named = set()
    for path in DOCS:
        for first, second in re.findall(r"`session\.([a-z_]+)(?:\.([a-z_]+))?", path.read_text()):
            named.add((path.name, first, second))
    assert len(named) >= 10
    seen = {}
    from loopkit.plugin.backend import Restored

    OPTIONAL = {"restored": Restored}  # attributes that are None on a fresh start

    class Look:
        @loopkit.hookimpl
        def session_create(self, session):
            for name, first, second in sorted(named):
                obj = getattr(session, first, AttributeError)
                if obj is None and first in OPTIONAL:  # None on a fresh start: its type
                    obj = OPTIONAL[first]
                if obj is not AttributeError and second:
                    obj = getattr(obj, second, AttributeError)
                seen[(name, first, second)] = obj is not AttributeError

    loopkit.train(lambda s, b: (s, {}), init={"w": 0.0}, data=[1] * 2, plugins=[Look()],
                  logdir=str(tmp_path), progress=False, autoload=False)
    missing = [f"{n}: session.{a}{'.' + b if b else ''}" for (n, a, b), ok in seen.items()
               if not ok]
    assert not missing, f"documented but absent: {missing}"
