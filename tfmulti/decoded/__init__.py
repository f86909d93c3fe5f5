"""Decoded once: the training examples that stay in files (a folder's images, records read by
index) decoded once before a run, into memory where they fit (dataonce.py), else into a file
of the user's cache that the run maps into memory (ondisk.py)."""
