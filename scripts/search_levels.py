"""What the declared searches share: a level is one factor's setting, run by commands whose JSON lines are kept in
OUT/levels.jsonl (resumable: a finished level is skipped), and one table OUT/table.md / table.csv written from them.

Used by scripts/routing_matters_search.py and scripts/where_grpo_fails_search.py; each script owns its declaration
(the levels, the readout, the target), this module only runs and records them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


def arguments(doc: str) -> argparse.Namespace:
    """The command line every search takes: OUT, --only, --jobs, --table-only (OUT made if missing)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--only", default=None, help="comma-separated level names (default: all, in declared order)")
    p.add_argument("--jobs", type=int, default=1, help="levels run at once (default 1)")
    p.add_argument("--table-only", action="store_true", help="rewrite the table from levels.jsonl, run nothing")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def run_json(cmd: list[str]) -> dict:
    """One command whose stdout is JSON: its object, or {"error": its last stderr line} when it exits non-zero."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout)


def markdown(frame) -> str:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def load(out: Path) -> list[dict]:
    """The finished levels' records, one per level: a level recorded twice (two runners on one folder, say one
    started with --only while another ran) keeps its first record; a rerun's measurements repeat the bits anyway."""
    path = out / "levels.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    first = {}
    for record in records:
        first.setdefault(record["level"], record)
    return list(first.values())


def run_levels(out: Path, todo: Iterable, run_level: Callable[[tuple], dict], write_table: Callable, jobs: int,
               first: Callable[[tuple], bool] = lambda level: False) -> list[dict]:
    """Run ``todo`` (levels not yet in OUT/levels.jsonl): the levels ``first`` selects alone and in order, then the
    rest ``jobs`` at a time; each record is appended as soon as its level finishes (not in declared order: a slow
    level must not hold back the records of faster ones that a stop would otherwise lose) and the table
    rewritten."""
    records = load(out)
    todo = list(todo)
    head = [lv for lv in todo if first(lv)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for record in _stream(pool, head, [lv for lv in todo if lv not in head], run_level):
            records.append(record)
            with open(out / "levels.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            write_table(out, records)
            print(f"{record['factor']}/{record['level']}: {'error ' + record['error'] if 'error' in record else 'done'}",
                  flush=True)
    write_table(out, records)
    return records


def _stream(pool, head: list, rest: list, run_level):
    yield from map(run_level, head)
    yield from (future.result() for future in as_completed([pool.submit(run_level, lv) for lv in rest]))
