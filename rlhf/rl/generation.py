"""Batched sampling with the KV cache (left-padded prompts) and the scoring passes over prompt + response that PPO
and evaluation share. Responses are right-padded; the mask covers every token up to and including the first EOS."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from rlhf.infra import dist
from rlhf.maths import losses
from rlhf.inputs import models
from rlhf.rl import sampler as samplers

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    query: torch.Tensor  # (B, P) left-padded prompt ids
    query_mask: torch.Tensor  # (B, P)
    response: torch.Tensor  # (B, R) right-padded response ids (pad after EOS)
    mask: torch.Tensor  # (B, R) 1 up to and including the first EOS
    ended: torch.Tensor  # (B,) True where the response stopped with EOS (rather than at max_new_tokens)
    sample_logp: torch.Tensor | None = None
    """(B, R) float32 log-probs (of logits / temperature) of each response token under what sampled it (the merged
    sampler, or the model itself), recorded while sampling; 0 after a response's end. The old log-probs of a ratio
    come from the training path instead: the difference is the sampler's gap (rollout/logprob_gap_*)."""

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.query, self.response], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.query_mask, self.mask], 1)

    def slice(self, idx) -> "Rollout":
        return Rollout(self.query[idx], self.query_mask[idx], self.response[idx], self.mask[idx], self.ended[idx],
                       None if self.sample_logp is None else self.sample_logp[idx])

    def chunks(self, rows: int) -> list["Rollout"]:
        """The rollout in pieces of `rows` sequences (0 = one piece): the bound of every no-grad pass (the online
        stages' forward_batch)."""
        n = self.query.shape[0]
        rows = rows or n
        return [self.slice(torch.arange(i, min(i + rows, n))) for i in range(0, n, rows)]


def encode_prompts(tok, prompts: list[str], max_prompt_length: int, device,
                   full_width: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, cut from the left at max_prompt_length; `full_width`: padded to
    max_prompt_length whatever the batch's longest (one shape for a compiled sampler)."""
    side, trunc = tok.padding_side, tok.truncation_side
    tok.padding_side, tok.truncation_side = "left", "left"
    try:
        enc = tok(prompts, return_tensors="pt", padding="max_length" if full_width else True, truncation=True,
                  max_length=max_prompt_length)
    finally:
        tok.padding_side, tok.truncation_side = side, trunc
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def cut_prompts(tok, prompts: dict[str, list[str]], max_prompt_length: int) -> str | None:
    """What encode_prompts cuts from `prompts` ({what they are: their texts}, tokenized as it tokenizes them, special
    tokens included): a warning naming how many of each are longer than max_prompt_length and the longest, or None
    when every prompt fits. A cut prompt loses the start of its text (a chat template's opening, the first turns; a
    tokenizer that adds a BOS adds it to what is left)."""
    lengths = {k: [len(ids) for ids in tok(v).input_ids] if v else [] for k, v in prompts.items()}
    over = {k: sum(n > max_prompt_length for n in v) for k, v in lengths.items()}
    if not any(over.values()):
        return None
    said = " and ".join(f"{n} of {len(lengths[k])} {k}" for k, n in over.items() if n)
    return (f"{said} are longer than data.max_prompt_length = {max_prompt_length} tokens (the longest: "
            f"{max(max(v) for v in lengths.values() if v)}): sampling cuts them from the left, so the policy never "
            "sees their start (a template's opening, the first turns); raise data.max_prompt_length to keep them whole")


def cut_responses(tok, responses: list[str], limits: dict[str, int]) -> str | None:
    """What sampling at `limits` ({config key: most new tokens}) would cut of responses like `responses` (the held-out
    chosen ones: what SFT taught), each counted as sampled, through its EOS (as_sampled): a warning naming how many
    need more than each limit that cuts some, and the longest; None when every one fits. A cut response has no EOS:
    missing_eos_penalty takes its toll and the held-out check counts it as not ending."""
    lengths = [len(as_sampled(r, tok)[0]) for r in responses]
    cut = {k: sum(n > v for n in lengths) for k, v in limits.items()}
    if not any(cut.values()):
        return None
    over = [(k, n, f"{n} ({n / len(lengths):.0%})") for k, n in cut.items() if n]
    said = ", and ".join(f"{share} of {len(lengths)} held-out chosen responses are longer than {k} = {limits[k]} "
                         f"tokens with their EOS" if i == 0 else f"{share} than {k} = {limits[k]}"
                         for i, (k, _, share) in enumerate(over))
    return (f"{said} (the longest: {max(lengths)}): the policy's responses of that length are cut before their EOS "
            f"and scored as not ending; raise {' and '.join(k for k, _, _ in over)} to let them end, as memory allows "
            f"(make memplan)")


def eos_terminated(text: str, tok) -> str:
    """`text` ending with the tokenizer's EOS (added once): a response as the reward model was trained to score it
    (`as_scored` is the same rule for a sampled rollout)."""
    return text if text.endswith(tok.eos_token) else text + tok.eos_token


def as_sampled(text: str, tok) -> tuple[list[int], str]:
    """A response written as text (a held-out pair's) as the stages sample one: its token ids through its first EOS
    (one appended when it has none), and the text reward functions get of it, decoded without special tokens as a
    rollout's (`texts`)."""
    ids = tok(text, add_special_tokens=False).input_ids
    ids = ids[:ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else [*ids, tok.eos_token_id]
    return ids, tok.decode(ids, skip_special_tokens=True)


def as_scored(r: Rollout, eos_id: int, pad_id: int | None) -> Rollout:
    """The rollout as the reward model (and the judge, an ensemble member) scores it: each response cut at
    max_new_tokens, with no EOS, gets one appended, as TRL appended it to every response the reward model was trained
    on (`eos_terminated` is the same rule for texts: `make eval`, the held-out checks, rm.score). The scorer then
    reads where it was trained to read (pool_index); the missing EOS is penalized on its own (missing_eos_penalty)."""
    if bool(r.ended.all()):
        return r
    B = r.response.shape[0]
    fill = pad_id if pad_id is not None else eos_id
    response = torch.cat([r.response, r.response.new_full((B, 1), fill)], 1)
    mask = torch.cat([r.mask, r.mask.new_zeros((B, 1))], 1)
    cut = (~r.ended).nonzero().squeeze(1)
    at = r.mask[cut].sum(1)  # a cut response's tokens all count: the EOS goes right after them
    response[cut, at] = eos_id
    mask[cut, at] = 1
    return Rollout(r.query, r.query_mask, response, mask, torch.ones_like(r.ended))


def response_mask(response: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for every token up to and including the first EOS, 0 after it."""
    is_eos = response == eos_id
    after_eos = (torch.cumsum(is_eos.int(), 1) - is_eos.int()) > 0
    return (~after_eos).long()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generate() uses: a left-padded row scores like an unpadded one."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


@contextlib.contextmanager
def plain_generation_config(model):
    """Sample from softmax(logits / T) only, as the scoring passes compute log-probs: a model's own
    generation_config (a hub model's repetition_penalty, top_k, no_repeat_ngram_size...) would otherwise fill in
    every setting generate() is not given and make the rollouts silently off-policy. It is set aside for the call
    and restored after; what it would have changed is logged once."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = inner.generation_config
    ignored = {k: v for k, v in own.to_diff_dict().items()
               if k not in ("transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "max_length",
                            "max_new_tokens", "use_cache", "_from_model_config")
               and not (k.startswith(("output_", "return_dict")) and not v)}  # what is returned, not what is sampled
    if ignored and not getattr(own, "_rlhf_warned", False):
        log.warning("generation: the model's generation_config sets %s; ignored, so that sampling matches the "
                    "log-probs the stages compute (plain softmax(logits / temperature), top_p from the config)",
                    ignored)
        own._rlhf_warned = True
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = own


BAR_DELAY = 2.0
"""Seconds a sampling pass runs before its progress bar shows: the short ones (a few prompts) print nothing."""


@torch.no_grad()
def generate(model, tok, prompts: list[str], *, max_new_tokens: int, temperature: float, top_p: float,
             max_prompt_length: int, batch_size: int = 64, do_sample: bool = True,
             copy_bytes: float = 0.0, desc: str = "sampling", top_k: int = 0, min_p: float | None = None,
             repetition_penalty: float = 1.0) -> Rollout:
    """Sample a response to each prompt, `batch_size` prompts at a time, with a progress bar (`desc`; on a terminal,
    once the pass has run BAR_DELAY seconds). `copy_bytes` > 0: through the model's merged sampler (rlhf/rl/sampler.py)
    of up to that many bytes of merged layers (memory/memplan.py sizes it; made on the first call and kept with the
    model); 0: through the model itself. Each token's log-prob under what sampled it is recorded (sample_logp)."""
    was_training = model.training
    model.eval()
    s = sampler_for(model, copy_bytes, batch_size, max_prompt_length + max_new_tokens)
    parts = []
    with tqdm(total=len(prompts), desc=desc, unit="seq", leave=False, delay=BAR_DELAY,
              disable=None if dist.is_main() else True) as bar:
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            parts.append(_generate_batch(model, s, tok, batch, max_new_tokens, temperature, top_p,
                                         max_prompt_length, do_sample, batch_size,
                                         dict(top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty)))
            bar.update(len(batch))
    model.train(was_training)
    width = max(p.query.shape[1] for p in parts)

    def lpad(t, value):
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    return Rollout(torch.cat([lpad(p.query, tok.pad_token_id) for p in parts]),
                   torch.cat([lpad(p.query_mask, 0) for p in parts]),
                   torch.cat([p.response for p in parts]), torch.cat([p.mask for p in parts]),
                   torch.cat([p.ended for p in parts]), torch.cat([p.sample_logp for p in parts]))


def sampler_for(model, copy_bytes: float, rows: int, seq: int) -> samplers.MergedSampler | None:
    """The model's merged sampler (samplers.of), made on first use with the copy the device can hold now beside a
    pass of `rows` x `seq` tokens (affordable_copy); None: sampling goes through the model itself."""
    return samplers.of(model, affordable_copy(model, copy_bytes, rows, seq))


def sampler_state(model, copy_bytes: float, rows: int, cuda: bool | None = None) -> dict:
    """The run record's `sampler`: what sampling decoded with (MergedSampler.state, or the training model itself:
    `4bit_lora`), the plan's copy (`planned_copy_bytes`) and rows, and `fell_back`: on a CUDA device (`cuda`; None:
    the model's) with the whole copy planned, the copy decoded eagerly (a compile that failed, a copy the device could
    not hold whole)."""
    s = getattr(model, "_rlhf_sampler", None)
    if s is None:
        state = {"path": "4bit_lora", "compiled": False, "eager_reason": "no merged copy (the plan's copy is 0)"
                 if not copy_bytes else "no LoRA adapter", "copy_bytes": 0, "copy_share": 0.0}
    else:
        state = s.state()
    cuda = next(model.parameters()).device.type == "cuda" if cuda is None else cuda
    whole = s is not None and copy_bytes >= s.whole_bytes * (1 - 1e-9)
    return {**state, "planned_copy_bytes": copy_bytes if math.isfinite(copy_bytes) else "whole", "rows": rows,
            "fell_back": bool(cuda and whole and not state["compiled"])}


CUDA_SLACK = 1024**3
"""Bytes a CUDA sampling call leaves free beyond its KV cache for the copy's sake: the context and the allocator's
fragmentation (results/gpu/: reserved runs 5-39% past allocated)."""


def affordable_copy(model, copy_bytes: float, rows: int, seq: int) -> float:
    """`copy_bytes` (the plan's copy), less what this CUDA device cannot hold now beside a sampling call's KV cache
    (`rows` x `seq` tokens, every layer's keys and values in the compute dtype) and CUDA_SLACK, when the model has no
    sampler yet (one made is kept): the plan predicts a stage's peak and can be wrong; a copy too large would turn a
    speed-up into an out-of-memory error. The memory this process may use is the device's free memory, within a cap
    (memory.cap_to_budget's allocator fraction)."""
    device = next(model.parameters()).device
    if device.type != "cuda" or not copy_bytes or getattr(model, "_rlhf_sampler", None) is not None:
        return copy_bytes
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (2 * cfg.num_hidden_layers * rows * seq * cfg.num_key_value_heads * head_dim
          * models.compute_dtype(model).itemsize)
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    spare = min(free, fraction * total - reserved) + reserved - allocated
    fit = max(0.0, spare - kv - CUDA_SLACK)
    if fit < copy_bytes:
        log.warning("sampling copy: %.2f GB planned, %.2f GB made (what the device can hold beside the KV cache)",
                 min(copy_bytes, 1e30) / 1024**3, fit / 1024**3)
    return min(copy_bytes, fit)


class SampledLogprobs:
    """A logits processor that records, at each decode step, the log-prob (of logits / temperature, float32) of the
    token that step then draws. transformers runs the processors it is given before its own (temperature, top-p),
    so the scores seen here are the raw logits."""

    def __init__(self, temperature: float):
        self.temperature, self.prev, self.out = temperature, None, []
        self.stamps: list[float] = []
        """When each step's logits came (time.perf_counter): the decode step's time (MergedSampler.record_steps)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        if self.prev is not None:
            self.out.append(self.prev.gather(1, input_ids[:, -1:]))
        self.prev = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def logprobs(self, sequences: torch.Tensor, steps: int) -> torch.Tensor:
        """(B, steps): one column per decode step, the last from the final drawn token (zeros from a model whose
        generate runs no processors)."""
        if self.prev is None:
            return torch.zeros(sequences.shape[0], steps, device=sequences.device)
        return torch.cat([*self.out, self.prev.gather(1, sequences[:, -1:])], 1)


FILTERS_OFF = {"top_k": 0, "min_p": None, "repetition_penalty": 1.0}
"""generate()'s sampling filters at the values that leave the distribution as it is."""


def _generate_batch(model, s: samplers.MergedSampler | None, tok, prompts: list[str], max_new_tokens: int,
                    temperature: float, top_p: float, max_prompt_length: int, do_sample: bool,
                    rows: int, filters: dict | None = None) -> Rollout:
    """One batch of generate(): its prompts left-padded, its responses right-padded to max_new_tokens. Through a
    compiled sampler the batch is `rows` rows of max_prompt_length tokens whatever its prompts (one shape: one static
    cache, one compiled graph): short batches repeat their last prompt, and the rows and prompt columns only padding
    holds are dropped after."""
    device = next(model.parameters()).device
    compiled = s is not None and s.compile
    q, qm = encode_prompts(tok, prompts, max_prompt_length, device, full_width=compiled)
    n = q.shape[0]
    if compiled and n < rows:
        q, qm = torch.cat([q, q[-1:].expand(rows - n, -1)]), torch.cat([qm, qm[-1:].expand(rows - n, -1)])
    record = SampledLogprobs(temperature if do_sample else 1.0)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample,
                  temperature=temperature if do_sample else None, top_p=top_p if do_sample else None,
                  top_k=0 if do_sample else None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  use_cache=True, logits_processor=[record])
    if do_sample:  # top_k, min_p, repetition_penalty where set (generate's own processors)
        kwargs.update({k: v for k, v in (filters or {}).items() if v is not None and v != FILTERS_OFF[k]})
    with plain_generation_config(model):
        if s is not None:
            out = s.generate(q, qm, **kwargs)
            s.record_steps(record.stamps)
        else:
            with models.autocast(model):  # a bf16 KV cache, not float32
                out = model.generate(input_ids=q, attention_mask=qm, **kwargs)
    resp = out[:, q.shape[1]:]
    logp = record.logprobs(out, resp.shape[1])
    q, qm, resp, logp = q[:n], qm[:n], resp[:n], logp[:n]
    if compiled:  # the prompt columns only padding holds
        keep = int(qm.sum(0).nonzero()[0]) if qm.any() else q.shape[1]
        q, qm = q[:, keep:], qm[:, keep:]
    # an EOS anywhere in the generated part, the max_new_tokens-th position included (before any padding)
    ended = (resp == tok.eos_token_id).any(1)
    if resp.shape[1] < max_new_tokens:  # every row ended early: pad to a common width
        pad = resp.new_full((resp.shape[0], max_new_tokens - resp.shape[1]), tok.pad_token_id)
        resp = torch.cat([resp, pad], 1)
        logp = torch.cat([logp, logp.new_zeros(logp.shape[0], pad.shape[1])], 1)
    mask = response_mask(resp, tok.eos_token_id)
    return Rollout(q, qm, resp.masked_fill(mask == 0, tok.pad_token_id), mask, ended, logp * mask)


def decode(tok, rollout: Rollout) -> list[str]:
    return [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(rollout.response, rollout.mask)]


def response_ids(rollout: Rollout) -> list[list[int]]:
    """Each response's token ids up to and with its EOS (what reward functions get as completion_ids)."""
    return [r[m.bool()].tolist() for r, m in zip(rollout.response, rollout.mask)]


def response_logits(model, rollout: Rollout, temperature: float = 1.0, with_hidden: bool = False):
    """The float32 logits / temperature (B, R, V) at the positions that predict each response token under `model`
    (its active adapter), and the final hidden states there when `with_hidden`: the one forward pass of every
    scoring pass (response_logprobs, response_log_softmax)."""
    R = rollout.response.shape[1]
    am = rollout.attention_mask
    with models.autocast(model):
        out = model(input_ids=rollout.input_ids, attention_mask=am, position_ids=position_ids(am), use_cache=False,
                    output_hidden_states=with_hidden, logits_to_keep=R + 1)
    hidden = out.hidden_states[-1][:, -R - 1:-1] if with_hidden else None
    return out.logits[:, :-1].float() / temperature, hidden


def response_logprobs(model, rollout: Rollout, temperature: float = 1.0, with_hidden: bool = False,
                      entropy_grad: bool = True):
    """Log-probs (B, R) of the response tokens under `model` (its active adapter), the per-token entropy, and
    optionally the final hidden states at the positions that predict each response token. `entropy_grad=False`
    computes the entropy outside the autograd graph (a loss without an entropy bonus then keeps no float32
    (B, R, vocab) tensor alive for the backward pass)."""
    logits, hidden = response_logits(model, rollout, temperature, with_hidden)
    logp = losses.logprobs_from_logits(logits, rollout.response)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = losses.entropy_from_logits(logits)
    return logp, entropy, hidden


def response_log_softmax(model, rollout: Rollout, temperature: float = 1.0,
                         with_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 log-softmax (B, R, V) of logits / temperature at the positions that predict each response token
    under `model` (its active adapter): the whole distribution, for the exact KL (losses.exact_kl); its entries at
    the response tokens are response_logprobs' log-probs. Also the final hidden states there when `with_hidden`."""
    logits, hidden = response_logits(model, rollout, temperature, with_hidden)
    return torch.nn.functional.log_softmax(logits, dim=-1), hidden


def pool_index(input_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """The position a sequence-classification head reads (transformers' rule for Llama/Mistral/Qwen, which the
    reward model is trained with): the last token that is not the pad token. With a tokenizer whose pad is its EOS
    (Llama-3 style) that is the token before the EOS, so the reward model is trained and scored at one place."""
    idx = torch.arange(input_ids.shape[1], device=input_ids.device)
    if pad_id is None:
        return idx[-1].expand(input_ids.shape[0])
    return (idx * (input_ids != pad_id)).argmax(-1)


def trunk_hidden(trunk, rollout: Rollout) -> torch.Tensor:
    """Final hidden states (B, P + R, H) of prompt + response under the trunk's active adapter (no LM head)."""
    am = rollout.attention_mask
    with models.autocast(trunk):
        return trunk(input_ids=rollout.input_ids, attention_mask=am, position_ids=position_ids(am),
                     use_cache=False).last_hidden_state


def reward_score(trunk, head, rollout: Rollout, pad_id: int | None) -> torch.Tensor:
    """The reward model's raw score (B,) of each prompt + response: `head` (models.reward_head) on the final hidden
    state where the RM reads it, with the RM's adapter active on `trunk`."""
    return head(last_hidden(trunk, rollout, pad_id).float()).squeeze(-1)


def last_hidden(trunk, rollout: Rollout, pad_id: int | None) -> torch.Tensor:
    """Final hidden state (B, H) where the reward model's head reads it (`pool_index`): the EOS, the last token if
    there is none, or the token before the EOS when pad == EOS."""
    am = rollout.attention_mask
    h = trunk_hidden(trunk, rollout)
    ids = rollout.input_ids.masked_fill(am == 0, pad_id if pad_id is not None else -1)
    return h[torch.arange(h.shape[0], device=h.device), pool_index(ids, pad_id)]
