"""The maths, no models: the RL and preference losses (losses.py), the guard's statistics and rules (guard.py) and
the curves it reads (curves.py)."""
