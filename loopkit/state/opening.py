"""Opening a session's state, as the Supervisor's `prepare_or_wait_for_session` does.

Recover from a checkpoint (`restore_state`), else build `init` and apply `init_fn`
(`init_state`); then `local_init_fn` (`local_init`); then the ready check against
`init`'s structure, shapes and dtypes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loopkit.state.init_trace import trace_init
from loopkit.state.pytree import abstract, check_matches, conform

if TYPE_CHECKING:
    from loopkit.plugin.backend import Restored
    from loopkit.plugin.view import SessionView

__all__ = ["recover_or_init"]


def recover_or_init(session: SessionView, init: Any) -> Restored | None:
    """Set `session`'s state (and step) from a checkpoint or from `init`; what was restored."""
    hook = session.hook
    session.phase = "looking for a checkpoint"
    # A callable init is traced (and lowered where shardings matter), not run;
    # built is init() run for real, once: when nothing can be restored, or when
    # it could not be traced.
    if callable(init) and hook.can_restore(session=session) is False:
        session.phase = "building the initial state"
        built = init()
        like = abstract(built)
    else:
        if callable(init):
            session.phase = "tracing init"
        like, built = trace_init(init) if callable(init) else (abstract(init), None)
    # the checkpoint plugin names the step ("restoring step 40") once it knows it
    session.phase = "restoring a checkpoint"
    restored = hook.restore_state(session=session, like=like)
    if restored is not None:
        session.restored = restored
        session.state = conform(restored.state, like)
        session.step = int(restored.step)
    else:
        session.phase = "building the initial state"
        if callable(init) and built is None:
            built = init()
            # the state of this one call is the reference: its static fields
            # (a transform made inside init) are not those of the trace
            like = abstract(built)
        state = built if built is not None else init
        new = hook.init_state(session=session, state=state)
        session.state = state if new is None else new
    session.phase = "local initialisation"
    hook.local_init(session=session)
    check_matches(
        session.state, like,
        "the restored state" if restored is not None else "the state after init_fn",
    )
    return restored
