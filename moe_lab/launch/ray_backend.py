"""``moe-lab run --backend ray``: the cells of an experiment as Ray tasks on a local or existing cluster.

Same rules as the local backend (moe_lab/launch/runner.py), whose plan and workers it reuses: every config is
validated before any work, finished cells are skipped, unfinished ones resume from their checkpoint, a
folder of another config is refused unless --overwrite, and cold starts run once per distinct setup
before the cells. Each cell is one task asking for ``threads`` CPUs (and a GPU when ``model.device`` is
cuda) that writes its run folder directly under ``--out``: on a cluster, ``--out`` and
``coldstart.cache_dir`` must be on a filesystem every node sees. A task whose node dies is retried by
Ray (``max_retries``) and resumes from the run's last checkpoint; writes are atomic, so a half-written
table never survives. Ray schedules; we add no scheduler of our own.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from moe_lab.launch.experiment import Cell
from moe_lab.store.status import FINISHED, STATUS_COLLAPSED, STATUS_FAILED

PROBE_TIMEOUT_S = 3.0


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ValueError("--backend ray needs Ray: pip install -e '.[ray]'") from exc
    return ray


def _resources(cfg) -> dict:
    return {"num_cpus": cfg.threads, "num_gpus": 1 if cfg.model.device == "cuda" else 0}


def probe(address: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """--address HOST:PORT: one line (ValueError) at once when nothing answers there, instead of Ray's minutes
    of retries. 'auto', 'local' and None are Ray's to resolve."""
    if not address or address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address={address!r}: allowed HOST:PORT (the head node's GCS port, 6379 by default), "
                         "auto, or none to start a local cluster")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"--address={address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
                         "with `ray start --head` on that node, check HOST:PORT, or drop --address to run on a "
                         "local cluster") from None


def connect(address: str | None):
    """Join the cluster at ``address`` ('auto' or HOST:PORT), or start a local one; keeps an existing one.

    A connection or authentication failure is one line (ValueError) saying what to do."""
    ray = _import_ray()
    if not ray.is_initialized():
        probe(address)
        try:
            # workers import moe_lab from their own installation; only a local cluster sees this driver's env
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except ray.exceptions.AuthenticationError as exc:
            raise ValueError(f"--address={address}: the Ray cluster refused this client's token ({_first_line(exc)}); "
                             "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, from "
                             "`ray get-auth-token` on its head node") from None
        except (ConnectionError, TimeoutError) as exc:
            # a wrong token ends here too (Ray logs 'InvalidAuthToken' and raises a plain ConnectionError)
            raise ValueError(f"--address={address or 'local'}: could not join the Ray cluster ({_first_line(exc)}); "
                             "check that `ray status` works on that node and, if the cluster uses token "
                             "authentication, that RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) holds its token "
                             "(`ray get-auth-token` there); or drop --address to run on a local cluster") from None
    return ray


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def progress_line(done: int, running: int, failed: int, total: int, collapsed: int = 0) -> str:
    """done counts every finished run, collapsed ones included (their number follows when there are any)."""
    return (f"ray: {done}/{total} done{f' ({collapsed} collapsed)' if collapsed else ''}, {running} running or "
            f"queued, {failed} failed")


def _failed_by_ray(cell: Cell, run_dir: Path, exc: BaseException) -> tuple[str, str]:
    """A task Ray gave up on (its retries spent on dead nodes): say so in the run's manifest."""
    from moe_lab.rl.loop import run_info
    from moe_lab.store.run_folder import RunFolder

    RunFolder(run_dir).record(STATUS_FAILED, run_info(cell.config, cell.run_id, cell.arm),
                              f"ray: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return cell.run_id, STATUS_FAILED


def run_experiment_ray(exp: dict, out: Path, *, address: str | None = None, max_retries: int = 3,
                       **kwargs) -> dict[str, str]:
    """runner.run_experiment with its cells run as Ray tasks: the same checks, plan, locks and summary."""
    from moe_lab.launch.runner import run_experiment

    return run_experiment(exp, out, backend=RayCells(address, max_retries), **kwargs)


class RayCells:
    """The runner's execution stage on a Ray cluster: cold starts first, then one task per cell."""

    def __init__(self, address: str | None = None, max_retries: int = 3):
        _import_ray()  # fail before any work when Ray is not installed
        if not (isinstance(max_retries, int) and max_retries >= 0):
            raise ValueError(f"--max-retries={max_retries!r}: allowed an integer >= 0")
        probe(address)  # an unreachable cluster fails before any folder is made
        self.address, self.max_retries = address, max_retries

    def describe(self) -> str:
        ray = connect(self.address)
        return f"Ray cluster {self.address or 'local'} ({int(ray.cluster_resources().get('CPU', 0))} CPUs)"

    def run(self, todo: list[Cell], runs_dir: Path, setups: list, progress: bool) -> dict[str, str]:
        from moe_lab.launch.runner import coldstart_worker, train_worker

        ray = connect(self.address)
        cold = ray.remote(coldstart_worker)
        ray.get([cold.options(max_retries=self.max_retries, **_resources(cfg)).remote(cfg) for cfg in setups])
        task = ray.remote(train_worker)
        pending = {task.options(max_retries=self.max_retries, **_resources(c.config)).remote(c, str(runs_dir / c.run_id)): c
                   for c in todo}
        return _wait_all(ray, pending, runs_dir, len(todo), progress)


def _wait_all(ray, pending: dict, runs_dir: Path, total: int, progress: bool) -> dict[str, str]:
    statuses, done, failed, collapsed = {}, 0, 0, 0
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(ready[0])
            try:
                run_id, status = ray.get(ready[0])
            except Exception as exc:  # Ray's errors (node died with no retry left, worker crashed): record
                run_id, status = _failed_by_ray(cell, runs_dir / cell.run_id, exc)
            statuses[run_id] = status
            done, failed = done + (status in FINISHED), failed + (status not in FINISHED)
            collapsed += status == STATUS_COLLAPSED
            say(progress_line(done, len(pending), failed, total, collapsed))
    except KeyboardInterrupt:
        for ref in pending:  # the runs keep their last checkpoint: the same command resumes them
            ray.cancel(ref, force=True)
        raise
    return statuses
