"""`python -m tests.killpoint STAGE ARGS...`: `python -m rlhf STAGE ARGS...` that records each rank's pid and is
killed (SIGKILL) at a chosen moment, for the data-parallel kill tests (tests/test_distributed.py) launched by torchrun.

RLHF_TEST_PIDS: a folder where each rank writes its pid (rank-<r>.pid). RLHF_TEST_KILL=<moment>:<step>[:launcher|:self]:
rank 0 kills its launcher (torchrun's agent, its parent) and then itself - with `launcher`, the launcher alone; with
`self`, itself alone (its peer then fails in a collective, as after the OOM killer) - at that moment of that step:
  write  inside a checkpoint write: the online stages' once every file is in the temp dir, before it is renamed into
         place; the Trainer's once its RNG state is written, before our resume state marks the checkpoint complete
  judge  inside a judge measurement (online stages): its samples drawn and scored, before its KL
  train  as the Trainer's optimizer step `step` begins"""

import os
import signal
import sys
import time
from pathlib import Path


def kill(who: str) -> None:
    if who != "self":
        os.kill(os.getppid(), signal.SIGKILL)
    if who == "launcher":
        time.sleep(60)  # what ends this rank now is its launcher's death alone (the test waits 10 s)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(moment: str, step: int, who: str) -> None:
    def at(s: int) -> None:
        if s == step:
            kill(who)

    if moment == "write":
        import transformers

        from rlhf.rl import checkpoints

        write, save_rng = checkpoints._write, transformers.Trainer._save_rng_state

        def _write(*args):  # (path, ..., state): the state is the last argument
            write(*args)
            at(args[-1]["step"])

        def _save_rng_state(self, output_dir):
            save_rng(self, output_dir)
            at(self.state.global_step)

        checkpoints._write, transformers.Trainer._save_rng_state = _write, _save_rng_state
    elif moment == "judge":
        from rlhf.rl import overopt

        measure = overopt.Judge._measure

        def _measure(self, s):
            self._kl = lambda r: at(s) or overopt.Judge._kl(self, r)
            return measure(self, s)

        overopt.Judge._measure = _measure
    elif moment == "train":
        import transformers

        train_step = transformers.Trainer.training_step

        def training_step(self, *args, **kwargs):
            at(self.state.global_step + 1)
            return train_step(self, *args, **kwargs)

        transformers.Trainer.training_step = training_step
    else:
        raise ValueError(f"RLHF_TEST_KILL: unknown moment {moment!r}")


def main() -> int:
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("RLHF_TEST_PIDS"):
        (Path(os.environ["RLHF_TEST_PIDS"]) / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if os.environ.get("RLHF_TEST_KILL") and rank == 0:
        moment, step, *who = os.environ["RLHF_TEST_KILL"].split(":")
        arm(moment, int(step), "".join(who))
    from rlhf.cli import main as rlhf_main

    return rlhf_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
