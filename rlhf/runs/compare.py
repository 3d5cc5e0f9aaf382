"""Compare finished (or killed) runs side by side: `python -m rlhf compare RUN ...` (`make compare RUNS="..."`).

A RUN is a run directory or a glob, taken as a path or relative to the results directory (e.g. "tiny/dpo/*").
Prints a table of the config keys (and the data-parallel ranks) that differ between the runs, their final metrics,
peak memory and wall time, and writes into <results>/compare/<timestamp>/: compare.md (the same table) and curves.png
(loss, reward, KL and memory curves from each run's metrics.jsonl, one line per run, labelled by the run id and its
differing config values)."""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time
from pathlib import Path

import yaml

from rlhf.experiment.config import flatten
from rlhf.maths.guard import won_tied_lost

IGNORED_CONFIG = {"results_dir"}
# which logged series get a panel: group name, how to recognise its keys, how many panels at most
GROUPS = (("loss", lambda k: k.endswith("loss") and k != "train_loss", 4),
          ("reward", lambda k: "reward" in k and "/std" not in k, 4),
          ("kl", lambda k: "kl" in k.split("/")[0] or k.startswith("kl/"), 3),
          ("memory", lambda k: k == "memory/peak_gb", 1))


def resolve(patterns: list[str], results_dir: str = "results") -> tuple[list[Path], list[str]]:
    """Run directories (those with a config.yaml) named by paths or globs, or a stage's `latest` pointer (the run it
    names), in the order given, without repeats; and the patterns that named none (a typo is said, not dropped)."""
    out: list[Path] = []
    none = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) or sorted(glob.glob(str(Path(results_dir) / pat)))
        found = False
        for h in map(Path, hits):
            if h.name == "latest" and h.is_file():
                h = h.parent / h.read_text().strip()
            if (h / "config.yaml").exists():
                found = True
                if h.resolve() not in [o.resolve() for o in out]:
                    out.append(h)
        if not found:
            none.append(pat)
    return out, none


def load_run(run_dir: Path) -> dict:
    summary_path = run_dir / "summary.json"
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by a kill
                continue
    return {"dir": run_dir, "id": run_dir.name, "stage": run_dir.parent.name, "experiment": run_dir.parent.parent.name,
            "config": flatten(yaml.safe_load((run_dir / "config.yaml").read_text())),
            "summary": json.loads(summary_path.read_text()) if summary_path.exists() else None, "rows": rows}


def config_diff(runs: list[dict]) -> list[str]:
    keys = sorted(set().union(*(r["config"] for r in runs)) - IGNORED_CONFIG)
    return [k for k in keys if len({json.dumps(r["config"].get(k), sort_keys=True) for r in runs}) > 1]


def label(run: dict, diff: list[str], runs: list[dict]) -> str:
    where = "" if len({(r["experiment"], r["stage"]) for r in runs}) == 1 else f"{run['experiment']}/{run['stage']}/"
    values = ", ".join(f"{k}={fmt(run['config'].get(k))}" for k in diff[:3]) + (", ..." if len(diff) > 3 else "")
    return f"{where}{run['id']}" + (f" ({values})" if values else "")


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(v, list):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return "-" if v is None else str(v)


def window(runs: list[dict], first: int, last: int, keys: list[str]) -> list[list[str]]:
    """Rows of each logged series over steps first..last (inclusive): mean, and for a few the min or max, e.g. how
    fast a value model catches up (explained_variance, vf_clipfrac over the first iterations)."""
    rows = []
    for key in keys:
        per_run = [[x[key] for x in r["rows"] if key in x and first <= x.get("step", -1) <= last] for r in runs]
        if not any(per_run):
            continue
        rows.append([f"steps {first}-{last} mean {key}", *(fmt(sum(v) / len(v)) if v else "-" for v in per_run)])
        rows.append([f"steps {first}-{last} min/max {key}",
                     *(f"{fmt(min(v))} / {fmt(max(v))}" if v else "-" for v in per_run)])
    return rows


def table(runs: list[dict], diff: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: status, the data-parallel ranks where the runs had different numbers of them, differing
    config keys, final metrics (a nested one as dotted keys: eval_win_rates.
    judge.win_rate), peak memory, wall time."""
    header = ["", *(r["id"] for r in runs)]
    rows = [["stage", *(f"{r['experiment']}/{r['stage']}" for r in runs)],
            ["status", *("finished" if r["summary"] else "unfinished" for r in runs)]]
    ranks = [(r["summary"] or {}).get("world_size") for r in runs]  # the launch's, not the config's: summary.json's
    if len({n for n in ranks if n is not None}) > 1:
        rows.append(["ranks (world_size)", *map(fmt, ranks)])
    rows += [[f"config: {k}", *(fmt(r["config"].get(k)) for r in runs)] for k in diff]
    metrics = [flatten(r["summary"]["metrics"]) if r["summary"] else {} for r in runs]  # a row per figure
    keys = list(dict.fromkeys(k for m in metrics for k in m))
    beside = {c for k in keys for c in companions(k).values()}
    for k in keys:
        if k not in beside:  # a figure's interval and n are in its own cell
            rows.append([k, *(figure(m, k) for m in metrics)])
    rows.append(["peak memory (GB)", *(fmt((r["summary"] or {}).get("memory", {}).get("peak_gb")) for r in runs)])
    rows.append(["wall time (s)", *(fmt((r["summary"] or {}).get("wall_time_s")) for r in runs)])
    rows.append(["fingerprint", *((r["summary"] or {}).get("lineage", {}).get("fingerprint", "-") for r in runs)])
    return header, rows


def companions(key: str) -> dict[str, str]:
    """The summary keys that go with figure `key`: its 95% interval, its n and effective n (`<key>_ci95`, ...), or,
    for a grader's win rate (`....win_rate`), the interval, n and won/tied counts beside it."""
    if key.endswith(".win_rate"):
        base = key[: -len("win_rate")]
        return {"ci95": f"{base}ci95", "n": f"{base}n", "wins": f"{base}wins", "ties": f"{base}ties"}
    return {"ci95": f"{key}_ci95", "n": f"{key}_n", "n_effective": f"{key}_n_effective"}


def figure(m: dict, key: str) -> str:
    """One run's figure `key` with what goes with it (companions) in one cell: `0.555 [0.413, 0.688] n=100
    (effective 46)`, a win rate's `0.6 [0.45, 0.75] n=40: 20 won, 8 tied, 12 lost`."""
    c = {k: m.get(v) for k, v in companions(key).items()}
    text = fmt(m.get(key))
    if isinstance(c["ci95"], list) and len(c["ci95"]) == 2:
        text += f" [{fmt(c['ci95'][0])}, {fmt(c['ci95'][1])}]"
    if isinstance(c["n"], int):
        text += f" n={c['n']}"
        if isinstance(c.get("n_effective"), (int, float)) and c["n_effective"] < c["n"] - 0.5:
            text += f" (effective {c['n_effective']:.0f})"
        if said := won_tied_lost(c):
            text += f": {said}"
    return text


def markdown(header: list[str], rows: list[list[str]], labels: list[str]) -> str:
    lines = ["# Run comparison", "", *(f"- `{r}`: {lab}" for r, lab in zip(header[1:], labels)), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


CELL = 64
"""The console table's widest cell: a longer one (a list of records) is cut with an ellipsis (compare.md: whole)."""


def cut(text: str, n: int) -> str:
    """`text` in at most n characters, a cut one ending in an ellipsis (a table's cell)."""
    return text if len(text) <= n else text[: n - 1] + "…"


def text(header: list[str], rows: list[list[str]]) -> str:
    rows = [[cut(c, CELL) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def series(run: dict, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in run["rows"]
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def panels(runs: list[dict]) -> list[str]:
    """The logged series worth a panel: per group, those with the most points (at least 2 in some run)."""
    keys = dict.fromkeys(k for r in runs for row in r["rows"] for k, v in row.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool))
    out = []
    for _, match, limit in GROUPS:
        found = [k for k in keys if match(k) and k not in out and max(len(series(r, k)[0]) for r in runs) >= 2]
        found.sort(key=lambda k: (-max(len(series(r, k)[0]) for r in runs), k))
        out += found[:limit]
    return out


def plot(runs: list[dict], labels: list[str], path: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = panels(runs)
    if not keys:
        return []
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    spare = nrows * ncols - len(keys)  # empty grid cells hold the legend; else it goes under the panels
    legend_h = 0.0 if spare else 0.25 + 0.22 * len(runs)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows + 0.5 + legend_h), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")  # identical runs draw over each other: dashes keep every one visible
    for ax, key in zip(axes.flat, keys):
        for i, run in enumerate(runs):
            x, y = series(run, key)
            ax.plot(x, y, color=colors[i % len(colors)], linestyle=styles[i % len(styles)],
                    marker="o" if len(x) <= 20 else None, markersize=3, linewidth=1.8, label=labels[i])
        ax.set_title(key if key.startswith("eval") else f"{key} (training)", fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel(key.split("/")[-1])
        ax.grid(alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=13)
    if spare:
        holder = list(axes.flat)[len(keys)]
        holder.legend(handles, names, loc="center left", fontsize=10, frameon=False, title="runs",
                      title_fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    else:
        fig.legend(handles, names, loc="lower center", ncol=1, fontsize=10, frameon=False)
        fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1 - 0.45 / fig.get_figheight()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlhf compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run directories or globs (paths, or relative to --results)")
    ap.add_argument("--results", default="results", help="results directory (default: %(default)s)")
    ap.add_argument("--out", default=None, help="output directory (default: <results>/compare/<timestamp>)")
    ap.add_argument("--steps", default=None, metavar="A:B",
                    help="also tabulate the logged series over steps A..B (mean, min/max), e.g. 1:15")
    ap.add_argument("--keys", default="explained_variance,vf_clipfrac,value_loss,clipfrac,approx_kl,kl/ref,"
                    "reward/mean,response/eos_frac", help="with --steps: the series (default: %(default)s)")
    args = ap.parse_args(argv)
    if not args.runs:  # `make compare` without RUNS
        print('error: compare needs the runs to compare: RUNS="tiny/dpo/*" (make compare), or run directories or '
              f'globs after `rlhf compare` (paths, or relative to --results {args.results})', file=sys.stderr)
        return 2
    dirs, none = resolve(args.runs, args.results)
    if none:
        print(f"error: {', '.join(none)}: no run directory (a run directory holds a config.yaml; a name that is not a "
              f"path is looked for under --results {args.results})", file=sys.stderr)
        return 2
    if len(dirs) < 2:
        print(f"error: compare needs at least two run directories; {' '.join(args.runs)} named {len(dirs)} (a run "
              f"directory holds a config.yaml; a name that is not a path is looked for under --results "
              f"{args.results})", file=sys.stderr)
        return 2
    runs = [load_run(d) for d in dirs]
    diff = config_diff(runs)
    labels = [label(r, diff, runs) for r in runs]
    header, rows = table(runs, diff)
    if args.steps:
        try:
            first, last = (int(x) for x in args.steps.split(":"))
        except ValueError:
            first, last = 0, -1
        if not 0 < first <= last:
            print(f"error: --steps takes A:B, two step numbers from 1 with A <= B, got '{args.steps}'", file=sys.stderr)
            return 2
        rows += window(runs, first, last, args.keys.split(","))
    out = Path(args.out) if args.out else Path(args.results) / "compare" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    stages = sorted({f"{r['experiment']}/{r['stage']}" for r in runs})
    keys = plot(runs, labels, out / "curves.png", f"{len(runs)} runs of {', '.join(stages)}"
                + (f" - differing: {', '.join(diff[:4])}" if diff else " - identical configs"))
    (out / "compare.md").write_text(markdown(header, rows, labels) + (
        "\n![curves](curves.png)\n" if keys else "\n(no curves: the runs logged no loss/reward/KL/memory series)\n"))
    print(text(header, rows))
    print(f"\nwrote {out / 'compare.md'}" + (f" and {out / 'curves.png'} ({', '.join(keys)})" if keys else ""))
    return 0
