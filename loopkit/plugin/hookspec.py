"""The hooks a loopkit run emits. Every plugin implements some of these.

Implement a hook with `@loopkit.hookimpl` on a method (or module function) of the
same name, taking only the arguments it needs: pluggy passes them by name, so a
hook can gain an argument later without breaking any plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import pluggy

if TYPE_CHECKING:
    from loopkit.loop.carry import StepCarry
    from loopkit.plugin.backend import CheckpointBackend, Restored, RollbackRecord
    from loopkit.config import Config
    from loopkit.loop.data import Input, Reader
    from loopkit.plugin.view import SessionView

hookspec = pluggy.HookspecMarker("loopkit")
hookimpl = pluggy.HookimplMarker("loopkit")

PyTree = Any

# -- lifecycle hooks: every implementation runs -----------------------------------


@hookspec
def session_open(session: SessionView) -> None:
    """The session starts to open: called first, before the logdir lock and the restore.

    For a service that watches the start-up itself (the hang watchdog); start
    other services in `session_create`. Nothing is ready yet: `session.step` is 0
    and there is no state. `session.phase` says what the start-up does next
    ("taking the logdir lock", "restoring step 40", "waiting for the first batch");
    it is set at start-up points only, never per step.

    :param session: the `loopkit.Session`, opening.
    """


@hookspec
def import_ahead(session: SessionView) -> list[str] | None:
    """Modules this plugin will import later (orbax, tensorboardX): imported from now on.

    Called once, after `session_open`, one implementation at a time. One background
    thread imports them beside the lock, the restore or `init` and the first compile;
    the plugin still imports each where it uses it (that waits for the thread's import).
    Name only modules the plugin cannot run without: a failed import stops the session
    with its error, noted with the module and the plugin.

    :param session: the `loopkit.Session`, opening (`config`, `is_chief`, `logdir` set).
    """


@hookspec
def session_create(session: SessionView) -> None:
    """The state is ready (recovered or initialised): start services.

    Called once per session, after the ready check and before the first step.
    Built-in services start first (their implementations are `tryfirst`), so
    `session.summary_writer` and the checkpoint backend are ready here. Register periodic work with
    `session.every(...)` here rather than checking a clock in `after_step`.

    :param session: the `loopkit.Session`; `session.step` is the start step.
    """


@hookspec
def before_step(session: SessionView, step: int) -> None:
    """Called before the step that will make global step ``step + 1``.

    On the per-step path: only emitted when some plugin implements it, and only
    for a step that then runs (not when the data is exhausted).

    :param session: the `loopkit.Session`.
    :param step: the global step before this step runs.
    """


@hookspec
def after_step(session: SessionView, step: int, metrics: Mapping[str, Any]) -> None:
    """Called after a step; ``step`` is the new global step.

    On the per-step path: only emitted when some plugin implements it. The
    metrics may still be device arrays being computed; converting one to a host
    value waits for the device, so do it on a timer (`session.every`).

    :param session: the `loopkit.Session`.
    :param step: the new global step.
    :param metrics: the mapping the step function returned.
    """


@hookspec
def on_stop(session: SessionView, error: BaseException | None) -> None:
    """Called once at the end of every session, whatever ended it.

    Every implementation runs even if one raises. Other plugins' `on_stop` run
    first; the built-in services stop last, in the reverse of their start
    order (so a final checkpoint and the last summary come after yours).

    :param session: the `loopkit.Session`.
    :param error: the exception that stopped the run, or None for a normal stop.
    """


@hookspec
def on_data_end(session: SessionView) -> None:
    """The data ran out after ``session.step``'s step; the stop comes next.

    With several processes every process is called at the same step (the end is
    agreed ahead). An implementation may go back (`Session.rewind`): the
    ``nan_guard`` built-in rolls back a bad value of the last step here, which a
    check one step late would otherwise see only at the stop. The loop then
    trains on from there (the batches a replay set come first) until the data
    runs out again.

    :param session: the `loopkit.Session`, after the last step's `after_step`.
    """


@hookspec(historic=True)
def plugin_registered(plugin: Any, manager: pluggy.PluginManager) -> None:
    """A plugin was registered with the session's plugin manager.

    Historic: a plugin registered later is also called for every plugin
    registered before it, itself included. `loopkit.testing.HookRecorder` uses it
    to start pluggy's hook-call monitoring.

    :param plugin: the plugin object just registered.
    :param manager: the session's `loopkit.plugin.manager.PluginManager`.
    """


@hookspec
def step_carry(session: SessionView) -> StepCarry | None:
    """Return a `loopkit.StepCarry` to thread through the jitted step, or None.

    Called once per session, just before the step function is jitted (after
    the state is ready, before `session_create`). Each carry's ``update`` is
    traced into the same compiled step, after the step function, so per-step
    work on device (a running sum of metrics, an average of the weights)
    costs no host work and no extra dispatch. An already-jitted step function
    is called as given: a carry then makes the session fail at start-up with a
    `ValueError` naming the carry's ``name``.

    :param session: the `loopkit.Session`; `session.state` is ready.
    """


# -- provider hooks: "give me one X" -------------------------------------------------


@hookspec(firstresult=True)
def checkpoint_backend(name: str, directory: Path | str,
                       config: Config) -> CheckpointBackend | None:
    """Build the checkpoint backend called ``name`` that stores in ``directory``.

    Called once per session when `Config.checkpoint_backend` is a name; the
    instance returned both restores and saves. Return None for a name this
    plugin does not provide. Stops at the first non-None result.

    :param name: the backend name, e.g. ``"orbax"`` or ``"npz"``.
    :param directory: the directory checkpoints live in (the logdir): an absolute
        `Path`, or a URL string (``s3://bucket/run``) that the backend reaches
        through fsspec (`loopkit.storage`).
    :param config: the run's `loopkit.Config`.
    """


@hookspec
def checkpoint_backend_names() -> list[str]:
    """The backend names this plugin's `checkpoint_backend` implementation provides; optional.

    Called by the helpers that read checkpoints outside a run (`load_checkpoint`,
    `latest_checkpoint`, `checkpoints_iterator`, `from_pretrained`, ``loopkit
    checkpoints``): besides the backend whose name the logdir records (which the
    `checkpoint` plugin writes beside the ``checkpoint`` file), they build each
    named backend for a directory and ask it which steps it holds. Not needed for
    a logdir a named backend wrote; it finds what was written otherwise (by a
    backend instance, or before the name was recorded).
    """


@hookspec(firstresult=True)
def can_restore(session: SessionView) -> bool | None:
    """Whether `restore_state` may find a state to recover; asked once, just before it.

    Return False when there is certainly nothing (no checkpoint on disk): a fresh
    start then calls a callable ``init`` at once, instead of first tracing and
    lowering it to learn the shardings a restore would need. True, or None (no
    answer), means it may. A plugin that recovers a state from elsewhere in
    `restore_state` returns True here when it will (else ``init`` may have run
    before its restore). Stops at the first non-None result.

    :param session: the `loopkit.Session` (its state is not set yet).
    """


@hookspec(firstresult=True)
def restore_state(session: SessionView, like: PyTree) -> Restored | None:
    """Recover the training state from the latest checkpoint, if there is one.

    Called once at start-up, before any state is materialised. Return a
    `loopkit.Restored` (state, step, input position) or None when there is
    nothing to recover (a fresh start). Raise `loopkit.CheckpointError` when
    checkpoints exist but none can be read. Stops at the first non-None result.

    :param session: the `loopkit.Session` (its state is not set yet).
    :param like: the abstract state (`jax.ShapeDtypeStruct` leaves) of ``init``; a
        leaf `init` left to XLA to place is a `loopkit.state.init_trace.Guessed`, whose
        ``sharding`` may be None (`xla_sharding()` compiles `init` for XLA's choice).
    """


@hookspec(firstresult=True)
def rollback_state(session: SessionView, before_step: int) -> Restored | None:
    """Read back the newest saved state of a step before `before_step`, mid-run.

    Called by the ``nan_guard`` built-in with ``Config.on_guard="rollback"``
    after a bad value at step `before_step`. Wait for saves in flight first; a
    saved state from `before_step` on holds abandoned steps and must not be
    resumed from later. Return a `loopkit.Restored` placed like
    ``session.state``, or None when there is none (the guard then goes back to
    the session's initial state). Stops at the first non-None result.

    :param session: the `loopkit.Session` (its state is the bad branch's).
    :param before_step: the first bad step.
    """


@hookspec
def on_rollback(session: SessionView, record: RollbackRecord) -> None:
    """After a rollback: the state is restored and the skipped batches recorded.

    :param session: the `loopkit.Session`, at the restored step.
    :param record: a `loopkit.RollbackRecord` (bad step, restored step, the batch
        range skipped, the metric and its value).
    """


@hookspec(firstresult=True)
def input_reader(session: SessionView, input: Input) -> Reader | None:
    """How the loop reads `input` (`train`'s data): batches made ahead, for example.

    Called once per session with data, after `session_create`. Return a
    `loopkit.loop.data.Reader`: ``batches``, the iterator the loop consumes (built
    from ``input.source``, the user's data opened at the session's step), and
    ``position(step)``, the input position after the batch of global step
    ``step`` as a checkpoint records it (None: read from the source when it is
    stateful). Return None to let the loop read ``input.iterator`` as it is.
    The built-in ``prefetch`` plugin implements it. Stops at the first non-None
    result.

    :param session: the `loopkit.Session`, ready to run.
    :param input: the `loopkit.loop.data.Input` (``source``, ``kind``, ``start_step``).
    """


@hookspec(firstresult=True)
def init_state(session: SessionView, state: PyTree) -> PyTree | None:
    """Return the state a fresh run starts from, given the ``init`` state.

    Called only when nothing was restored (the Supervisor's ``init_fn``).
    Return None to leave ``state`` as it is. Stops at the first non-None result.

    :param session: the `loopkit.Session`.
    :param state: the state built from ``init``.
    """


@hookspec
def local_init(session: SessionView) -> None:
    """Per-session initialisation, run whether the state was restored or fresh.

    Called after restore or init, before the ready check (the Supervisor's
    ``local_init_op``). May replace ``session.state``.

    :param session: the `loopkit.Session`.
    """


# -- the `loopkit` command ---------------------------------------------------------------


@hookspec
def command_line(subparsers: Any) -> None:
    """Add verbs to the `loopkit` command, as the built-ins add ``checkpoints``,
    ``goodput`` and ``report``.

    Called once when the command starts, on each built-in's ``commands`` module and
    the entry-point plugins. Add a verb with ``subparsers.add_parser(name, help=...,
    description=...)`` and set its ``func`` (``func(args) -> exit code``) with
    ``set_defaults``; import what the verb needs when it runs, not here.

    :param subparsers: the `argparse` sub-parsers of the ``loopkit`` parser.
    """


@hookspec
def run_restarted(logdir: str, kind: str, exit_code: int | None, signal: int | None,
                  step: int | None) -> None:
    """``loopkit run`` is restarting the chief's child: record it (the goodput ledger does).

    Called in the runner's process, between two children, for the runner of
    process 0 only, with the logdir that child held.

    :param logdir: the child's logdir (a path or URL), as its status file named it.
    :param kind: ``"failure"`` or ``"preemption"``.
    :param exit_code: the child's exit code, or None when a signal ended it.
    :param signal: the signal that ended it, or None.
    :param step: the step the child reached (None if it never said).
    """
