#!/usr/bin/env bash
# Two Ray nodes on this one machine (a head and a worker, 1 CPU each); run the smoke grid on them, kill
# the worker node mid-run, and check that every cell still ends done with no row lost or duplicated.
#   bash scripts/ray_two_node_check.sh        (needs pip install -e '.[ray]'; ~2 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-6391}
WORK=$(mktemp -d /tmp/moe-lab-ray2.XXXX)
# a private HOME: a stale ~/.ray/auth_token from an earlier local ray.init makes joining fail
export HOME=$WORK/home RAY_USAGE_STATS_ENABLED=0 OMP_NUM_THREADS=1
mkdir -p "$HOME"
cleanup() { [ -n "${WORKER_PGID:-}" ] && kill -9 -- -"$WORKER_PGID" 2>/dev/null; ray stop --force >/dev/null 2>&1 || true; }
trap cleanup EXIT
ray start --head --node-ip-address=127.0.0.1 --port="$PORT" --num-cpus=1 --include-dashboard=false >"$WORK/head.log" 2>&1
setsid ray start --address=127.0.0.1:"$PORT" --node-ip-address=127.0.0.1 --num-cpus=1 --block >"$WORK/worker.log" 2>&1 &
WORKER_PGID=$!
sleep 8
python -c "import ray; ray.init(address='127.0.0.1:$PORT', _node_ip_address='127.0.0.1'); print('nodes alive:', sum(n['Alive'] for n in ray.nodes()))"
RAY_NODE_IP_ADDRESS=127.0.0.1 moe-lab run smoke --backend ray --address 127.0.0.1:"$PORT" --out "$WORK/out" \
  --no-progress coldstart.cache_dir="$WORK/cache" > "$WORK/run.log" 2>&1 &
RUN=$!
# kill the worker node once two cells are finished (others are then running or queued)
until [ "$(grep -l '"status": "done"' "$WORK"/out/runs/*/manifest.json 2>/dev/null | wc -l)" -ge 2 ]; do
  kill -0 $RUN 2>/dev/null || break; sleep 1; done
echo "killing the worker node (process group $WORKER_PGID) with $(ls "$WORK"/out/runs | wc -l) run folders present"
kill -9 -- -"$WORKER_PGID"; WORKER_PGID=
wait $RUN; echo "moe-lab run exit status: $?"
tail -n 15 "$WORK/run.log"
python - "$WORK/out" <<'PY'
import json, sys
from pathlib import Path
import pandas as pd
runs = sorted(Path(sys.argv[1], "runs").iterdir())
bad = []
for r in runs:
    status = json.loads((r / "manifest.json").read_text())["status"]
    df = pd.read_parquet(r / "metrics.parquet")
    keys = list(zip(df["step"], df["minibatch"]))
    ok = status == "done" and len(keys) == len(set(keys)) == 3 * 2
    print(f"{r.name:20s} {status:6s} rows={len(df)} unique={len(set(keys))} {'ok' if ok else 'BAD'}")
    bad += [] if ok else [r.name]
print("ALL CELLS DONE, NO ROW LOST OR DUPLICATED" if not bad and len(runs) == 10 else f"FAILED: {bad}")
sys.exit(1 if bad or len(runs) != 10 else 0)
PY
