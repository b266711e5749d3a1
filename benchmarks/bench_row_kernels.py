"""Batch-invariant GEMM kernels for the float8 emulation, at the rollout_mismatch organism's shapes (prints figures;
not a test).

The emulated rollouts need a GEMM whose bits for a row do not depend on the rows beside it. Today's kernel is
``numerics.row_gemm`` (one 1 x K by K x N product per row: MKL's one-row path). A candidate is a row tile of fixed
height (``tile_gemm``: rows zero-padded to a multiple of T, one T x K by K x N product per tile), which is
batch-invariant only if the platform's T-row GEMM gives a row the same bits whatever the other rows of its tile
hold and wherever the row sits in it. This script checks that property on this machine (a row's bits under
shuffles and other neighbours: counts of differing elements, which must be 0), then times row_gemm, tile_gemm and
torch.mm (batch-dependent bits) per shape: M rows as one expert gets them in decode and prefill, and the
attention projections.

    python benchmarks/bench_row_kernels.py [--tile 16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_lab.models.numerics import row_gemm

# (M, K, N): an expert's rows in decode (about 16) and prefill (about 288), gate_up (K = hidden 128, N = 2 x 16)
# and down (K = 16, N = 128); a split-K chunk (K = 43); the attention projections (128 x 128) in decode and prefill
SHAPES = [(16, 128, 32), (16, 16, 128), (288, 128, 32), (288, 16, 128), (1024, 43, 32), (128, 128, 128),
          (2304, 128, 128)]


def tile_gemm(x_RK: torch.Tensor, w_NK: torch.Tensor, tile: int) -> torch.Tensor:
    rows, k = x_RK.shape
    x_TtK = torch.nn.functional.pad(x_RK, (0, 0, 0, -rows % tile)).view(-1, tile, k)
    y = torch.bmm(x_TtK, w_NK.t().unsqueeze(0).expand(x_TtK.shape[0], -1, -1))
    return y.reshape(-1, w_NK.shape[0])[:rows]


def neighbour_dependence(tile: int, gen: torch.Generator) -> int:
    """Elements of 200 rows that change when the rows are shuffled and other rows are put in front of them."""
    changed = 0
    for _, k, n in SHAPES:
        w, x = torch.randn(n, k, generator=gen), torch.randn(200, k, generator=gen)
        ref = tile_gemm(x, w, tile)
        for _ in range(5):
            perm = torch.randperm(200, generator=gen)
            extra = torch.randn(int(torch.randint(0, 50, (1,), generator=gen)), k, generator=gen)
            changed += int((tile_gemm(torch.cat([extra, x[perm]]), w, tile)[len(extra):] != ref[perm]).sum())
    return changed


def seconds(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"tile {args.tile}: elements changed by other rows and positions (must be 0): "
          f"{neighbour_dependence(args.tile, gen)}")
    print(f"{'M':>5} {'K':>4} {'N':>4} {'row_gemm us':>12} {'GFLOP/s':>8} {'tile us':>8} {'GFLOP/s':>8} "
          f"{'mm us':>7} {'GFLOP/s':>8} {'row / tile':>10}")
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        row = seconds(lambda: row_gemm(x, w), args.repeats)
        tile = seconds(lambda: tile_gemm(x, w, args.tile), args.repeats)
        mm = seconds(lambda: x @ w.t(), args.repeats)
        gf = 2 * m * k * n / 1e9
        print(f"{m:5d} {k:4d} {n:4d} {row * 1e6:12.1f} {gf / row:8.1f} {tile * 1e6:8.1f} {gf / tile:8.1f} "
              f"{mm * 1e6:7.1f} {gf / mm:8.1f} {row / tile:10.2f}")


if __name__ == "__main__":
    main()
