"""What `moe-lab check-trace` measures and diagnoses, from the imported routes and the model's own passes.

Agreement: over the slots (MoE layer, position) where the trace carries a usable route (present, ids in
range, none repeated), the fraction whose SET of top-k ids equals the model's own choice on the same tokens.
Positions a trace need not cover are left out of "missing": those before a declared start
(SGLang's routed_experts_start_len, prime-rl's start) and the last position (the last sampled token is never
fed to the engine; it is reported, not counted). Each known fault is diagnosed by name (``FAULTS``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from moe_lab.audit.trace_run import FreePass, ReplayPass, usable_LS
from moe_lab.formats.routes import RoutedSequence

Tensor = torch.Tensor
POSITION_SHIFTS = (-2, -1, 1, 2)
# A shift explains the trace when it agrees far better than the identity: random routing agrees ~k/E.
SHIFT_MIN, SHIFT_GAIN, LOW_AGREEMENT = 0.5, 0.25, 0.5
# Numerics flip a route only near a tie: within a few bf16 roundings of the router logits (the margin one
# rounding erases, trace_run.tie_scale_S). A disagreement beyond that is another routing, not rounding.
NEAR_TIE_ROUNDINGS = 4.0
# A share of the usable slots disagreeing beyond a near tie that numerics do not reach (a few stray slots of
# a long dump are left to the margin line), and the fewest such slots a verdict rests on.
FAR_SHARE, FAR_MIN = 0.02, 3
REPEAT_MIN = 4  # positions one foreign row must cover to be named
AGREE = 0.9  # "the other layers agree": what a clean trace of a bf16 engine clears with room
FAULTS = ("trace-too-long", "trace-too-short", "missing-layer", "missing-positions", "zeroed-rows",
          "missing-routes", "out-of-range", "duplicate-ids", "dense-rows-carry-ids", "layer-shift",
          "position-shift", "completion-only", "no-routes", "low-agreement", "replay-no-effect",
          # the agreement verdict and its detectors (``verdict``); a layer axis two numberings fit
          "stale-routes", "stale-prompt", "physical-ids", "repeated-rows", "layer0-overwritten",
          "ambiguous-layer-axis")


@dataclass
class Checked:
    """One sequence with the model's passes over it."""

    seq: RoutedSequence
    free: FreePass
    replayed: ReplayPass | None = None


@dataclass
class Tally:
    """Sums over sequences (per MoE layer where it says _L)."""

    agree_L: Tensor
    usable_L: Tensor
    expected: int = 0
    missing: int = 0
    last_uncovered: int = 0
    out_of_range: int = 0
    duplicates: int = 0
    margins: list[Tensor] = field(default_factory=list)
    # disagreements in units of the margin one bf16 rounding erases (trace_run.tie_scale_S)
    roundings: list[Tensor] = field(default_factory=list)
    # [L, 2]: per MoE layer, prompt (0) and completion (1) positions: usable slots, and disagreements beyond
    # NEAR_TIE_ROUNDINGS (what numerics cannot flip)
    usable_LR: Tensor | None = None
    far_LR: Tensor | None = None

    @property
    def agreement(self) -> float:
        total = int(self.usable_L.sum())
        return float(self.agree_L.sum()) / total if total else float("nan")


def set_equal_LS(a_LSK: Tensor, b_LSK: Tensor) -> Tensor:
    return (a_LSK.sort(-1).values == b_LSK.sort(-1).values).all(-1)


def duplicate_LS(ids_LSK: Tensor) -> Tensor:
    srt = ids_LSK.sort(-1).values
    return (srt[..., 1:] == srt[..., :-1]).any(-1)


def expected_LS(seq: RoutedSequence) -> Tensor:
    """Slots a complete trace covers: positions [start, S - 1) of every MoE layer."""
    r = seq.routes
    exp = torch.zeros_like(r.mask_LS)
    exp[:, r.start: max(r.start, seq.num_tokens - 1)] = True
    return exp


def tally(checked: list[Checked], num_experts: int) -> Tally:
    L = checked[0].seq.routes.num_layers
    t = Tally(torch.zeros(L, dtype=torch.long), torch.zeros(L, dtype=torch.long),
              usable_LR=torch.zeros(L, 2, dtype=torch.long), far_LR=torch.zeros(L, 2, dtype=torch.long))
    for c in checked:
        r = c.seq.routes
        use = usable_LS(r.ids_LSK, r.mask_LS, num_experts)
        same = set_equal_LS(r.ids_LSK, c.free.ids_LSK) & use
        t.agree_L += same.sum(1)
        t.usable_L += use.sum(1)
        exp = expected_LS(c.seq)
        t.expected += int(exp.sum())
        t.missing += int((exp & ~r.mask_LS).sum())
        t.last_uncovered += int(not bool(r.mask_LS[:, -1].any())) if r.num_positions else 0
        ids_ok = ((r.ids_LSK >= 0) & (r.ids_LSK < num_experts)).all(-1)
        t.out_of_range += int((r.mask_LS & ~ids_ok).sum())
        t.duplicates += int((r.mask_LS & ids_ok & duplicate_LS(r.ids_LSK)).sum())
        t.margins.append(c.free.margin_LS[use & ~same])
        _tally_ties(t, c, use, use & ~same)
    return t


def margin_line(t: Tally) -> str:
    """The margin distribution of the disagreements: in router log-prob and in bf16 roundings of a tie."""
    margins = torch.cat(t.margins) if t.margins else torch.empty(0)
    if margins.numel() == 0:
        return "none (no disagreement)"
    r = torch.cat(t.roundings)
    q = torch.quantile(r.clamp_max(1e30).double(), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64))
    near = int((r <= NEAR_TIE_ROUNDINGS).sum())
    return (f"{margins.numel()} slots, {margins.min():.4g} .. {margins.max():.4g} (median {margins.median():.4g}; "
            "router log-prob of its k-th choice minus its (k+1)-th); in bf16 roundings of a tie min/q1/median/q3/max "
            f"{' / '.join(f'{v:.3g}' for v in q.tolist())}: {near} within {NEAR_TIE_ROUNDINGS:g} (numerics can "
            f"flip those), {margins.numel() - near} beyond (another routing)")


def _tally_ties(t: Tally, c: Checked, use: Tensor, differ: Tensor) -> None:
    tie = c.free.tie_LS if c.free.tie_LS is not None else torch.zeros_like(c.free.margin_LS)
    ratio = c.free.margin_LS / tie.clamp_min(torch.finfo(torch.float32).tiny)
    t.roundings.append(ratio[differ])
    far = differ & (ratio > NEAR_TIE_ROUNDINGS)
    completion = torch.arange(use.shape[1]) >= c.seq.prompt_len
    for region, cols in enumerate((~completion, completion)):
        t.usable_LR[:, region] += use[:, cols].sum(1)
        t.far_LR[:, region] += far[:, cols].sum(1)


def _shifted_agreement(checked: list[Checked], num_experts: int, axis: int, d: int | None) -> float:
    """Agreement when the trace's index i is compared with the model's index i + d along ``axis`` (0: MoE
    layer, 1: position); d=None: each sequence's prompt length (routes of the completion only, read as if
    they started at position 0)."""
    agree = total = 0
    for c in checked:
        r = c.seq.routes
        use = usable_LS(r.ids_LSK, r.mask_LS, num_experts)
        n, dd = r.ids_LSK.shape[axis], c.seq.prompt_len if d is None else d
        if abs(dd) >= n or dd == 0:
            continue
        src = slice(max(0, -dd), n - max(0, dd))
        dst = slice(max(0, dd), n - max(0, -dd))
        pick = (lambda x, s: x[s]) if axis == 0 else (lambda x, s: x[:, s])
        u = pick(use, src)
        agree += int((set_equal_LS(pick(r.ids_LSK, src), pick(c.free.ids_LSK, dst)) & u).sum())
        total += int(u.sum())
    return agree / total if total else 0.0


def _explains(shifted: float, identity: float) -> bool:
    return not identity >= 0.9 and shifted >= max(SHIFT_MIN, identity + SHIFT_GAIN)


def shift_faults(checked: list[Checked], num_experts: int, identity: float) -> list[tuple[str, str]]:
    out = []
    L = checked[0].seq.routes.num_layers
    # every offset the config allows along the MoE layers (first_k_dense_replace=3 shifts by 3)
    layer_shifts = [d for d in range(1 - L, L) if d]
    for axis, name, what in ((0, "layer-shift", "MoE layer"), (1, "position-shift", "position")):
        shifts = layer_shifts if axis == 0 else POSITION_SHIFTS
        best = max(((_shifted_agreement(checked, num_experts, axis, d), d) for d in shifts), default=(0.0, 0))
        if _explains(best[0], identity):
            hint = ("a dense or MTP layer counted, or not counted, in the layer axis" if axis == 0 else
                    "the routes belong to the next or previous token (an off-by-one start)")
            out.append((name, f"the trace's {what} i holds what the model routes at {what} i{best[1]:+d} "
                              f"(agreement {best[0]:.4f} shifted vs {identity:.4f} as read): {hint}"))
    prompt = _shifted_agreement(checked, num_experts, 1, None)
    if not out and _explains(prompt, identity):
        out.append(("completion-only", f"the routes match the model's shifted by each prompt's length (agreement "
                                       f"{prompt:.4f} vs {identity:.4f} as read): they cover the completion only; "
                                       "give the prompt's rows too (prompt_routed_experts) or their start"))
    return out


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of sorted positions."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def _sequence_coverage(c: Checked) -> tuple[list[tuple[str, str]], Tensor]:
    """Faults of one sequence's coverage (too long, ends early, position ranges without any route) and the
    positions they explain."""
    r, where, out = c.seq.routes, c.seq.where, []
    if r.excess:
        out.append(("trace-too-long", f"{where}: {r.excess} route rows past the last of its {c.seq.num_tokens} "
                                      "tokens (a trace of other tokens, or one token counted twice)"))
    exp = expected_LS(c.seq)
    gone_S = (exp & ~r.mask_LS).all(0) & exp[0]
    runs = _runs(gone_S.nonzero().squeeze(1).tolist())
    end = c.seq.num_tokens - 1
    if runs and runs[-1][1] == end:
        a, _ = runs.pop()
        out.append(("trace-too-short", f"{where}: routes stop before position {a}; its {c.seq.num_tokens} tokens "
                                       f"need them up to position {end - 1} (the last, {end}, may be left out)"))
    if runs:
        spans = ", ".join(f"[{a}, {b})" for a, b in runs[:4]) + (" ..." if len(runs) > 4 else "")
        out.append(("missing-positions", f"{where}: positions {spans} have no route in any MoE layer "
                                          "(e.g. prefix caching with chunked prefill)"))
    return out, gone_S


def _grouped(faults: list[tuple[str, str]], n_seq: int) -> list[tuple[str, str]]:
    """One line per fault name: how many sequences, and the first one's detail."""
    first: dict[str, str] = {}
    count: dict[str, int] = {}
    for name, detail in faults:
        first.setdefault(name, detail)
        count[name] = count.get(name, 0) + 1
    return [(name, f"{count[name]} of {n_seq} sequences; first: {first[name]}") for name in first]


def coverage_faults(checked: list[Checked], layer_names: list[int]) -> list[tuple[str, str]]:
    """Structural faults: length, missing layers and positions, zeroed rows, missing-route markers, ids in
    rows the config says are dense. Each missing slot is blamed once: on its position range, else its layer,
    else as a zeroed row or a missing-route marker."""
    per_seq, explained = [], []
    for c in checked:
        faults, gone_S = _sequence_coverage(c)
        per_seq += faults
        explained.append(gone_S)
    out = _grouped(per_seq, len(checked))
    covered_L = sum(c.seq.routes.mask_LS.any(1).long() for c in checked)
    gone_L = covered_L == 0
    if gone_L.any() and not gone_L.all():
        names = [layer_names[l] for l in gone_L.nonzero().squeeze(1).tolist()]
        out.append(("missing-layer", f"MoE layers {names} (decoder index) have no route in any sequence while "
                                     "the others have (a pipeline stage's routes not gathered?)"))
    zeroed = negative = 0
    for c, gone_S in zip(checked, explained):
        left = expected_LS(c.seq) & ~c.seq.routes.mask_LS & ~gone_S[None] & ~gone_L[:, None]
        z = _zeroed(c)
        zeroed += int((left & z).sum())
        negative += int((left & ~z).sum())
    if zeroed:
        out.append(("zeroed-rows", f"{zeroed} (layer, position) slots of MoE layers are all-zero rows: no route "
                                   "was written there, and a replay reading them would force expert 0"))
    if negative:
        out.append(("missing-routes", f"{negative} (layer, position) slots carry the missing-route marker"))
    dense = sorted({row for c in checked for row in c.seq.routes.dropped_nonzero})
    if dense:
        out.append(("dense-rows-carry-ids", f"layer rows {dense}, dense or MTP by the model's config, carry "
                                            "expert ids: the layer axis is likely shifted"))
    return out


def _zeroed(c: Checked) -> Tensor:
    z = c.seq.routes.zeroed_LS
    return torch.zeros_like(c.seq.routes.mask_LS) if z is None else z


def verdict(checked: list[Checked], t: Tally, num_experts: int, faults: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``faults`` (structural ones and shifts) with the agreement verdict added; a detector that explains a
    structural line replaces it. Numerics flip a route only near a tie (NEAR_TIE_ROUNDINGS); what disagrees
    beyond that on routes that line up structurally is another routing, named by where it sits: stale-routes,
    stale-prompt, physical-ids, repeated-rows, layer0-overwritten, else low-agreement (below LOW_AGREEMENT with
    none of these nor a shift explaining it; docs/traces.md's fault table says what each names)."""
    names = {n for n, _ in faults}
    out = list(faults)
    layer0 = _layer0_overwritten(checked, t)
    if layer0:
        out = [f for f in out if not (f[0] == "dense-rows-carry-ids" and _only_row0(checked))] + [layer0]
    repeated = _repeated_rows(checked, num_experts)
    out += repeated
    if names & {"layer-shift", "position-shift", "completion-only"}:
        return out
    physical = _physical_ids(checked, num_experts, t.agreement)
    if physical:
        return out + [physical]
    if t.agreement < LOW_AGREEMENT:
        return out + [("low-agreement", f"only {t.agreement:.4f} of the routed slots match the model's own choice "
                                        "and no shift explains it: another checkpoint, or other tokens?")]
    keep = torch.ones(t.far_LR.shape[0], dtype=torch.bool)
    keep[0] = not layer0
    return out + ([] if repeated else _stale(t, keep))


def _stale(t: Tally, keep_L: Tensor) -> list[tuple[str, str]]:
    far_R, use_R = t.far_LR[keep_L].sum(0), t.usable_LR[keep_L].sum(0)
    share = [float(f) / float(u) if int(u) else 0.0 for f, u in zip(far_R, use_R)]
    stale = [int(f) >= FAR_MIN and s >= FAR_SHARE for f, s in zip(far_R, share)]
    detail = (f"prompt {int(far_R[0])} of {int(use_R[0])} slots ({share[0]:.1%}), completion {int(far_R[1])} of "
              f"{int(use_R[1])} ({share[1]:.1%}) disagree beyond {NEAR_TIE_ROUNDINGS:g} bf16 roundings of a tie, "
              "where numerics cannot flip a route")
    if stale[1]:
        return [("stale-routes", f"{detail}: the routes come from another policy (an older checkpoint's router?)")]
    if stale[0]:
        return [("stale-prompt", f"{detail}: the prompt's routes are stale while the completion's are the "
                                 "model's (a prefix cache holding routes of an older policy?)")]
    return []


def _layer_agreement(t: Tally, l: int) -> float:
    return float(t.agree_L[l]) / float(t.usable_L[l]) if int(t.usable_L[l]) else float("nan")


def _only_row0(checked: list[Checked]) -> bool:
    return {row for c in checked for row in c.seq.routes.dropped_nonzero} == {0}


def _layer0_overwritten(checked: list[Checked], t: Tally) -> tuple[str, str] | None:
    L = t.agree_L.shape[0]
    rest = float(t.agree_L[1:].sum()) / float(t.usable_L[1:].sum()) if int(t.usable_L[1:].sum()) else float("nan")
    if _only_row0(checked) and int(t.usable_L.sum()) and float(t.agree_L.sum()) >= AGREE * float(t.usable_L.sum()):
        return ("layer0-overwritten", "layer row 0, a dense layer by the model's config, carries expert ids while "
                                      f"every MoE layer agrees ({t.agreement:.4f}): a draft / MTP router's capture "
                                      "written into layer 0 (vLLM #48622)")
    first = _layer_agreement(t, 0)
    if L >= 2 and rest >= AGREE and first < LOW_AGREEMENT and int(t.far_LR[0].sum()) >= FAR_MIN:
        return ("layer0-overwritten", f"the first MoE layer agrees {first:.4f}, far from ties, while the others "
                                      f"agree {rest:.4f}: a draft / MTP router's capture overwrote layer 0's "
                                      "(vLLM #48622)")
    return None


def _sorted_rows(c: Checked, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(positions usable in every layer, the trace's rows there [P, L, K] sorted, the model's)."""
    r = c.seq.routes
    pos = usable_LS(r.ids_LSK, r.mask_LS, num_experts).all(0).nonzero().squeeze(1)
    sort = lambda ids_LSK: ids_LSK[:, pos].sort(-1).values.transpose(0, 1)  # noqa: E731
    return pos, sort(r.ids_LSK), sort(c.free.ids_LSK)


def _repeated_rows(checked: list[Checked], num_experts: int) -> list[tuple[str, str]]:
    """One row (every layer's top-k) at REPEAT_MIN or more positions of a sequence where the model routes
    otherwise, and more often than the model's own rows repeat there (chance: same tokens, same routes)."""
    hits = []
    for c in checked:
        pos, trace_PLK, model_PLK = _sorted_rows(c, num_experts)
        if pos.numel() < REPEAT_MIN:
            continue
        keys = [tuple(row.flatten().tolist()) for row in trace_PLK]
        own = max(Counter(tuple(row.flatten().tolist()) for row in model_PLK).values())
        key, n = Counter(keys).most_common(1)[0]
        at = [i for i, k in enumerate(keys) if k == key]
        foreign = sum(int(not torch.equal(trace_PLK[i], model_PLK[i])) for i in at)
        if n >= REPEAT_MIN and foreign >= REPEAT_MIN and n > 2 * own:
            hits.append(f"{c.seq.where}: one row at {n} positions ({int(pos[at[0]])}..{int(pos[at[-1]])}), "
                        f"{foreign} of them where the model routes otherwise (its own rows repeat at most {own}x)")
    if not hits:
        return []
    return [("repeated-rows", f"{len(hits)} of {len(checked)} sequences; first: {hits[0]}: padded or reused rows "
                              "carrying a stale route (SGLang #36404)")]


def _physical_ids(checked: list[Checked], num_experts: int, identity: float) -> tuple[str, str] | None:
    """Per MoE layer, the relabelling trace id -> model id that co-occurs most; a fault when it is a
    permutation (not the identity) under which the routes agree far better than as read (vLLM #33013, vllm-ascend
    #13882: physical slots of the engine's load balancer instead of logical experts)."""
    L, E = checked[0].seq.routes.num_layers, num_experts
    co_LEE = torch.zeros(L, E, E, dtype=torch.long)  # [layer, trace id, model id]
    for c in checked:
        r = c.seq.routes
        use = usable_LS(r.ids_LSK, r.mask_LS, E)
        for l in range(L):
            a, b = r.ids_LSK[l][use[l]], c.free.ids_LSK[l][use[l]]
            co_LEE[l].index_put_((a[:, :, None].expand(-1, -1, b.shape[1]).reshape(-1),
                                  b[:, None, :].expand(-1, a.shape[1], -1).reshape(-1)),
                                 torch.ones(a.numel() * b.shape[1], dtype=torch.long), accumulate=True)
    seen_LE = co_LEE.sum(-1) > 0
    perm_LE = co_LEE.argmax(-1)
    for l in range(L):
        mapped = perm_LE[l][seen_LE[l]]
        if mapped.unique().numel() != mapped.numel():
            return None  # two ids onto one expert: not a relabelling
    if bool((perm_LE[seen_LE] == torch.arange(E).expand(L, E)[seen_LE]).all()):
        return None
    agree = total = 0
    for c in checked:
        r = c.seq.routes
        use = usable_LS(r.ids_LSK, r.mask_LS, E)
        relabelled = torch.stack([perm_LE[l][r.ids_LSK[l].clamp(0, E - 1)] for l in range(L)])
        agree += int((set_equal_LS(relabelled, c.free.ids_LSK) & use).sum())
        total += int(use.sum())
    mapped = agree / total if total else 0.0
    if not (mapped >= AGREE and mapped >= identity + SHIFT_GAIN):
        return None
    moved = {l: {int(i): int(perm_LE[l, i]) for i in range(E) if seen_LE[l, i] and int(perm_LE[l, i]) != i}
             for l in range(L)}
    shown = "; ".join(f"MoE layer {l}: {m}" for l, m in moved.items() if m)
    return ("physical-ids", f"the ids agree {mapped:.4f} after a fixed relabelling per layer (trace id: model "
                            f"id) vs {identity:.4f} as read - physical expert slots of the engine's load balancer, "
                            f"not logical experts (vLLM #33013): {shown[:600]}")


def replay_fault(checked: list[Checked], num_experts: int) -> tuple[str, tuple[str, str] | None]:
    """(a summary line, the fault if the experts run differ from the trace's on a covered slot)."""
    differ = total = unobserved = 0
    for c in checked:
        r, rp = c.seq.routes, c.replayed
        use = usable_LS(r.ids_LSK, r.mask_LS, num_experts)
        if rp.ran_LSK is None:
            unobserved += 1
            rp_ids = rp.forced_LSK
        else:
            rp_ids = rp.ran_LSK
        differ += int((use & ~set_equal_LS(rp_ids, r.ids_LSK)).sum())
        total += int(use.sum())
    seen = "experts run" if not unobserved else "router outputs (experts module not observable)"
    line = f"replay: {seen} equal the trace's on {total - differ}/{total} covered slots"
    if not differ:
        return line, None
    return line, ("replay-no-effect", f"under replay the experts run differ from the trace's on {differ} of "
                                      f"{total} covered slots: the forced routes did not reach the experts "
                                      "(a fused MoE path or a router the hooks do not see)")
