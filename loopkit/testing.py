"""Helpers for testing loopkit plugins: a hook-call recorder and a fake clock.

>>> import jax.numpy as jnp, loopkit
>>> rec = HookRecorder()
>>> _ = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=2,
...                   plugins=[rec], progress=False)
>>> rec.names()
['session_open', 'restore_state', 'init_state', 'local_init', 'step_carry', 'session_create', 'before_step', 'after_step', 'before_step', 'after_step', 'on_stop']
>>> [c.kwargs["step"] for c in rec.calls("after_step")]
[1, 2]
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from loopkit.plugin.hookspec import hookimpl

__all__ = ["FakeClock", "HookCall", "HookRecorder", "Tick", "assert_same_state",
           "free_port", "kill_after_checkpoint", "read_events", "run_processes", "scalars"]


@dataclasses.dataclass
class HookCall:
    name: str
    kwargs: dict[str, Any]


class HookRecorder:
    """A plugin that records every hook call of its session, in order.

    Pass it in `plugins=[...]`. It turns on pluggy's hook-call monitoring for
    the session's plugin manager, so it sees every hook, including any added
    later, with the arguments it was called with. (`on_stop` is called one
    implementation at a time, so that all run even when one raises: the
    recorder sees it through its own `on_stop`.) It implements
    `before_step`/`after_step`, so that they are emitted: keep it out of benchmarks.
    """

    def __init__(self) -> None:
        self.calls_: list[HookCall] = []
        self._lock = threading.Lock()

    def _record(self, name: str, kwargs: dict[str, Any]) -> None:
        with self._lock:
            self.calls_.append(HookCall(name, dict(kwargs)))

    def names(self) -> list[str]:
        """The names of the hooks called, in call order."""
        return [c.name for c in self.calls_]

    def calls(self, name: str) -> list[HookCall]:
        """Every call of hook `name`."""
        return [c for c in self.calls_ if c.name == name]

    def getcall(self, name: str) -> HookCall:
        """The one call of hook `name` (an `AssertionError` if not exactly one)."""
        found = self.calls(name)
        assert len(found) == 1, f"expected one call of {name!r}, got {len(found)}"
        return found[0]

    @hookimpl
    def plugin_registered(self, plugin: Any, manager: Any) -> None:
        if plugin is not self:
            return

        def before(hook_name: str, impls: Any, kwargs: dict[str, Any]) -> None:
            if hook_name != "plugin_registered":
                session = kwargs.get("session")
                extra = {"step": session.step} if session is not None and "step" not in kwargs else {}
                self._record(hook_name, {**kwargs, **extra})

        manager.add_hookcall_monitoring(before, lambda outcome, name, impls, kwargs: None)

    @hookimpl
    def before_step(self) -> None:
        pass

    @hookimpl
    def after_step(self) -> None:
        pass

    @hookimpl
    def on_stop(self, session: Any, error: BaseException | None) -> None:
        self._record("on_stop", {"session": session, "step": session.step, "error": error})


class FakeClock:
    """A clock you move by hand: pass `clock=FakeClock()` to `train`/`Supervisor`.

    >>> c = FakeClock(); c.advance(5); c()
    5.0
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += float(secs)


class Tick:
    """A plugin that advances a `FakeClock` by `secs` after every step.

    For tests of time-based timers: each step then "takes" `secs` of fake time.
    It implements `after_step`, so it is for tests only.

    >>> import jax.numpy as jnp, loopkit
    >>> clock = FakeClock()
    >>> _ = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=4,
    ...                   clock=clock, plugins=[Tick(clock, 2.5)], progress=False)
    >>> clock()
    10.0
    """

    def __init__(self, clock: FakeClock, secs: float) -> None:
        self.clock, self.secs = clock, secs

    @hookimpl
    def after_step(self) -> None:
        self.clock.advance(self.secs)


def assert_same_state(got: Any, want: Any) -> None:
    """Assert that two states are identical: their leaf paths, and every leaf's Python
    type, dtype (a key's implementation included), weak type, sharding and bits.

    What a resumed run is checked against: the uninterrupted run's state. Static
    fields are not compared: two calls of an init make two equal but distinct
    transforms and bound methods.

    >>> import jax, jax.numpy as jnp
    >>> assert_same_state({"k": jax.random.key(0), "lr": 0.5}, {"k": jax.random.key(0), "lr": 0.5})
    """
    import jax
    import numpy as np

    from loopkit.state.pytree import is_key, leaves_with_paths

    got_leaves, want_leaves = leaves_with_paths(got), leaves_with_paths(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves], "the leaf paths differ"
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        where = path or "<root>"
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if not hasattr(b, "dtype"):
            assert a == b, f"{where}: {a!r} vs {b!r}"
            continue
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert getattr(a, "weak_type", None) == getattr(b, "weak_type", None), (
            f"{where}: weak type {getattr(a, 'weak_type', None)} vs {getattr(b, 'weak_type', None)}")
        if isinstance(b, jax.Array):
            assert a.sharding.is_equivalent_to(b.sharding, b.ndim), (
                f"{where}: sharding {a.sharding} vs {b.sharding}")
        if is_key(b.dtype):
            assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(b))
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{where}: shape {a.shape} vs {b.shape}"
        assert a.tobytes() == b.tobytes(), f"{where}: the bits differ"


def read_events(logdir: Any) -> Any:
    """Every event file in `logdir`, read with TensorBoard's own reader (keeping all points).

    Needs the `tensorboard` package (a test extra). Returns its `EventAccumulator`.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0,
                                                        "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: Any, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point of the scalar `tag` in `acc` (`read_events`)."""
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def kill_after_checkpoint(cmd: list[str], logdir: Any, min_step: int,
                          env: dict[str, str] | None = None) -> None:
    """Start `cmd` (a training process), SIGKILL it once `logdir/checkpoint` names a
    committed step >= `min_step`; for crash tests. Fails if it exits on its own first."""
    import re
    import signal
    import subprocess
    import time

    def named() -> int:
        """The step ``model_checkpoint_path`` names in the tf-format file (-1: none yet)."""
        try:
            with open(os.path.join(logdir, "checkpoint"), encoding="utf-8") as f:
                m = re.search(r'^model_checkpoint_path:\s*"[^"]*-(\d+)"', f.read(), re.M)
        except FileNotFoundError:
            return -1
        return int(m.group(1)) if m else -1

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while named() < min_step:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


_HANDED_OUT: set[int] = set()


def free_port(band: int = 1000) -> int:
    """A free TCP port on 127.0.0.1 for a server or a `jax.distributed` coordinator
    that a test starts, safe when pytest-xdist runs tests in several workers.

    A port found by binding port 0 and closing it can be handed out again by the OS
    (to another worker's bind, or an outgoing connection) before the test's server
    binds it. So each worker takes ports from a band of its own below the OS's
    ephemeral range (`PYTEST_XDIST_WORKER` gw0 from 10000, gw1 from 10000 + `band`,
    ...), which the OS never hands out by itself, and never the same port twice.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    first = 10000 + (int(worker) if worker.isdigit() else 0) * band
    if first + band > ephemeral:  # no room below the ephemeral range: ask the OS
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in random.sample(range(first, first + band), band):
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError(f"no free port left in {first}..{first + band - 1}")


def run_processes(command: Callable[[int], Sequence[str]], out_dir: str | os.PathLike[str],
                  processes: int = 2, *, env: Mapping[str, str] | None = None,
                  timeout: float = 240.0, name: str = "p") -> list[tuple[int, str]]:
    """Run ``command(i)`` for each process ``i`` (a `jax.distributed` job on
    127.0.0.1, say, with a port from `free_port`), wait for all, and return each one's
    ``(returncode, output)``; the output (stdout and stderr) is also kept in
    ``out_dir/<name><i>.out``. A process still running after `timeout` seconds is
    killed, as is every other once one wait times out, so a hung collective never
    hangs the test.
    """
    import subprocess

    outs = [open(Path(out_dir) / f"{name}{i}.out", "w+") for i in range(processes)]
    procs = [subprocess.Popen(list(command(i)), env=dict(env) if env is not None else None,
                              stdout=outs[i], stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for f in outs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return [(p.returncode, t) for p, t in zip(procs, texts)]
