"""Built-in `nan_guard` (not written yet)."""

INACTIVE = "not implemented yet"


def plugin(config):
    return None
