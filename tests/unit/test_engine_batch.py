"""Automatic batch sizes: the CPU rule unchanged, GPU sizes from free memory (given here, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipatch._engine import auto_batch_size, batch_size_for_memory, check_batch_size
from pipatch._model.models import PipatchError

GB = 10**9
# Gemma 3 270M: 18 layers, d_model 640, 4 query heads, vocabulary 262144, float32.
GEMMA = {"d_model": 640, "n_layers": 18, "bytes_per_value": 4}
GEMMA_EXTRA = {"n_heads": 4, "vocab_rows": 262144}


def gemma_on(device: str) -> SimpleNamespace:
    """A stand-in backend with the embedded model's sizes (what auto_batch_size reads)."""
    return SimpleNamespace(device=torch.device(device), dtype=torch.float32,
                           adapter=SimpleNamespace(d_model=640, n_layers=18, n_heads=4),
                           tokenizer=[None] * 262144)


def sized(free_bytes, n_tokens, **kwargs):
    return batch_size_for_memory(free_bytes, n_tokens, **GEMMA, **GEMMA_EXTRA, **kwargs)


def test_cpu_rule_unchanged():
    for n in (1, 7, 10, 16, 32, 100, 128, 4096, 5000):
        today = max(1, min(256, 4096 // n))
        assert auto_batch_size(n) == today
        assert auto_batch_size(n, backend=gemma_on("cpu")) == today
        assert check_batch_size(None, n) == check_batch_size(None, n, gemma_on("cpu")) == today
    assert check_batch_size(3, 10, gemma_on("cpu")) == 3
    with pytest.raises(PipatchError):
        check_batch_size(0, 10, gemma_on("cpu"))


def test_sane_sizes_for_the_embedded_model():
    assert sized(80 * GB, 10, cap=4096) >= 1024  # an H100's worth: thousands of 10-token invokes
    assert sized(80 * GB, 10) == 256  # ... held to the cap
    assert 100 <= sized(1 * GB, 10) < 256  # 1 GB: a couple of hundred
    assert 1 <= sized(1 * GB, 512) < 16  # long prompts: few
    assert sized(1 * GB, 10) < sized(80 * GB, 10)


def test_monotone_and_bounded():
    frees = [0, 10**6, 10**8, GB, 4 * GB, 16 * GB, 80 * GB, 10**13]
    lengths = [1, 8, 32, 128, 512, 2048, 8192]
    for n in lengths:
        sizes = [sized(f, n, cap=10**6) for f in frees]
        assert sizes == sorted(sizes) and sizes[0] == 1
    for f in frees:
        sizes = [sized(f, n, cap=10**6) for n in lengths]
        assert sizes == sorted(sizes, reverse=True)
        assert all(1 <= sized(f, n, cap=64) <= 64 for n in lengths)


def test_by_hand():
    # 2 layers, d 4, 1 head, no logits, float32, work 16: per token 4·(2·2 + 16) + 1·T values.
    # T = 3: 3 · (80 + 3) = 249 values = 996 bytes per invoke; half of 10 000 bytes → 5 invokes.
    assert batch_size_for_memory(10_000, 3, 4, 2, 4, n_heads=1) == 5
    assert batch_size_for_memory(10_000, 3, 4, 2, 4, n_heads=1, fraction=1.0) == 10


def test_cuda_backend_sized_from_free_memory():
    # free_bytes given: no GPU needed; the backend's sizes and dtype feed batch_size_for_memory.
    backend = gemma_on("cuda")
    for free in (GB, 8 * GB, 80 * GB):
        for n in (10, 128, 1024):
            assert auto_batch_size(n, backend=backend, free_bytes=free) == sized(free, n)
    half = SimpleNamespace(**{**vars(backend), "dtype": torch.bfloat16})
    assert auto_batch_size(128, backend=half, free_bytes=GB) >= auto_batch_size(128, backend=backend, free_bytes=GB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reads_free_memory():
    free = torch.cuda.mem_get_info(0)[0]
    n = auto_batch_size(32, backend=gemma_on("cuda:0"))
    assert 1 <= n <= 256 and n == pytest.approx(sized(free, 32), abs=2)
