"""Prefix reuse: a patched run starts at its first written position, with the same numbers.

Attention is causal, so a patch at position ``p`` changes nothing before ``p``; the
transformers backend then runs only positions ``p …`` and attends to the base run's cached
keys and values for the rest (:mod:`pipatch._backends.transformers`), and the engine groups a
row's cells by that position (:func:`pipatch._engine.batches`). Proven here against the same
backend with reuse switched off (``TransformersBackend(model, reuse_prefix=False)``), within
1e-4, on every tiny family (sliding-window layers: Gemma 2/3 with a 4-token window on a
20-token prompt; grouped-query attention; fused q/k/v: GPT-2, GPT-NeoX, Phi-3, Falcon;
ALiBi: BLOOM; rotary variants) and on the embedded Gemma 3 270M, for every site and
direction, causal tracing (noise, windows, several seeds), multi-token answers and path
patching. Each comparison also checks that reuse really happened: the last block saw runs
shorter than the prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

import pipatch
from pipatch._backends.transformers import NO_BOUND, PACK_TOKENS, TransformersBackend, _layout
from pipatch._engine import auto_batch_size, batches
from pipatch._engine._sweeps import _is_unread
from pipatch._experiments._api import plan_patch, plan_trace
from pipatch._model.cells import Base, Cell, Metric, Op
from pipatch._model.models import _get
from pipatch._model.sites import SITES, projection
from pipatch._programs import PatchRequest, capture, patch
from tests._tiny import FAMILIES, SUBLAYER_REFUSED, VARIANTS, tiny_model
from tests.unit.test_schedule import cells_at

# 20 tokens or so: longer than the tiny Gemmas' 4-token sliding window, so the cached keys of
# a sliding layer reach outside its window.
CLEAN = "John went to the store and Mary gave a book to him . The Eiffel Tower is in the city of"
CORRUPT = "John went to the store and Mary gave a book to him . The Big Ben is in the city of"
ATOL = 1e-4
# Families whose batches are not packed: BLOOM's ALiBi biases come from a 2-D mask.
NOT_PACKED = ["bloom"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def backends(family: str) -> tuple[TransformersBackend, TransformersBackend]:
    model = tiny_model(family)
    return TransformersBackend(model), TransformersBackend(model, reuse_prefix=False)


@functools.cache
def unpacked(family: str) -> TransformersBackend:
    """Prefix reuse without packing: a batch's cells start at the first position among them."""
    return TransformersBackend(backends(family)[0].model, pack=False)


@contextlib.contextmanager
def run_lengths(backend, every_block=False):
    """(batch rows, length) of each run of the last block's MLP (or of every block's), while
    hooked: what the block really computed, after nnsight's skips and narrowed inputs."""
    blocks = _get(backend._hf, backend.adapter.blocks)
    seen: list[tuple[int, int]] = []
    handles = [_get(block, backend.adapter.mlp).register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        tuple((args[0] if args else next(iter(kwargs.values()))).shape[:2])), with_kwargs=True)
        for block in (blocks if every_block else blocks[-1:])]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def computed(backend, fn, **kwargs):
    """``fn(backend, **kwargs)`` and the positions its runs' blocks computed in all."""
    with run_lengths(backend, every_block=True) as seen:
        got = fn(backend, **kwargs)
    return got, sum(rows * length for rows, length in seen)


def same(on, off, views, what):
    for view in views:
        a, b = on.raw[view], off.raw[view]
        assert not torch.isnan(a).any(), (what, view)
        assert torch.allclose(a, b, atol=ATOL, rtol=0), (what, view, float((a - b).abs().max()))


def compare(family, fn, views, what, packs=True, **kwargs):
    """``fn`` with reuse on (packed where the family packs, and not packed) and off: equal
    grids; reuse computed fewer positions than no reuse, and packing, where its cells start
    at different positions (``packs``), fewer than not packing."""
    on, off = backends(family)
    packs = packs and family not in NOT_PACKED
    got, n_packed = computed(on, fn, **kwargs)
    grouped, n_grouped = computed(unpacked(family), fn, **kwargs)
    want, n_all = computed(off, fn, **kwargs)
    same(got, want, views, what)
    same(grouped, want, views, (what, "unpacked"))
    assert n_grouped < n_all, (what, "no run started after position 0")
    assert n_packed <= n_grouped, (what, n_packed, n_grouped)
    if packs:
        assert n_packed < n_grouped, (what, "packing computed no fewer positions", n_packed, n_grouped)
    return got


def _sites(family):
    return ["resid"] if family in SUBLAYER_REFUSED else ["resid", "attn", "mlp", "head"]


@pytest.mark.parametrize("family", FAMILIES + VARIANTS + SUBLAYER_REFUSED)
def test_patching_every_site_and_direction_equals_reuse_off(family):
    n_tokens = len(backends(family)[0].tokenizer(CLEAN).input_ids)
    for site in _sites(family):
        # A head grid patches its positions all at once: the last three, so it can start late.
        where = {"positions": list(range(n_tokens - 3, n_tokens))} if site == "head" else {}
        for direction in ("denoise", "noise"):
            compare(family, pipatch.patch, [site], (site, direction), packs=site != "head", clean=CLEAN, corrupt=CORRUPT,
                    answer=" Paris", foil=" Rome", site=site, direction=direction, **where)


@pytest.mark.parametrize("family", FAMILIES + VARIANTS + SUBLAYER_REFUSED)
def test_tracing_with_noise_windows_and_seeds_equals_reuse_off(family):
    kinds = ["resid"] if family in SUBLAYER_REFUSED else ["resid", "mlp", "attn"]
    compare(family, pipatch.trace, kinds, "trace", prompt=CLEAN, subject="Eiffel Tower", answer=" Paris",
            seeds=3, scale=3.0, sites=kinds, window=2, metric="logprob")


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "bloom", "falcon_new"])
def test_multi_token_answers_equal_reuse_off(family):
    """Two inputs per cell (the foil diverges before its last token): the cache holds one row
    per input, both from the same base run."""
    result = compare(family, pipatch.patch, ["resid"], "multi-token", packs=False, clean=CLEAN, corrupt=CORRUPT,
                     answer=" Paris France", foil=" Rome Italy")
    assert result.metric == "logprob_diff"


def exact_cost(backend, plan):
    """Run ``plan``: the positions its blocks computed; what its cells need — each cell its
    own positions (from its first written one) through the blocks from its ``start`` up —
    plus the padding of their rows (:func:`_layout`: a row is padded to the widest, and runs
    the blocks from its cells' ``start`` up); and whether a trace held cells of different
    ``start``. The packed traces are read off the backend's call log."""
    n_layers, needed, mixed = backend.adapter.n_layers, [], []
    with backend.log.recording() as log, run_lengths(backend, every_block=True) as seen:
        result = plan.run()
    for trace in (event for event in log if event["event"] == "packed"):
        starts, lengths = trace["starts"], trace["lengths"]
        assert trace["bases"] == 1
        rows = _layout(starts, lengths)
        width = max(sum(lengths[i] for i in row) for row in rows)
        pad = sum((width - sum(lengths[i] for i in row)) * (n_layers - starts[row[0]]) for row in rows)
        needed.append(sum(n * (n_layers - start) for n, start in zip(lengths, starts)) + pad)
        mixed.append(len(set(starts)) > 1)
    return result, sum(rows * length for rows, length in seen), sum(needed), any(mixed)


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "falcon", "embedded"])
def test_a_packed_cell_computes_only_its_own_layers_and_positions(family, request):
    """Packed, rows of different layers share traces and each cell still runs only the blocks
    from its ``start`` up, at its positions from its first written one: the blocks compute
    the sum of that over the cells and their rows' padding (none on the embedded model's
    grids: test_the_layout_of_a_grid_pads_little), no more, with the same grid as no reuse."""
    if family == "embedded":
        model = request.getfixturevalue("model")
        backend, off = TransformersBackend(model), TransformersBackend(model, reuse_prefix=False)
        kwargs = dict(clean="The Eiffel Tower is in the city of", corrupt="The Colosseum is in the city of")
    else:
        (backend, off), kwargs = backends(family), dict(clean=CLEAN, corrupt=CORRUPT)
    for site in ("resid", "mlp"):
        plan = plan_patch(backend, answer=" Paris", foil=" Rome", site=site, **kwargs)
        result, ran, needed, mixed = exact_cost(backend, plan)
        assert ran == needed and mixed, (site, ran, needed, mixed)
        same(result, pipatch.patch(off, answer=" Paris", foil=" Rome", site=site, **kwargs), [site], site)
    plan = plan_trace(backend, kwargs["clean"], subject="Eiffel Tower", answer=" Paris", seeds=3, scale=3.0)
    result, ran, needed, mixed = exact_cost(backend, plan)
    assert ran == needed and mixed, ("trace", ran, needed, mixed)
    same(result, pipatch.trace(off, kwargs["clean"], subject="Eiffel Tower", answer=" Paris", seeds=3, scale=3.0),
         ["resid"], "trace")


def test_every_family_but_alibi_packs():
    """Packing needs ``position_ids`` and a 4-D mask the attention takes: every tiny family
    but BLOOM (checked above to compute fewer positions packed than not)."""
    assert [f for f in FAMILIES + VARIANTS + SUBLAYER_REFUSED if backends(f)[0]._masks is None] == NOT_PACKED


def test_path_patching_falls_back_to_position_0():
    """Path patching freezes every prompt position: nothing to reuse, the same numbers."""
    on, off = backends("llama")
    kwargs = dict(clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome", sender="mlp")
    n_tokens = len(on.tokenizer(CLEAN).input_ids)
    with run_lengths(on) as seen:
        got = pipatch.path_patch(on, **kwargs)
    same(got, pipatch.path_patch(off, **kwargs), got.raw, "path")
    assert all(length % n_tokens == 0 for _, length in seen), seen  # whole runs (packed or not)


def test_a_model_without_a_cache_argument_runs_from_position_0():
    """The adapter finds no cache argument (a forward that takes none): the backend does not
    reuse, by itself, and the grid is the same."""
    model = tiny_model("qwen2")
    plain = TransformersBackend(model)
    plain.adapter = dataclasses.replace(plain.adapter, cache_kwarg=None)
    n_tokens = len(plain.tokenizer(CLEAN).input_ids)
    kwargs = dict(clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome")
    with run_lengths(plain) as seen:
        got = pipatch.patch(plain, **kwargs)
    assert min(length for _, length in seen) == n_tokens
    same(got, pipatch.patch(backends("qwen2")[0], **kwargs), ["resid"], "no cache")


def test_embedded_model_sites_and_trace_equal_reuse_off(model):
    """Gemma 3 270M (sliding-window and full layers, one key/value head, soft-capped
    attention): a head grid at the last 4 positions, MLP noising, and a 2-seed trace."""
    on, off = TransformersBackend(model), TransformersBackend(model, reuse_prefix=False)
    pair = dict(clean="The Eiffel Tower is in the city of", corrupt="The Colosseum is in the city of",
                answer=" Paris", foil=" Rome")
    cases = [
        (pipatch.patch, dict(pair, site="head", positions=[6, 7, 8]), "head"),
        (pipatch.patch, dict(pair, site="mlp", direction="noise"), "mlp"),
        (pipatch.trace, dict(prompt=pair["clean"], subject="Eiffel Tower", answer=" Paris", seeds=2, window=3), "resid"),
    ]
    grouped = TransformersBackend(model, pack=False)
    for fn, kwargs, view in cases:
        got, n_packed = computed(on, fn, **kwargs)
        want, n_all = computed(off, fn, **kwargs)
        same(got, want, [view], view)
        same(computed(grouped, fn, **kwargs)[0], want, [view], view)
        assert n_packed < n_all, (view, n_packed, n_all)


# --------------------------------------------------------------------------------------------
# Writes the metric cannot see: the last block at earlier positions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "bloom", "qwen3"])
def test_unread_or_unchanging_writes_are_filled_without_a_forward(family):
    """The last block's writes before the last position never reach the metric, and restoring
    a clean state before the first noised position writes what the noised run already has:
    the engine fills both with the base run's value and runs nothing; every cell run for real
    (``fast=False``) gives the same grid."""
    on, _ = backends(family)
    kinds = ["resid"] if family in SUBLAYER_REFUSED else ["resid", "mlp", "attn"]
    kwargs = dict(prompt=CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0, sites=kinds,
                  window=2, metric="logprob")
    fast = pipatch.trace(on, **kwargs)
    slow = pipatch.trace(on, **kwargs, fast=False)
    same(fast, slow, kinds, "unread")
    n_tokens, first = len(fast.tokens), min(fast.meta["subject_positions"])
    n_layers = fast.raw[kinds[0]].shape[1]
    # Per kind and seed: the top row from the subject to the last position but one (unread),
    # and every row before the subject, where the noised run's inputs are the clean run's, so
    # (attention being causal) restoring a clean state there changes nothing (Sweep.agrees_before;
    # the two runs' states agree there only to rounding, batched differently).
    skipped = len(kinds) * 2 * (n_tokens - 1 - first + n_layers * first)
    assert first > 0 and fast.meta["engine"]["noop_cells"] >= skipped, fast.meta["engine"]
    assert slow.meta["engine"]["noop_cells"] == 0
    corrupt = fast.corrupt_seeds.to(fast.raw[kinds[0]].dtype)
    for view in kinds:
        top, before = fast.raw[view][:, -1, first:-1], fast.raw[view][:, :, :first]
        assert torch.equal(top, corrupt[:, None].expand_as(top))
        assert torch.equal(before, corrupt[:, None, None].expand_as(before))


def test_a_key_written_at_the_last_layer_is_still_run():
    """A key or value written at the last layer reaches later positions through that layer's
    own attention: such a cell runs (and changes the metric), where the same write to the
    block's output is filled from the base run (and running it changes nothing)."""
    backend = backends("llama")[0]
    adapter = backend.adapter
    ids = backend.tokenizer(CLEAN, return_tensors="pt").input_ids
    metric = Metric("logprob", backend.tokenizer(" Paris", add_special_tokens=False).input_ids[:1])
    base = Base(ids, capture(backend, ids, metric))
    last, T = adapter.n_layers - 1, ids.shape[1]
    key = projection(adapter.qkv[1], 1)
    generator = torch.Generator().manual_seed(0)
    kv_width = adapter.n_kv_heads * adapter.head_dim
    key_cell = Cell(last, 2, 0, start=last, ops=[Op(key, last, (slice(None), [2]),
                                                    torch.randn(1, 1, kv_width, generator=generator) * 50)])
    resid_cell = Cell(last, 2, 0, start=last, ops=[Op(SITES["resid"], last, (slice(None), [2]),
                                                      torch.randn(1, 1, adapter.d_model, generator=generator) * 5)])
    assert not _is_unread(base, key_cell) and _is_unread(base, resid_cell)
    (moved,), _ = patch(backend, PatchRequest.of(base, [[key_cell]], metric, fast=False))
    (still,), _ = patch(backend, PatchRequest.of(base, [[resid_cell]], metric, fast=False))
    assert abs(float(moved[0]) - float(base.capture.metric[0])) > 1e-3, "the key write did not reach the metric"
    assert abs(float(still[0]) - float(base.capture.metric[0])) < 1e-6
    # At the last position the block's output is read: not filled.
    read = dataclasses.replace(resid_cell, ops=[dataclasses.replace(resid_cell.ops[0], index=(slice(None), [T - 1]))])
    assert not _is_unread(base, read)


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_a_rows_batches_finish_together_with_the_same_numbers(family):
    """A row's batches (one trace each, by first written position) go to the backend as one
    ``patch`` request, which computes every cell's probability in one product with the
    unembedding: the same numbers as each batch run alone."""
    backend = backends(family)[0]
    # Ten seeds: ten cells per position, too many to start every position's cells at one;
    # packed, traces of at most 32 cells: a row's 90 in several.
    plan = plan_trace(backend, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=10, scale=3.0, batch_size=32)
    sweep = plan.sweeps[0]
    groups = batches(list(sweep.cells(0)), 256, prefix_reuse=True)
    assert len(groups) > 1 and sweep.metric.token_ids is None  # several traces; a full softmax
    together = patch(backend, PatchRequest.of(sweep.base, groups, sweep.metric))[0]
    alone = [patch(backend, PatchRequest.of(sweep.base, [cells], sweep.metric))[0][0] for cells in groups]
    assert [len(v) for v in together] == [len(c) for c in groups]
    assert torch.allclose(torch.cat(together), torch.cat(alone), atol=1e-6, rtol=0)
    # ... and the engine hands a row's batches over in one request (the backend's call log).
    with plan.backend.log.recording() as log:
        plan.run()
    calls = [event["batches"] for event in log if event["event"] == "patch"]
    assert max(calls) > 1 and plan.result.status == "done"
    slow = pipatch.trace(backend, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=10, scale=3.0, fast=False)
    same(plan.result, slow, ["resid"], "grouped")


def test_a_packed_trace_holds_pack_tokens_on_the_cpu_and_the_memory_sized_batch_on_a_gpu():
    """On the CPU a packed trace holds about PACK_TOKENS["cpu"] positions; on a GPU the
    backend sets no bound of its own (NO_BOUND), so the batch size, sized from the device's
    free memory (auto_batch_size), is what bounds a packed trace: here 8 GB of a GPU for the
    embedded model's sizes at 128 tokens holds far more than 1,024 positions."""
    backend = backends("llama")[0]
    sweep = plan_patch(backend, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome").sweeps[0]
    base, metric = sweep.base, sweep.metric
    assert backend.capabilities.packed(base, metric) == PACK_TOKENS["cpu"] == 1024
    on_gpu = type("OnGpu", (TransformersBackend,), {"device": torch.device("cuda")})(backend.model)
    assert on_gpu.capabilities.packed(base, metric) == NO_BOUND

    T, GB = 128, 10**9
    gemma = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32, tokenizer=[None] * 262144,
                            adapter=SimpleNamespace(d_model=640, n_layers=18, n_heads=4))
    size = auto_batch_size(T, backend=gemma, free_bytes=8 * GB)
    assert size * T > 4 * PACK_TOKENS["cpu"]  # the GPU's batch: many times the CPU's pack
    cells = cells_at(*[T - 64] * (3 * size))  # 3 batches' worth of 64-position cells
    on_cpu = batches(cells, size, prefix_reuse=True, pack=PACK_TOKENS["cpu"], n_positions=T)
    gpu = batches(cells, size, prefix_reuse=True, pack=NO_BOUND, n_positions=T)
    assert [len(b) for b in gpu] == [size] * 3  # cut by the batch size alone
    assert len(on_cpu) == -(-3 * size * 64 // PACK_TOKENS["cpu"])  # the CPU's: 1,024 positions each
    assert all(len(b) * 64 <= PACK_TOKENS["cpu"] for b in on_cpu)
    assert sorted(id(c) for b in gpu for c in b) == sorted(id(c) for c in cells)
    # Cells of every length: still the fewest traces the batch size allows, far more than the
    # CPU's pack each.
    mixed = batches(cells_at(*[i % T for i in range(3 * size)]), size, prefix_reuse=True, pack=NO_BOUND,
                    n_positions=T)
    assert [len(b) for b in mixed] == [size] * 3
    assert max(sum(T - c.first_position for c in b) for b in mixed) > 4 * PACK_TOKENS["cpu"]
