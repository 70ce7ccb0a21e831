"""Built-in `step_counter` (not written yet)."""

INACTIVE = "not implemented yet"


def plugin(config):
    return None
