"""The benchmark's FLOP counter (bench/flops.py) against a case worked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.flops import Sizes, cell_flops, forward_flops, sweep_flops  # noqa: E402

# 2 blocks, d 4, 2 query heads and 1 key/value head of 2, gated MLP of 8, vocabulary 10.
TINY = Sizes(n_layers=2, d_model=4, n_heads=2, n_kv_heads=1, head_dim=2, intermediate=8, vocab=10)
T = 3


def test_block_weights_by_hand():
    # q 4×4 + k 4×2 + v 4×2 + out 4×4 = 48; MLP gate, up, down 3 × 4×8 = 96.
    assert TINY.block_weights == 48 + 96 == 144


def test_full_forward_by_hand():
    # Per block: linear 2·144·3 = 864, attention 2·2·3·3·2·2 = 144 → 1008; two blocks 2016;
    # unembedding at the last position, whole vocabulary: 2·4·10 = 80.
    assert forward_flops(TINY, T) == 2 * (864 + 144) + 80 == 2096
    assert forward_flops(TINY, T, logit_rows=2) == 2016 + 16


def test_cell_limit_by_hand():
    # Patch inside block 1 at position 1: block 1 on positions 1, 2 (2 queries over 3 keys):
    # linear 2·144·2 = 576, attention 2·2·2·3·2·2 = 96; two unembedding rows 2·4·2 = 16.
    assert cell_flops(TINY, T, first_layer=1, first_position=1, logit_rows=2) == 576 + 96 + 16 == 688
    # The last block's output patched before the last position changes nothing read: free.
    assert cell_flops(TINY, T, first_layer=2, first_position=0, logit_rows=2) == 0
    # ... at the last position: only the unembedding rows.
    assert cell_flops(TINY, T, first_layer=2, first_position=2, logit_rows=2) == 16


def test_limit_at_most_full_and_falls_with_position():
    for rows in (2, TINY.vocab):
        full = forward_flops(TINY, T, rows)
        for layer in range(TINY.n_layers + 1):
            costs = [cell_flops(TINY, T, layer, p, rows) for p in range(T)]
            assert all(c <= full for c in costs)
            if layer < TINY.n_layers:
                assert all(a > b for a, b in zip(costs, costs[1:]))
    assert cell_flops(TINY, T, 0, 0, 10) == forward_flops(TINY, T, 10)  # patch everything: a full run


def test_gemma_sizes_and_sweep():
    gemma = Sizes(n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256, intermediate=2048,
                  vocab=262144)
    assert gemma.block_weights == 640 * 6 * 256 + 1024 * 640 + 3 * 640 * 2048
    cells = [(layer, p) for layer in range(18) for p in range(3, 10)]
    sweep = sweep_flops(gemma, 10, cells, logit_rows=2, baselines=2)
    assert 2 * forward_flops(gemma, 10) < sweep["limit"] < sweep["full"]
    # Every cell a full run: baselines plus one forward (two unembedding rows) per cell.
    assert sweep["full"] == 2 * forward_flops(gemma, 10) + len(cells) * forward_flops(gemma, 10, 2)
