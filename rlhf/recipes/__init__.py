"""One module per stage, each exposing train(exp) -> summary (the registry, experiment/stages.py, names them):
sft, rm, dpo, kto (over preference.py), ppo, grpo (GRPO and RLOO), evaluate, export; trainers.py: what the
TRL-backed stages share."""
