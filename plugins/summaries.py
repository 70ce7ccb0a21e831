"""Built-in `summaries` (not written yet)."""

INACTIVE = "not implemented yet"


def plugin(config):
    return None
