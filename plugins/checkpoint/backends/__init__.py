"""The built-in checkpoint backends, and what they share.

- `orbax` (``"orbax"``, the default): a standard orbax PyTree checkpoint per step,
  written asynchronously (`orbax_write`: the arrays in one batch), read by
  `orbax_read`; `orbax_layout` is what loopkit keeps beside orbax's tree.
- `npz` (``"npz"``): one ``.npz`` file per step, numpy only, synchronous.
- `staged`: any local-file backend under a URL, staged on local disk and uploaded.
- `records` (how a leaf is described in JSON), `placement` (restored leaves placed
  like ``like``), `temporaries` (the save lock and the clean-up of dead saves).

Heavy imports (orbax, tensorstore) happen when a backend is built, not here.
"""
