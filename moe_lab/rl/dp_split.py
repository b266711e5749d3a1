"""How one data-parallel step is split over the ranks and put back together (no torch.distributed here).

``moe_lab.rl.distributed`` runs the process group; this module holds what makes its table independent of the
world size:
- every prompt group is sampled under its own seed, a function of (seed, step, prompt index), so a group
  gets the same responses on whichever rank it lands (``moe_lab.rl.groups``; a plain run samples the same way,
  so a plain run and a 1-rank torchrun give the same table bit for bit);
- groups never straddle ranks (advantages are group-local), and minibatch m takes the same G/M responses
  of every group (a seeded per-group shuffle), so each rank holds the same number of sequences in every
  minibatch and DDP's mean of the per-rank seq-mean losses is the global seq-mean loss;
- every epoch (``rl.epochs``) reshuffles each group under its own seed, so epoch e's minibatch m is also
  the same sequences on any split; update indices follow step.py (step*epochs*M + epoch*M + m);
- metrics are combined with the weights that make them the global ones (tokens for token means, sequences
  for sequence means, law of total variance for variances, max for maxima, ``rollout_corr/ess`` recomputed
  from each part's weight sums), as the module that makes each metric declares (its ``REDUCTIONS``).
What a split cannot compute as the single-process step does is refused by ``check_data_parallel``.
"""

from __future__ import annotations

import fnmatch
import math

from moe_lab.algos import reductions as R
from moe_lab.config import ConfigError, RunConfig
from moe_lab.config.mode_specs import REPLAY_SPECS, names_where


def check_data_parallel(cfg: RunConfig, world: int) -> None:
    """Refuse, in one line, what a split over ``world`` ranks cannot compute as the single-process step does."""
    rl = cfg.rl
    if rl.prompts_per_step % world:
        raise ConfigError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of the world size {world} "
                          "(prompt groups never straddle ranks)")
    if rl.group_size % rl.minibatches:
        raise ConfigError(f"rl.group_size={rl.group_size} must be a multiple of rl.minibatches={rl.minibatches} in a "
                          "data-parallel run (each minibatch takes group_size/minibatches responses of every group)")
    if rl.loss_agg == "token-mean":
        raise ConfigError("rl.loss_agg=token-mean is not supported data-parallel (a mean of per-rank token means is "
                          "not the global one); allowed: seq-mean-token-mean, seq-mean-token-sum, "
                          "seq-mean-token-sum-norm")
    if rl.whiten == "batch":
        raise ConfigError("rl.whiten=batch is not supported data-parallel (advantages must be group-local); "
                          "allowed: group")
    if rl.rollout_seeding != "per_group":
        raise ConfigError(f"rl.rollout_seeding={rl.rollout_seeding} is a plain run's legacy sampling (one generator "
                          "for the whole batch) and cannot split over ranks; allowed: per_group")
    if not REPLAY_SPECS[rl.replay].data_parallel:
        why = REPLAY_SPECS[rl.replay].single_process
        raise ConfigError(f"rl.replay={rl.replay} is not supported data-parallel ({why}); allowed: "
                          f"{names_where(REPLAY_SPECS, lambda s: s.data_parallel)}")


def rank_groups(n_prompts: int, rank: int, world: int) -> range:
    """Contiguous block of prompt indices of one rank: rank order = global batch order."""
    per = n_prompts // world
    return range(rank * per, (rank + 1) * per)


# ----------------------------------------------------------------------------- metrics across parts

def reductions() -> dict[str, object]:
    """Every metric's reduction across ranks, as declared by the module that makes it (algos/reductions.py)."""
    from moe_lab.algos import ratio_metrics, rollout_correction
    from moe_lab.algos.objectives import OBJECTIVES
    from moe_lab.rl import collect, expert_bias, step
    from moe_lab.routing import metrics, predictor

    table = {**ratio_metrics.REDUCTIONS, **ratio_metrics.DECOMP_REDUCTIONS, **rollout_correction.REDUCTIONS,
             **metrics.REDUCTIONS, **predictor.REDUCTIONS, **collect.REDUCTIONS, **step.REDUCTIONS,
             **expert_bias.REDUCTIONS}
    for objective in OBJECTIVES.values():
        table.update(objective.reductions)
    return table


def reduction_of(key: str, table: dict[str, object]):
    """The declared reduction of metric ``key`` (a name, else the first fnmatch pattern that matches it)."""
    if key in table:
        return table[key]
    for pattern, kind in table.items():
        if fnmatch.fnmatchcase(key, pattern):
            return kind
    raise KeyError(f"metric {key!r} declares no reduction across ranks: add it to the REDUCTIONS of the module "
                   "that makes it (moe_lab/algos/reductions.py lists the kinds)")


def combine_metrics(parts: list[tuple[dict, float, float]]) -> dict[str, float]:
    """Global metrics from the metrics of disjoint parts of a batch: [(metrics, n_seq, n_tok)].

    Each metric combines as its module declares (``reductions``): token means weighted by tokens, sequence
    means by sequences, variances and stds by the law of total variance, maxima by max, timings by the
    slowest part, ``rollout_corr/ess`` recomputed. Parts list the same keys.
    """
    if len(parts) == 1:  # one part's metrics are the global ones (recombining them would round)
        return dict(parts[0][0])
    table = reductions()
    kinds = {k: reduction_of(k, table) for k in parts[0][0]}
    out: dict[str, float] = {}
    for k, kind in kinds.items():
        vals = [p[0][k] for p in parts]
        if kind == R.SAME:
            # the same number on every rank, unless one rank's is NaN/inf: keep that one, so that the global
            # row shows the non-finite value the health rules must see
            out[k] = next((v for v in vals if isinstance(v, float) and not math.isfinite(v)), vals[0])
        elif kind in (R.MAX, R.SLOWEST):
            out[k] = max(vals)
        elif kind == R.MIN:
            out[k] = min(vals)
        else:  # a mean; a variance, std, covariance or share starts as the mean of its parts, replaced below
            weight = kind[-1] if isinstance(kind, tuple) else kind
            out[k] = _weighted_mean(vals, [p[1] if weight == R.SEQ_MEAN else p[2] for p in parts])
    if "rollout_corr/ess" in out:
        out["rollout_corr/ess"] = _combined_ess(parts)
    for k, kind in kinds.items():  # variances, stds and covariances around the combined means
        if isinstance(kind, tuple) and kind[0] in ("var", "std") and kind[1] in out:
            spread, mean_key, weight = kind
            w = [p[1] if weight == R.SEQ_MEAN else p[2] for p in parts]
            second = [(p[0][k] ** 2 if spread == "std" else p[0][k]) + p[0][mean_key] ** 2 for p in parts]
            var = max(_weighted_mean(second, w) - out[mean_key] ** 2, 0.0)
            out[k] = math.sqrt(var) if spread == "std" else var
        elif isinstance(kind, tuple) and kind[0] == "cov" and kind[1] in out and kind[2] in out:
            _, a, b, weight = kind
            second = [p[0][k] + p[0][a] * p[0][b] for p in parts]
            out[k] = _weighted_mean(second, [p[1] if weight == R.SEQ_MEAN else p[2] for p in parts]) - out[a] * out[b]
    for k, kind in kinds.items():  # shares of two combined variances, 0 when both are 0 (as on one part)
        if isinstance(kind, tuple) and kind[0] == "share":
            vr, vw = out[kind[1]], out[kind[2]]
            out[k] = vr / (vr + vw) if vr + vw > 0 else (0.0 if vr + vw == 0 else math.nan)
    return out


def _combined_ess(parts: list[tuple[dict, float, float]]) -> float:
    """ESS = (sum w)^2 / (n sum w^2) of the whole batch, exactly, from each part's weight mean, ESS and tokens.

    A part's sums are recovered as S = mean * n and Q = S^2 / (n ESS) (Q = 0 when its ESS is 0: all its
    weights are 0), so no extra gather is needed.
    """
    S = Q = N = 0.0
    for metrics, _, n in parts:
        if n <= 0:
            continue
        s_i, ess_i = metrics["rollout_corr/weight_mean"] * n, metrics["rollout_corr/ess"]
        S, N = S + s_i, N + n
        Q += s_i * s_i / (n * ess_i) if ess_i > 0 else 0.0
    return S * S / (N * Q) if Q > 0 else 0.0


def _weighted_mean(vals: list[float], w: list[float]) -> float:
    total = sum(wi for wi, v in zip(w, vals) if wi > 0)
    if total == 0:
        return math.nan
    return sum(wi * v for wi, v in zip(w, vals) if wi > 0) / total
