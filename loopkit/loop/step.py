"""The compiled step: one jitted function, its layout pinned, frozen leaves never donated.

At the first call loopkit traces ``step_fn`` once with the first batch and sorts the
state's leaves: those the step returns unchanged (the same traced value, e.g. frozen
weights in a fine-tune) are *frozen*, the others are *rewritten*. It then jits one
function ``inner(frozen, live, *batch) -> (live, metrics)``: `live` holds the
rewritten leaves and every `StepCarry`'s value and is donated; `frozen` is passed in
and never returned, so it is neither donated nor copied. The rewritten leaves'
output shardings are pinned to their input shardings (those of `init` or of the
restore), so XLA's propagation never re-lays a sharded state out.

Protecting buffers. A background saver must keep reading the buffers of the state
it was given while the next steps run. Off CPU a save copies the leaves the next
step rewrites to host memory (`stage`) and donation goes on, so device memory never
doubles. On CPU "device" memory is host memory and a copy of the rewritten leaves
costs about what a fresh write of them does, so a save hands the saver the buffers
themselves and the step after it writes into *spare* buffers instead: those of the
previous save, which its saver gave back (`Staged.release`), donated through a
variant compiled in the background at the first save. Until a spare exists (the
first save, or a saver that never releases) the saver reads a copy made at the
save (`jax.device_put(..., may_alias=False)`), which becomes the spare once
released. The first step of a session must not donate the caller's arrays: on CPU
views protect them the same way; elsewhere it runs a non-donating variant of the
same function. A step the user jitted is called as given; its state is protected
by a host copy at a save, never copied leaf by leaf.
"""

from __future__ import annotations

import enum
import functools
import logging
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from loopkit.loop.carry import CarriedMetrics, attach, first_values
from loopkit.state.pytree import abstract
from loopkit.state.staging import (
    Spare, Staged, aval, copied, copied_arrays, swap_leaves, to_host, views, views_protect,
)
from loopkit.loop.step_checks import RecompileWatch, check_step_output, is_jitted
from loopkit.loop.step_layout import (
    Layout, Program, on_cpu_devices, one_in_flight, sorted_leaves, step_body,
)

if TYPE_CHECKING:
    from loopkit.loop.carry import StepCarry
    from loopkit.config import Config

__all__ = ["CompiledStep", "is_jitted"]

log = logging.getLogger("loopkit")

PyTree = Any
_UNSET = object()
_NO_METRICS: Mapping[str, Any] = MappingProxyType({})


class Phase(enum.Enum):
    """What the compiled step's next call does; `call` is that phase's function."""

    ENTER = "enter"    # a state set from outside: split it (build at the first call), step
    NORMAL = "normal"  # the jitted step, donating `live`
    SPARE = "spare"    # CPU, the step after a save: writes into a spare, not into `live`
    ENDED = "ended"    # the session is over: every call raises


class CompiledStep:
    """`step_fn` as the loop calls it: ``live, metrics = call(live, *batch)``.

    `live` is what the step donates: the rewritten leaves (a tuple), paired with the
    carries' values when there are carries (`state` assembles the full state from it);
    `set_state` replaces the state, split again at the next call. `program` is what
    the first call built (None before it). `phase` says what the next call does;
    `_to` is the one place it changes, and `call` with it (the loop calls `call`
    directly: no dispatch per step).
    """

    def __init__(self, fn: Callable[..., Any], config: Config,
                 carries: Sequence[StepCarry] = (), metrics_needed: bool = True) -> None:
        carries = tuple(carries)
        #: whether something reads the metrics on every step (an `after_step`)
        self.metrics_needed = metrics_needed
        #: what `session.metrics` is when the step returns none (see `StepCarry.metrics_of`)
        self.no_metrics: Mapping[str, Any] = _NO_METRICS
        self.user_jitted = is_jitted(fn)
        if carries and self.user_jitted:
            wants = ", ".join(c.name for c in carries)
            raise ValueError(
                f"{wants} needs loopkit to jit the step function, but {fn!r} is "
                "already jitted and loopkit calls it as given: pass the un-jitted "
                "function (loopkit jits it), or turn that option off"
            )
        self.fn, self.carries = fn, carries
        self.jit = bool(config.jit) and not self.user_jitted
        #: whether a call may donate the state's buffers (a user's jit may)
        self.donates = self.user_jitted or (self.jit and bool(config.donate))
        self.by_views = views_protect()
        #: what the next call takes and donates: ``(rewritten leaves, carry values)``
        #: (the state itself for a step the user jitted)
        self.live: Any = None
        self.frozen: tuple = ()
        #: what the first call built; None before it
        self.program: Program | None = None
        self.phase = Phase.ENTER
        self.call: Callable[..., Any] = self._enter
        self._pending: Any = _UNSET  # a state set from outside, split at the next call
        self._protect = True  # the next call donates none of the current buffers
        self._ahead = False  # the donating variant compiled before its first use (off CPU)
        self._normal: Callable[..., Any] | None = None  # the NORMAL phase's call
        self._ended: Callable[..., Any] | None = None  # what calls do after `end`
        attach(carries, self)

    @property
    def spare(self) -> Spare | None:
        """The CPU save variant's buffers (None before the first call, or off CPU)."""
        return None if self.program is None else self.program.spare

    @property
    def layout(self) -> Layout | None:
        return None if self.program is None else self.program.layout

    # -- the state ---------------------------------------------------------------------

    def set_state(self, state: PyTree) -> None:
        """Take `state` as the current state; it is split at the next call."""
        self._pending = state
        spare = self.spare
        if spare is not None:
            if spare.next is not None:
                # a saver reads the current buffers, which the new state may hold:
                # the next call donates none of them
                self._protect = True
            spare.forget()
        self._to(Phase.ENTER)

    def state(self) -> PyTree:
        """The current state, assembled from `live` and the frozen leaves."""
        if self._pending is not _UNSET:
            return self._pending
        layout, live = self.layout, self.live
        if self.user_jitted or live is None:
            return live
        part = live[0] if self.carries else live
        if layout is None:  # not jitted by loopkit
            return part
        leaves: list[Any] = [None] * layout.treedef.num_leaves
        for i, x in zip(layout.rewritten, part):
            leaves[i] = x
        for i, x in zip(layout.frozen, self.frozen):
            leaves[i] = x
        return layout.treedef.unflatten(leaves)

    @property
    def carry_values(self) -> tuple | None:
        """The carries' values, the second half of `live` (None before the first call)."""
        return None if self.live is None else self.live[1]

    @carry_values.setter
    def carry_values(self, new: tuple) -> None:
        self.live = (self.live[0], tuple(new))

    def _donated_leaves(self) -> list[Any]:
        layout = self.layout
        if self._pending is not _UNSET:
            state = self._pending
            if layout is None:
                return jax.tree.leaves(state)
            leaves = layout.treedef.flatten_up_to(state)
            return [leaves[i] for i in layout.rewritten]
        if self.user_jitted or layout is None:
            return jax.tree.leaves(self.state())
        return list(self.live[0] if self.carries else self.live)

    def stage(self, state: PyTree, ahead: bool = True) -> Staged:
        """`state` made safe to read from another thread while the next steps run.

        `ahead`: whether more steps may follow (not at a stop), so that the save
        variant (CPU) is worth compiling now.
        """
        if not self.donates or self._protect:
            return Staged(state, None)  # the next call donates nothing
        donated = self._donated_leaves()
        if self.spare is not None:
            staged = self._stage_in_place(state, tuple(donated), self.spare, ahead)
            if staged is not None:
                return staged
        return Staged(swap_leaves(state, donated, [to_host(x) for x in donated]), None)

    def _stage_in_place(self, state: PyTree, part: tuple, spare: Spare,
                        ahead: bool) -> Staged | None:
        """CPU: the saver reads `part` itself and the next step writes into a spare, or
        the saver reads a copy of `part`, which becomes a spare once released; None
        after a state set from outside (split at the next call): `part` is copied."""
        steady = self._pending is _UNSET and self.phase is Phase.NORMAL
        if steady and spare.take(part):
            self._to(Phase.SPARE)
        if spare.next is not None:  # the next call writes into a spare: `part` is safe
            return Staged(state, None, spare.releaser(part))
        if not steady:
            return None
        # each leaf where it is, committed as it is: the spare variant's signature
        copies = tuple(copied(part))
        if ahead and not spare.compiling:
            program = self.program
            assert program is not None
            args = (jax.tree.map(aval, self.live), tuple(aval(x) for x in part),
                    *program.batch_avals)
            spare.compile_ahead((jax.tree.map(aval, self.frozen), *args) if program.bound
                                else args)
        return Staged(swap_leaves(state, part, copies), None, spare.releaser(copies))

    def _spare_call(self, live: Any, *batch: Any) -> Any:
        """The step after a save: donates the spare, not `live` (a saver reads it)."""
        program = self.program
        assert program is not None and program.spare is not None
        spare = program.spare
        assert spare.next is not None
        into, spare.next = spare.next, None
        try:
            if program.bound:
                out = spare.jit(self.frozen, live, into, *batch)
            else:
                out = spare.jit(live, into, *batch)
        except BaseException:
            # a caller may go on after a failed step: the saver still reads `live`
            self.skip_donation_once()
            raise
        self._to(Phase.NORMAL)
        if program.wait_each:
            jax.block_until_ready(out)
        return out

    def skip_donation_once(self) -> None:
        """Make the next call donate nothing the current state holds."""
        self._protect = True
        if self.spare is not None:
            self.spare.next = None
        self._to(Phase.ENTER)

    def end(self, ended: Callable[..., Any]) -> None:
        """The session is over: every call now goes to `ended`."""
        self._ended = self._normal = ended
        self._to(Phase.ENDED)
        if self.spare is not None:
            self.spare.close()

    def _to(self, phase: Phase) -> None:
        """Make `phase` the next call's; nothing leaves `ENDED`."""
        if self.phase is Phase.ENDED:
            return
        self.phase = phase
        self.call = {Phase.ENTER: self._enter, Phase.NORMAL: self._normal,
                     Phase.SPARE: self._spare_call, Phase.ENDED: self._ended}[phase]

    # -- the first call: trace, sort the leaves, jit ---------------------------------------

    def _enter(self, live: Any, *batch: Any) -> Any:
        """Split a newly set state (building the step at the first call), then step."""
        unchecked = None
        if self._pending is not _UNSET:
            if self.program is None:
                self.program = self._build(self._pending, batch)
                unchecked = self.program.unchecked
            self.live = self._split(self._pending)
            self._pending = _UNSET
            self._bind()
        live = self.live
        assert self._normal is not None and self.program is not None
        self._to(Phase.NORMAL)
        if self._protect:
            self._protect = False
            out = self._protected(live, *batch)
            if self.program.wait_each:  # `_normal` itself waits; a protected call may not
                jax.block_until_ready(out)
        else:
            out = self._normal(live, *batch)
        if unchecked is not None:  # a step not traced by loopkit: its first output
            check_step_output(out, unchecked)
        return out

    def _build(self, state: PyTree, batch: tuple) -> Program:
        """The step's `Program` for this state and the first batch."""
        fn, carries = self.fn, self.carries
        wait_each = on_cpu_devices(jax.tree.leaves(state))
        if self.user_jitted:  # called as given; checked on what its first call returns
            return Program(None, fn, fn, None, False, wait_each, (), (), abstract(state))
        layout = like_state = like_metrics = unchecked = None
        if self.jit:
            closed, out = jax.make_jaxpr(fn, return_shape=True)(state, *batch)
            check_step_output(out, state)
            like_state, like_metrics = out
            layout = sorted_leaves(state, closed.jaxpr)
        elif carries:
            out = jax.eval_shape(fn, state, *batch)
            check_step_output(out, state)
            like_state, like_metrics = out
        else:  # checked on what the first call returns (nothing traced twice)
            unchecked = abstract(state)
        firsts = first_values(carries, like_state, like_metrics) if carries else ()
        holder = next((c for c in carries if c.metrics_of is not None), None)
        drop = holder is not None and not self.metrics_needed
        if drop:  # the carry holds the latest metrics: no metric arrays out of the step
            self.no_metrics = CarriedMetrics(holder)
        watch = RecompileWatch(getattr(fn, "__qualname__", repr(fn)))
        inner = step_body(fn, carries, None if layout is None else layout.treedef,
                          layout.rewritten if layout else (), layout.frozen if layout else (),
                          watch, drop)
        # With no frozen leaf the jitted function takes `live` alone: the loop then
        # calls it directly, with no argument bound in front (measured: ~0.3 us/step).
        bound = layout is not None and bool(layout.frozen)
        if not bound:
            inner = functools.partial(inner, ())
        donating, plain, spare = self._variants(inner, layout, bound)
        batch_avals = tuple(jax.tree.map(aval, batch)) if spare is not None else ()
        return Program(layout, donating, plain, spare, bound, wait_each, firsts, batch_avals,
                       unchecked)

    def _variants(self, inner: Callable[..., Any], layout: Layout | None,
                  bound: bool) -> tuple[Any, Any, Spare | None]:
        """``(donating, plain, spare)``: `inner` jitted in each calling convention."""
        if not self.jit:
            return inner, inner, None
        kw: dict[str, Any] = {}
        if layout is not None and layout.pins is not None:
            kw["out_shardings"] = ((layout.pins, None) if self.carries else layout.pins, None)
        donated = (1 if bound else 0) if self.donates else ()
        donating = jax.jit(inner, donate_argnums=donated, **kw)
        plain = jax.jit(inner, **kw) if self.donates else donating
        # one process only: with several, each must run the same executable at a step,
        # and whether a spare is ready differs between them
        if not (self.donates and self.by_views and layout is not None and layout.rewritten
                and jax.process_count() == 1):
            return donating, plain, None
        k = 1 if bound else 0

        def inner_with_spare(*args: Any) -> Any:  # (frozen,) live, spare, *batch
            return inner(*args[:k + 1], *args[k + 2:])

        # `spare` is never read: kept (and donated) so that the outputs land in it
        return donating, plain, Spare(jax.jit(inner_with_spare, donate_argnums=k + 1,
                                              keep_unused=True, **kw))

    def _split(self, state: PyTree) -> Any:
        """The state's donated part (and the carries' values), as the next call takes it."""
        if self.user_jitted:
            return state
        program = self.program
        assert program is not None
        values = ()
        if self.carries:
            values = self.live[1] if self.live is not None else program.firsts
        layout = program.layout
        if layout is None:
            return (state, values) if self.carries else state
        leaves = layout.treedef.flatten_up_to(state)
        self.frozen = tuple(leaves[i] for i in layout.frozen)
        pins = layout.pins or (None,) * len(layout.rewritten)
        part = []
        for i, pin in zip(layout.rewritten, pins):
            x = leaves[i]
            # an array placed as the step's output will be: one signature, one compile
            if pin is not None and (not isinstance(x, jax.Array) or x.sharding != pin):
                x = jax.device_put(x, pin)
            elif not isinstance(x, jax.Array):
                x = jnp.asarray(x)
            part.append(x)
        return (tuple(part), values) if self.carries else tuple(part)

    def _bind(self) -> None:
        program = self.program
        assert program is not None
        normal = (functools.partial(program.donating, self.frozen) if program.bound
                  else program.donating)
        self._normal = one_in_flight(normal) if program.wait_each else normal

    def _protected(self, live: Any, *batch: Any) -> Any:
        """One call that donates none of `live`'s current buffers."""
        assert self._normal is not None and self.program is not None
        if not self.donates:
            return self._normal(live, *batch)
        if self.by_views:
            try:
                hold = views(jax.tree.leaves(live))  # noqa: F841 - XLA won't donate these
            except ValueError:  # an array whose shards have no host view: as off CPU
                hold = None
            if hold is not None:
                return self._normal(live, *batch)
        if self.user_jitted:  # its arrays copied where they are: nothing compiled
            return self._normal(copied_arrays(live), *batch)
        program = self.program
        args = (self.frozen, live, *batch) if program.bound else (live, *batch)
        if not self._ahead:
            self._ahead = True  # the normal variant, compiled before it is first needed
            program.donating.lower(*args).compile()
        return program.plain(*args)

