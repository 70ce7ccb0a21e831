"""The processes of a hung job, compared: which one is behind.

Each process's watchdog publishes its last completed step in `jax.distributed`'s
key-value store when it changed (from the watchdog thread, at most once a poll,
never from the loop). At a hang every process fires within a poll of the others,
since a collective holds them all; each then publishes where its main thread
waits, waits (bounded) for the others to do the same, and its report lists every
process and names the ones behind: a smaller step, or, at the same step, a main
thread outside JAX (in the data source, a hook) while the others wait inside a
collective for it.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

__all__ = ["ProcessSteps", "main_thread_position"]

log = logging.getLogger("loopkit")

PREFIX = "loopkit/watchdog/"
# frames that only say "waiting": the place a thread waits is the caller's
_WAITING = ("/threading.py", "/queue.py", "/selectors.py", "/multiprocessing/")


def main_thread_position() -> tuple[str, bool]:
    """Where the main thread waits ("function (file:line)"), and whether inside JAX."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    where, in_jax = "unknown", False
    while frame is not None:
        code = frame.f_code
        if "/jax/_src/" in code.co_filename or "/jaxlib/" in code.co_filename:
            in_jax = True
        if where == "unknown" and not any(w in code.co_filename for w in _WAITING):
            where = f"{code.co_name} ({code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return where, in_jax


class ProcessSteps:
    """This process's view of the job's key-value store (no-op in one process)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls) -> ProcessSteps:
        import jax

        if jax.process_count() == 1:
            return cls(None)
        # the store belongs to the job, not to a process
        from loopkit.process.job import kv_client

        return cls(kv_client())

    def _set(self, key: str, value: str) -> None:
        if self.client is None:
            return
        import jax

        try:
            self.client.key_value_set(f"{PREFIX}{key}/{jax.process_index()}", value,
                                      allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator may be gone; the report says so
            log.debug("loopkit: could not publish %s", key, exc_info=True)

    def _get(self, key: str) -> dict[int, str]:
        pairs = self.client.key_value_dir_get(f"{PREFIX}{key}/")
        return {int(k.rsplit("/", 1)[-1]): v for k, v in pairs}

    def publish(self, step: int) -> None:
        """This process's last completed step."""
        self._set("step", str(step))

    def mark(self, what: str, value: str = "") -> None:
        self._set(what, value)

    def mark_hung(self, step: int) -> None:
        where, in_jax = main_thread_position()
        self._set("step", str(step))
        self._set("hung", json.dumps({"step": step, "where": where, "in_jax": in_jax}))

    def gather(self, what: str, bound: float) -> dict[int, str]:
        """Every process's `what` record, waiting up to `bound` s for all of them."""
        if self.client is None:
            return {}
        import jax

        deadline = time.monotonic() + bound
        seen: dict[int, str] = {}
        while True:
            try:
                seen = self._get(what)
            except Exception:  # noqa: BLE001 - the coordinator may be gone
                return seen
            if len(seen) >= jax.process_count() or time.monotonic() >= deadline:
                return seen
            time.sleep(0.1)

    def await_exit_turn(self, bound: float) -> None:
        """The chief waits for every report (its exit takes the coordinator down)."""
        if self.client is None:
            return
        import jax

        if jax.process_index() == 0:
            self.gather("reported", bound)
            time.sleep(0.5)  # let the others see it and leave with their own code

    def describe(self, hung: dict[int, str]) -> str:
        """Every process's step and position; "process 1 is at step 10, the others at 12"."""
        import jax

        try:
            steps = {p: int(s) for p, s in self._get("step").items()}
        except Exception as e:  # noqa: BLE001 - a report must still be written
            return f"the other processes' steps are unknown: the key-value store failed ({e})"
        info = {p: json.loads(v) for p, v in hung.items()}
        lines = ["every process (last completed step; where its main thread waits):"]
        for p in range(jax.process_count()):
            if p in info:
                lines.append(f"  process {p}: step {info[p]['step']}, waiting in "
                             f"{'JAX' if info[p]['in_jax'] else 'Python'}: {info[p]['where']}")
            elif p in steps:
                lines.append(f"  process {p}: step {steps[p]}, no report (dead, or not hung)")
            else:
                lines.append(f"  process {p}: nothing published (dead, or never past its "
                             f"first step)")
        steps.update({p: i["step"] for p, i in info.items()})
        if not steps:
            return "\n".join(lines)
        top = max(steps.values())
        behind = {p: s for p, s in sorted(steps.items()) if s < top}
        if behind:
            names = ", ".join(f"process {p} is at step {s}" for p, s in behind.items())
            lines.append(f"{names}, the others at {top}")
        else:
            outside = [p for p, i in sorted(info.items()) if not i["in_jax"]]
            if outside and len(outside) < len(info):
                names = ", ".join(f"process {p}" for p in outside)
                lines.append(f"every process is at step {top}; {names} is behind: it waits "
                             f"outside JAX while the others wait inside a collective for it")
            else:
                lines.append(f"every process is at step {top}")
        return "\n".join(lines)
