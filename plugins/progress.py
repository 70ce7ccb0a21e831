"""Built-in `progress` (not written yet)."""

INACTIVE = "not implemented yet"


def plugin(config):
    return None
