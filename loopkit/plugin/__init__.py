"""What a plugin author uses: the hookspecs, the plugin manager, the checkpoint-backend Protocol and the session view hooks receive."""
