"""The plugins' heavy imports run in a background thread from a session's opening.

What a user sees: orbax and tensorboardX are imported beside the start-up (not by the
main thread before the first step), a save right after the start still lands, the
summaries are still written, and a module a plugin needs that cannot be imported stops
the run at once with that module's error, naming the plugin.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.testing import read_events, scalars


def _run(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_orbax_and_tensorboardx_are_imported_beside_the_start_up_not_by_the_main_thread(
        tmp_path):
    """A fresh process: whichever thread imports each module first is recorded; the
    run saves (orbax) and writes summaries (tensorboardX), and neither was imported by
    the main thread, so neither delayed `init` or the first compile."""
    got = json.loads(_run("""
        import json, sys, threading
        first = {}

        class Who:  # records the thread that imports each top-level module first
            def find_spec(self, name, path=None, target=None):
                first.setdefault(name.split(".")[0], threading.current_thread().name)

        sys.meta_path.insert(0, Who())
        import jax.numpy as jnp
        import loopkit

        r = loopkit.train(lambda s: (s + 1, {"loss": s}), init=lambda: jnp.zeros(()),
                          max_steps=4, logdir=sys.argv[1], save_model_steps=2,
                          save_model_secs=None, save_summaries_steps=2,
                          save_summaries_secs=None, progress=False, autoload=False)
        print(json.dumps({"step": r.step, "orbax": first.get("orbax"),
                          "tensorboardX": first.get("tensorboardX"),
                          "latest": loopkit.latest_checkpoint(sys.argv[1])[0]}))
    """, str(tmp_path / "run")))
    assert (got["step"], got["latest"]) == (4, 4)
    # the import-ahead thread, or the summary writer's opening thread when it got there
    # first: either runs beside the main thread's start-up
    assert got["orbax"] == "loopkit-import-ahead", got
    assert got["tensorboardX"] in ("loopkit-import-ahead", "loopkit-summary-writer-open"), got


def test_a_save_right_after_the_start_and_the_summaries_still_land(tmp_path):
    """The first save comes at step 1 (the backend builds orbax's part at that save),
    a resume reads it back, and the event file holds the config text and the scalars."""
    logdir = str(tmp_path / "run")
    r = loopkit.train(lambda s: (s + 1, {"loss": s}), init=jnp.zeros(()), max_steps=1,
                      logdir=logdir, save_model_steps=1, save_model_secs=None,
                      save_summaries_steps=1, save_summaries_secs=None, progress=False,
                      autoload=False)
    assert r.step == 1 and loopkit.latest_checkpoint(logdir)[0] == 1
    r = loopkit.train(lambda s: (s + 1, {"loss": s}), init=jnp.zeros(()), max_steps=3,
                      logdir=logdir, save_summaries_steps=1, save_summaries_secs=None,
                      progress=False, autoload=False)
    assert (r.step, float(r.state)) == (3, 3.0)  # resumed from step 1's checkpoint
    events = read_events(logdir)
    assert [step for step, _ in scalars(events, "loss")] == [1, 2, 3]
    assert [e.step for e in events.Tensors("loopkit/config/text_summary")] == [0, 2]


class Needs:
    """A third-party plugin that cannot run without a module that is not installed."""

    @loopkit.hookimpl
    def import_ahead(self):
        return ["loopkit_no_such_module"]


@pytest.mark.parametrize("blocked, plugin", [
    (None, "Needs"), ("orbax.checkpoint", "checkpoint"), ("tensorboardX", "summaries"),
])
def test_a_module_a_plugin_needs_that_cannot_be_imported_stops_the_run_at_once(
        tmp_path, monkeypatch, blocked, plugin):
    """The import error itself, noted with the module and the plugin that named it,
    raised from `train` long before `max_steps` (the first save would be at the end)."""
    if blocked is not None:
        monkeypatch.setitem(sys.modules, blocked, None)  # `import` then raises
    module = blocked or "loopkit_no_such_module"
    steps = []

    class Count:
        @loopkit.hookimpl
        def after_step(self, step):
            steps.append(step)

    plugins = [Count()] + ([Needs()] if blocked is None else [])
    with pytest.raises(ModuleNotFoundError) as info:
        loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=10**6,
                      logdir=str(tmp_path / "run"), save_model_secs=None,
                      save_summaries_secs=None, progress=False, autoload=False,
                      plugins=plugins)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"importing {module!r} ahead" in notes and f"plugin {plugin!r}" in notes, notes
    assert len(steps) < 10**6


def test_an_import_ahead_that_returns_a_string_is_refused_naming_the_plugin(tmp_path):
    class Wrong:
        @loopkit.hookimpl
        def import_ahead(self):
            return "orbax.checkpoint"

    with pytest.raises(TypeError, match=r"plugin 'Wrong': import_ahead returned the string"):
        loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=1,
                      progress=False, autoload=False, plugins=[Wrong()])
