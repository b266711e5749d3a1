"""The check `moe-lab check-trace` runs on sequences already read, shared by the command (check_trace: a dump
on disk) and the in-loop API (replay_check: a batch in memory), so that both give the same report lines, the
same faults and the same agreement from one piece of code.

``run_check`` runs the model teacher-forced on each sequence with its routing recorded, compares the routes
with the model's own choices (trace_report), then replays the routes (R3) and checks the experts
that ran. Torch and the model code are imported inside the functions: importing this module (and
``moe_lab.audit``, which exports replay_check) needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def check_inputs(sequences: list, config: dict) -> None:
    """ValueError (one line naming the sequence) for a sequence too short to check or with token ids outside
    the model's vocabulary: bad input, refused before the model runs."""
    for seq in sequences:
        if seq.num_tokens < 2:
            raise ValueError(f"{seq.where}: {seq.num_tokens} tokens; a check needs at least 2")
        if (seq.tokens < 0).any() or (seq.tokens >= int(config.get("vocab_size", 1 << 62))).any():
            raise ValueError(f"{seq.where}: token ids out of range for vocab_size={config.get('vocab_size')}")


@dataclass
class CheckReport:
    """What one check found: the report lines (``agreement`` last comes from ``report_lines``), the faults, the
    overall agreement and the mismatch report (audit.trace_mismatch; None without engine log-probs)."""

    lines: list[str]
    faults: list[tuple[str, str]]
    agreement: float
    mismatch: dict | None = None


def run_check(sequences: list, model: Any, config: dict, device: Any) -> tuple[list[str], list[tuple[str, str]], float]:
    """(report lines, faults, overall agreement) for sequences already read."""
    report = check(sequences, model, config, device)
    return report.lines, report.faults, report.agreement


def check(sequences: list, model: Any, config: dict, device: Any, options: Any = None) -> CheckReport:
    """The check of sequences already read; ``options``: trace_mismatch.MismatchOptions (None: defaults)."""
    import moe_lab.audit.trace_report as rep
    from moe_lab.audit.trace_mismatch import MismatchOptions, mismatch_report
    from moe_lab.audit.trace_mismatch import report_lines as mismatch_lines
    from moe_lab.audit.trace_run import forced_trace, free_pass, replay_pass
    from moe_lab.formats.layers import moe_layer_indices, num_experts
    from moe_lab.models import moe_layers

    E, family, names = num_experts(config), moe_layers(model)[0].family.name, moe_layer_indices(config)
    built = [layer.layer_idx for layer in moe_layers(model)]
    if built != names:  # the layer rule and the modelling code must agree, or every mapping above is wrong
        raise ValueError(f"--model: the config's MoE layers {names} (moe_lab.formats.layers) are not the layers "
                         f"whose routers the model built, {built}: the layer rule of this model_type needs fixing")
    # the head runs only for a sequence carrying engine log-probs, from its first completion token
    logp_from = [None if s.engine_logprobs is None else s.prompt_len for s in sequences]
    checked = [rep.Checked(s, free_pass(model, s.tokens, device, at)) for s, at in zip(sequences, logp_from)]
    t = rep.tally(checked, E)
    lines = [f"layer {names[l]} (MoE {l}): agreement {_frac(t.agree_L[l], t.usable_L[l])} "
             f"({int(t.usable_L[l])} slots)" for l in range(len(names))]
    lines += _summary_lines(t, len(sequences))
    faults = rep.coverage_faults(checked, names)
    if t.out_of_range:
        faults.append(("out-of-range", f"{t.out_of_range} slots hold expert ids outside 0..{E - 1}"))
    if t.duplicates:
        faults.append(("duplicate-ids", f"{t.duplicates} slots repeat an expert within one token's top-k"))
    if not int(t.usable_L.sum()):
        faults.append(("no-routes", "no (layer, position) slot of any sequence carries a usable route"))
    faults = rep.verdict(checked, t, E, faults + rep.shift_faults(checked, E, t.agreement))
    for c, at in zip(checked, logp_from):
        c.replayed = replay_pass(model, c.seq.tokens, forced_trace(c.seq, c.free.ids_LSK, E, family), device, at)
    replay_line, fault = rep.replay_fault(checked, E)
    disagreement = {f"layer {names[l]}": 1 - float(t.agree_L[l]) / float(t.usable_L[l])
                    for l in range(len(names)) if int(t.usable_L[l])}
    mismatch = mismatch_report(checked, disagreement, options or MismatchOptions())
    lines += mismatch_lines(mismatch) + [replay_line]
    return CheckReport(lines, faults + ([fault] if fault else []), t.agreement, mismatch)


def _frac(num, den) -> str:
    return f"{float(num) / float(den):.4f}" if int(den) else "n/a"


def _summary_lines(t, n_seq: int) -> list[str]:
    from moe_lab.audit.trace_report import margin_line

    margin = margin_line(t)
    return [f"missing {_frac(t.missing, t.expected)} ({t.missing} of {t.expected} (layer, position) slots a "
            "complete trace covers)",
            f"last position not covered: {t.last_uncovered} of {n_seq} sequences (accepted: the last sampled token "
            "is never fed to the engine)",
            f"out-of-range ids {t.out_of_range}", f"duplicate ids {t.duplicates}",
            f"router margin where they disagree: {margin}"]


def report_lines(lines: list[str], faults: list[tuple[str, str]], agreement: float) -> list[str]:
    """What the command prints after its header: the measurements, a line per fault, ``agreement`` last."""
    return [*lines, *(f"fault: {name}: {detail}" for name, detail in faults),
            f"agreement {agreement:.4f}" if agreement == agreement else "agreement n/a"]
