"""The over-optimization guard's decisions, from the judge's measurements along a run (rlhf/rl/overopt.py measures): the
paired gain and its error, the fall test and its threshold for the run's planned number of measurements, the KL
budget, the selection of the kept policy (Guard: a run's decisions as its measurements arrive), and the flags. Plain
Python: no torch, no model.

- **The fall test** compares each new measurement with the best one so far (the peak), paired per prompt. A run of K
  measurements can compare K (K - 1) / 2 pairs (every earlier measurement may be the peak of a later one), and the
  peak is the maximum of noisy gains: a fixed threshold flags more plateaus the longer the run (at z = 3: about 5% of
  runs at 12 measurements, half at 60). The threshold is set from the planned number of measurements so that the
  chance of any false fall over the whole run stays within <stage>.overopt_alpha: the one-sided quantile of
  alpha / (K (K - 1) / 2) (Student's t, the standard error being the sample's own), a union bound over every pair
  the test can compare (fall_z). It tests two statistics of a measurement: the mean gain (against SFT's first
  measurement, drawn with the measurements' own seed: common random numbers, so SFT's part cancels in every paired
  drop), and the win rate (the share of prompts whose score beats SFT's) against SFT's `reference` draw, a second
  one with a seed no measurement uses. Against the same-seed draw the win rate's expectation would drift as the
  policy's samples decorrelate from SFT's (early samples share SFT's random numbers), with no fall in the gain: 21%
  of runs falsely flagged at 13 correlated measurements (AR(1) 0.9); against an independent draw each statistic's
  expectation holds still while the policy's quality does, and the union bound holds for both. A policy that games
  the judge on a few prompts while getting worse on most can hold its mean gain and lose its win rate: on the BPE,
  tied-embedding variant the judge's mean gain stayed within 0.06 of its peak while its win rate fell from 0.82 to
  0.60 and the ground truth from 0.68 to 0.11. alpha is split between the two statistics.
  studies/fall_simulation.py measures the rates it gives at 13, 21 and 61 measurements.
- **The confirmation**: a fall the test sees counts (flags and stops a run) only when fresh prompts confirm it
  (`confirm`: the peak's and the current policy sample fresh training prompts of their own, after the judge's and the
  playoff's, and the fall is tested once more, one-sided at the playoff's alpha). It can only remove stops: the false
  ones fall from the test's few percent to about alpha times that (the simulation: 0.0-0.2% of runs against
  0.8-3.6%), at little cost to detection, since a real fall shows on fresh prompts too. A fall they do not confirm is
  reported and the run goes on. The judge is a proxy, and fresh prompts confirm its own small declines too, so the
  drop must exceed a margin: fall_margin of what the peak gained over SFT (`gained`, `margin`).
"""

from __future__ import annotations

import math
from statistics import NormalDist

Z95 = 1.959964
"""The normal quantile of a two-sided 95% interval."""


def won_tied_lost(w: dict) -> str | None:
    """A win rate's outcomes said (`w`: its n, wins and ties, as checks.win_rate records them): "12 won, 3 tied, 9
    lost" (a tie counts a half: 0.35 from 1 won and 15 tied of 24 is no loss); None where they were not recorded."""
    n, wins, ties = w.get("n"), w.get("wins"), w.get("ties")
    if not all(isinstance(x, int) for x in (n, wins, ties)):
        return None
    return f"{wins} won, {ties} tied, {n - wins - ties} lost"


def kl_window(m: dict) -> str:
    """The iterations a summary's train_kl_ref_last5 (what kl_band is judged on at the end) is the mean of, said: the
    last five, or fewer in a shorter run (train_kl_ref_window; a summary from before it was recorded: five)."""
    n = m.get("train_kl_ref_window", 5)
    return "its one iteration" if n == 1 else f"the last {n} iterations"


def wilson(k: float, n: float) -> list[float]:
    """Wilson's 95% interval of a rate of k in n (sound at 0 and n, where the normal approximation's is empty)."""
    if n == 0:
        return [0.0, 1.0]
    p, z2 = k / n, Z95 * Z95
    centre, half = p + z2 / (2 * n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return [max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))]


def batch_mean_n(rows: int, batch: int, ranks: int = 1) -> float:
    """The effective n of a rate a trainer reports as the mean of its batches' rates (TRL's DPO evaluation): `rows`
    rows in global batches of `batch`, each batch weighing the same. The mean is sum_i w_i x_i over the rows, its
    variance p(1 - p) sum_i w_i^2, so n_eff = 1 / sum_i w_i^2. On one process the last batch is short: k batches of
    b_i rows give n_eff = k^2 / sum(1 / b_i) (`rows` when `batch` divides them, fewer otherwise: the short batch weighs
    as a whole one). On `ranks` > 1 accelerate fills the last batch with rows from the start (even batches) and TRL
    gathers them all (`gather`), so those rows weigh twice."""
    k = -(-rows // batch)
    if ranks > 1:  # every batch whole, row j at position j, j + rows, ... (k x batch positions in all)
        times = [len(range(j, k * batch, rows)) for j in range(rows)]
        return (k * batch) ** 2 / sum(t * t for t in times) if rows else 0
    sizes = [batch] * (rows // batch) + ([rows % batch] if rows % batch else [])
    return k * k / sum(1 / b for b in sizes) if sizes else 0


def batch_mean_wilson(rate: float, rows: int, batch: int, ranks: int = 1) -> list[float]:
    """Wilson's 95% interval of a rate a trainer reports as the mean of its batches' rates, at the mean's effective n
    (batch_mean_n)."""
    n_eff = batch_mean_n(rows, batch, ranks)
    return wilson(rate * n_eff, n_eff)


def margin_accuracy(margins: list[float]) -> dict:
    """How often margins chosen - rejected of preference pairs are positive (a tie counts as an error), with n and
    Wilson's 95% interval: {"accuracy", "n", "ci95"}."""
    right = sum(m > 0 for m in margins)
    return {"accuracy": right / len(margins), "n": len(margins), "ci95": wilson(right, len(margins))}


def paired(a: list[float], b: list[float]) -> dict:
    """The mean of a - b over paired items (the same prompts), with its standard error and 95% interval (mean_se)."""
    return mean_se([x - y for x, y in zip(a, b, strict=True)])


def mean_se(d: list[float]) -> dict:
    """The mean of independent items, its standard error (sample sd / sqrt(n); 0 for fewer than two items) and 95%
    interval: {"mean", "se", "ci95", "n"} (none: a mean of 0)."""
    n = len(d)
    mean = sum(d) / n if n else 0.0
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    return {"mean": mean, "se": se, "ci95": [mean - Z95 * se, mean + Z95 * se], "n": n}


def correlation(a: list[float], b: list[float]) -> float | None:
    """Pearson's r of two equally long series (None: fewer than three points, or a constant one)."""
    n = len(a)
    if n < 3:
        return None
    ma, mb = sum(a) / n, sum(b) / n
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / math.sqrt(va * vb)


def planned_measurements(steps: int, every: int) -> int:
    """How many times the judge measures a run of `steps` iterations: every `every` iterations from the first (before
    the iteration's update), and once more after the last update (the final policy)."""
    return len(range(1, steps + 1, every)) + 1 if every else 0


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at p with df degrees of freedom, from the normal one by the Cornish-Fisher expansion
    (three terms: within 1e-3 of the exact one for df >= 30 out to 5 standard errors)."""
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def fall_z(measurements: int, alpha: float, prompts: int) -> float:
    """The fall test's threshold in paired standard errors for a run of `measurements` on `prompts` prompts each:
    the one-sided quantile of alpha spread over the measurements' pairs and the STATISTICS tested (a union bound: a
    false fall anywhere in the run has probability at most alpha while each statistic's expectation holds still,
    which the win rate's does against SFT's independent `reference` draw; studies/fall_simulation.py measures each
    statistic's rate at 13, 21 and 61 measurements, independent and correlated), Student's t with prompts - 1 degrees
    of freedom (the standard error is the sample's own)."""
    pairs = max(measurements * (measurements - 1) // 2, 1) * len(STATISTICS)
    return t_quantile(1 - alpha / pairs, max(prompts - 1, 1))


def threshold(section, prompts: int) -> float:
    """An online section's fall threshold: its overopt_z, or (0, the default) fall_z for the run it plans (steps,
    judge_every) at its overopt_alpha, on `prompts` judge prompts."""
    planned = planned_measurements(section.steps, section.judge_every)
    return section.overopt_z or fall_z(planned, section.overopt_alpha, prompts)


def one_se(points: list[dict]) -> dict:
    """The one-standard-error rule over measurements ({"iteration", "gain", "gain_se"}, in order): the earliest whose
    gain is within one standard error of the best gain (the best's own)."""
    best = max(points, key=lambda p: p["gain"])
    return next(p for p in points if p["gain"] >= best["gain"] - best["gain_se"])


def t_of(d: dict) -> float:
    """Student's t of a paired difference `d` (paired's: mean over se); with no spread (se 0) infinite in the mean's
    direction (0 for no difference)."""
    return d["mean"] / d["se"] if d["se"] > 0 else (math.inf if d["mean"] > 0 else -math.inf if d["mean"] < 0 else 0.0)


def one_sided(d: dict, alpha: float) -> tuple[float, float]:
    """(t, threshold) of a paired difference `d` (paired's) tested one-sided at `alpha` with Student's t (t_of) on
    n - 1 degrees of freedom."""
    return t_of(d), t_quantile(1 - alpha, max(d["n"] - 1, 1))


def margin(share: float, gain: float) -> float:
    """A test's margin: `share` of a policy's measured gain over SFT (the playoff's: playoff_margin of the guard's
    choice's; a fall's confirmation: fall_margin of the peak's), none when that gain is not positive."""
    return share * max(gain, 0.0)


def beyond_margin(d: dict, alpha: float, margin: float) -> tuple[float, float]:
    """(t, threshold) of a paired difference `d` (paired's) less `margin`, one-sided at `alpha` (the playoff's test,
    and a fall's confirmation's)."""
    return one_sided({**d, "mean": d["mean"] - margin}, alpha)


def playoff(incumbent: list[float], challenger: list[float], alpha: float, margin: float = 0.0) -> dict:
    """The final playoff's decision (overopt.Judge.keep_selected): the challenger's paired gain over the incumbent on
    the same fresh prompts (judge scores per prompt), less `margin` (playoff_margin's), tested one-sided at `alpha`
    (beyond_margin): the challenger wins when it is better by more than the margin, significantly; {"gain", "margin",
    "se", "t", "threshold", "prompts", "won"}. A gain above the margin on every prompt alike (se 0) wins."""
    d = paired(challenger, incumbent)
    t, threshold = beyond_margin(d, alpha, margin)
    return {"gain": d["mean"], "margin": margin, "se": d["se"], "t": t, "threshold": threshold, "prompts": d["n"],
            "won": t > threshold}


def confirm(peak: list[float], current: list[float], statistic: str, alpha: float, margin: float = 0.0) -> dict:
    """A fall seen on the judge's prompts, tested once more on fresh ones (Guard.confirm): `peak` and `current`, the
    judge's per-prompt scores of the peak's and the current policy on the same fresh prompts with the same seed. The
    two policies are compared head to head by the kind of statistic that fell: "gain", the paired drop peak -
    current; "win rate", how often the peak beats the current policy per prompt (1, a tie 0.5, else 0) above one half
    (a policy worse on most prompts, whatever its mean). The drop less `margin` (in the statistic's units: fall_margin
    of what the peak gained over SFT, Guard.confirm) is tested one-sided at `alpha` (beyond_margin): a fall counts
    when it is bigger than the margin, significantly. {"statistic", "drop", "margin", "se", "t", "threshold",
    "prompts", "confirmed"}. A drop above the margin on every prompt alike (se 0) is confirmed."""
    per_prompt = (wins(peak, current) if statistic == "win rate"
                  else [a - b for a, b in zip(peak, current, strict=True)])
    d = paired(per_prompt, [0.5 if statistic == "win rate" else 0.0] * len(per_prompt))
    t, threshold = beyond_margin(d, alpha, margin)
    return {"statistic": statistic, "drop": d["mean"], "margin": margin, "se": d["se"], "t": t,
            "threshold": threshold, "prompts": d["n"], "confirmed": t > threshold}


def gained(point: dict, statistic: str, sft: list[float]) -> float:
    """What a measurement gained over SFT by one of the STATISTICS: its mean gain, or its win rate against `sft`
    (SFT's reference draw) less one half; a fall's margin is a share of its peak's (Guard.confirm)."""
    if statistic == "gain":
        return point["gain"]
    return sum(wins(point["scores"], sft)) / len(sft) - 0.5


def wins(scores: list[float], sft: list[float]) -> list[float]:
    """Per prompt, whether a measurement's score beats SFT's on the same prompt: 1, 0.5 for a tie, else 0."""
    return [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(scores, sft, strict=True)]


STATISTICS = {"gain": lambda scores, reference: scores, "win rate": wins}
"""The fall test's statistics, per prompt from a measurement's judge scores and SFT's reference draw: the score (its
mean less SFT's is the gain; the reference cancels in a paired drop) and the win against the reference (its mean is
the win rate against SFT)."""


def peak_of(points: list[dict], per_prompt, sft: list[float]) -> dict:
    """The measurement of `points` where a statistic of the STATISTICS (`per_prompt`, against `sft`) is highest: the
    peak a fall is measured from."""
    return max(points, key=lambda p: sum(per_prompt(p["scores"], sft)))


def fall(points: list[dict], scores: list[float], z: float, reference: list[float] | None = None) -> dict | None:
    """Whether `scores` (a new measurement's per-prompt judge scores) fall significantly below the peak of `points`
    (the earlier measurements, SFT's first, each with its "scores" on the same prompts), by either of the STATISTICS
    (the win rate against `reference`, SFT's independent draw on the same prompts; None: SFT's first measurement, as
    the records made before that draw were tested): the paired drop from the measurement where that statistic was
    best exceeds z standard errors, or is positive with no spread at all (every prompt lower by the same amount: se
    0, z infinite). {"statistic", "peak": the peak's iteration, "drop": mean, "se", "z"} (the first statistic that
    fell) or None."""
    if not points:
        return None
    sft = points[0]["scores"] if reference is None else reference
    for name, per_prompt in STATISTICS.items():
        peak = peak_of(points, per_prompt, sft)
        d = paired(per_prompt(peak["scores"], sft), per_prompt(scores, sft))
        if d["mean"] > 0 and d["mean"] > z * d["se"]:
            return {"statistic": name, "peak": peak["iteration"], "drop": d["mean"], "se": d["se"],
                    "z": d["mean"] / d["se"] if d["se"] else math.inf}
    return None


class Guard:
    """The guard's decisions along one run, from the judge's measurements (rlhf/rl/overopt.py measures): the fall test
    of each measurement against the peak so far, the KL budget read every iteration, which measured policies the
    selection may still choose (`held`: their copies are kept), the early stop and the kept policy. Plain values: the
    judge adds each measurement ({"iteration", "gain", "gain_se", "proxy", "scores", "kl", ...}) and each iteration's
    KL; the tests and the studies' replays of recorded runs do the same by hand."""

    def __init__(self, every: int, budget: float, z: float, keep: bool = True, stop: bool = True,
                 rollout_kl: bool = True, confirm_alpha: float = 0.0, fall_margin: float = 0.0):
        self.every, self.budget, self.z, self.keep, self.stop, self.rollout_kl = every, budget, z, keep, stop, rollout_kl
        self.confirm_alpha = confirm_alpha
        """A fall's confirmation level on fresh prompts (the playoff's: playoff_alpha; 0: a fall stands as seen). With
        it, each statistic's peak so far keeps its copy too (`copies`): the policy a fall is tested against."""
        self.fall_margin = fall_margin
        """The share of what the peak gained over SFT that a fall must exceed on fresh prompts (fall_margin)."""
        self.reference: list[float] | None = None
        """SFT's second draw of the judge's prompts (a seed no measurement uses), the judge's scores per prompt: what
        the win rate is measured against (fall). The judge sets it before its first measurement."""
        self.points: list[dict] = []
        """Each measurement: {"iteration", "judge", "proxy", "gain", "gain_se", "win", "win_ci95", "scores" (the judge's
        per prompt, over every rank), "kl" (overopt/kl), "kl_ref"}; the first is the SFT policy's (gain 0), the last
        (the judge's measure_final) the final policy's, as iteration (updates + 1)."""
        self.fell: dict | None = None
        """The judge's first significant fall from its peak (fall), with the iteration and the proxy's rise; with
        confirm_alpha, the first one fresh prompts confirmed ("fresh": the test's figures)."""
        self.pending: dict | None = None
        """A fall the last measurement saw, waiting for its test on fresh prompts (confirm); None: none."""
        self.unconfirmed: list[dict] = []
        """The falls fresh prompts did not confirm (the run went on): each with its test's figures."""
        self.kls: list[float] = []
        """The KL of the last `every` iterations (kl/ref; without a KL in the rollout, the judge's measurements of it)."""
        self.left: dict | None = None
        """Where the run first left the KL budget: their mean above kl_band's high end."""
        self.held: set[int] = set()
        """keep: the iterations of the measured policies the selection may still choose (their copies are kept)."""

    def add(self, point: dict) -> None:
        """A measurement joins the run's: the fall test against the peak so far (the first fall is kept, with the
        proxy's rise since the peak), then the point; with keep, its policy is held. With confirm_alpha, a fall from
        a peak whose copy is kept waits (`pending`) for its test on fresh prompts (confirm); else it stands as seen,
        saying why ("fresh")."""
        fell = fall(self.points, point["scores"], self.z, self.reference)
        if fell and self.fell is None:
            peak = next(p for p in self.points if p["iteration"] == fell["peak"])
            seen = {"iteration": point["iteration"], **fell, "proxy_rise": point["proxy"] - peak["proxy"],
                    "gained": gained(peak, fell["statistic"], self.sft)}
            if self.confirm_alpha and peak["iteration"] in self.copies:
                self.pending = seen
            else:
                why = "no confirmation (no playoff: too few fresh prompts or playoff_alpha 0)" if not \
                    self.confirm_alpha else "the peak's copy was not kept"
                self.fell = {**seen, "fresh": {"skipped": why}}
        self.points.append(point)
        if self.keep:
            self.held.add(point["iteration"])

    def confirm(self, peak: list[float], current: list[float]) -> dict:
        """The pending fall tested on fresh prompts (guard.confirm at confirm_alpha, on the statistic that fell, with
        fall_margin of what the peak gained by it on the judge's prompts, "gained", as the margin): `peak` and
        `current`, the judge's scores of the two policies there. Confirmed, it is the run's fall (and overopt_stop
        stops the run); else it joins `unconfirmed` and the run goes on. Returns the test."""
        seen, self.pending = self.pending, None
        test = confirm(peak, current, seen["statistic"], self.confirm_alpha, margin(self.fall_margin, seen["gained"]))
        if test["confirmed"]:
            self.fell = {**seen, "fresh": test}
        else:
            self.unconfirmed.append({**seen, "fresh": test})
        return test

    def peaks(self) -> set[int]:
        """The iterations where each of the STATISTICS is best so far (fall's peaks)."""
        if not self.points:
            return set()
        return {peak_of(self.points, f, self.sft)["iteration"] for f in STATISTICS.values()}

    @property
    def sft(self) -> list[float]:
        """What the statistics are measured against (fall's): SFT's reference draw, or (none yet: records made before
        it) SFT's first measurement."""
        return self.points[0]["scores"] if self.reference is None else self.reference

    @property
    def copies(self) -> set[int]:
        """The measured policies whose copies the judge keeps: those the selection may still choose (`held`) and, with
        confirm_alpha, each statistic's peak (a later fall is tested against it)."""
        return self.held | (self.peaks() if self.confirm_alpha and self.keep else set())

    def read_kl(self, step: int, kl: float | None) -> None:
        """The iteration's KL to the reference (kl/ref of its rollout, sampled by the policy measured before the
        update; without a KL in the rollout (rollout_kl False), the judge's own measurement of it, at its
        iterations): the run leaves the KL budget when the mean over the last `every` iterations (without: the last
        measurement) exceeds it (`left`); it joins the iteration's measurement, if any, and then the policies the
        selection can no longer choose are let go (prune)."""
        measured = bool(self.points) and self.points[-1]["iteration"] == step
        if not self.rollout_kl:
            kl = self.points[-1]["kl"] if measured else None
        if kl is not None:
            window = self.every if self.rollout_kl else 1
            self.kls = (self.kls + [kl])[-window:]
            mean = sum(self.kls) / len(self.kls)
            if self.left is None and len(self.kls) == window and mean > self.budget:
                self.left = {"iteration": step, "kl_ref": mean, "window": window, "budget": self.budget,
                             **({} if self.rollout_kl else {"measured_by": "judge"})}
        if not measured:
            return
        self.points[-1]["kl_ref"] = 0.0 if step == 1 else (kl or 0.0)  # iteration 1: the SFT policy itself
        self.prune()

    def prune(self) -> None:
        """Let go of the policies the selection can no longer choose: all but the latest that are outside the KL
        budget, or with a gain below the best eligible gain less two of its standard errors (a margin over the one-SE
        rule's one: a later best with a larger error can lower the threshold)."""
        if not self.keep:
            return
        eligible = self.eligible()
        best = max(eligible, key=lambda p: p["gain"])
        keep = {p["iteration"] for p in eligible if p["gain"] >= best["gain"] - 2 * best["gain_se"]}
        keep.add(self.points[-1]["iteration"])  # the latest: the last policy, while no fall or budget exit
        self.held &= keep

    def eligible(self) -> list[dict]:
        """The measured policies within the KL budget (kl_band's high end: the KL the reward model is trusted to back;
        the judge, a reward model too, is not trusted far beyond it), the SFT policy always; not the policy after an
        early stop's update (the guard stopped the run before it)."""
        return [p for p in self.points if ((p.get("kl_ref") or 0.0) <= self.budget and not p.get("stopped"))
                or p["iteration"] == 1]

    @property
    def should_stop(self) -> bool:
        """overopt_stop: the judge has fallen significantly from its peak, or the run has left its KL budget (no later
        policy could be kept)."""
        return self.stop and (self.fell is not None or self.left is not None)

    def select(self) -> dict:
        """The measured policy keep=judge keeps (rlhf/rl/overopt.py's rule): the last one when the run neither fell nor
        left its KL budget (it is then eligible), else the one-standard-error rule within the budget."""
        eligible = self.eligible()
        if not (self.fell or self.left) and eligible[-1] is self.points[-1]:
            return self.points[-1]
        chosen = one_se(eligible)
        if chosen["iteration"] not in self.held:  # let go by a best whose error grew: the earliest still held
            chosen = next(p for p in self.points if p["iteration"] in self.held)
        return chosen

    def challenger(self, chosen: dict) -> dict | None:
        """The policy the final playoff sets against the guard's `chosen` one (select's): the best measured gain
        within the KL budget when the guard chose the last policy (the decline the fall test missed), else the latest
        policy within the budget (a fall the fresh playoff prompts may not bear out); among the policies still
        held, never an early stop's last policy. None: no other candidate."""
        held = [p for p in self.eligible() if p["iteration"] in self.held]
        if not held:
            return None
        other = max(held, key=lambda p: p["gain"]) if chosen is self.points[-1] else held[-1]
        return None if other is chosen else other

    def rule(self, chosen: dict) -> str:
        """Which rule chose `chosen` (select's); a fall fresh prompts did not confirm is no fall."""
        return ("the last policy: no fall, within kl_band" if chosen is self.points[-1] and not (self.fell or self.left)
                else "one standard error, within kl_band")

    def state(self) -> dict:
        """The decisions' state for a checkpoint (JSON)."""
        return {"judge_reference": self.reference, "judge_points": self.points, "judge_fell": self.fell,
                "judge_kls": self.kls, "judge_left": self.left, "judge_unconfirmed": self.unconfirmed,
                "judge_held": sorted(self.held)}

    def restore(self, state: dict, held: set[int]) -> None:
        """The decisions as a checkpoint recorded them, with the policies whose copies it holds."""
        self.points, self.fell = state.get("judge_points") or [], state.get("judge_fell")
        # a checkpoint from before the reference draw: its runs' win rate was SFT's first measurement's
        self.reference = state.get("judge_reference") or (self.points[0]["scores"] if self.points else None)
        self.kls, self.left = state.get("judge_kls") or [], state.get("judge_left")
        self.unconfirmed = state.get("judge_unconfirmed") or []
        # the selection's policies as recorded (the copies also hold the peaks); older checkpoints: every copy
        self.held = set(held) & set(state["judge_held"]) if "judge_held" in state else set(held)


def set_aside_for_kl(stage: str, kept: dict | None, end: dict, budget: float, flagged: bool) -> str | None:
    """A note when the keep rule set the last measured policy (`end`) aside for its own KL above the budget while no
    flag says why (`flagged`: the run left its budget or the judge fell): the budget's test reads kl/ref averaged
    over judge_every iterations, which can stay within it while the last measurement alone is past it. None else."""
    if not kept or kept["last"] or flagged or (end.get("kl_ref") or 0.0) <= budget:
        return None
    sft = " (the SFT policy)" if kept["iteration"] == 1 else ""
    return (f"{stage}: the last policy's KL to the reference, {end['kl_ref']:.2f} nats as measured, is above "
            f"{stage}.kl_band's high end ({budget:g}), so the guard kept the latest policy within it, after "
            f"{kept['iteration'] - 1} updates{sft}; kl/ref sums over each response's tokens: raise {stage}.kl_band's "
            f"high end to trust the reward model further")


def flags(stage: str, fell: dict | None, check: dict, left: dict | None = None, keeps: bool = True) -> list[str]:
    """The over-optimization warnings of a finished run (rlhf/rl/overopt.py's rules): `fell`, the judge's first
    significant fall with the proxy's rise since the peak ({"iteration", "peak", "drop", "se", "z", "proxy_rise"});
    `check`, the held-out check of the saved policy; `left`, where the run left its KL budget ({"iteration",
    "kl_ref", "window", "budget"}); `keeps`: the guard chooses the saved policy (keep judge/auto), else the last one
    is saved whatever its KL (keep last)."""
    out = []
    if left:
        kl = (f"the KL of the judge's samples was {left['kl_ref']:.2f} at iteration {left['iteration']} (no KL in the "
              f"rollout: {stage}.beta = 0)" if left.get("measured_by") == "judge" else
              f"kl/ref averaged {left['kl_ref']:.2f} over the {left['window']} iterations to {left['iteration']}")
        saved = ("the kept policy is chosen within it" if keeps else
                 f"the last policy is saved all the same ({stage}.keep = last)")
        out.append(f"{stage}: the policy left its KL budget: {kl}, above {stage}.kl_band's high end "
                   f"({left['budget']:g}); past it the reward model, and the judge with it, are not trusted, and "
                   f"{saved} (kl/ref sums over each response's tokens: a budget set for short responses is tight for "
                   f"long ones)")
    if fell:
        why = (f"while the reward model's score rose {fell['proxy_rise']:.3f} (each on its held-out scale): reward "
               f"over-optimization" if fell["proxy_rise"] > 0 else
               f"and the reward model's score did not rise ({fell['proxy_rise']:+.3f}): the update itself went wrong")
        what = "win rate against SFT" if fell.get("statistic") == "win rate" else "mean gain"
        size = (f"{fell['z']:.1f} standard errors, paired per prompt" if fell["se"] else
                "the same on every prompt")
        c = fell.get("fresh") or {}
        if "t" in c:
            size += (f"; confirmed on {c['prompts']} fresh prompts: a drop of {c['drop']:.3f}"
                     + (f", beyond a margin of {c['margin']:.3f}" if c.get("margin") else "")
                     + f", t {c['t']:.2f} against {c['threshold']:.2f}")
        out.append(f"{stage}: at iteration {fell['iteration']} the judge's {what} had fallen {fell['drop']:.3f} below "
                   f"its peak at iteration {fell['peak']} ({size}) {why}")
    wj = check.get("eval_win_rates", {}).get("judge")
    if wj and wj["ci95"][1] < 0.5:
        out.append(f"{stage}: the saved policy loses to SFT by the judge on held-out prompts: win rate "
                   f"{wj['win_rate']:.3f} [{wj['ci95'][0]:.3f}, {wj['ci95'][1]:.3f}], n={check.get('eval_prompts')}")
    return out


def chance_rm(stage: str, accuracy: float, n: int) -> str | None:
    """The warning for a reward model not shown to rank better than chance: the Wilson 95% interval of its held-out
    pair `accuracy` over `n` pairs reaches 50% (or lies wholly below it: worse than chance, the pairs swapped?). As the
    RM stage and the stages it rewards or grades print it; None for one that ranks better (a caveat, never a flag: it
    judges the reward, not a policy)."""
    right = round(accuracy * n)
    low, high = wilson(right, n)
    if not n or low > 0.5:
        return None
    if high < 0.5:  # its ends to a tenth of a percent: [31%, 50%] would read as reaching chance
        return (f"{stage}: the reward model ranks {right / n:.0%} [{low:.1%}, {high:.1%}] of its {n} held-out pairs: "
                f"worse than chance, so a stage trained against it learns the opposite of the pairs' preference: check "
                f"that chosen and rejected are not swapped in the data (or data.columns)")
    return (f"{stage}: the reward model ranks {right / n:.0%} [{low:.0%}, {high:.0%}] of its {n} held-out pairs: not "
            f"shown better than chance, so a stage trained against it follows noise (more pairs or epochs, or another "
            f"rm.learning_rate, would help it learn)")


def rm_at_chance(stage: str, rm: dict) -> str | None:
    """chance_rm for a reward model run's summary (metrics.eval_accuracy over its data.eval held-out pairs)."""
    return chance_rm(stage, rm["metrics"]["eval_accuracy"], rm["data"]["eval"])


def weak_judge(stage: str, ind: dict) -> str:
    """The warning for a weak judge (rm.judge_independence's `weak`), as the RM stage and the online stages print it:
    a caveat on the judge, not evidence about a policy, so never a flag."""
    return (f"{stage}: the judge is weak: it is wrong on {ind['judge_error_rate_on_rm_errors']:.0%} "
            f"[{ind['ci95'][0]:.0%}, {ind['ci95'][1]:.0%}] of the {ind['rm_errors']} held-out pairs the reward model "
            f"gets wrong (overall {ind['judge_error_rate']:.0%}): it shares the reward model's errors, so an absent "
            f"over-optimization flag is weak evidence that nothing went wrong")
