"""The mode registries (moe_lab/config/mode_specs.py): what validation, the data-parallel split, collect and the
rollout-correction weights do follows each row's traits, never its name. Each property is checked on every row,
and again after a row's trait is changed in place (monkeypatch): code that compared names would not follow."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lab.config import mode_specs as M
from moe_lab.algos.rollout_correction import rollout_correction
from moe_lab.config import ConfigError, apply_overrides, from_dict, validate
from moe_lab.rl.collect import replay_traces
from moe_lab.rl.dp_split import check_data_parallel


def _refused(*overrides: str) -> bool:
    try:
        validate(from_dict(apply_overrides({}, list(overrides))))
    except ConfigError:
        return True
    return False


def _dp_refused(mode: str) -> bool:
    cfg = from_dict(apply_overrides({}, [f"rl.replay={mode}", "rl.prompts_per_step=2", "rl.minibatches=1"]))
    try:
        check_data_parallel(cfg, world=2)
    except ConfigError:
        return True
    return False


def _replay_refusals(mode: str) -> dict[str, bool]:
    return {"rollout_lag": _refused(f"rl.replay={mode}", "rl.rollout_lag=1"),
            "replay_gate": _refused(f"rl.replay={mode}", "rl.replay_gate=0.5"),
            "old_logp=rollout": _refused(f"rl.replay={mode}", "rl.old_logp=rollout"),
            "data_parallel": _dp_refused(mode)}


def _expected_refusals(spec: M.ReplaySpec) -> dict[str, bool]:
    return {"rollout_lag": spec.predictor, "replay_gate": not spec.replays,
            "old_logp=rollout": spec.forces == M.OLD_FORWARD, "data_parallel": not spec.data_parallel}


@pytest.mark.parametrize("mode", list(M.REPLAY_SPECS))
def test_each_replay_row_is_refused_exactly_where_its_traits_say(mode):
    assert not _refused(f"rl.replay={mode}")
    assert _replay_refusals(mode) == _expected_refusals(M.REPLAY_SPECS[mode])


@pytest.mark.parametrize("mode, change", [("rollout", dict(predictor=True, single_process="no heads under torchrun")),
                                          ("old", dict(forces=M.ROLLOUT, label="R3'")),
                                          ("predictive", dict(predictor=False, single_process=""))])
def test_validation_follows_a_changed_trait_not_the_name(monkeypatch, mode, change):
    changed = dataclasses.replace(M.REPLAY_SPECS[mode], **change)
    before = _replay_refusals(mode)
    monkeypatch.setitem(M.REPLAY_SPECS, mode, changed)
    after = _replay_refusals(mode)
    assert after == _expected_refusals(changed) and after != before


@pytest.mark.parametrize("mode", list(M.REPLAY_SPECS))
def test_replay_forces_the_trace_its_row_names(mode):
    rollout_trace, old_trace = object(), object()  # stand-ins: replay_traces only routes them
    forced, ref = replay_traces(mode, rollout_trace, old_trace)
    source = M.REPLAY_SPECS[mode].forces
    assert forced is {None: None, M.OLD_FORWARD: old_trace, M.ROLLOUT: rollout_trace}[source] and ref is old_trace
    before_old_pass, _ = replay_traces(mode, rollout_trace, None)  # R3 forces the old pass too; R2 records it
    assert before_old_pass is (rollout_trace if source == M.ROLLOUT else None)


def _expected_weights(spec: M.CorrectionSpec, log_r_BT, mask_BT, lower, upper):
    """float64, from the traits alone: the ratio per token or per sequence, truncated or masked at the bounds."""
    log_r_BT = torch.where(mask_BT, log_r_BT, 0.0)
    if not spec.active:
        return mask_BT.double()
    if spec.level == M.SEQUENCE:
        log_r_BT = log_r_BT.sum(-1, keepdim=True).expand_as(log_r_BT)
    r_BT = log_r_BT.exp()
    if spec.action == M.TRUNCATE:
        w_BT = r_BT.clamp(max=upper)
    else:
        inside = (r_BT <= upper) & (r_BT >= (lower if lower is not None else 0.0))
        w_BT = torch.where(inside, r_BT, 0.0)
    return torch.where(mask_BT, w_BT, 0.0)


def _weights(spec: M.CorrectionSpec):
    gen = torch.Generator().manual_seed(7)
    old_BT = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    rollout_BT = old_BT - torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.6
    mask_BT = torch.ones(6, 5, dtype=torch.bool)
    mask_BT[:, 3:] = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1], [0, 0], [1, 0]], dtype=torch.bool)
    got, _ = rollout_correction(old_BT, rollout_BT, mask_BT, mode=spec.name)
    return got, _expected_weights(spec, old_BT - rollout_BT, mask_BT, spec.lower, spec.upper)


@pytest.mark.parametrize("mode", list(M.ROLLOUT_CORRECTION_SPECS))
def test_each_correction_row_weighs_as_its_traits_say(mode):
    got, expected = _weights(M.ROLLOUT_CORRECTION_SPECS[mode])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("mode, change", [("tis_token", dict(action=M.MASK)), ("mis_seq", dict(level=M.TOKEN)),
                                          ("icepop", dict(action=M.TRUNCATE, lower=None, upper=1.2))])
def test_correction_weights_follow_a_changed_trait_not_the_name(monkeypatch, mode, change):
    changed = dataclasses.replace(M.ROLLOUT_CORRECTION_SPECS[mode], **change)
    before, _ = _weights(M.ROLLOUT_CORRECTION_SPECS[mode])
    monkeypatch.setitem(M.ROLLOUT_CORRECTION_SPECS, mode, changed)
    got, expected = _weights(changed)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0.0)
    assert not torch.equal(got, before)  # the change matters on this batch: the check above can fail


@pytest.mark.parametrize("mode", list(M.ROLLOUT_CORRECTION_SPECS))
def test_a_lower_bound_is_refused_unless_the_row_masks(mode):
    assert _refused(f"rl.rollout_correction={mode}", "rl.rollout_correction_lower=0.1") == \
        (not M.ROLLOUT_CORRECTION_SPECS[mode].takes_lower)


@pytest.mark.parametrize("make", [
    lambda: M.ReplaySpec("x", "PR", forces=M.OLD_FORWARD, predictor=True, single_process="", trl=False),
    lambda: M.ReplaySpec("x", "", forces=M.ROLLOUT, predictor=False, single_process="", trl=False),
    lambda: M.ReplaySpec("x", "R9", forces="engine", predictor=False, single_process="", trl=False),
    lambda: M.CorrectionSpec("x", level=M.TOKEN, action=M.TRUNCATE, lower=0.5, upper=2.0),
    lambda: M.CorrectionSpec("x", level=M.SEQUENCE, action=None, lower=None, upper=2.0),
    lambda: M.CorrectionSpec("x", level=M.TOKEN, action=M.MASK, lower=3.0, upper=2.0),
    lambda: M.mode_table((M.REPLAY_SPECS["old"], M.REPLAY_SPECS["old"])),
])
def test_an_inconsistent_row_fails_when_declared(make):
    with pytest.raises((ValueError, TypeError)):
        make()


def test_trl_config_accepts_exactly_the_rows_offered_to_trl(tmp_path):
    pytest.importorskip("trl")
    from moe_lab.integrations.trl import MoEGRPOConfig

    for name, spec in M.REPLAY_SPECS.items():
        kw = dict(output_dir=str(tmp_path), routing_replay=name, use_cpu=True, report_to="none")
        if spec.trl:
            assert MoEGRPOConfig(**kw).routing_replay == name
        else:
            with pytest.raises(ValueError, match=f"routing_replay={name!r}"):
                MoEGRPOConfig(**kw)
        weights_refused = not spec.trl or not spec.replays
        try:
            MoEGRPOConfig(**kw, routing_replay_weights=True)
        except ValueError:
            assert weights_refused
        else:
            assert not weights_refused
