"""The online stages' shared pieces without a trained pipeline (issue 28): the reward they log before any KL
penalty and the penalty on its own, the one exact KL, and one optimizer whatever `optim` says."""

import contextlib
import math
import types

import pytest
import torch

from rlhf.infra import dist
from rlhf.maths import guard
from rlhf.rl import checks, generation, online, trajectory
from rlhf.experiment import config
from rlhf.recipes import grpo
from rlhf.inputs import models
from rlhf.rl.roles import Roles

from .conftest import TINY, tiny_llama


# ---------------------------------------------------------------------------------- item 4: reward before the KL
def test_rloo_logs_its_reward_before_the_kl_penalty_and_the_penalty_on_its_own():
    g = config.Experiment().rloo  # kl_penalty=reward, as TRL's RLOOTrainer
    g.beta = 0.5
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    st = trajectory.Trajectory(
        logp=torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -1.0, -1.0], [-2.0, -9.0, -9.0], [-1.0, -1.0, -9.0]]),
        ref_logp=torch.tensor([[-1.5, -1.5, 0.0], [-1.0, -2.0, -1.0], [-2.0, 0.0, 0.0], [-1.0, -1.0, 0.0]]))
    penalty = grpo.kl_reward_penalty(g, st, mask)  # beta x the summed log-ratio over each response's tokens
    assert penalty.tolist() == pytest.approx([0.5 * 1.0, 0.5 * 1.0, 0.0, 0.0])
    reward = torch.tensor([1.0, 1.0, 0.0, 2.0])  # group 0 got one score twice: no signal, whatever its KL
    m = trajectory.reward_metrics(reward, penalty, group=2)
    assert m["reward/mean"] == pytest.approx(1.0) and m["reward/kl_penalty"] == pytest.approx(0.25)
    assert m["reward/std"] == pytest.approx(torch.tensor([1.0, 1.0, 0.0, 2.0]).std().item())
    assert m["groups/zero_std_frac"] == 0.5  # before the penalty (after it, group 0 would look informative)
    assert m["reward/group_std"] == pytest.approx((0.0 + math.sqrt(2.0)) / 2)
    grpo_section = config.Experiment().grpo  # kl_penalty=loss: nothing is subtracted from the reward
    assert grpo.kl_reward_penalty(grpo_section, st, mask).tolist() == [0.0] * 4


# --------------------------------------------------------------------------------------------- item 5: one KL
class Pair(torch.nn.Module):
    """Two models as one, `use(name)` picking which answers: the policy and its reference."""

    def __init__(self, policy, ref):
        super().__init__()
        self.models = torch.nn.ModuleDict({"policy": policy, "ref": ref})
        self.active = "policy"

    def use(self, name):
        self.active = name

    def forward(self, **kw):
        return self.models[self.active](**kw)


def _pair_and_rollout(prompt: str, n: int, new_tokens: int, temperature: float):
    """A random tiny policy, a reference a little away from it, and the policy's samples of `prompt`."""
    tok = models.build_tokenizer(["\n\nHuman: a b c d e f g\n\nAssistant: a b"])
    policy, ref = tiny_llama(tok), tiny_llama(tok)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.manual_seed(0)
    r = generation.generate(policy, tok, [prompt] * n, max_new_tokens=new_tokens, temperature=temperature, top_p=1.0,
                            max_prompt_length=16)
    return policy, ref, Pair(policy, ref), r


def test_kl_to_reference_is_the_exact_sequence_kl_at_the_given_temperature():
    policy, ref, pair, r = _pair_and_rollout("\n\nHuman: a b\n\nAssistant:", 4, 5, 0.7)
    kl = checks.kl_to_reference(pair, r, pair.use, lambda: checks.using(pair.use, "ref"), 0.7, batch_size=3)
    # by hand: sum over the vocabulary of p (log p - log q) at temperature 0.7, per response position, summed and
    # averaged over the responses
    with torch.no_grad():
        lp = generation.response_log_softmax(policy, r, 0.7)[0].double()
        lq = generation.response_log_softmax(ref, r, 0.7)[0].double()
    each = ((lp.exp() * (lp - lq)).sum(-1) * r.mask).sum(1)
    want = each.mean().item()
    assert kl == pytest.approx(want, rel=1e-4) and kl > 0
    # the held-out check's standard error (eval_kl_ref_se): each response's KL, their sample sd / sqrt(n)
    kls = checks.response_kls(pair, r, pair.use, lambda: checks.using(pair.use, "ref"), 0.7, batch_size=3)
    assert kls == pytest.approx(each.tolist(), rel=1e-4)
    assert guard.mean_se(kls)["se"] == pytest.approx(each.std().item() / 2, rel=1e-4) and each.std() > 0
    assert checks.kl_to_reference(pair, r, pair.use, contextlib.nullcontext, 0.7) == 0.0  # the policy itself
    # the held-out check reports it under its own name, with the reference it is to; the flags read it
    flags = checks.collapse_flags("dpo", {"eval_kl_ref": 9.5, "eval_kl_reference": "base"}, 8.0, 0.0)
    assert len(flags) == 1 and "9.50 nats" in flags[0] and "dpo.max_kl_ref=8" in flags[0] and "(base)" in flags[0]
    assert checks.collapse_flags("dpo", {"eval_kl_to_sft": 9.5}, 8.0, 0.0) == []  # the old key is gone


def test_roles_reference_pass_returns_the_exact_per_token_kl():
    policy, ref, pair, r = _pair_and_rollout("\n\nHuman: a\n\nAssistant:", 3, 4, 1.0)
    roles = types.SimpleNamespace(model=pair, reference="sft",
                                  active=lambda name: checks.using(pair.use, name or "policy"))
    with torch.no_grad():
        lp = generation.response_log_softmax(pair, r, 1.0)[0]
    ref_logp, kl = Roles.ref_logprobs(roles, r, 1.0, lp)
    with torch.no_grad():
        lq = generation.response_log_softmax(ref, r, 1.0)[0]
    torch.testing.assert_close(kl, (lp.exp() * (lp - lq)).sum(-1).clamp(min=0) * r.mask)
    torch.testing.assert_close(ref_logp, generation.response_logprobs(ref, r, 1.0)[0])
    assert (kl >= 0).all()


# ---------------------------------------------------------------------------------------- item 6: one optimizer
def test_both_online_optimizers_get_the_configured_settings(monkeypatch):
    import bitsandbytes as bnb

    seen = {}

    class Fake(torch.optim.SGD):
        def __init__(self, params, **kw):
            seen.update(kw)
            super().__init__(params, lr=kw["lr"])

    monkeypatch.setattr(bnb.optim, "PagedAdamW8bit", Fake)
    params = [torch.nn.Parameter(torch.zeros(3))]
    p = config.Experiment().ppo
    want = {"lr": p.learning_rate, "betas": (0.9, 0.999), "eps": 1e-5, "weight_decay": 0.0}  # adamw_torch's until now
    group = online.make_optimizer(params, p).param_groups[0]
    assert {k: group[k] for k in want} == want
    p.optim = "paged_adamw_8bit"
    online.make_optimizer(params, p)
    assert seen == want  # not bitsandbytes' own weight_decay 0.01 and eps 1e-8
    p.weight_decay, p.adam_beta1, p.adam_beta2, p.adam_epsilon = 0.1, 0.8, 0.99, 1e-6
    online.make_optimizer(params, p)
    p.optim = "adamw_torch"
    group = online.make_optimizer(params, p).param_groups[0]
    assert seen == {k: group[k] for k in seen} == {"lr": p.learning_rate, "betas": (0.8, 0.99), "eps": 1e-6,
                                                   "weight_decay": 0.1}


def test_trl_stages_get_the_optimizer_settings(tmp_path):
    from transformers import TrainingArguments

    from rlhf.recipes import trainers

    exp = config.load("experiments/tiny.yaml", ["device=cpu", "sft.adam_beta2=0.95", "sft.adam_epsilon=1e-6",
                                                "sft.weight_decay=0.01", "sft.optim=paged_adamw_8bit"])
    session = types.SimpleNamespace(run=types.SimpleNamespace(dir=tmp_path, stage="sft"))
    args = trainers.training_args(TrainingArguments, trainers.settings(exp), exp.sft, session)
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (0.9, 0.95, 1e-6, 0.01)
    assert args.optim == "paged_adamw_8bit"


def test_an_online_plan_refuses_bad_settings_before_it_loads_anything(monkeypatch):
    """online_plan.resolve checks the per-rank batch against the group and keep=judge against the config before the
    stage's inputs are prepared (nothing is loaded)."""
    from rlhf.rl import online_plan

    def prepare():
        raise AssertionError("prepared")

    exp = config.load(TINY, ["grpo.keep=judge", "data.judge_fraction=0", "reward.model=0",
                             "reward.functions={rlhf.inputs.data:letters_reward: 1}"])
    with pytest.raises(config.ConfigError, match=r"grpo.keep=judge needs the judge"):
        online_plan.resolve(exp, "grpo", exp.grpo, prepare, group=exp.grpo.num_generations)
    exp = config.load(TINY)
    with pytest.raises(config.ConfigError, match=r"grpo.rollout_batch / processes \(\d+\) must be a multiple"):
        online_plan.resolve(exp, "grpo", exp.grpo, prepare, group=exp.grpo.rollout_batch + 1)
    # two ranks of 12 rows, groups of 8: named by the override that set it, with the sizes that split
    exp = config.load(TINY, ["grpo.rollout_batch=24", "grpo.minibatch=24", "grpo.micro_batch=8"])
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    with pytest.raises(config.ConfigError) as e:
        online_plan.resolve(exp, "grpo", exp.grpo, prepare, group=exp.grpo.num_generations)
    assert str(config.origin(e.value, exp.source, ["grpo.rollout_batch=24"])) == (
        "override grpo.rollout_batch=24: grpo.rollout_batch / processes (12) must be a multiple of "
        "grpo.num_generations (8): each rank samples whole groups; set grpo.rollout_batch to a multiple of 16 (16 or "
        "32; its minibatch and micro_batch split it)")



def test_a_prompt_pool_smaller_than_a_batch_fills_it_by_going_round_again():
    """A prompt file with fewer distinct prompts than a rollout needs (4 for PPO's 64, 1 for GRPO's two groups) is gone
    through as often as the batch needs, each pass a fresh seeded shuffle; a pool at least a batch wide takes exactly
    the order it took before (one shuffle per pass, the rest kept for the next batch)."""
    import random

    from rlhf.rl.checkpoints import PromptOrder

    def shuffled_passes(n, seed, passes):
        rng, out = random.Random(seed), []
        for _ in range(passes):
            p = list(range(n))
            rng.shuffle(p)
            out += p
        return out

    order, want = PromptOrder(4, 0), shuffled_passes(4, 0, 3)
    assert order.take(10) == want[:10] and order.order == want[10:]
    assert order.take(2) == want[10:12] and order.order == []
    assert PromptOrder(1, 3).take(8) == [0] * 8
    with pytest.raises(ValueError, match="no prompts"):  # never a loop without end
        PromptOrder(0, 0).take(1)
    wide, want = PromptOrder(100, 7), shuffled_passes(100, 7, 2)
    assert wide.take(64) == want[:64] and wide.take(64) == want[64:128] and wide.order == want[128:]


def test_an_offline_check_grades_with_the_reward_model_of_its_own_sft_run_only(tmp_path, capsys):
    """DPO's and KTO's held-out check, and `make eval`, score with the latest reward model run only when it was trained
    on the same base and tokenizer from the same SFT adapter as the policies: an RM of an earlier SFT run (other
    data, another vocabulary) once failed DPO's check after training (a size mismatch loading its embeddings), or,
    where the vocabularies agreed, graded other data under a true-sounding label. Now the check goes on without it and
    says why (rank 0, on stderr and in the summary's `warnings`); with no RM run it says nothing."""
    import json

    from rlhf.runs import lineage, records

    exp = config.load(TINY, [f"results_dir={tmp_path / 'results'}"])
    sft_dir = tmp_path / "sft"
    (sft_dir / "adapter").mkdir(parents=True)
    (sft_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"the SFT adapter")
    sft = {"model": {"adapter": str(sft_dir / "adapter")}}
    tok = models.build_tokenizer(["a b c"])
    assert checks.latest_rm(exp, "dpo", sft_dir, sft, tok) == (None, None, None)

    def rm_run(name, tokenizer_hash, sft_sha, accuracy=0.9):
        run = records.stage_root(exp, "rm") / name
        run.mkdir(parents=True)
        summary = {"run_dir": str(run), "model": {"base_model": "tiny", "tokenizer_hash": tokenizer_hash},
                   "lineage": {"upstream": {"sft": {"adapter_sha256": sft_sha}}},
                   "metrics": {"eval_accuracy": accuracy}, "data": {"eval": 100}}
        (run / "summary.json").write_text(json.dumps(summary))
        (run.parent / "latest").write_text(name + "\n")
        return run, summary

    ours = rm_run("1", models.tokenizer_hash(tok), lineage.adapter_sha256(sft_dir / "adapter"))
    assert checks.latest_rm(exp, "dpo", sft_dir, sft, tok) == (*ours, None)
    for name, tokenizer_hash, sft_sha, says in (
            ("2", "0123456789abcdef", ours[1]["lineage"]["upstream"]["sft"]["adapter_sha256"], "another tokenizer"),
            ("3", models.tokenizer_hash(tok), "f" * 64, "from another SFT adapter than the latest SFT run")):
        rm_run(name, tokenizer_hash, sft_sha)
        rm_dir, rm, why = checks.latest_rm(exp, "dpo", sft_dir, sft, tok)
        assert (rm_dir, rm) == (None, None) and why.startswith("dpo: ") and says in why, why
        assert why.endswith("goes on without it.") and "\n" not in why
        assert dist.warn(why) == [why] and capsys.readouterr().err == f"warning: {why}\n"  # rank 0 says it, once
    assert dist.warn(None) == [] and capsys.readouterr().err == ""
    # ours again, at chance (44 of 100 held-out pairs): it grades, and its win rates are said to be noise
    chance = rm_run("4", models.tokenizer_hash(tok), lineage.adapter_sha256(sft_dir / "adapter"), accuracy=0.44)
    rm_dir, rm, why = checks.latest_rm(exp, "eval", sft_dir, sft, tok)
    assert (rm_dir, rm) == chance and why == (f"{guard.chance_rm('eval', 0.44, 100)}; its win rates (by reward_model) "
                                              "are no evidence either way")


def test_eval_gives_a_grader_its_role_for_each_policy_as_its_own_check_did_else_from_its_run_config(tmp_path):
    """`make eval` prints each grader's role for each policy: an online policy's reward model or judge that its run
    never saw (another RM run) is independent; one it saw, the role its own check recorded; else the role
    checks.grader_role gives under the config the policy was trained with (its run's config.yaml), and none when
    that no longer loads."""
    from rlhf.recipes import evaluate

    rm = {"reward_model": "R", "judge": "R"}
    chose = {"inputs": {"rm_run": "R"}, "metrics": {"eval_win_rates": {
        "judge": {"grader": "selected and graded by the same judge"}}}}
    assert evaluate.grader_roles("ppo", tmp_path, chose, ["judge"], rm) == {
        "judge": "selected and graded by the same judge"}
    assert evaluate.grader_roles("ppo", tmp_path, {**chose, "inputs": {"rm_run": "Q"}}, ["judge"], rm) == {
        "judge": "independent"}
    assert evaluate.grader_roles("grpo", tmp_path, {"inputs": {"rm_run": None}}, ["reward_model"], rm) == {
        "reward_model": "independent"}
    assert evaluate.grader_roles("dpo", tmp_path, {}, ["reward_model"], rm) == {"reward_model": None}  # no config
    # the same reward model adapter in another run folder (a rerun of the RM gives the same weights): not independent
    same = {**chose, "inputs": {"rm_run": "Q"}, "lineage": {"upstream": {"rm": {"adapter_sha256": "S"}}}}
    assert evaluate.grader_roles("ppo", tmp_path, same, ["judge"], rm, "S") == {
        "judge": "selected and graded by the same judge"}
    assert evaluate.grader_roles("ppo", tmp_path, same, ["judge"], rm, "T") == {"judge": "independent"}
    # a policy trained from another SFT adapter than the SFT eval compares with is left out, and said so
    from rlhf.runs import lineage

    adapter = tmp_path / "sft-adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"A")
    found = {s: (tmp_path / s, {"lineage": {"upstream": {"sft": {"adapter_sha256": sha, "run": "old"}}}})
             for s, sha in (("dpo", lineage.adapter_sha256(adapter)), ("ppo", "B"), ("grpo", None))}
    found["sft"] = (tmp_path / "sft", {})
    assert evaluate.other_sft(found, tmp_path / "sft", {"model": {"adapter": str(adapter)}}) == [
        f"ppo: its run {tmp_path / 'ppo'} was trained from another SFT run (old) than the latest, {tmp_path / 'sft'}, "
        "which eval compares with: left out; rerun `make ppo` to evaluate it"]
    assert list(found) == ["dpo", "grpo", "sft"]  # a record without the sha (older runs) stays
    # a run whose guard kept the policy it started from: make eval says its rows are SFT against itself
    assert evaluate.kept_sft({"ppo": (tmp_path, {"model": {"kept": {"iteration": 1}}}), "dpo": (tmp_path, {}),
                              "grpo": (tmp_path, {"model": {"kept": {"iteration": 16}}})}) == [
        "ppo: its run kept the SFT policy (after 0 updates; its summary's flags and warnings say why): its rows here "
        "are SFT against itself"]
    fns = "reward.functions={rlhf.inputs.data:letters_reward: 1}"
    for stage, overrides, grader, role in (("ppo", ["reward.model=1"], "reward_model", "trained against"),
                                           ("grpo", ["reward.model=0", fns], "reward_functions", "trained against"),
                                           ("dpo", [], "reward_model", "fit on the same pairs"),
                                           ("dpo", [], "judge", "independent")):
        run = tmp_path / f"{stage}-{grader}"
        run.mkdir(exist_ok=True)
        (run / "config.yaml").write_text(config.dump(config.load(TINY, [f"results_dir={tmp_path}", *overrides])))
        summary = {"inputs": {"rm_run": "R"}, "metrics": {}}
        assert evaluate.grader_roles(stage, run, summary, [grader], rm) == {grader: role}, (stage, grader)
    # eval's own reward functions: trained against only by the policy whose run's reward named one of them (a new
    # user's PPO on the reward model alone, and GRPO on another function, were both said "trained against")
    letters, other = "rlhf.inputs.data:letters_reward", "rlhf.inputs.data:gt_reward"
    mine = config.load(TINY, [f"reward.functions={{{letters}: 1}}"]).reward
    for overrides, role in ((["reward.model=1"], "independent"),
                            (["reward.model=0", f"reward.functions={{{other}: 1}}"], "independent"),
                            (["reward.model=0", f"reward.functions={{{other}: 1, {letters}: 0.5}}"], "trained against"),
                            (["reward.model=1", f"reward.functions={{{letters}: 0}}"], "independent")):
        run = tmp_path / "grpo-own"
        run.mkdir(exist_ok=True)
        (run / "config.yaml").write_text(config.dump(config.load(TINY, [f"results_dir={tmp_path}", *overrides])))
        recorded = {"inputs": {"rm_run": "R"}, "metrics": {"eval_win_rates": {
            "reward_functions": {"grader": "trained against"}}}}  # its own check's, on its own functions
        assert evaluate.grader_roles("grpo", run, recorded, ["reward_functions"], rm, None, mine) == {
            "reward_functions": role}, overrides
    judged = config.load(TINY, [f"reward.judge_functions={{{letters}: 1}}"]).reward
    assert evaluate.functions_role("judge", judged, mine) == "trained against"
    assert evaluate.functions_role("judge", judged, judged) == "judge"  # the run's own judge: its record says the rest
    assert evaluate.functions_role("judge", judged, config.load(TINY).reward) == "independent"
    assert evaluate.functions_role("judge", config.load(TINY).reward, mine) is None  # the RM stage's judge adapter
    # eval's reward functions that were the run's judge: the judge's role as the run recorded it, not its reward's
    run = tmp_path / "grpo-judged"
    run.mkdir()
    (run / "config.yaml").write_text(config.dump(config.load(TINY, [
        f"results_dir={tmp_path}", "reward.model=0", f"reward.functions={{{other}: 1}}",
        f"reward.judge_functions={{{letters}: 1}}"])))
    recorded = {"inputs": {"rm_run": "R"}, "metrics": {"eval_win_rates": {
        "reward_functions": {"grader": "trained against"}, "judge": {"grader": "selected and graded by the same judge"}}}}
    assert evaluate.grader_roles("grpo", run, recorded, ["reward_functions"], rm, None, mine) == {
        "reward_functions": "selected and graded by the same judge"}
    # a judge model named by another spelling of the same folder is the run's judge
    (tmp_path / "judge-model").mkdir()
    theirs = config.load(TINY, [f"reward.judge_model={tmp_path / 'judge-model'}"]).reward
    ours = config.load(TINY, [f"reward.judge_model={tmp_path / 'judge-model'}/"]).reward
    assert evaluate.functions_role("judge", ours, theirs) == "judge"
    from rlhf.rl import checks  # a function of weight 0 trains nothing: its own check says so too, as eval does

    assert checks.grader_role(config.load(TINY, [f"reward.functions={{{letters}: 0}}"]), "grpo",
                              "reward_functions") == "independent"


def test_an_unguarded_run_outside_its_kl_band_says_that_nothing_flagged_it():
    outside = {"train_kl_ref_last5": 2.674, "kl_within_band": False}
    said = online.unguarded_kl("grpo", outside, [0.0, 2.0])
    assert said.startswith("grpo: kl/ref averaged 2.67 over the last 5 iterations, above grpo.kl_band [0.0, 2.0]; "
                           "no judge watched this run") and said.endswith("the last is saved")
    for n, words in ((2, "over the last 2 iterations"), (1, "over its one iteration")):  # a run of n iterations
        assert words in online.unguarded_kl("grpo", {**outside, "train_kl_ref_window": n}, [0.0, 2.0])
    assert online.summarize([{"kl/ref": 1.0, "reward/mean": 0.0}] * 2, [0.0, 2.0], ())[0]["train_kl_ref_window"] == 2
    assert online.unguarded_kl("grpo", {**outside, "kl_within_band": True}, [0.0, 2.0]) is None
    assert online.unguarded_kl("grpo", {**outside, "train_kl_ref_last5": 0.2}, [0.5, 2.0]) is None  # below: no budget
    assert online.unguarded_kl("grpo", {"train_kl_ref_last5": None, "kl_within_band": None}, [0.0, 2.0]) is None


def test_a_check_over_fewer_held_out_rows_than_eval_prompts_says_so():
    """eval.prompts asks for more held-out rows than the data holds: every stage's check warns (Check.short, in its
    summary's warnings) instead of shrinking n without a word."""
    exp = config.load(TINY, ["eval.prompts=5"])
    rows = [{"id": f"r{i}", "prompt": "p"} for i in range(3)]
    assert checks.plan(exp, "dpo", rows).short == ("dpo: eval.prompts = 5, but the held-out rows (synthetic) are 3: "
                                                   "every held-out figure is over those 3")
    assert checks.plan(exp, "dpo", rows + rows[:2]).short is None


def test_an_online_max_grad_norm_of_0_clips_nothing_as_in_trl():
    """TRL's (transformers') max_grad_norm 0: no clipping. torch's clip to 0 would zero every gradient and freeze the
    policy without a word."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    run = types.SimpleNamespace(timer=lambda name: contextlib.nullcontext(), roles=types.SimpleNamespace(trainable=[p]),
                                opt=opt, it=types.SimpleNamespace(grad_norms=[]))
    for bound, moved in ((0.0, 0.2), (1.0, 0.1 / math.sqrt(3))):
        p.data.fill_(1.0)
        p.grad = torch.full((3,), 2.0)
        online.OnlineRun.optimizer_step(run, bound)
        assert run.it.grad_norms[-1] == pytest.approx(2 * math.sqrt(3)) and 1 - p[0].item() == pytest.approx(moved)


def test_a_merged_reward_model_is_compared_with_the_adapter_model_pair_by_pair():
    """export.rm_agreement by hand: texts are (chosen, rejected) in turn; the second pair's order flips."""
    from rlhf.recipes.export import rm_agreement

    got = rm_agreement([1.0, 0.5, 0.2, 0.1, -1.0, 0.0], [1.0, 0.4, 0.1, 0.15, -1.0, 0.01])
    assert got == {"score_max_abs_diff": pytest.approx(0.1), "pairs_ranked_alike": 2, "pairs": 3}
    assert rm_agreement([], []) == {"score_max_abs_diff": None, "pairs_ranked_alike": 0, "pairs": 0}
