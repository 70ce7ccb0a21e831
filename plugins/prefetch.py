"""Built-in `prefetch` (not written yet)."""

INACTIVE = "not implemented yet"


def plugin(config):
    return None
