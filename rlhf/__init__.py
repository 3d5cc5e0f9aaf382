"""rlhf-harness: SFT, reward model, DPO, PPO, GRPO/RLOO, evaluation and export (README.md)."""

import logging

# bitsandbytes 0.50, imported on a CPU with AVX512-BF16, tries to fetch a packed 4-bit CPU kernel from the hub through
# the optional `kernels` package and warns when it is absent. The harness never computes through that layout
# (models.plain_4bit), so the warning says nothing about a run: drop that one message, keep the logger's others.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "kernels-community" not in record.getMessage())
