"""A CPU quota per process, for benchmarks that stand in for a host per process.

A job of N processes on a machine of fewer cores than N measures the cores' contention
as much as the job: every process's per-leaf work shares them. With a quota of Q cores
for each process (and one for the store's server), N processes have what N hosts of Q
cores would, and one process what one such host would, so their ratio is a pod's.

Linux cgroups, as root: v1's ``cpu`` controller (``cpu.cfs_quota_us``) or v2's
``cpu.max``. `Quotas.command(name, cores, argv)` is ``argv`` started in the group
``name`` (with the threads and children it makes): a shell joins the group and
``exec``s it, so the caller forks nothing itself (a ``preexec_fn`` would, beside JAX's
threads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_PERIOD = 100_000  # µs


class Quotas:
    """cgroups of a CPU quota each, made on demand under one parent; `close` removes them."""

    def __init__(self, prefix: str = "loopkit-bench") -> None:
        if (_V1 / "cpu.cfs_quota_us").exists():
            self.root, self.v1 = _V1, True
        elif (_V2 / "cgroup.controllers").exists() and "cpu" in (
                _V2 / "cgroup.controllers").read_text().split():
            self.root, self.v1 = _V2, False
            control = _V2 / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        else:
            raise SystemExit("--cpu-per-process needs Linux cgroups with the cpu controller")
        if not os.access(self.root, os.W_OK):
            raise SystemExit(f"--cpu-per-process needs write access to {self.root} (root)")
        self.prefix = f"{prefix}-{os.getpid()}"
        self.made: list[Path] = []

    def command(self, name: str, cores: float, argv: Sequence[str]) -> list[str]:
        """``argv``, run in group ``name`` of ``cores`` cores."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self._group(name, cores), *argv]

    def _group(self, name: str, cores: float) -> str:
        """The ``cgroup.procs`` file of group ``name``, of ``cores`` cores (made now)."""
        group = self.root / f"{self.prefix}-{name}"
        if group not in self.made:
            group.mkdir(exist_ok=True)
            quota = max(1000, int(cores * _PERIOD))
            if self.v1:
                (group / "cpu.cfs_period_us").write_text(str(_PERIOD))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (group / "cpu.max").write_text(f"{quota} {_PERIOD}")
            self.made.append(group)
        return str(group / "cgroup.procs")

    def close(self) -> None:
        """Remove the groups (their processes have ended)."""
        for group in self.made:
            try:
                group.rmdir()
            except OSError:
                pass  # a process still in it: left for the next boot
        self.made.clear()
