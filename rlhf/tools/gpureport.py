"""`make gpucheck`'s tables: the .md beside each results/gpu .json (measured beside planned memory, throughput,
the device checks, where an iteration's time goes), and earlier runs replanned with today's memory plan."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf.experiment import config, stages
from rlhf.memory import memplan
from rlhf.infra.toolchain import stack, stack_line
from rlhf.tools.gpumetrics import online_throughput, trained_tokens_per_s

ROOT = Path(__file__).resolve().parents[2]


def _speed(stage: str, exp, row: dict) -> str:
    """The throughput cell of the tables: what each figure counts, in its name."""
    if stages.get(stage).online:
        on = row.get("online") or {}
        if "sampled_tokens_per_s" not in on:
            on = online_throughput(stage, exp, {"throughput": row.get("throughput") or {}})
        return f"{on['episodes_per_s']:.2f} episodes/s, {on['sampled_tokens_per_s']:,.0f} sampled tok/s"
    rate, label = trained_tokens_per_s(stage, exp, row)
    return f"{rate:,.0f} {label}" if rate is not None else "-"


def markdown(report: dict, tops: bool = True) -> str:
    """The .md beside the .json; `tops=False` (the console's copy) leaves out the profiles' top-op tables."""
    lines = [f"# gpucheck {report['date']} on {report['device']}", "",
             f"{stack_line(report)}; bitsandbytes {report.get('bitsandbytes')}, transformers "
             f"{report.get('transformers')}; {report['mode']}", "",
             "Throughput: trained tok/s = every token of every trained sequence (prompt and response; chosen and "
             "rejected) per second of training; sampled tok/s = prompt + response tokens of every sampled sequence "
             "per second of the whole iteration.", "",
             "| experiment | stage | predicted GB | measured GB (probe) | error | torch allocated | torch reserved | "
             "NVML process | peak phase | throughput |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["experiments"]:
        name = Path(r["experiment"]).stem
        exp = config.load(ROOT / r["experiment"], _settings(r))
        for st, row in r["stages"].items():
            if "measured_gb" not in row:
                lines.append(f"| {name} | {st} | {row['predicted_gb']:.2f} | FAILED: {row.get('error')} | | | | | | |")
                continue
            speed = _speed(st, exp, row)

            def gb(k):
                return f"{row[k]:.2f}" if row.get(k) is not None else "-"
            lines.append(f"| {name} | {st} | {row['predicted_gb']:.2f} | {row['measured_gb']:.2f} | "
                         f"{row['prediction_error']:+.1%} | {gb('peak_allocated_gb')} | {gb('peak_reserved_gb')} | "
                         f"{gb('nvml_used_gb')} | {row['measured_peak_phase']} | {speed} |")
        cg = r.get("checkpointing_gradients")
        if cg and "all" in cg:
            lines.append(f"\n{name}: PPO gradients (all {cg['all']['tensors']} policy and value tensors), checkpointing "
                         f"on vs off: relative norm difference {cg['all']['rel_norm_diff']:.3g}; off vs off (the "
                         f"floor): {cg['all']['floor_rel_norm_diff']:.3g}; deterministic algorithms, one rollout "
                         f"(its passes equal in every setting: {cg['rollout_stats_equal']}). {cg}\n")
        elif cg:
            lines.append(f"\n{name}: PPO gradients with checkpointing on vs off: {cg}\n")
        sc = r.get("sampling_copy")
        if sc and "error" not in sc and "merged_s" in sc:
            lines.append(f"\n{name}: PPO's policy sampling {sc['rows']} prompts x {sc['max_new_tokens']} new tokens: "
                         f"the training model (4-bit layers, LoRA branches) {sc['4bit_s']:.2f} s, the merged sampler "
                         f"({sc['copy_bytes'] / 1024**3:.2f} GB, {'compiled' if sc['compiled'] else 'eager'}) "
                         f"{sc['merged_s']:.2f} s ({sc['speedup']:.2f}x); same samples: {sc['same_samples']}; "
                         f"log-prob gap to the training path over {sc['tokens']} tokens, max / mean: training model "
                         f"{sc['4bit_logprob_gap_max']:.2e} / {sc['4bit_logprob_gap_mean']:.2e}, merged sampler "
                         f"{sc['merged_logprob_gap_max']:.2e} / {sc['merged_logprob_gap_mean']:.2e}.\n")
        elif sc:
            lines.append(f"\n{name}: sampling check: {sc}\n")
        d = r.get("decode")
        if d and "ms_per_step" in d:
            lines.append(f"\n{name}: a decode step of {d['rows']} rows through {d['path']}: {d['ms_per_step']:.2f} ms, "
                         f"{d.get('x_weight_read', '-')}x the time to read its weights at the measured copy "
                         f"bandwidth ({d.get('weight_read_ms', '-')} ms at {d.get('copy_bandwidth_gbps', '-')} GB/s).\n")
        elif d:
            lines.append(f"\n{name}: decode step: {d}\n")
        lines += online_lines(name, r["stages"])
    lines += loan_lines(report.get("loan"))
    timing = [line for r in report["experiments"] for st, row in r["stages"].items()
              for line in time_markdown(Path(r["experiment"]).stem, st, row, tops)]
    if timing:
        lines += ["", "## Where an iteration's time goes", "",
                  "Seconds per part of an iteration (the loop's `time/<part>_s`; rollout_rest, update_rest: what "
                  "the timed parts leave of the rollout and of the update; bookkeeping: after the update), then one "
                  "iteration under torch.profiler: self time by group (bnb_dequant: bitsandbytes' 4-bit ops and "
                  "kernels; matmul; attention; other ops; untraced: CPU time outside any op, Python; idle: no kernel "
                  "running), as a share of that iteration's wall time (profiler on), and the top ops and kernels. "
                  "docs/performance.md says how to read it.", *timing]
    return "\n".join(lines) + "\n"


def online_lines(name: str, rows: dict) -> list[str]:
    """Per online stage: its throughput with the first iteration apart and as shipped (the judge composed at the
    shipped cadence), what its sampler decoded with and the decode step against the weights' read time."""
    out = []
    for st, row in rows.items():
        on, smp, d = row.get("online") or {}, row.get("sampler"), row.get("decode") or {}
        if not smp:
            continue
        a = on.get("as_shipped") or {}
        drawn = (f"; SFT's reference draw, once a run: {a['reference_draw_s']:.3g} s" if a.get("reference_draw_s")
                 else "")
        shipped = (f"; as shipped ({a['rollout_batch']}-episode rollouts, the judge's {a['judge_prompts']} prompts "
                   f"every {a['judge_every']} iterations: {a['judge_s']:.3g} s, {a['judge_share']:.0%}{drawn}) "
                   f"**{a['episodes_per_s']:.3g} episodes/s**" if a else "; as shipped: not composed (no iteration "
                   "after the first, or no judge's measurement)")
        how = "compiled" if smp.get("compiled") else f"eager ({smp.get('eager_reason')})"
        ms = d.get("ms_per_step")
        dec = (f"; decode step {ms:.3g} ms" + (f", {d['x_weight_read']}x the {d['weight_read_ms']} ms its weights take "
                                             f"to read" if d.get("x_weight_read") else "") if ms else "")
        n = on.get("iterations") or 0
        over = f"iterations 2-{n} (the first: {on.get('first_iteration_s')} s)" if n > 1 else f"{n} iteration(s)"
        out.append(f"\n{name} {st}: {on.get('episodes_per_s')} episodes/s over {over}{shipped}. Sampler: "
                   f"{smp.get('path')}, {how}, copy "
                   f"{_share(smp.get('copy_share'))} of the base's linear weights, {smp.get('rows')} rows{dec}."
                   + (f" FAILED: {row['failed']}" if row.get("failed") else "") + "\n")
    return out


def _share(x) -> str:
    return f"{x:.0%}" if isinstance(x, (int, float)) else str(x)


def loan_lines(loan: dict | None) -> list[str]:
    """The loan's plan against its wall time, DPO's reused figure and the int8 copy's decode step."""
    if not loan:
        return []
    out = [f"\nPlan: ~{loan['estimate_s']:.0f} s estimated (" + ", ".join(f"{p['part']} ~{p['estimate_s']:.0f} s"
                                                                       for p in loan["plan"])
           + f"); {loan.get('wall_s')} s so far" + (f" of the {loan['budget_s']:.0f} s budget" if loan.get("budget_s")
                                                   else "") + ".\n"]
    if loan.get("dpo_reused"):
        d = loan["dpo_reused"]
        out.append(f"\nDPO (reused, not measured in this call: {d['reused_from']}, {d['device']}, {d['date']}): "
                   f"{d['trained_tokens_per_s']} trained tok/s, {d['measured_gb']} GB measured.\n")
    if "int8" in loan:
        i = loan["int8"]
        x = f"; {i['x_weight_read']}x the bf16 weights' read time" if i.get("x_weight_read") else ""
        out.append("\nint8 weight-only copy, decode step in its own process: "
                   + (f"{i['ms_per_step']} ms ({i.get('rows')} rows{x})" if "ms_per_step" in i else str(i)) + ".\n")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def time_markdown(name: str, stage: str, row: dict, tops: bool = True) -> list[str]:
    """The markdown lines of an online stage's time per part and its profiled iteration (none for other stages)."""
    parts, prof = row.get("iteration_parts"), row.get("profile")
    if not parts and not prof:
        return []
    out = [""]
    if parts:
        n = parts["iterations"]
        of = f"mean of iterations 2-{n}, the first {parts['first_iteration']['step_s']:.3g} s" if n > 1 else "mean of 1"
        out.append(f"**{name} {stage}**: {parts['step_s']:.3g} s per iteration ({of}): " +
                   ", ".join(f"{k} {v:.3g} s ({parts['share'][k]:.0%})" for k, v in parts["parts_s"].items()
                             if parts["share"].get(k) is not None) + ".")
    if prof and "error" in prof:
        out.append(f"\n{name} {stage} profile: FAILED {prof['error']}")
    elif prof:
        def groups(g: dict) -> str:
            return ", ".join(f"{k} {v['s']:.3g} s ({v['share']:.0%})" for k, v in g["groups"].items())

        out.append(f"\nProfile of iteration {prof['iteration']} ({', '.join(prof['activities'])}; {prof['wall_s']:.3g} "
                   f"s with the profiler on):" + (f" device kernels: {groups(prof['device'])};" if prof.get("device")
                                                  else "") + f" CPU ops: {groups(prof['cpu'])}.")
        for kind, g in (("device kernels", prof.get("device")), ("CPU ops", prof["cpu"])):
            if tops and g and g["top"]:
                out += ["", f"| top {kind}, self time | group | s | calls | share |", "|---|---|---|---|---|"]
                out += [f"| {_cell(t['name'])} | {t['group']} | {t['s']:.4g} | {t['calls']} | {t['share']:.1%} |"
                        for t in g["top"]]
    return out


def _settings(r: dict) -> list[str]:
    """A recorded experiment's overrides, less the data and base paths (a scratch folder, gone)."""
    return [o for o in r["overrides"] if not o.startswith(("data.source", "data.path"))]


def replan(paths: list[str]) -> str:
    """Measured peaks of earlier gpucheck runs beside what the memory plan predicts for the same settings now (the
    README's table): `python -m rlhf.tools.gpucheck --table results/gpu/*.json`. Each row names the torch, CUDA and
    driver it was measured with; a line under the table says how each run's stack differs from the lock's."""
    lines = ["| experiment | stage | measured GB (NVML) | torch peak allocated | peak phase | predicted now | "
             "error now | training phases: measured / predicted / error | throughput | torch / CUDA / driver |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    stacks = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        stacks.append(f"{Path(path).name}: {stack_line(report)}")
        measured_with = " / ".join(stack(report))
        for r in report["experiments"]:
            exp = config.load(ROOT / r["experiment"], _settings(r))
            for st, row in r["stages"].items():
                if "measured_gb" not in row:
                    continue
                p = memplan.plans(exp, [st])[0] if exp.device == "cuda" else memplan.plan(exp, st)
                speed = _speed(st, exp, row)
                # without the held-out check after training (the phase the plan calls eval)
                trained = max(ph["peak_gb"] for k, ph in row["phases"].items() if k != "eval")
                planned = p.peak_gb - p.components.get("held_out_check", 0.0) / 1024**3
                lines.append(f"| {Path(r['experiment']).stem} | {st} | {row['measured_gb']:.2f} | "
                             f"{max(ph['peak_allocated_gb'] for ph in row['phases'].values()):.2f} | "
                             f"{row['measured_peak_phase']} | {p.peak_gb:.2f} ({p.peak_phase}) | "
                             f"{p.peak_gb / row['measured_gb'] - 1:+.1%} | {trained:.2f} / {planned:.2f} / "
                             f"{planned / trained - 1:+.1%} | {speed} | {measured_with} |")
    return "\n".join([*lines, "", *stacks])
