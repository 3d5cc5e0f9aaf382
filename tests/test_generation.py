import re

import torch

from rlhf.rl import generation
from rlhf.maths import losses
from rlhf.inputs import models

from .conftest import tiny, tiny_llama


def _model_and_tok():
    tok = models.build_tokenizer(["\n\nHuman: a b c d e f g\n\nAssistant: a b"])
    return tiny_llama(tok), tok


def test_left_padded_response_logprobs_equal_a_plain_forward_pass():
    model, tok = _model_and_tok()
    prompts = ["\n\nHuman: a\n\nAssistant:", "\n\nHuman: a b c d e f g\n\nAssistant:"]
    torch.manual_seed(1)
    r = generation.generate(model, tok, prompts, max_new_tokens=6, temperature=1.0, top_p=1.0,
                            max_prompt_length=32)
    assert r.query_mask[0, 0] == 0  # the short prompt is left-padded
    with torch.no_grad():
        logp, _, _ = generation.response_logprobs(model, r, temperature=1.0)
        for i in range(len(prompts)):
            q = r.query[i][r.query_mask[i].bool()]
            n = int(r.mask[i].sum())
            ids = torch.cat([q, r.response[i, :n]]).unsqueeze(0)
            plain = losses.logprobs_from_logits(model(ids).logits[:, :-1], ids[:, 1:])[0, -n:]
            torch.testing.assert_close(logp[i, :n], plain, atol=1e-5, rtol=1e-5)


def test_generation_masks_everything_after_eos():
    model, tok = _model_and_tok()
    torch.manual_seed(0)
    r = generation.generate(model, tok, ["\n\nHuman: a\n\nAssistant:"] * 16, max_new_tokens=8, temperature=3.0,
                            top_p=1.0, max_prompt_length=32)
    for resp, m in zip(r.response, r.mask):
        eos = (resp == tok.eos_token_id).nonzero()
        if len(eos):
            first = int(eos[0])
            assert m[: first + 1].all() and not m[first + 1:].any()
            assert (resp[first + 1:] == tok.pad_token_id).all()
        else:
            assert m.all()


def test_samples_are_transformers_own_draws_and_batching_changes_no_token():
    """The held-out checks and the rollouts sample what transformers' generate() samples (TRL's sampler) from the
    same seed and batch: the same texts, token for token; and the rows a batch is cut into change no greedy token
    (left padding to another width leaves each row's logits as they were)."""
    model, tok = _model_and_tok()
    prompts = [f"\n\nHuman: {' '.join('abcdefg'[:k])}\n\nAssistant:" for k in range(1, 8)]
    torch.manual_seed(3)
    r = generation.generate(model, tok, prompts, max_new_tokens=8, temperature=0.7, top_p=1.0, max_prompt_length=32)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(3)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    theirs = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert generation.decode(tok, r) == theirs and len(set(theirs)) > 3  # distinct draws: not a degenerate match
    greedy = [generation.generate(model, tok, prompts, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                  max_prompt_length=32, batch_size=b, do_sample=False) for b in (7, 3, 1)]
    for g in greedy[1:]:
        assert torch.equal(g.response, greedy[0].response) and torch.equal(g.mask, greedy[0].mask)


class _Scripted(torch.nn.Module):
    """A stand-in whose generate() returns fixed continuations, to pin down how responses are cut and flagged."""

    def __init__(self, continuations):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.continuations = continuations
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig()

    def generate(self, input_ids, **kwargs):
        return torch.cat([input_ids, self.continuations], 1)


def test_a_response_whose_eos_is_the_last_allowed_token_counts_as_ended():
    _, tok = _model_and_tok()
    a, eos, pad = tok.convert_tokens_to_ids("a"), tok.eos_token_id, tok.pad_token_id
    rows = torch.tensor([[a, a, eos],      # EOS exactly at max_new_tokens
                         [a, a, a],        # cut by max_new_tokens
                         [a, eos, pad]])   # ended early
    r = generation.generate(_Scripted(rows), tok, ["\n\nHuman: a\n\nAssistant:"] * 3, max_new_tokens=3,
                            temperature=1.0, top_p=1.0, max_prompt_length=32)
    assert r.ended.tolist() == [True, False, True]
    assert r.mask.sum(1).tolist() == [3, 3, 2]
    assert r.slice(torch.tensor([1, 0])).ended.tolist() == [False, True]


def test_sampling_ignores_the_models_own_generation_config():
    """A hub model's generation_config (repetition_penalty, no_repeat_ngram_size...) must not reach generate():
    the scoring passes compute log-probs from plain softmax(logits / T). Greedy tokens are then exactly the argmax
    of the scoring pass, and the same config does change what generate() picks when left in place."""
    model, tok = _model_and_tok()
    with torch.no_grad():  # no EOS from the random head: greedy runs all 8 tokens, so the comparison has content
        model.lm_head.weight[tok.eos_token_id].zero_()
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.no_repeat_ngram_size = 1
    prompts = ["\n\nHuman: a b\n\nAssistant:", "\n\nHuman: c\n\nAssistant:"]
    r = generation.generate(model, tok, prompts, max_new_tokens=8, temperature=1.0, top_p=1.0,
                            max_prompt_length=32, do_sample=False)
    am = r.attention_mask
    with torch.no_grad():
        logits = model(input_ids=r.input_ids, attention_mask=am, position_ids=generation.position_ids(am)).logits
    R = r.response.shape[1]
    argmax = logits[:, -R - 1:-1].argmax(-1)
    assert (r.mask.sum(1) >= 4).all()  # long enough responses: the comparisons below are not vacuous
    assert torch.equal(argmax[r.mask.bool()], r.response[r.mask.bool()])
    with_config = model.generate(input_ids=r.query, attention_mask=r.query_mask, max_new_tokens=8, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = with_config[:, r.query.shape[1]:]
    n = min(new.shape[1], r.response.shape[1])
    assert (new[:, :n] != r.response[:, :n]).any()  # the config would have changed them
    assert model.generation_config.repetition_penalty == 50.0  # restored after the call


def test_entropy_keeps_no_graph_when_the_loss_has_no_entropy_bonus():
    model, tok = _model_and_tok()
    torch.manual_seed(0)
    r = generation.generate(model, tok, ["\n\nHuman: a\n\nAssistant:"] * 2, max_new_tokens=4, temperature=1.0,
                            top_p=1.0, max_prompt_length=32)
    logp, entropy, _ = generation.response_logprobs(model, r, entropy_grad=False)
    assert logp.requires_grad and not entropy.requires_grad
    _, entropy, _ = generation.response_logprobs(model, r, entropy_grad=True)
    assert entropy.requires_grad


def _seq_cls(pad_is_eos: bool):
    from transformers import LlamaForSequenceClassification

    tok = models.build_tokenizer(["\n\nHuman: a b c d e f g\n\nAssistant: a b"])
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    cfg = tiny_llama(tok, num_labels=1).config  # the same shape, with a one-label score head
    torch.manual_seed(0)
    return LlamaForSequenceClassification(cfg).eval(), tok


def test_ppo_scores_where_the_reward_model_pools_also_when_pad_is_eos():
    """The RM is trained by transformers' sequence-classification head, which reads the last non-pad token; PPO's
    scoring of a left-padded prompt + right-padded response must read the same position (pad == EOS included)."""
    for pad_is_eos in (False, True):
        model, tok = _seq_cls(pad_is_eos)
        prompts = ["\n\nHuman: a\n\nAssistant:", "\n\nHuman: a b c d\n\nAssistant:"]
        responses = [" b c", " d"]
        q, qm = generation.encode_prompts(tok, prompts, 32, "cpu")
        resp = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id] for x in responses]
        width = max(map(len, resp)) + 1
        response = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in resp])
        mask = generation.response_mask(response, tok.eos_token_id)
        r = generation.Rollout(q, qm, response, mask, torch.tensor([True, True]))
        with torch.no_grad():
            h = generation.last_hidden(model.model, r, tok.pad_token_id)
            ours = model.score(h).squeeze(-1)
            # the RM's own forward pass on each unpadded text (what RewardTrainer trained and rm.score reads)
            theirs = torch.stack([model(input_ids=torch.tensor([[*q[i][qm[i].bool()].tolist(), *resp[i]]])).logits[0, 0]
                                  for i in range(2)])
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)



def test_qlora_with_bf16_compute_runs_in_bf16_outside_the_trainers(tmp_path):
    """peft's prepare_model_for_kbit_training upcasts embeddings and norms to float32, so the residual stream, the
    KV cache and the activations ran in float32 (the 7B PPO rollout measured 13.3 GB on an H100, its KV cache twice
    the plan), and the RM's first scoring pass failed on a bf16 head. With bf16 compute they stay bf16
    (models.frozen_for_kbit_training), and our own forwards (scoring, generation) run under `models.autocast`."""
    from rlhf.recipes import rm

    from .conftest import tiny

    model, tok = _model_and_tok()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    exp = tiny(tmp_path, "model.dtype=bfloat16", "quantization.load_in_4bit=true",
               "quantization.compute_dtype=bfloat16", "lora.target_modules=[all-linear]")
    policy = models.add_adapter(models.load_base(models.loading(exp), str(tmp_path / "base"), "causal", tok), exp.lora)
    seen = []
    layer = policy.base_model.model.model.layers[0].self_attn.k_proj
    layer.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    q, qm = generation.encode_prompts(tok, ["\n\nHuman: a b\n\nAssistant:"], 16, "cpu")
    with torch.no_grad():
        policy.generate(input_ids=q, attention_mask=qm, max_new_tokens=2, do_sample=False)
    assert set(seen) == {torch.bfloat16}  # no float32 upcast (models.frozen_for_kbit_training)
    seen.clear()
    generation.generate(policy, tok, ["\n\nHuman: a b\n\nAssistant:"], max_new_tokens=2, temperature=1.0,
                        top_p=1.0, max_prompt_length=16)
    assert set(seen) == {torch.bfloat16}  # what the KV cache stores
    scorer = models.add_adapter(models.load_base(models.loading(exp), str(tmp_path / "base"), "reward", tok), exp.lora, "SEQ_CLS")
    for n, prm in scorer.named_parameters():  # the trainers hand the RM a bf16 head (trainers.adapter_dtype_as_compute)
        if prm.requires_grad:
            prm.data = prm.data.to(torch.bfloat16)
    scores = rm.score(scorer, tok, ["\n\nHuman: a\n\nAssistant:"] * 2, [" a b", " c"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_reward_scores_need_neither_the_rm_stage_nor_trl(monkeypatch):
    """checks.reward_scores (how PPO, GRPO and DPO score with the reward model) EOS-terminates each response as the
    RM was trained, with generation.eos_terminated: it imports neither the RM stage nor, with it, TRL."""
    import sys

    import peft

    import rlhf
    from rlhf.rl import checks

    for name in ("rlhf.recipes.rm", "trl"):
        monkeypatch.setitem(sys.modules, name, None)  # importing either now fails
    monkeypatch.delattr(rlhf, "rm", raising=False)
    model, tok = _model_and_tok()
    policy = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    head = torch.nn.Linear(model.config.hidden_size, 1, bias=False)
    prompts, eos = ["\n\nHuman: a\n\nAssistant:", "\n\nHuman: b c\n\nAssistant:"], tok.eos_token
    assert generation.eos_terminated(" a", tok) == generation.eos_terminated(" a" + eos, tok) == " a" + eos
    with torch.no_grad():
        once = checks.reward_scores(policy, head, tok, prompts, [" a b", " c" + eos], rows=1)
        again = checks.reward_scores(policy, head, tok, prompts, [" a b" + eos, " c"], rows=2)
    torch.testing.assert_close(torch.tensor(once), torch.tensor(again), atol=1e-5, rtol=1e-5)


def test_a_cut_response_gets_one_score_in_training_and_in_the_checks():
    """One rule for a response cut at max_new_tokens (no EOS): scored with an EOS appended, as the reward model was
    trained. Training's scorer on the sampled rollout (generation.as_scored, Roles.score_by) and the text scorer of the
    held-out checks and `make eval` (checks.reward_scores) give the same score, cut or not, pad == EOS too; scoring
    the cut rollout as sampled would read another position."""
    import peft

    from rlhf.rl import checks

    for pad_is_eos in (False, True):
        model, tok = _model_and_tok()
        if pad_is_eos:
            tok.pad_token = tok.eos_token
        policy = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
        torch.manual_seed(0)
        head = torch.nn.Linear(model.config.hidden_size, 1, bias=False)
        prompts = ["\n\nHuman: a\n\nAssistant:", "\n\nHuman: a b c d\n\nAssistant:", "\n\nHuman: e\n\nAssistant:"]
        texts = [" b c", " d e f", " g"]  # the first and the last end with EOS; the second was cut at 3 tokens
        resp = [tok(x, add_special_tokens=False).input_ids for x in texts]
        resp = [resp[0] + [tok.eos_token_id], resp[1], resp[2] + [tok.eos_token_id]]
        response = torch.tensor([x + [tok.pad_token_id] * (3 - len(x)) for x in resp])
        q, qm = generation.encode_prompts(tok, prompts, 32, "cpu")
        r = generation.Rollout(q, qm, response, generation.response_mask(response, tok.eos_token_id),
                               torch.tensor([True, False, True]))
        scored = generation.as_scored(r, tok.eos_token_id, tok.pad_token_id)
        assert scored.response.shape[1] == 4 and scored.response[1].tolist() == resp[1] + [tok.eos_token_id]
        assert bool(scored.ended.all()) and generation.as_scored(scored, tok.eos_token_id, tok.pad_token_id) is scored
        with torch.no_grad():
            training = generation.reward_score(models.trunk(policy), head, scored, tok.pad_token_id)
            as_sampled = generation.reward_score(models.trunk(policy), head, r, tok.pad_token_id)
            text_path = checks.reward_scores(policy, head, tok, prompts, texts, rows=3)
        torch.testing.assert_close(training, torch.tensor(text_path), atol=1e-5, rtol=1e-5)
        if not pad_is_eos:  # as sampled, the cut row was read at its last token, not at the EOS it was trained on
            assert abs(as_sampled[1] - training[1]) > 1e-4 and torch.allclose(as_sampled[[0, 2]], training[[0, 2]])


def test_prompts_longer_than_max_prompt_length_are_counted_as_sampling_cuts_them():
    """cut_prompts counts the prompts encode_prompts drops the start of (sampling cuts from the left), tokenized the
    way it tokenizes them, in each group it is given (training and held-out prompts); None when every prompt fits."""
    _, tok = _model_and_tok()
    prompts = ["\n\nHuman: a\n\nAssistant:", "\n\nHuman: a b c d e f g\n\nAssistant:"]
    lengths = [len(tok(p).input_ids) for p in prompts]
    assert lengths[0] < lengths[1] and tok(prompts[0]).input_ids[0] == tok.bos_token_id
    assert generation.cut_prompts(tok, {"training prompts": prompts, "held-out prompts": []}, lengths[1]) is None
    warning = generation.cut_prompts(tok, {"training prompts": prompts, "held-out prompts": prompts[:1]},
                                     lengths[1] - 1)
    assert warning.startswith(f"1 of 2 training prompts are longer than data.max_prompt_length = {lengths[1] - 1} "
                              f"tokens (the longest: {lengths[1]})"), warning
    q, _ = generation.encode_prompts(tok, prompts, lengths[1] - 1, "cpu")
    ids = tok(prompts[1]).input_ids  # what the warning is about: the text's first token is gone (the BOS is re-added)
    assert q[1].tolist() == [tok.bos_token_id] + ids[2:]
    both = generation.cut_prompts(tok, {"training prompts": prompts, "held-out prompts": prompts[::-1]},
                                  lengths[0] - 1)
    assert both.startswith("2 of 2 training prompts and 2 of 2 held-out prompts are longer"), both
    assert generation.cut_prompts(tok, {"training prompts": prompts[:1], "held-out prompts": prompts},
                                  lengths[1] - 1).startswith("1 of 2 held-out prompts are longer")


def test_responses_longer_than_the_sampling_limits_are_counted():
    """cut_responses counts the held-out chosen responses that need more new tokens than each limit, their EOS
    included (as sampled): a policy that learned them is cut there, without its EOS; None when every one fits."""
    _, tok = _model_and_tok()
    responses = [" a b", " a b c d e"]  # 3 and 6 tokens with the EOS
    assert [len(generation.as_sampled(r, tok)[0]) for r in responses] == [3, 6]
    assert generation.cut_responses(tok, responses, {"grpo.max_completion_length": 6, "eval.max_new_tokens": 8}) is None
    said = generation.cut_responses(tok, responses, {"grpo.max_completion_length": 5, "eval.max_new_tokens": 2})
    assert said.startswith("1 (50%) of 2 held-out chosen responses are longer than grpo.max_completion_length = 5 "
                           "tokens with their EOS, and 2 (100%) than eval.max_new_tokens = 2 (the longest: 6): ")
    assert said.endswith("raise grpo.max_completion_length and eval.max_new_tokens to let them end, as memory allows "
                         "(make memplan)")


def test_sft_says_when_its_held_out_responses_are_longer_than_eval_max_new_tokens(tmp_path):
    """SFT's held-out check (and DPO's, KTO's, make eval's: checks.said) warns when the reference responses
    need more new tokens than eval.max_new_tokens, whose cut responses it counts as not ending, and when held-out
    prompts are longer than data.max_prompt_length (sampling cuts them)."""
    from rlhf.recipes import sft

    # tiny's prompts are 7 to 9 tokens: max_prompt_length 8 cuts some, and the check says how many it will cut
    summary = sft.train(tiny(tmp_path, "sft.max_steps=1", "eval.max_new_tokens=4", "eval.prompts=20",
                             "data.max_prompt_length=8"))
    (said,) = [w for w in summary["warnings"] if "eval.max_new_tokens = 4" in w]
    assert re.match(r"sft: \d+ \(\d+%\) of 20 held-out chosen responses are longer than eval.max_new_tokens = 4 "
                    r"tokens with their EOS \(the longest: \d+\)", said), said
    (cut,) = [w for w in summary["warnings"] if "data.max_prompt_length" in w]
    assert re.match(r"sft: [1-9]\d? of 20 held-out prompts are longer than data.max_prompt_length = 8 tokens \(the "
                    r"longest: 9\)", cut), cut


def test_top_k_min_p_and_repetition_penalty_sample_as_transformers_generate_does():
    """TRL's top_k, min_p and repetition_penalty reach transformers' generate as its own: the same draws from the same
    seed as generate given them; top_k 1 is the greedy response; off (0, None, 1) the draws are the plain ones."""
    model, tok = _model_and_tok()
    prompts = [f"\n\nHuman: {' '.join('abcdefg'[:k])}\n\nAssistant:" for k in range(1, 8)]
    kw = dict(max_new_tokens=8, temperature=1.5, top_p=1.0, max_prompt_length=32)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    filters = dict(top_k=3, min_p=0.05, repetition_penalty=1.3)
    torch.manual_seed(5)
    r = generation.generate(model, tok, prompts, **kw, **filters)
    torch.manual_seed(5)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=True, temperature=1.5, top_p=1.0, **filters,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert generation.decode(tok, r) == tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    torch.manual_seed(5)
    plain = generation.generate(model, tok, prompts, **kw)
    torch.manual_seed(5)
    off = generation.generate(model, tok, prompts, **kw, top_k=0, min_p=None, repetition_penalty=1.0)
    assert torch.equal(off.response, plain.response) and not torch.equal(r.response, plain.response)
    greedy = generation.generate(model, tok, prompts, **kw, do_sample=False)
    torch.manual_seed(5)
    top1 = generation.generate(model, tok, prompts, **kw, top_k=1)
    assert torch.equal(top1.response, greedy.response)
