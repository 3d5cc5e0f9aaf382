"""Sweeps over an experiment's config (`make sweep`, `python -m rlhf.sweeps`): the study and its workers (sweep.py),
the sweep file's schema (sweepfile.py), one trial (sweeptrial.py) and the W&B translation (sweepwandb.py). The only
modules of rlhf that import the `sweep` extra (Optuna)."""
