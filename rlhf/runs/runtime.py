"""What every stage shares: seeding, stopping cleanly on SIGTERM, a stage's plan (its inputs, typed, and lineage),
the run record + tracker + memory probe bundle (with resume), and the upstream runs a stage starts from. The glue to
TRL's trainers (used by SFT, RM and DPO only) is in rlhf/recipes/trainers.py."""

from __future__ import annotations

import difflib
import json
import os
import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlhf.inputs import data, models
from rlhf.infra import dist, faults, ranks
from rlhf.runs import lineage, records, tracking
from rlhf.experiment import stages
from rlhf.memory import memplan
from rlhf.memory.probe import MemoryProbe
from rlhf.experiment.config import ConfigError, Experiment


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (every device); `deterministic` also restricts torch to deterministic
    algorithms (cuBLAS needs CUBLAS_WORKSPACE_CONFIG for that, set here unless the user set it)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic)


class Interrupted(RuntimeError):
    """A stage stopped on SIGTERM/SIGINT after saving a checkpoint; rerunning the same command resumes it."""


class _Stop:
    """Set by the signal handler; the training loops poll it between steps."""

    requested = False
    signum = 0


def install_stop_handler() -> None:
    """First SIGTERM/SIGINT: ask the running stage to checkpoint and stop. A second one exits at once."""
    def handler(signum, frame):
        if _Stop.requested:
            sys.exit(128 + signum)
        _Stop.requested, _Stop.signum = True, signum
        if not dist.quiet():  # under rlhf.launch rank 0 says it for all
            print(f"\nsignal {signum}: saving a checkpoint, then stopping (rerun the same command to resume)",
                  file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    ranks.started()


def stop_requested() -> bool:
    return _Stop.requested


def stopped_status() -> int:
    """The exit status of a stage a signal stopped: 128 + the signal's number, as the shell's (130 for Ctrl-C, 143
    for SIGTERM)."""
    return 128 + (_Stop.signum or signal.SIGTERM)


@dataclass
class Inputs:
    """What a stage's prepare() loaded for its train(): each stage fills the fields it consumes, the rest stay None."""

    splits: data.Splits | None = None
    """The data source's splits (the pool, held-out rows, what was skipped)."""
    tok: object = None
    """The tokenizer of the upstream SFT run (SFT itself builds or loads its own)."""
    sft: dict | None = None
    """The upstream SFT run's summary (its base path and adapter)."""
    rm: dict | None = None
    """The upstream reward model run's summary (None: the stage scores without one)."""
    train_rows: list[dict] | None = None
    """SFT, DPO, KTO: the rows it trains on (SFT's {prompt, completion}, DPO's pairs, KTO's unpaired rows)."""
    eval_rows: list[dict] | None = None
    """SFT, DPO, KTO: the held-out rows its trainer evaluates on."""
    pairs: list[dict] | None = None
    """RM, DPO: training preference pairs."""
    judge_pairs: list[dict] | None = None
    """RM: the judge's training pairs (held out of the reward model's and DPO's)."""
    eval_pairs: list[dict] | None = None
    """RM, DPO: held-out preference pairs."""
    prompts: list[dict] | None = None
    """Online RL: training prompt rows (with their columns)."""


@dataclass
class Plan:
    """What a stage will consume, known before any model is loaded: the record's `inputs`, the example ids used,
    the upstream runs, and the resulting lineage (fingerprint). `data` carries what was loaded to the stage."""

    stage: str
    inputs: dict
    lineage: dict
    upstream: dict = field(default_factory=dict)
    data: Inputs = field(default_factory=Inputs)

    @classmethod
    def make(cls, exp: Experiment, stage: str, inputs: dict, data_ids: dict, upstream: dict | None = None,
             **loaded):
        """`loaded`: the fields of Inputs this stage fills."""
        return cls(stage, inputs, lineage.compute(exp, stage, data_ids, upstream), upstream or {}, Inputs(**loaded))


@dataclass
class Session:
    """A stage run in progress: its record directory, tracker and memory probe. `checkpoint` is the checkpoint a
    resumed run continues from (None for a fresh run)."""

    name: str
    """The experiment's name (the memory plot's title)."""
    run: records.Run
    tracker: tracking.NoOpTracker
    probe: MemoryProbe
    device: torch.device
    """Where the stage computes (models.device: the experiment's `device`, resolved on this machine)."""
    checkpoint: Path | None = None
    resumed_step: int = 0

    @classmethod
    def start(cls, exp: Experiment, stage: str | Plan, inputs: dict | None = None, resume: bool = True) -> "Session":
        """Seed, then open the run record: the newest unfinished run with the same fingerprint that has a checkpoint
        (resume=True), or a new run directory."""
        plan = stage if isinstance(stage, Plan) else None
        stage = plan.stage if plan else stage
        if stage in stages.training():
            check_trainer_names(exp, stage)
            memplan.preflight(exp, stage)  # a stage predicted over budget is refused before anything is loaded
        device = models.device(exp.device)
        dist.init(device)  # data parallel (torchrun / accelerate launch): join the process group first
        if dist.world_size() < exp.distributed.num_processes:  # each rank would hold more than its plan: refused
            raise ConfigError(f"{exp.source or 'config'}: distributed.num_processes = "
                              f"{exp.distributed.num_processes}, but this run has {dist.world_size()} process(es): "
                              f"its memory plan is per rank of {exp.distributed.num_processes}; launch them with "
                              f"`make {stage} NPROC={exp.distributed.num_processes}`")
        seed_everything(exp.seed, exp.deterministic)
        if plan:
            plan.lineage["determinism"].update(device=device.type,
                                               torch_deterministic=torch.are_deterministic_algorithms_enabled())
        if dist.is_main():
            for line in lineage.clear_killed_writes(exp, stage):
                print(line, file=sys.stderr, flush=True)
        # data parallel: rank 0 decides which run to resume (every rank then continues the same one)
        found = dist.broadcast_object(lineage.find_resumable(exp, stage, plan.lineage["fingerprint"])
                                      if plan and resume and dist.is_main() else None)
        checkpoint, step, keep = None, 0, 0
        if found:
            run_dir, checkpoint, step = found
            lineage.check_ranks(checkpoint)  # as many ranks as wrote it, before anything is loaded
            keep = resume_state(checkpoint)["metrics_lines"]
        elif plan and resume and dist.is_main():
            passed = lineage.passed_over(exp, stage, plan.lineage["fingerprint"])
            if passed:
                print(passed, file=sys.stderr, flush=True)
        run = records.Run(exp, stage, plan.inputs if plan else inputs, plan.lineage if plan else None,
                          resume=(run_dir, keep) if found else None)
        if found and dist.is_main():
            changed = f" (changed since it started: {'; '.join(run.changed)})" if run.changed else ""
            print(f"resuming {run_dir} from {checkpoint.name}{changed}", file=sys.stderr, flush=True)
        m = exp.memory
        probe = MemoryProbe(device, m.budget_gb, m.enforce, m.cap_to_budget, m.track_tensors)
        tracker = tracking.make(exp, stage, run.dir) if dist.is_main() else tracking.NoOpTracker()
        return cls(exp.name, run, tracker, probe, device, checkpoint, step)

    def log(self, step: int, metrics: dict, member: str = "") -> None:
        """A metrics line (and the tracker's). A resumed run skips the resumed model's lines below its checkpoint's
        step: they are in the record from before it (e.g. SFT's "before" eval). `member` names a second model the run
        trains from scratch after that one (the RM stage's judge, an ensemble member: no checkpoint of its own): the
        record was cut back to the checkpoint, before any of its lines, so it logs every step again."""
        if not member and step < self.resumed_step:
            return
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
        self.run.log(step, metrics)
        self.tracker.log(metrics, step)

    def save_adapter(self, model, tok, **kwargs) -> Path:
        adapter = self.run.dir / "adapter"
        if dist.is_main():  # the ranks hold the same weights: one copy
            with faults.writing(adapter, "adapter"):
                model.save_pretrained(adapter, **kwargs)
                models.save_tokenizer(tok, adapter)
        return adapter

    def finish(self, summary: dict) -> dict:
        self.probe.close()
        summary["memory"] = self.probe.summary()
        summary["world_size"] = dist.world_size()  # data-parallel ranks (the record is rank 0's)
        if self.checkpoint:
            summary["resumed_from"] = {"checkpoint": str(self.checkpoint), "step": self.resumed_step,
                                       "changed": self.run.changed}
        if self.run.lineage and dist.is_main():
            adapter = summary.get("model", {}).get("adapter")
            self.run.lineage["adapter_sha256"] = lineage.adapter_sha256(adapter) if adapter else None
        if dist.is_main():
            with faults.writing(self.run.dir / "memory.png", "plot"):
                self.probe.plot(self.run.dir / "memory.png",
                                f"{self.name} / {self.run.stage} / {self.run.dir.name}")
        tracked = self.tracker.where()
        if tracked:
            summary["tracking"] = tracked
        summary = self.run.finish(summary)
        self.tracker.summary(summary)
        self.tracker.finish()
        return summary


def resume_state(checkpoint: Path) -> dict:
    """What a checkpoint records about the run beyond the trainer's own state (metrics lines written, loss sum)."""
    if (checkpoint / "rlhf_state.json").exists():
        return json.loads((checkpoint / "rlhf_state.json").read_text())
    return {"metrics_lines": json.loads((checkpoint / "state.json").read_text())["metrics_lines"]}  # PPO's


def check_trainer_names(exp: Experiment, stage: str) -> None:
    """A TRL-backed stage's optimizer and schedule are transformers' names (its OptimizerNames, SchedulerType): one
    that is none is a config error before anything loads, not the trainer's traceback after the model did."""
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    st = stages.get(stage)
    if st.online or not st.section:
        return
    t = getattr(exp, st.section)
    for key, names in (("optim", OptimizerNames), ("lr_scheduler", SchedulerType)):
        known = [n.value for n in names]
        if getattr(t, key) not in known:
            near = difflib.get_close_matches(getattr(t, key), known, n=3)
            raise ConfigError(f"{exp.source or 'config'}: {st.section}.{key}={getattr(t, key)!r} is not a transformers "
                              f"name" + (f"; did you mean {' or '.join(map(repr, near))}?" if near else ""))


def upstream_sft(exp: Experiment, needed_by: str, held_out=()) -> tuple[Path, dict, object]:
    """The SFT run this stage starts from, its summary and tokenizer; refuses a missing or mismatched one, and one
    that trained on any of the rows `held_out` the stage is graded on (lineage.held_out_overlap)."""
    sft_dir, sft = records.latest(exp, "sft", needed_by)
    if why := lineage.held_out_overlap(sft, sft_dir, held_out, needed_by):
        raise records.StageInputError(why)
    adapter = Path(sft["model"]["adapter"])
    if not (adapter / "adapter_config.json").exists():
        raise records.StageInputError(f"{needed_by}: the SFT adapter {adapter} is missing (its run record is there, "
                                      f"the weights are not). Rerun `make sft`.")
    tok = models.load_tokenizer(str(adapter))
    records.check_same_base(exp, sft, "sft", needed_by, models.tokenizer_hash(tok), sft_dir)
    return sft_dir, sft, tok


def upstream_rm(exp: Experiment, stage: str, sft_dir: Path, sft: dict, tok) -> tuple[Path, dict]:
    """The reward model's run a policy stage scores with; refused when it sits on another base or was trained from
    another SFT adapter than the one the stage starts from."""
    rm_dir, rm = records.latest(exp, "rm", stage)
    check_rm(exp, stage, rm_dir, rm, sft_dir, sft, tok)
    return rm_dir, rm


def check_rm(exp: Experiment, stage: str, rm_dir: Path, rm: dict, sft_dir: Path, sft: dict, tok) -> None:
    """Refuse the reward model run `rm_dir` (its summary `rm`) when it sits on another base or tokenizer, or was
    trained from another SFT adapter than the SFT run `sft_dir` (`sft`) the stage starts from."""
    records.check_same_base(exp, rm, "rm", stage, models.tokenizer_hash(tok), rm_dir)
    if lineage.from_other_sft(rm, lineage.adapter_sha256(sft["model"]["adapter"])):
        raise records.StageInputError(f"{stage}: the reward model {rm_dir} was trained from another SFT adapter than "
                                      f"the latest SFT run {sft_dir}. Rerun `make rm` (or `make {stage}`).")


def preference_plan(exp: Experiment, stage: str) -> Plan:
    """The inputs of a preference stage (RM, DPO): the SFT run it starts from, the pairs it trains on (less the
    judge's: data.judge_fraction), the judge's pairs and the held-out pairs."""
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, stage, splits.eval)
    splits.render(tok)  # conversational records -> text with the SFT tokenizer's chat template
    pairs, judge = data.judge_split(splits.pairs(exp.data.pref_pairs), exp.data.judge_fraction, exp.seed)
    ids = {"train": [p["id"] for p in pairs], "eval": [p["id"] for p in splits.eval],
           **({"judge": [p["id"] for p in judge]} if judge else {})}
    inputs = {"sft_run": str(sft_dir), "data": splits.source, "train_ids": ids["train"]}
    inputs.update(data.skipped_record(splits.skipped))
    return Plan.make(exp, stage, inputs, ids, {"sft": (sft_dir, sft)}, sft=sft, tok=tok, pairs=pairs,
                     judge_pairs=judge, eval_pairs=splits.eval, splits=splits)
