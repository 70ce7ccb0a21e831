"""The `>>>` examples in loopkit's docstrings run, so they stay true."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import loopkit

MODULES = sorted(m.name for m in pkgutil.iter_modules(loopkit.__path__, "loopkit.")
                 if m.name not in ("loopkit.__main__",))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_some_modules_carry_examples():
    attempted = sum(doctest.testmod(importlib.import_module(n)).attempted for n in MODULES)
    assert attempted >= 10
