"""The loop: one step and its timers (Session, the compiled step, the scheduler, the coordinator, the input the loop reads, the stash, the writer protocol)."""
