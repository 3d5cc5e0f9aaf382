"""Studies: research scripts that measure the harness itself, each run as `python studies/<name>.py` (its docstring
has its commands) and writing its table under results/calibration/ or results/bench/, which docs/*.md cite with the
command. What they share (running stages, seeds, tables, intervals) is studies/harness.py.

- the over-optimization guard: flag_calibration (`make flag-calibration`: false flags and detections),
  guard_study (the fall tests and selection rules replayed), guard_trace (every measured policy graded),
  guard_variants (the shipped defaults on task variants), fall_simulation (the fall test's error rates and the final
  playoff's, numpy),
  overopt_kl (ground truth against the KL spent), judge_share (what the judge's pairs cost the reward model);
- the stages: kto_vs_dpo, trl_recipes (TRL's DAPO and GSPO keyword sets as the grpo section), value_model (PPO's separate and shared value), sampler_gap (the sampler's log-prob gap and
  its correction, PPO, GRPO, RLOO);
- speed and memory: decode_levers, stage_accounting, memaccuracy (the predictor against the probe);
- upkeep: same_runs (the same figures before and after a change of structure), dp_kill_resume (2-rank runs killed
  and resumed against uninterrupted ones), durations (the test suite's times),
  bnb_packed_repro (a bitsandbytes bug, reproduced for its tracker)."""
