"""The state: pytree helpers, tracing `init`, recover-or-initialise, and staging a state for a reader in another thread (a save)."""
