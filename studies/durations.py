"""The durations table of docs/testing.md, from the output of `make test PYTEST_ADDOPTS=--durations=0`:

    make test PYTEST_ADDOPTS=--durations=0 2>&1 | tee test.log
    .venv/bin/python studies/durations.py test.log

Prints the time per test module (setup, call and teardown added up, over both workers), the largest single items,
and the totals. The wall time is pytest's own last line."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

ITEM = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(\S+)$")
LAST = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?) in ([\d.]+)s")


def fmt(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def main(path: str, top: int = 12) -> None:
    by_module: dict[str, float] = defaultdict(float)
    items: list[tuple[float, str, str]] = []
    result = wall = None
    for line in open(path, encoding="utf-8", errors="replace"):
        m = ITEM.match(line.strip())
        if m:
            t, when, node = float(m.group(1)), m.group(2), m.group(3)
            by_module[node.split("::")[0]] += t
            items.append((t, when, node))
        elif last := LAST.search(line.strip()):
            result, wall = last.group(1), float(last.group(2))
    if not items:
        sys.exit(f"{path}: no `--durations` lines; make the log with `make test PYTEST_ADDOPTS=--durations=0 2>&1 | "
                 f"tee {path}`")
    total = sum(by_module.values())
    print(f"pytest: {result}, {fmt(wall or 0)} wall; {fmt(total)} of test time over the workers\n")
    print("| module | test time |\n|---|---|")
    for module, t in sorted(by_module.items(), key=lambda kv: -kv[1]):
        if t >= 1:
            print(f"| `{module}` | {fmt(t)} |")
    print("\n| largest items (setup = a shared fixture) | time |\n|---|---|")
    for t, when, node in sorted(items, reverse=True)[:top]:
        print(f"| {when} `{node}` | {fmt(t)} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python studies/durations.py PYTEST_LOG")
    if not Path(sys.argv[1]).is_file():
        sys.exit(f"{sys.argv[1]}: no such file; make it with `make test PYTEST_ADDOPTS=--durations=0 2>&1 | tee "
                 f"{sys.argv[1]}`")
    main(sys.argv[1])
