"""Plumbing every stage shares: processes and collectives (dist.py), a rank's last console line (ranks.py), faults
and signals (faults.py), the pinned toolchain (toolchain.py)."""
