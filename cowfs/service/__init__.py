"""The daemon side: the session (the one orchestrator of checkpoint,
rollback, commit, redo and restore, with or without a mount), the daemon
process that hosts it over a FUSE engine, the control channel, and the
launching of daemons and views."""
