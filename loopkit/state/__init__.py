"""The state: pytree helpers, tracing `init`, recover-or-initialise."""
