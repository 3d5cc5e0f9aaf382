"""The online RL core PPO, GRPO and RLOO share: the plan (online_plan.py), the run (online.py), roles and scoring
(roles.py, rewards.py), sampling (generation.py, sampler.py), a rollout's passes (trajectory.py), checkpoints
(checkpoints.py) and the judge that measures (overopt.py, checks.py)."""
