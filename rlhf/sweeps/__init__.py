"""Sweeps over an experiment's config (`make sweep`, `python -m rlhf.sweeps`): the study and its workers (sweep.py),
the sweep file's schema (spec.py), one trial (trial.py) and the W&B translation (wandb_sweep.py). The only
modules of rlhf that import the `sweep` extra (Optuna)."""
