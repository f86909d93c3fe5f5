"""Processes tfmulti starts and watches: the launcher of workers, their network of their own,
the one supervisor, child processes that die with their parent."""
