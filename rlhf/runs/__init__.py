"""A run: its session (runtime.py), its record on disk (records.py), lineage and resumption (lineage.py),
trackers (tracking.py) and run comparison (compare.py)."""
