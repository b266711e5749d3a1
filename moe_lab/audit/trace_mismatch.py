"""check-trace's mismatch report: the engine's log-probs of the completion tokens against the trainer's (the
checkpoint run teacher-forced), with free routing and with the trace's routes replayed (R3), under the names
each stack logs them (algos.mismatch_metrics), how much of the mismatch replaying the routes removes, and a
one-line verdict naming the larger source (docs/traces.md, "The mismatch report").

Routing's share is paired: both passes are scored on the same tokens (every sequence that carries engine
log-probs), so k3(free) - k3(replayed) is the part of the mismatch the routes explain; what is left under
replay is numerics (kernels, dtypes, batch composition), the part R3 cannot remove.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lab.algos import mismatch_metrics as mm
from moe_lab.config.constants import TIS_THRESHOLD
from moe_lab.formats.logprobs import FIELDS

Tensor = torch.Tensor
PASSES = ("free", "replayed")
# Below this k3 (|d| ~ 1.4e-3 rms: float32 against float64 log-softmax, never a bf16 engine) neither source is
# worth naming: the verdict is "none".
NEGLIGIBLE_K3 = 1e-6


@dataclass(frozen=True)
class MismatchOptions:
    tis_threshold: float = TIS_THRESHOLD
    seq_error_threshold: float = mm.SEQ_ERROR_THRESHOLD


def _padded(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    T = max(r.numel() for r in rows)
    out = torch.zeros(len(rows), T, dtype=torch.float64)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r.double()
        mask[b, : r.numel()] = True
    return out, mask


def batch(checked: list) -> dict[str, Tensor] | None:
    """Padded [B, T] completion log-probs of the sequences that carry the engine's: ``engine``, ``free``,
    ``replayed`` (absent when a pass was not run) and ``mask``; None when no sequence carries them."""
    rows = [c for c in checked if c.seq.engine_logprobs is not None and c.seq.engine_logprobs.numel()]
    if not rows:
        return None
    out: dict = {"where": [c.seq.where for c in rows], "token_ids": [c.seq.tokens[c.seq.prompt_len:] for c in rows]}
    out["engine"], out["mask"] = _padded([c.seq.engine_logprobs for c in rows])
    out["free"], _ = _padded([c.free.token_logp_S[c.seq.prompt_len:] for c in rows])
    if all(c.replayed is not None and c.replayed.token_logp_S is not None for c in rows):
        out["replayed"], _ = _padded([c.replayed.token_logp_S[c.seq.prompt_len:] for c in rows])
    return out


def pass_report(engine: Tensor, trainer: Tensor, mask: Tensor, opts: MismatchOptions) -> dict:
    """Every metric of one pass (the trainer's log-probs with free or replayed routing)."""
    err = mm.seq_mult_prob_error(engine, trainer, mask)
    return {"token": mm.token_mismatch(engine, trainer, mask),
            "nemo_rl": {"seq_mult_prob_error": err.tolist(),
                        "max_seq_mult_prob_error": float(err.max()), "mean_seq_mult_prob_error": float(err.mean()),
                        "min_seq_mult_prob_error": float(err.min()),
                        "seq_logprob_error_threshold": opts.seq_error_threshold,
                        "outlier_share": float((err > opts.seq_error_threshold).double().mean())},
            "verl": mm.verl_offpolicy(engine, trainer, mask),
            "tis": {"threshold": opts.tis_threshold, **mm.verl_tis(engine, trainer, mask, opts.tis_threshold)}}


def routing_share(passes: dict, disagreement_L: dict[str, float]) -> dict:
    """The k3 replaying the trace's routes removes (same tokens in both passes) and the per-layer router
    disagreement (1 - agreement of the routes with the model's own choice)."""
    out: dict = {"router_disagreement": disagreement_L}
    if "replayed" in passes:
        free, rep = passes["free"]["token"]["k3"], passes["replayed"]["token"]["k3"]
        out.update(k3_free=free, k3_replayed=rep, k3_removed_by_replay=free - rep,
                   share_removed=(free - rep) / free if free > 0 else 0.0)
    return out


def verdict(routing: dict) -> str:
    """The larger source of the mismatch, with the figures behind it."""
    if "k3_replayed" not in routing:
        return "mismatch verdict: n/a (the routes were not replayed)"
    free, rep, removed = routing["k3_free"], routing["k3_replayed"], routing["k3_removed_by_replay"]
    figures = f"k3 {free:.3g} free, {rep:.3g} with the trace's routes replayed"
    if max(free, rep) < NEGLIGIBLE_K3:
        return f"mismatch verdict: none ({figures}; both below {NEGLIGIBLE_K3:g})"
    if removed > rep:
        return (f"mismatch verdict: routing is the larger source ({figures}: replay removes {removed:.3g}, "
                f"{routing['share_removed']:.1%}; numerics leave {rep:.3g}); R3 would remove it")
    return (f"mismatch verdict: numerics is the larger source ({figures}: {rep:.3g} remains under replay; "
            f"routing accounts for {removed:.3g}, {routing['share_removed']:.1%}); R3 would not remove it")


def mismatch_report(checked: list, disagreement_L: dict[str, float],
                    opts: MismatchOptions = MismatchOptions()) -> dict | None:
    """The whole report (JSON-ready), None when FILE carries no engine log-probs."""
    b = batch(checked)
    if b is None:
        return None
    passes = {p: pass_report(b["engine"], b[p], b["mask"], opts) for p in PASSES if p in b}
    routing = routing_share(passes, disagreement_L)
    return {"sequences": int(b["mask"].shape[0]), "tokens": int(b["mask"].sum()), **passes, "routing": routing,
            "per_sequence": per_sequence(b), "per_token": per_token(b), "verdict": verdict(routing)}


def _delta_k3(b: dict, p: str) -> tuple[Tensor, Tensor]:
    """Pass ``p``'s d = logp_trainer - logp_engine and k3 = exp(d) - 1 - d per token, 0 on padding."""
    keep = b["mask"]
    d = torch.where(keep, b[p] - b["engine"], torch.zeros_like(b[p]))
    return d, (torch.exp(d) - 1 - d) * keep


def per_sequence(b: dict) -> list[dict]:
    """Each sequence's own figures (``where``: FILE line N): its tokens, and per pass its k3 and max |d|."""
    keep = b["mask"]
    rows = [{"where": w, "tokens": int(n)} for w, n in zip(b["where"], keep.sum(-1).tolist())]
    for p in PASSES:
        if p not in b:
            continue
        d, k3 = _delta_k3(b, p)
        for row, k, m in zip(rows, (k3.sum(-1) / keep.sum(-1)).tolist(), d.abs().amax(-1).tolist()):
            row[f"k3_{p}"], row[f"abs_delta_max_{p}"] = k, m
    return rows


def per_token(b: dict) -> list[dict]:
    """One row per completion token (``where``: FILE line N; ``position``: its index in the completion): its id,
    the engine's log-prob and per pass the trainer's, d and k3. A sequence's rows average to its per_sequence
    k3 and all rows to ``token.k3``."""
    columns: dict[str, list] = {"logp_engine": b["engine"].tolist()}
    for p in PASSES:
        if p in b:
            d, k3 = _delta_k3(b, p)
            columns.update({f"logp_trainer_{p}": b[p].tolist(), f"delta_{p}": d.tolist(), f"k3_{p}": k3.tolist()})
    rows = []
    for i, (where, ids) in enumerate(zip(b["where"], b["token_ids"])):
        for t, token in enumerate(ids.tolist()):
            rows.append({"where": where, "position": t, "token": token, **{k: v[i][t] for k, v in columns.items()}})
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def report_lines(report: dict | None) -> list[str]:
    """The report's section of check-trace's output (the first two lines are the ones it always printed)."""
    if report is None:
        return [f"mismatch: no engine log-probs in FILE (any of {', '.join(FIELDS)})"]
    out = []
    for name in PASSES:
        if name in report:
            t = report[name]["token"]
            out.append(f"mismatch ({name}): {t['tokens']} tokens, mean |logp_trainer - logp_engine| "
                       f"{t['abs_delta_mean']:.3g}, max {t['abs_delta_max']:.3g}, k3 KL {t['k3']:.3g}")
    for name in PASSES:
        if name in report:
            out += _pass_lines(name, report[name])
    r = report["routing"]
    layers = ", ".join(f"{k} {v:.4f}" for k, v in r["router_disagreement"].items())
    removed = (f"k3 removed by replaying the trace's routes {r['k3_removed_by_replay']:.3g} of {r['k3_free']:.3g} "
               f"({r['share_removed']:.1%}); " if "k3_removed_by_replay" in r else "")
    out.append(f"mismatch routing: {removed}router disagreement per MoE layer: {layers or 'n/a'}")
    return out + [report["verdict"]]


def _pass_lines(name: str, p: dict) -> list[str]:
    t, n, v, tis = p["token"], p["nemo_rl"], p["verl"], p["tis"]
    c = tis["threshold"]
    return [
        f"mismatch ({name}) KL(engine || trainer): k1 {t['k1']:.3g}, k2 {t['k2']:.3g}, k3 {t['k3']:.3g}; "
        f"|delta logp| > ln 2: {_pct(t['abs_delta_above_ln2'])} of tokens; ratio outside [1/2, 2]: "
        f"{_pct(t['ratio_outside_half_two'])}",
        f"mismatch ({name}) NeMo-RL seq_mult_prob_error: max {n['max_seq_mult_prob_error']:.4g}, mean "
        f"{n['mean_seq_mult_prob_error']:.4g}; above {n['seq_logprob_error_threshold']:g}: "
        f"{_pct(n['outlier_share'])} of sequences",
        f"mismatch ({name}) verl " + ", ".join(f"{k} {v[k]:.4g}" for k in (
            "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "rollout_corr/ppl_ratio",
            "rollout_corr/chi2_token", "rollout_corr/chi2_seq")),
        f"mismatch ({name}) TIS at {c:g}: token level truncates "
        f"{_pct(tis['rollout_is=token']['rollout_corr/rollout_is_ratio_fraction_high'])} of tokens, sequence level "
        f"{_pct(tis['rollout_is=sequence']['rollout_corr/rollout_is_ratio_fraction_high'])} of sequences; "
        f"masking outside [1/{c:g}, {c:g}]: token level (token_k1) "
        f"{_pct(tis['rollout_rs=token_k1']['rollout_corr/rollout_rs_token_k1_masked_fraction'])} of tokens ("
        f"{_pct(tis['rollout_rs=token_k1']['rollout_corr/rollout_rs_token_k1_seq_masked_fraction'])} of sequences "
        f"touched), sequence level (seq_sum_k1) "
        f"{_pct(tis['rollout_rs=seq_sum_k1']['rollout_corr/rollout_rs_seq_sum_k1_seq_masked_fraction'])} of sequences",
    ]
