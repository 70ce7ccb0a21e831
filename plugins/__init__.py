"""loopkit's built-in plugins, one module each, or a subpackage for one that needs several
(`checkpoint`); see `loopkit.plugin.manager.BUILTINS`.

Each module has ``plugin(config)`` returning the plugin object to register for a
session, or None when the config leaves it inactive (its ``INACTIVE`` says why).
"""
