"""`--report-to` streams rows while a run runs (moe_lab/launch/tracking.py): a tracker receives every committed row of a
run once, in order, across an interruption and a resume; a replaced run is sent again from its first row; rows
arrive before the cell ends; a tracker that refuses never stops the runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from moe_lab.launch import tracking
from moe_lab.launch.tracking import STREAMED_FILE, TrackerError, TrackerStream
from moe_lab.rl import checkpoint
from moe_lab.store.layout import EVAL_FILE, METRICS_FILE
from moe_lab.store.status import STATUS_DONE, STATUS_INTERRUPTED, STATUS_RUNNING

ROOT = Path(__file__).resolve().parents[1]


class FakeSink:
    """Records every row it is given (per run and table x) and whether its run was still running then."""

    received: dict[tuple[str, str], list[dict]] = {}
    while_running: list[str] = []
    opened: list[str] = []

    def __init__(self, run_dir: Path, logdir: Path, group):
        self.run_dir = Path(run_dir)
        logdir.mkdir(parents=True, exist_ok=True)
        (logdir / "events").write_text("fake")
        FakeSink.opened.append(self.run_dir.name)

    def log(self, frame: pd.DataFrame, x: str) -> int:
        FakeSink.received.setdefault((self.run_dir.name, x), []).extend(frame.to_dict("records"))
        manifest = json.loads((self.run_dir / "manifest.json").read_text())
        if manifest.get("status") == STATUS_RUNNING:
            FakeSink.while_running.append(self.run_dir.name)
        return len(frame)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(tracking.TRACKERS, "fake", (lambda: None, FakeSink))
    FakeSink.received, FakeSink.while_running, FakeSink.opened = {}, [], []
    return FakeSink


def _tables(run: Path, updates: int, evals: int, perf: float = 1.0, shift: float = 0.0) -> None:
    pd.DataFrame({"step": list(range(updates)), "update": list(range(updates)),
                  "reward/mean": [0.1 * u + shift for u in range(updates)],
                  "perf/wall_s": [perf * u for u in range(updates)]}).to_parquet(run / METRICS_FILE)
    pd.DataFrame({"step": [4 * e for e in range(evals)],
                  "eval/acc_greedy": [0.5 + e / 10 + shift for e in range(evals)]}).to_parquet(run / EVAL_FILE)


def _commit(run: Path, rows: int, eval_rows: int) -> None:
    model = torch.nn.Linear(1, 1)
    checkpoint.save(run / "checkpoint", model, torch.optim.SGD(model.parameters(), lr=0.1),
                    {"step": rows, "rows": rows, "eval_rows": eval_rows})


def _manifest(run: Path, status: str, **fields) -> None:
    (run / "manifest.json").write_text(json.dumps({"run_id": run.name, "status": status, **fields}))


def _stream(run: Path, root: Path) -> TrackerStream:
    return TrackerStream("fake", [run], root, poll_s=3600)


def test_every_committed_row_reaches_the_tracker_once_in_order_across_an_interruption_and_a_resume(tmp_path, fake):
    run, root = tmp_path / "runs" / "a-s0", tmp_path / "fake"
    run.mkdir(parents=True)
    # first invocation: 6 rows flushed, 4 committed by the checkpoint; the 2 after it are recomputed by the resume
    _tables(run, 6, 1)
    _commit(run, 4, 1)
    _manifest(run, STATUS_RUNNING)
    stream = _stream(run, root)
    stream.poll()
    assert [r["update"] for r in fake.received[("a-s0", "update")]] == [0, 1, 2, 3]
    stream.poll()  # nothing committed since: nothing sent
    assert len(fake.received[("a-s0", "update")]) == 4
    _manifest(run, STATUS_INTERRUPTED)
    stream.finish()
    # the resume: rows 4 and 5 come back with other timings, 8 rows and 2 evals committed, then the run ends done
    _tables(run, 8, 2, perf=2.0)
    pd.concat([pd.read_parquet(run / METRICS_FILE).iloc[:4].assign(**{"perf/wall_s": [0.0, 1.0, 2.0, 3.0]}),
               pd.read_parquet(run / METRICS_FILE).iloc[4:]], ignore_index=True).to_parquet(run / METRICS_FILE)
    _commit(run, 8, 2)
    _manifest(run, STATUS_RUNNING)
    stream = _stream(run, root)
    stream.poll()
    assert [r["update"] for r in fake.received[("a-s0", "update")]] == list(range(8))
    _tables(run, 10, 3, perf=2.0)
    pd.concat([pd.read_parquet(run / METRICS_FILE).iloc[:4].assign(**{"perf/wall_s": [0.0, 1.0, 2.0, 3.0]}),
               pd.read_parquet(run / METRICS_FILE).iloc[4:]], ignore_index=True).to_parquet(run / METRICS_FILE)
    _commit(run, 10, 3)
    _manifest(run, STATUS_DONE, rows=10, eval_rows=3)
    stream.finish()
    final = pd.read_parquet(run / METRICS_FILE).to_dict("records")
    assert fake.received[("a-s0", "update")] == final  # each row once, in order, as the tables hold it
    assert fake.received[("a-s0", "step")] == pd.read_parquet(run / EVAL_FILE).to_dict("records")
    assert fake.opened == ["a-s0", "a-s0"]  # one sink per invocation that had rows to send
    # a later invocation over the finished run sends nothing and opens no sink
    _stream(run, root).finish()
    assert fake.opened == ["a-s0", "a-s0"] and len(fake.received[("a-s0", "update")]) == 10


def test_a_replaced_run_is_sent_again_from_its_first_row_into_an_emptied_folder(tmp_path, fake):
    run, root = tmp_path / "runs" / "a-s0", tmp_path / "fake"
    run.mkdir(parents=True)
    _tables(run, 4, 1)
    _commit(run, 4, 1)
    _manifest(run, STATUS_DONE, rows=4, eval_rows=1)
    _stream(run, root).finish()
    (root / "a-s0" / "stale").write_text("left by the first")
    _tables(run, 4, 1, shift=1.0)  # --overwrite: another run of the same id, other rows
    _commit(run, 4, 1)
    fake.received = {}
    _stream(run, root).finish()
    assert fake.received[("a-s0", "update")] == pd.read_parquet(run / METRICS_FILE).to_dict("records")
    assert not (root / "a-s0" / "stale").exists() and (root / "a-s0" / STREAMED_FILE).is_file()


def test_an_older_mirror_without_a_record_is_replaced_not_added_to(tmp_path, fake):
    run, root = tmp_path / "runs" / "a-s0", tmp_path / "fake"
    run.mkdir(parents=True)
    _tables(run, 3, 1)
    _manifest(run, STATUS_DONE, rows=3, eval_rows=1)
    (root / "a-s0").mkdir(parents=True)
    (root / "a-s0" / "events.old").write_text("a whole-table mirror of older code")
    _stream(run, root).finish()
    assert not (root / "a-s0" / "events.old").exists()
    assert [r["update"] for r in fake.received[("a-s0", "update")]] == [0, 1, 2]


def test_a_tracker_that_refuses_one_run_streams_the_others_and_says_so_after(tmp_path, fake, monkeypatch):
    runs = []
    for name in ("a-s0", "b-s0"):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        _tables(run, 2, 1)
        _manifest(run, STATUS_DONE, rows=2, eval_rows=1)
        runs.append(run)

    class Refusing(FakeSink):
        def __init__(self, run_dir, logdir, group):
            if Path(run_dir).name == "a-s0":
                raise RuntimeError("no login")
            super().__init__(run_dir, logdir, group)

    monkeypatch.setitem(tracking.TRACKERS, "fake", (lambda: None, Refusing))
    with pytest.raises(TrackerError, match=r"--report-to fake: could not stream 1 run\(s\) \(a-s0: RuntimeError"):
        TrackerStream("fake", runs, tmp_path / "fake").finish()
    assert [r["update"] for r in fake.received[("b-s0", "update")]] == [0, 1]


def test_rows_stream_while_the_run_runs_and_all_of_them_arrive_once(tmp_path, fake, monkeypatch):
    """A real run through the runner: the tracker gets rows while the run's manifest still says running (each
    checkpoint commits some), and in the end exactly the run's tables."""
    from moe_lab.config import apply_overrides, load_yaml
    from moe_lab.launch.runner import run_experiment

    monkeypatch.setattr(tracking, "POLL_S", 0.05)
    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
    base = apply_overrides(smoke["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=6",
                                           "rl.checkpoint_every=1"])
    exp = {"name": "tracked", "base": base, "arms": {"grpo": smoke["arms"]["grpo"]}, "seeds": [0]}
    out = tmp_path / "out"
    t0 = time.time()
    assert run_experiment(exp, out, jobs=1, progress=False, echo=lambda *_: None, report_to="fake") == {
        "grpo-s0": STATUS_DONE}
    assert "grpo-s0" in fake.while_running, f"no rows before the cell ended ({time.time() - t0:.1f} s)"
    run = out / "runs" / "grpo-s0"
    for x, name in (("update", METRICS_FILE), ("step", EVAL_FILE)):  # NaN columns too: compared as frames
        pd.testing.assert_frame_equal(pd.DataFrame(fake.received[("grpo-s0", x)]), pd.read_parquet(run / name),
                                      check_dtype=False)
