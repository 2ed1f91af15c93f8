"""Checkpoints: the state a run saves and loads, its file layout, registered objects, atomic model
files."""
