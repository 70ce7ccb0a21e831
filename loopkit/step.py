"""The compiled step: jitted (or the user's own jitted function), with donation variants."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax

from loopkit.carry import with_carries

if TYPE_CHECKING:
    from loopkit.carry import StepCarry
    from loopkit.config import Config

__all__ = ["CompiledStep", "is_jitted"]


def is_jitted(fn: Any) -> bool:
    """True for a function JAX has already jitted (`jax.jit` and wrappers built on it)."""
    # jax.jit, flax.nnx.jit and equinox.filter_jit all have `lower`; equinox's
    # wrapper is no PjitFunction and has no `eval_shape`
    return callable(getattr(fn, "lower", None))


def _copy(x: Any) -> Any:
    return x.copy() if isinstance(x, jax.Array) else x


class CompiledStep:
    """`step_fn` as the loop calls it: a donating variant and a non-donating one.

    `call` is what `Session.run` calls; `skip_donation_once()` makes the next call
    use the non-donating variant, then goes back to the donating one.
    """

    def __init__(self, fn: Callable[..., Any], config: Config,
                 carries: Sequence[StepCarry] = ()) -> None:
        host = None
        if carries:
            if is_jitted(fn):
                wants = ", ".join(c.name for c in carries)
                raise ValueError(
                    f"{wants} needs loopkit to jit the step function, but {fn!r} is "
                    "already jitted and loopkit calls it as given: pass the un-jitted "
                    "function (loopkit jits it), or turn that option off"
                )
            fn, host = with_carries(fn, carries)
        if is_jitted(fn):
            # Already jitted, maybe with donate_argnums=0 that we cannot undo: the
            # "plain" variant feeds it a copy, so the buffers a saver (or the
            # caller's init) still holds are never donated.
            def plain(state: Any, *batch: Any) -> Any:
                return fn(jax.tree.map(_copy, state), *batch)

            donating = fn
        elif not config.jit:
            donating = plain = fn
        else:
            plain = jax.jit(fn)
            donating = jax.jit(fn, donate_argnums=0) if config.donate else plain
        if host is not None:
            donating, plain = host(donating), (host(plain) if plain is not donating else None)
            plain = plain or donating
        self.donating, self.plain = donating, plain
        self.call: Callable[..., Any] = donating

    def skip_donation_once(self) -> None:
        if self.plain is self.donating:
            return
        donating, plain = self.donating, self.plain

        def once(*args: Any) -> Any:
            self.call = donating
            return plain(*args)

        self.call = once
