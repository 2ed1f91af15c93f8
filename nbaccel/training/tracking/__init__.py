"""Experiment trackers: the interface and the built-ins (``trackers``), the one table of tracker
names (``registry``), one accelerator's trackers (``tracker_set``), the library backends."""
