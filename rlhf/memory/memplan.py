"""Memory predictor: each stage's peak, component by component, before any weight is loaded.

The model's shape comes from arch.py. `make memplan EXP=...` prints the table; stages launched over budget are
refused (`memory.preflight`).

What is counted (bytes, per process):
  weights      4-bit linear layers (0.5 B/param + block constants) or dense ones in model.dtype; embeddings, head, norms
  lora         LoRA A/B of every target module, and modules_to_save copies (trainable), per adapter on the base;
               the online stages also hold the reward model's rm.ensemble members and the judge (frozen)
  grads        one gradient per trainable parameter; SFT/RM/DPO's forward/backward peak comes before a saved
               embed_tokens' gradient is made (the backward pass's last), so the optimizer phase counts that one
  optimizer    AdamW: two states per trainable parameter in its dtype; paged AdamW 8-bit: 2 B/param (+ block scales)
  activations  what the backward pass keeps per token and layer; with gradient checkpointing the layer inputs plus
               one layer recomputed
  logits       TRL's fused LM head works in [min(tokens, 4096), 32768] tiles (its buffer is allocated 32768 wide
               whatever the vocabulary; without Triton, on CPU, it scores every position of the padded batch and its
               torch fallback adds float32 temporaries as wide as the vocabulary chunk); our PPO keeps float32
               logits of the response positions (rows x response x vocabulary)
  tokens       SFT, RM and DPO batches are padded to their longest sequence: data.max_length, or on the synthetic
               task with a tokenizer known before loading, its longest tokenized pair (`padded_length`)
  optimizer_step  AdamW's temporaries during the step, where they outgrow the freed graph (large saved embeddings)
  kv_cache     PPO/GRPO/RLOO rollouts: keys and values of every layer for prompt + response, at the k/v heads' width
Embeddings: a tied head is one table; PEFT copies a saved embed_tokens and a saved lm_head separately (tied or not),
and PPO's reward and value adapters (the reward model's) carry no lm_head.
Data parallel (distributed.num_processes = N ranks, one GPU each) - the figures are per GPU: the config's batch
sizes are global, so activations, logits and rollouts use batch / N rows, and by distributed.strategy
  ddp          every rank holds weights, adapters, grads and optimizer state, plus DDP's gradient buckets (about one
               more copy of the trainable gradients)
  zero2        gradients and optimizer state divided by N
  fsdp, zero3  weights, adapters, gradients and optimizer state divided by N, plus one gathered (unsharded) layer:
               the larger of a decoder layer with its LoRA and the embedding / head
  PPO, GRPO    our own loops (rlhf/rl/online.py) replicate the model on every rank whatever the strategy: planned as ddp
The per-token activation coefficients were derived by counting the tensors each layer saves (RMSNorm, the LoRA
paths, rotary, SDPA, SwiGLU) and checked against the CPU tensor probe; tests/test_memory.py asserts +/-15% against
measured stage peaks on ten shapes (vocabularies of ~40 words, 613, 3,000, 32k, 128k and 152k, tied and untied
heads, fewer key/value heads than heads, gradient checkpointing on and off, batches of one length and padded ones);
`studies/memaccuracy.py` prints the same comparison with the components.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rlhf.experiment import online_sections
from rlhf.experiment import stages as registry
from rlhf.memory.arch import Arch, MemoryPlanError, UnknownArchitecture, arch
from rlhf.experiment.config import Experiment
from rlhf.memory.sizes import (
    GB, BYTES, PPO_SCORING_LOGITS, PPO_UPDATE_LOGITS, _lora_counts, _weights, _trainable, _optimizer, optimizer_step,
    _act_bytes, generation_bytes, sampling_copy_bytes, _unpadded, activations, activations_and_head, _with_ckpt,
    logits_tile, padded_length)

log = logging.getLogger(__name__)


COPY_MARGIN = 0.10
"""quantization.dequantized_copy=auto makes the copies only as large as keeps the plan 10% under memory.budget_gb: the
plan's error on the 7B shapes (results/gpu/) must not turn the speed-up into an out-of-memory error."""


@dataclass
class Plan:
    stage: str
    components: dict[str, float] = field(default_factory=dict)  # bytes
    peak_phase: str = ""
    budget_gb: float = 24.0
    info: dict[str, float] = field(default_factory=dict)  # bytes, shown beside the table, not part of the peak
    copy: float = 0.0
    """Bytes of the merged sampler's copy of the base (rlhf/rl/sampler.py; quantization.dequantized_copy), held for the
    whole run; 0: the online stage samples through the training model."""
    train_copy: float = 0.0
    """Bytes of the training path's dequantized copy of a 4-bit base (models.dequantized), held for the whole run."""
    copy_scope: str = ""
    """"run": both copies; "sampling": the sampler's alone; "": none."""
    sampling_rows: int = 0
    """Sequences each sampling pass decodes at once (an online stage's rollouts, judge measurements and held-out
    check): its KV cache's rows."""

    @property
    def peak_gb(self) -> float:
        return sum(self.components.values()) / GB

    @property
    def fits(self) -> bool:
        return self.peak_gb <= self.budget_gb


def ranks(exp: Experiment) -> int:
    return max(1, exp.distributed.num_processes)


def _local(rows: int, exp: Experiment) -> int:
    """A global batch's rows on one rank."""
    return max(1, rows // ranks(exp))


def _shard(p: Plan, a: Arch, exp: Experiment) -> None:
    """Per-GPU figures under the experiment's data-parallel strategy (see the module docstring)."""
    n, strategy = ranks(exp), exp.distributed.strategy
    if registry.get(p.stage).online:  # our online RL loops replicate the model on every rank
        strategy = "ddp"
    c = p.components
    if n == 1:
        return
    if strategy == "ddp":
        c["ddp_grad_buckets"] = c["grads"]
    elif strategy == "zero2":
        c["grads"] /= n
        c["optimizer"] /= n
        c["optimizer_step"] = c.get("optimizer_step", 0.0) / n
    else:  # fsdp / zero3: every parameter-sized component is sharded; one unit is gathered at a time
        dense = "weights_4bit" not in c
        linear = sum(i * o for i, o in a.linears().values())
        per = BYTES[exp.model.dtype] if dense else _weights(a, exp, False)["weights_4bit"] / (linear * a.layers)
        lora_layer = _lora_counts(a, exp)[0] / a.layers * BYTES[exp.quantization.compute_dtype if not dense
                                                               else exp.model.dtype]
        embed = a.vocab * a.hidden * BYTES[exp.model.dtype]
        gathered = max(linear * per + lora_layer, embed)
        for k in ("weights_4bit", "weights_dense", "embeddings_head_norms", "lora", "grads", "optimizer",
                  "optimizer_step"):
            if k in c:
                c[k] /= n
        c["gathered_layer"] = gathered


def _late_grad(a: Arch, exp: Experiment, grad_accum: int, head: bool) -> float:
    """Bytes of a saved embed_tokens' gradient (PEFT's trainable copy), which the backward pass makes last; with
    gradient accumulation the previous micro-batch's is already there, and a causal LM's tied head's share of it,
    made first, waits for the rest all through the backward."""
    if "embed_tokens" not in exp.lora.modules_to_save or grad_accum > 1 or (a.tied and head):
        return 0.0
    return a.vocab * a.hidden * BYTES[exp.quantization.compute_dtype if exp.quantization.load_in_4bit
                                      else exp.model.dtype]


def plan(exp: Experiment, name: str) -> Plan:
    """The stage's predicted peak, by the plan shape its registry entry names (rlhf/experiment/stages.py), with CUDA's overhead
    on a cuda device. An online stage samples through the merged sampler's copy of its base (held for the run) and,
    on a 4-bit base, may also train through a dequantized copy (quantization.dequantized_copy): `run` both, `sampling`
    the sampler's, `never` neither, `auto` as much as keeps COPY_MARGIN of the budget free: both, else the sampler's,
    else as many of its decoder layers as have room. On a CUDA device the sampler decodes `sampling_rows` sequences
    at once from a static cache: the most rows (up to the stage's largest sampling call) that keep that margin."""
    a = arch(exp)
    full, mode = sampling_copy_bytes(a, exp), exp.quantization.dequantized_copy
    if not _stage(name).online:
        p, longest = _plan(exp, name), padded_length(exp)
        if longest < exp.data.max_length:  # planned at the data's longest row; the worst case beside it
            p.info[f"peak if a batch reached data.max_length={exp.data.max_length} (the data's longest row: "
                   f"{longest} tokens)"] = _plan(exp, name, worst=True).peak_gb * GB
        return p
    return choose(exp, name, full, mode)


def _plan(exp: Experiment, name: str, copy: float = 0.0, train_copy: float = 0.0, rows: int = 0,
          worst: bool = False) -> Plan:
    """plan() with `copy` bytes of the merged sampler's copy and `train_copy` bytes of the training path's
    dequantized copy, both held for the whole run, and `rows` sequences per sampling pass (online stages); `worst`:
    SFT, RM and DPO batches at data.max_length, whatever the data's longest row."""
    a = arch(exp)
    st = _stage(name)
    shape, t = st.memplan, st.config(exp)  # t: the stage's section
    head = shape != "reward"
    scope = "run" if copy and train_copy else "sampling" if copy else ""
    p = Plan(name, budget_gb=exp.memory.budget_gb, copy=copy, train_copy=train_copy, copy_scope=scope,
             sampling_rows=rows)
    c = p.components
    c.update(_weights(a, exp, head))
    adapter_bytes, adapter_params = _trainable(a, exp, head)
    S = exp.data.max_length
    if shape in registry.TRAINER_SHAPES:
        S = S if worst else padded_length(exp)  # each batch is padded to its longest sequence, at most max_length
        # each rank takes batch / N of the global batch, each example its sequences (a pair: chosen and rejected)
        rows = _local(getattr(t, st.batch), exp) * st.sequences
        tokens = rows * S
        # a preference stage's reference: a frozen copy of the SFT adapter beside the trained one (reference=sft)
        c["lora"] = adapter_bytes * (2 if shape == "preference" and t.reference == "sft" else 1)
        # a saved embed_tokens' gradient is the backward pass's last, made after the graph is freed: at the
        # forward/backward peak it does not exist yet, unless an earlier micro-batch of the step left it
        late = _late_grad(a, exp, t.grad_accum, head)
        c["grads"] = adapter_bytes - late
        c["optimizer"] = _optimizer(adapter_params, adapter_bytes, t.optim)
        trains_head = "lm_head" in exp.lora.modules_to_save or (a.tied and "embed_tokens" in exp.lora.modules_to_save)
        tile = logits_tile(a, exp, rows * (S - 1), trains_head) if head else 0.0
        dropout = shape == "lm"  # TRL's preference and reward trainers turn LoRA dropout off
        c["activations"], c["logits"] = activations_and_head(a, exp, tokens, tile, dropout, not _unpadded(exp))
        # the optimizer step comes after the graph is freed (every gradient made): its temporaries count where they
        # outgrow it
        step = optimizer_step(a, exp, t.optim, adapter_bytes, head) + late
        c["optimizer_step"] = max(0.0, step - c["activations"] - c["logits"])
        p.info[f"activations if gradient checkpointing were {'off' if exp.model.gradient_checkpointing else 'on'}"] = \
            _with_ckpt(exp, not exp.model.gradient_checkpointing, lambda e: activations(a, e, tokens, dropout))
        p.peak_phase = "optimizer" if c["optimizer_step"] else "forward_backward"
        if st.policy:
            # the held-out check after training samples eval.prompts, eval.batch_size at a time, with their KV cache;
            # a preference stage's also scores with the reward model and the judge (when an RM run exists): their
            # adapters on the policy's base
            n = min(exp.eval.batch_size, exp.eval.prompts)
            check = generation_bytes(a, exp, n, exp.data.max_prompt_length + exp.eval.max_new_tokens)
            scorers = (1 + (exp.data.judge_fraction > 0)) * (shape == "preference")
            check += _trainable(a, exp, head=False)[0] * scorers + judge_model_bytes(exp)
            p.info[f"{name} held-out check (sampling{f', {scorers} reward adapters' if scorers else ''})"] = check
            beyond = check + late - (c["activations"] + c["logits"] + c["optimizer_step"])
            if beyond > 0:  # the peak is the check's: what it needs beyond the training step's transient
                c["held_out_check"], p.peak_phase = beyond, "eval"
        _shard(p, a, exp)
        return _cuda_overhead(p, exp)
    # online RL: policy (+ PPO's value) trained; ref, reward, value adapters co-resident on the one base. GRPO/RLOO
    # have no value model, a reference only when beta > 0 and a reward adapter only when reward.model > 0
    pp = t
    critic = pp.value_model if shape == "actor-critic" else None
    # beta 0 loads the reference too when the judge guards the run: the KL budget reads the KL of its samples
    reference = pp.reference if shape == "actor-critic" or pp.beta or online_sections.guarded(exp, pp) else None
    uses_rm = shape == "actor-critic" or bool(exp.reward.model)
    T, P = pp.max_new_tokens, exp.data.max_prompt_length
    # the policy (and the SFT reference) carry the SFT adapter, with its saved lm_head; the reward and value roles
    # carry the reward model's, whose saved modules have no lm_head (a sequence classifier has none)
    rm_bytes, rm_params = _trainable(a, exp, head=False)
    # the reward model's rm.ensemble members and the judge (data.judge_fraction) are frozen adapters beside it
    scorers = exp.rm.ensemble + (exp.data.judge_fraction > 0)
    n_sft, n_rm = 1 + (reference == "sft"), uses_rm * scorers + (critic == "separate")
    dt = _act_bytes(a, exp)
    c["lora"] = adapter_bytes * n_sft + rm_bytes * n_rm + (2 * a.hidden * 4 if critic else 0)
    if exp.reward.judge_model or exp.reward.grader_model:  # the user's own judge or grader: another base, resident
        c["judge_model"] = judge_model_bytes(exp)
    separate = critic == "separate"  # a value adapter trained beside the policy
    train_bytes, train_params = adapter_bytes + rm_bytes * separate, adapter_params + rm_params * separate
    c["grads"] = train_bytes
    c["optimizer"] = _optimizer(train_params, train_bytes, pp.optim)
    local_rollout = _local(getattr(pp, st.batch), exp)
    rows = rows or (min(pp.forward_batch, local_rollout) if pp.forward_batch else local_rollout)
    score_rows = scoring_rows(pp, rows, local_rollout)
    micro = _local(pp.micro_batch, exp)
    seq = P + T
    # rollout (no grad): generation holds the KV cache (a compiled sampler's static cache is held for the run); a
    # scoring pass one layer's transients, the final hidden states (every layer's with value_model=shared) and
    # float32 logits + log-softmax + entropy terms. (Every layer's for a separate value model too over-predicted the
    # 7B Mistral rollout 2.8x on an H100: results/gpu/.)
    static = compiled(exp, copy, a)
    # the static cache is made for the run's longest call (the held-out check samples eval.max_new_tokens)
    kv = generation_bytes(a, exp, rows, P + max(T, exp.eval.max_new_tokens) if static else seq)
    kept = a.layers + 1 if critic == "shared" else 1
    scoring = score_rows * seq * (4 * a.hidden + 3 * a.intermediate + kept * a.hidden) * dt
    scoring += PPO_SCORING_LOGITS * score_rows * (T + 1) * a.vocab * 4  # logits, /temperature, log-softmax, exp, ...
    if static:  # held for the run: every phase has it
        c["kv_cache"], kv = kv, 0.0
    rollout = max(kv, scoring)
    # update: one micro-batch's graph at a time (a separate value model's loss is backpropagated after the
    # policy's graph is freed: ppo.micro_step), float32 logits + log-softmax + grads of them
    tokens = micro * seq
    acts = activations(a, exp, tokens)
    update_logits = PPO_UPDATE_LOGITS * micro * (T + 1) * a.vocab * 4
    step = optimizer_step(a, exp, pp.optim, train_bytes, True)
    update = max(acts + update_logits, step)
    p.info[f"{name} rollout phase (KV cache or scoring pass)"] = rollout
    p.info[f"{name} update phase (activations + logits)"] = update
    if update >= rollout:
        c["activations"], c["logits"], p.peak_phase = acts, update_logits, "update"
        c["optimizer_step"] = update - acts - update_logits
    else:
        c["kv_cache" if kv >= scoring else "rollout_scoring"], p.peak_phase = rollout, "rollout"
    c["rollout_buffers"] = local_rollout * seq * 8 * 6
    if exp.device == "cpu" and pp.keep in ("judge", "auto") and online_sections.guarded(exp, pp):
        # the judge's CPU copies of the policies it may keep (at least the first measured and the final one): on a
        # CPU run they are device memory
        c["kept_policies"] = 2 * adapter_bytes
    if copy:
        c["sampling_copy"] = copy
    if train_copy:
        c["dequantized_copy"] = train_copy
    _shard(p, a, exp)
    return _cuda_overhead(p, exp, held=(copy + (c["kv_cache"] if static else 0.0)) if static else 0.0)


def choose(exp: Experiment, name: str, full: float, mode: str) -> Plan:
    """An online stage's plan (plan) with the copies and sampling rows quantization.dequantized_copy asks
    for: `full` the bytes of a whole copy of the decoder's linear layers, `mode` the setting (see memplan.plan)."""
    a = arch(exp)
    low, high = rows_range(exp, name)
    if mode == "never":
        return _plan(exp, name, rows=low)

    def room(p: Plan) -> bool:
        return p.peak_gb <= (1 - COPY_MARGIN) * p.budget_gb

    train = full if exp.quantization.load_in_4bit else 0.0
    order = {"run": [train], "sampling": [0.0], "auto": [train, 0.0] if train else [0.0]}[mode]
    p = None
    for t in order:
        for rows in _rows_down(high, 1 if exp.device == "cuda" else low):
            p = _plan(exp, name, full, t, rows)
            if room(p):
                return _with_info(p, full)
        if mode != "auto":
            return _with_info(p, full)
    lo, hi = 0, a.layers - 1  # auto: the most decoder layers whose sampler copy has room (the plan grows with it)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if room(_plan(exp, name, full * mid / a.layers, 0.0, low)) else (lo, mid - 1)
    return _with_info(_plan(exp, name, full * lo / a.layers, 0.0, low), full)


def rows_range(exp: Experiment, name: str) -> tuple[int, int]:
    """(rows, most rows) of an online stage's sampling passes: its forward_batch (else its local rollout batch),
    and on a CUDA device up to its largest sampling call (the local rollout batch, the judge's prompts, the held-out
    check's). On a CUDA device the whole compiled copy decodes any rows at one step's cost (the weights' read):
    the plan takes the most that fit, down to one, before it gives up layers of the copy; on a CPU batching buys no
    speed, and the passes keep forward_batch."""
    st = registry.get(name)
    pp = st.config(exp)
    local = _local(getattr(pp, st.batch), exp)
    low = min(pp.forward_batch, local) if pp.forward_batch else local
    if exp.device != "cuda":
        return low, low
    judge = pp.judge_prompts if getattr(pp, "judge_every", 0) else 0
    return low, max(low, local, judge, exp.eval.prompts)


def _rows_down(high: int, low: int) -> list[int]:
    """high, then the powers of two below it down to low, then low."""
    out, r = [high], 1 << (high.bit_length() - 1)
    while r > low:
        if r < high:
            out.append(r)
        r //= 2
    return [*out, low] if out[-1] != low else out


def _with_info(p: Plan, full: float) -> Plan:
    if full:
        label = {"run": "merged sampler's copy, held for the run, and a dequantized copy for training",
                 "sampling": "merged sampler's copy, held for the run",
                 "": f"no merged sampler's copy (all: {full / GB:.2f} GB), sampling through the 4-bit layers"}
        part = f" ({p.copy / full:.0%} of the layers; all: {full / GB:.2f} GB)" if 0 < p.copy < full else ""
        p.info[label[p.copy_scope] + part] = p.copy
    return p


def compiled(exp: Experiment, copy: float, a: Arch) -> bool:
    """The sampler decodes through a compiled static cache: on a CUDA device, with every layer merged."""
    return exp.device == "cuda" and copy > 0 and copy >= sampling_copy_bytes(a, exp) * (1 - 1e-9)


def scoring_rows(section, rows: int, local_rollout: int) -> int:
    """Rows per no-grad scoring pass of an online stage: its forward_batch (else its local rollout batch), at most
    `rows`, the plan's sampling rows (beside a held copy, the plan may have lowered both)."""
    return min(section.forward_batch or local_rollout, local_rollout, rows)


def _stage(name: str) -> registry.Stage:
    """The registry's entry of a stage with a memory plan; MemoryPlanError for an unknown stage or one that trains
    nothing."""
    try:
        st = registry.get(name)
    except KeyError as e:
        raise MemoryPlanError(f"memplan: {e.args[0]}") from None
    if st.memplan is None:
        raise MemoryPlanError(f"memplan: stage {name!r} does not train and has no memory plan")
    return st


def judge_model_bytes(exp: Experiment) -> float:
    """The weights of reward.judge_model and reward.grader_model (0 without), each loaded as the experiment loads its
    base (quantized or not): resident from the first judge measurement or held-out check on."""
    import copy

    total = 0.0
    for name in ("judge_model", "grader_model"):
        path = getattr(exp.reward, name)
        if not path:
            continue
        other = copy.deepcopy(exp)
        other.model.name = path
        try:
            total += sum(_weights(arch(other), other, head=False).values())
        except UnknownArchitecture as e:
            raise UnknownArchitecture(f"reward.{field}: {e}") from None
    return total


def _cuda_overhead(p: Plan, exp: Experiment, held: float = 0.0) -> Plan:
    """CUDA context and allocator slack (reserved beyond allocated), measured on an H100 (results/gpu/): the process
    holds 0.75 GB beyond what torch reserves, and torch reserves 5-16% beyond its peak allocation in SFT, RM and DPO,
    25-39% in PPO (generation and training passes of different shapes alternate and fragment the cache; then the
    copy was made and freed at every sampling call and the KV cache grew token by token). `held`: bytes allocated
    once for the whole run (the compiled sampler's copy and static cache), which fragment nothing: no slack on them
    (a model, not yet a measurement: results/gpu/2026-11-26-H200-decode measured sampling alone)."""
    if exp.device == "cuda":
        slack = 0.30 if registry.get(p.stage).online else 0.10
        p.components["cuda_context_and_cache"] = 0.75 * GB + slack * (sum(p.components.values()) - held)
    return p


def plans(exp: Experiment, stages=None) -> list[Plan]:
    return [plan(exp, s) for s in (stages or registry.training())]


def table(exp: Experiment, stages=None) -> str:
    """A per-stage, per-component table (GB) with the predicted peak and the budget."""
    ps = plans(exp, stages)
    names = list(dict.fromkeys(k for p in ps for k in p.components))
    unit, scale = ("GB", GB) if max(p.peak_gb for p in ps) >= 0.5 else ("MB", 1024**2)
    width = max(len(n) for n in names + ["predicted peak"])
    where = (f", per GPU of {ranks(exp)} ({exp.distributed.strategy})" if ranks(exp) > 1 else "")
    lines = [f"memory plan for {exp.name} ({exp.model.name}), {unit}{where}; budget {exp.memory.budget_gb} GB",
             f"{'component':<{width}}" + "".join(f"{p.stage:>18}" for p in ps)]
    for n in names:
        lines.append(f"{n:<{width}}" + "".join(f"{p.components.get(n, 0) / scale:>18.3f}" for p in ps))
    lines.append(f"{'predicted peak':<{width}}" + "".join(f"{p.peak_gb * GB / scale:>18.3f}" for p in ps))
    lines.append(f"{'peak phase':<{width}}" + "".join(f"{p.peak_phase:>18}" for p in ps))
    lines.append(f"{'fits budget':<{width}}" + "".join(f"{'yes' if p.fits else 'NO':>18}" for p in ps))
    online = [_stage(p.stage).online for p in ps]
    if any(online):
        full = sampling_copy_bytes(arch(exp), exp)
        copies = [(f"{p.copy / full:.0%} {p.copy_scope}" if p.copy else "none") if on else "-"
                  for p, on in zip(ps, online)]
        lines.append(f"{'sampler copy':<{width}}" + "".join(f"{c:>18}" for c in copies))
        lines.append(f"{'sampling rows':<{width}}" + "".join(
            f"{p.sampling_rows if on else '-':>18}" for p, on in zip(ps, online)))
    for key in dict.fromkeys(k for p in ps for k in p.info):
        figures = ", ".join(f"{p.stage} {p.info[key] / scale:.3f}" for p in ps if key in p.info)
        lines.append(f"for reference, {key}: {figures} {unit}")
    return "\n".join(lines)


def preflight(exp: Experiment, stage: str) -> Plan | None:
    """Refuse a stage predicted over budget before anything is loaded (memory.preflight=false launches anyway)."""
    try:
        p = plans(exp, [stage])[0]
    except UnknownArchitecture as e:
        log.warning("%s; launching without a memory prediction", e)
        return None
    if not p.fits and exp.memory.preflight:
        top = sorted(p.components.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in top)
        raise MemoryPlanError(f"{stage}: predicted peak {p.peak_gb:.2f} GB > memory.budget_gb={exp.memory.budget_gb} "
                              f"(largest: {parts}). See `make memplan EXP={exp.source or '...'}`; lower the batch "
                              f"or sequence length, or set memory.preflight=false to launch anyway.")
    return p


