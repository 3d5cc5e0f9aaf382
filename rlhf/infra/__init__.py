"""Plumbing every stage shares: processes and collectives (dist.py), faults and signals (faults.py), the pinned
toolchain (toolchain.py)."""
