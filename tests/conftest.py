"""Shared test set-up: JAX on CPU, no third-party plugins unless a test asks."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests that want entry-point plugins unset this in their own subprocess.
os.environ["LOOPKIT_DISABLE_PLUGIN_AUTOLOAD"] = "1"
