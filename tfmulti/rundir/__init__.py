"""The run folder: its file names, its lifecycle (made, refused, overwritten, resumed) and
its lock."""
