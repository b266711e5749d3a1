"""The file names of the run store, declared once: every reader and writer takes them from here.

A results folder (`moe-lab run --out`)::

    experiment.yaml      the experiment as the runner ran it
    runs/<run_id>/       one run folder per cell
    coldstarts/<key>.json  each cold start's recipe and weights digest

A run folder::

    config.yaml          the resolved RunConfig (safe YAML)
    manifest.json        status, reason, seed, versions, git commit, machine, timings
    metrics.parquet      one row per minibatch update (see docs/metrics.md)
    eval.parquet         one row per evaluation
    checkpoint/          model.safetensors, optim.pt (tensors only), lagged.safetensors (rl.rollout_lag > 0),
                         state.json (the commit marker, written last); checkpoint.tmp/ and checkpoint.old/ during a swap
    .lock                the one writer's flock (runlog.RunLock), holding its pid
"""

EXPERIMENT_FILE, RUNS_DIR = "experiment.yaml", "runs"
COLDSTARTS_DIR = "coldstarts"  # <key>.json: each cold start's recipe and digest (moe_lab/rl/coldstart_recipe.py)
CONFIG_FILE, MANIFEST_FILE, METRICS_FILE, EVAL_FILE = "config.yaml", "manifest.json", "metrics.parquet", "eval.parquet"
CHECKPOINT_DIR, LOCK_FILE = "checkpoint", ".lock"
# each table of a run: its file -> (the manifest / checkpoint field counting its committed rows, the column that
# steps it: a tracker's x axis)
RUN_TABLES = {METRICS_FILE: ("rows", "update"), EVAL_FILE: ("eval_rows", "step")}
# a subfolder holding any of these is a run folder (a run killed before its first flush holds its config alone)
RUN_MARKERS = (MANIFEST_FILE, METRICS_FILE, CONFIG_FILE)
# inside checkpoint/: the weights, the optimizer and RNG state, the lagged rollout weights, the commit marker
MODEL_FILE, OPTIMIZER_FILE, SNAPSHOTS_FILE, MARKER_FILE = "model.safetensors", "optim.pt", "lagged.safetensors", "state.json"
# a checkpoint is written into <checkpoint>.tmp and swapped in through <checkpoint>.old
STAGING_SUFFIX, PREVIOUS_SUFFIX = ".tmp", ".old"
# every file name above: tests/test_architecture.py checks that no module outside moe_lab/store spells one
RUN_FILE_NAMES = (EXPERIMENT_FILE, CONFIG_FILE, MANIFEST_FILE, METRICS_FILE, EVAL_FILE, LOCK_FILE, MODEL_FILE,
                  OPTIMIZER_FILE, SNAPSHOTS_FILE, MARKER_FILE)
