"""Regenerate tests/golden/losses_golden.json: `python tests/golden/make_losses_golden.py`.

Fixed float32 tensors (stored in the file, so the check never depends on an RNG) and, for every
algorithm x aggregation (plus dual clip, per-token advantages, a fixed norm_len), the loss, its
gradient wrt logp_new and the metrics from moe_lab.algos.losses. tests/test_losses.py checks them to
1e-6 and checks them against its independent loop-based reference, so regenerate only after a
deliberate change of the formulas, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere, installed or not
from moe_lab.algos.losses import policy_loss  # noqa: E402
from moe_lab.config.constants import LOSS_AGGS, PPO_CLIP_ALGOS  # noqa: E402

OUT = Path(__file__).with_name("losses_golden.json")
B, T = 4, 5


def fixed_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20250724)
    logp_old = -3.0 * torch.rand(B, T, generator=g)
    d = 0.35 * torch.randn(B, T, generator=g)
    d[1] += 0.5  # one sequence far above 1 + clip_high, with A < 0 below: exercises the dual clip
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv_B = torch.tensor([1.25, -0.75, 0.5, -1.5])
    adv_BT = adv_B.unsqueeze(-1) + 0.3 * torch.randn(B, T, generator=g)
    return dict(logp_new=logp_old + d, logp_old=logp_old, mask=mask, adv_B=adv_B, adv_BT=adv_BT)


def case_list() -> list[tuple[str, dict, str]]:
    base = dict(clip_low=0.1, clip_high=0.15)
    cases = [(f"{a}/{agg}", dict(base, algo=a, loss_agg=agg), "adv_B") for a in PPO_CLIP_ALGOS for agg in LOSS_AGGS]
    cases += [(f"{a}/dual1.5", dict(base, algo=a, dual_clip_c=1.5), "adv_B") for a in PPO_CLIP_ALGOS]
    cases += [("grpo/token_adv", dict(base, algo="grpo"), "adv_BT")]
    cases += [("gspo_token/token_adv", dict(base, algo="gspo_token", dual_clip_c=1.5), "adv_BT")]
    cases += [("grpo/sum-norm-8", dict(base, algo="grpo", loss_agg="seq-mean-token-sum-norm", norm_len=8), "adv_B")]
    return cases


def main() -> None:
    x = fixed_inputs()
    cases = []
    for case_id, kwargs, adv_key in case_list():
        logp_new = x["logp_new"].clone().requires_grad_(True)
        loss, metrics = policy_loss(logp_new, x["logp_old"], x[adv_key], x["mask"], **kwargs)
        (grad,) = torch.autograd.grad(loss, logp_new)
        cases.append(
            dict(
                id=case_id,
                kwargs=kwargs,
                logp_new=x["logp_new"].tolist(),
                logp_old=x["logp_old"].tolist(),
                advantages=x[adv_key].tolist(),
                mask=x["mask"].tolist(),
                loss=loss.item(),
                grad=grad.tolist(),
                metrics={k: v.item() for k, v in metrics.items()},
            )
        )
    lines = ",\n".join(json.dumps(case) for case in cases)  # one case per line: readable diffs
    OUT.write_text(f'{{"generator": "tests/golden/make_losses_golden.py", "cases": [\n{lines}\n]}}\n')
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
