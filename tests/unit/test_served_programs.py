"""Programs by name (:mod:`pipatch._backends._served_programs`), with no model and no server:
what a served client encodes decodes on the server to the same arguments, and every bad
request is refused in one line before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipatch._backends._served_programs import (
    PROGRAM_FORMAT,
    PROGRAMS,
    BadRequest,
    Bounds,
    check_versions,
    decode,
    encode,
    pipatch_version,
)
from pipatch._backends._vllm_worker import capture_request, head_request, patch_request, program_request
from pipatch._model.cells import Metric, Op
from pipatch._model.models import Adapter, PipatchError
from pipatch._model.sites import EMBED, HEAD, MLP, RESID, Site, projection
from pipatch._programs.circuit import Baselines
from tests._program_requests import BAD_REQUESTS, good_request

ADAPTER = Adapter(family="gemma3_text", embed="model.embed_tokens", blocks="model.layers", attn="self_attn", mlp="mlp",
                  out_proj="o_proj", unembed="lm_head", final_norm="model.norm", n_layers=4, n_heads=4, n_kv_heads=1,
                  head_dim=8, d_model=32, softcap=None, sublayers_are_contributions=True, qkv=("qkv_proj",),
                  qkv_layout="stacked")
BOUNDS = Bounds.of(ADAPTER, vocab=1000, max_len=64)
IDS = [2, 651, 128, 997, 603, 575]
METRIC = Metric("logit_diff", (17,), (23,))


def same(a, b) -> bool:
    """Equal values, tensors by value and dtype, through containers and pipatch's dataclasses."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def round_trip(body, jobs, skip=0):
    request = decode(encode(body, jobs, skip, ADAPTER), BOUNDS)
    assert request.program == body.__name__ and request.body is body and request.skip == skip
    assert len(request.jobs) == len(jobs)
    for (ids, args), (got_ids, got_args) in zip(jobs, request.jobs):
        assert got_ids == list(ids)
        assert same(tuple(args[1:]), got_args), (args[1:], got_args)  # the adapter stays with the client
    return request


def test_every_program_arrives_as_it_was_sent():
    ops = [Op(EMBED, 0, (slice(None), [1, 2]), torch.randn(1, 2, 32), add=True),
           Op(HEAD, 2, (slice(None), slice(-1, None), slice(8, 16)), torch.randn(1, 1, 8)),
           Op(projection("qkv_proj", 0), 1, (slice(None), (3, 4), slice(0, 8))),
           Op(RESID, 3, (slice(None), torch.tensor([True, False, True, False, True, False])), torch.randn(1, 3, 32))]
    state = torch.randn(len(IDS), 32)
    means = Baselines(*(torch.randn(2, 4, 5, 32) for _ in Baselines._fields))
    round_trip(patch_request, [(IDS, (ADAPTER, METRIC, ops, False, None)),
                               (IDS[:3], (ADAPTER, Metric("prob", (5, 6)), [], True, None))])
    round_trip(patch_request, [(IDS, (ADAPTER, METRIC, ops[2:], False, (2, state, True)))], skip=2)
    round_trip(capture_request, [(IDS, (ADAPTER, METRIC, [MLP, RESID], ops[:1], 6)),
                                 (IDS, (ADAPTER, Metric("rank", (9,)), None, [], 6))])
    round_trip(head_request, [(IDS[:1], (ADAPTER, METRIC, torch.randn(3, 1, 32)))])
    assert set(PROGRAMS) == {"capture_request", "patch_request", "head_request"}  # the vLLM backend's own bodies
    # Every other program by name, its request from its declared inputs (one invoke per row).
    from pipatch._programs import CIRCUIT_BASELINES, CIRCUIT_RUN, LENS
    from pipatch._programs.circuit import BaselinesRequest, MasksRequest
    from pipatch._programs.lens import LensRequest

    ids = torch.tensor([IDS])
    for program, request in [(LENS, LensRequest(ids, METRIC, [0, 3, -1])),
                             (CIRCUIT_BASELINES, BaselinesRequest(torch.tensor([IDS, IDS[::-1]]))),
                             (CIRCUIT_RUN, MasksRequest(ids, METRIC, torch.rand(5, 3, 4) > 0.5, torch.randn(1, 6, 32), means)),
                             (CIRCUIT_RUN, MasksRequest(ids, METRIC, torch.rand(5, 3, 4), torch.randn(1, 6, 32), None))]:
        parts = rows_apart(request)
        got = decode(encode(program_request, [(p.ids[0].tolist(), (ADAPTER, program.name, p)) for p in parts], 0,
                            ADAPTER), BOUNDS)
        assert got.program == program.name and got.body is program_request and len(got.jobs) == len(parts)
        for (_, (name, mine)), sent in zip(got.jobs, parts):
            assert name == program.name and type(mine) is type(sent)
            assert all(same(getattr(mine, f.name), getattr(sent, f.name)) for f in dataclasses.fields(sent)), program


def test_the_server_uses_its_own_sites_and_adapter():
    request = round_trip(patch_request, [(IDS, (ADAPTER, METRIC, [Op(RESID, 1, (slice(None), -1))], False, None))])
    (op,) = request.jobs[0][1][1]
    assert op.site is RESID  # the server's own instance, found by name
    assert not any(isinstance(arg, Adapter) for arg in request.jobs[0][1])


@pytest.mark.parametrize("what, broken, words", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_a_bad_request_is_refused_in_one_line(what, broken, words):
    good = good_request(ADAPTER, IDS, 17, 23)
    assert decode(good, BOUNDS).program == "patch_request"
    with pytest.raises(BadRequest) as error:
        decode(broken(good), BOUNDS)
    message = str(error.value)
    assert "\n" not in message and words in message, message


def test_values_that_do_not_fit_the_model_are_refused():
    too_wide = (2, torch.randn(len(IDS), 33), True)
    cases = [
        (patch_request, [(IDS, (ADAPTER, METRIC, [], False, too_wide))], 2, "33 wide, not the model's 32"),
        (head_request, [(IDS[:1], (ADAPTER, METRIC, torch.randn(3, 32)))], 0, "of 3 dimensions"),
        (patch_request, [(IDS, (ADAPTER, Metric("prob", (1000,)), [], False, None))], 0, "token ids in [0, 1000)"),
        (patch_request, [(IDS, (ADAPTER, METRIC, [], False, (5, torch.randn(6, 32), True)))], 4, "below is 5"),
        (patch_request, [(IDS, (ADAPTER, METRIC, [], False, (1, torch.randn(6, 32), True)))], 2, "skips 2 blocks"),
    ]
    from pipatch._programs.lens import LensRequest

    lens = LensRequest(torch.tensor([IDS]), METRIC, [64])
    cases.append((program_request, [(IDS, (ADAPTER, "lens", lens))], 0, "positions[0] is 64, not a whole number in [-64, 64)"))
    for body, jobs, skip, words in cases:
        with pytest.raises(BadRequest) as error:
            decode(encode(body, jobs, skip, ADAPTER), BOUNDS)
        assert "\n" not in str(error.value) and words in str(error.value), (words, str(error.value))


def test_a_site_or_body_without_a_name_is_refused_on_the_client():
    @dataclasses.dataclass(frozen=True)
    class Mine(Site):
        pass

    for site in (Mine("resid", order=7, holder="block", sublayer=False), Site("o_proj", order=0, holder="proj")):
        with pytest.raises(PipatchError) as error:
            encode(patch_request, [(IDS, (ADAPTER, METRIC, [Op(site, 1, (slice(None), -1))], False, None))], 0, ADAPTER)
        assert "\n" not in str(error.value) and "has no name a pipatch server knows" in str(error.value)

    def patch_request_of_mine(model, adapter):  # a body of the same kind, not one of pipatch's
        return None

    with pytest.raises(PipatchError, match="no program a pipatch server runs"):
        encode(patch_request_of_mine, [(IDS, (ADAPTER,))], 0, ADAPTER)


def test_another_version_is_one_line_naming_both_at_connect():
    check_versions({"pipatch": pipatch_version(), "program_format": PROGRAM_FORMAT}, "http://h:1")
    for info, words in [({"pipatch": "0.0.1", "program_format": PROGRAM_FORMAT}, "runs pipatch 0.0.1"),
                        ({"pipatch": pipatch_version(), "program_format": 99}, "program format 99"),
                        ({}, "runs pipatch ? (program format ?)")]:
        with pytest.raises(PipatchError) as error:
            check_versions(info, "http://h:1")
        message = str(error.value)
        assert "\n" not in message and words in message and f"this client pipatch {pipatch_version()}" in message


# --------------------------------------------------------------------------------------------
# SAE latent sites travel as data
# --------------------------------------------------------------------------------------------


def _latent_site(kind: str = "jumprelu", n: int = 48):
    """A random SAE (or skip transcoder) of layer 2 of the hand-made model, bound to it."""
    from pipatch._model.features.hooks import locate
    from pipatch._model.features.sae import SAE
    from pipatch._model.features.site import latent_site

    d = ADAPTER.d_model
    transcoder = kind == "transcoder"
    sae = SAE(activation="topk" if kind == "topk" else "jumprelu", k=5 if kind == "topk" else None,
              W_enc=torch.randn(d, n), b_enc=torch.randn(n), W_dec=torch.randn(n, d), b_dec=torch.randn(d),
              threshold=None if kind == "topk" else torch.rand(n), W_skip=torch.randn(d, d) if transcoder else None,
              hook="blocks.2.hook_mlp_in" if transcoder else "blocks.2.hook_resid_post",
              hook_out="blocks.2.hook_mlp_out" if transcoder else None, name=f"random {kind}")
    reads = locate(sae.hook, ADAPTER)
    writes = locate(sae.hook_out, ADAPTER) if transcoder else reads
    return latent_site(sae, reads, writes, f"L2 {kind}")


@pytest.mark.parametrize("kind", ["jumprelu", "topk", "transcoder"])
def test_a_latent_site_arrives_as_the_same_sae(kind):
    """An SAE's latent and error sites travel as data (description and tensors) and are rebuilt
    on the server with pipatch's classes: the same name, place and math; a second request
    naming the same SAE gets the site built for the first (kept by its content's hash)."""
    from pipatch._model.features.site import ErrorSite, InOut, LatentSite

    site = _latent_site(kind)
    ops = [Op(site, 2, site.cell(3, [1, 2]), torch.randn(1, 1, 2)),
           Op(site.error_site, 2, site.error_site.cell(3), torch.randn(1, 1, 32))]
    jobs = [(IDS, (ADAPTER, METRIC, ops, False, None))] * 3
    first, second = (decode(encode(patch_request, jobs, 0, ADAPTER), BOUNDS) for _ in range(2))
    latent, error = (op.site for op in first.jobs[0][1][1])
    assert type(latent) is LatentSite and type(error) is ErrorSite
    assert (latent.name, error.name, latent.place_key, latent.holder) == (site.name, f"{site.name} error",
                                                                         site.place_key, site.holder)
    assert all(op.site.sae is latent.sae for _, args in first.jobs + second.jobs for op in args[1])
    x = torch.randn(2, 5, 32)
    raw = InOut(x, torch.randn(2, 5, 32)) if kind == "transcoder" else x
    for mine, theirs in ((latent, site), (error, site.error_site)):
        assert torch.equal(mine.encode(raw), theirs.encode(raw))
        assert torch.equal(mine.decode(theirs.encode(raw)), theirs.decode(theirs.encode(raw)))
    for got, sent in zip(first.jobs[0][1][1], ops):
        assert got.index == sent.index and torch.equal(got.value, sent.value)
    captured = decode(encode(capture_request, [(IDS, (ADAPTER, METRIC, [site, RESID], [], 6))], 0, ADAPTER), BOUNDS)
    assert [s.name for s in captured.jobs[0][1][1]] == [site.name, "resid"]


def test_an_saes_latents_and_error_side_by_side_arrive_as_one_site():
    """A feature circuit's faithfulness curve writes an SAE's latents and error as one site
    (:class:`~pipatch._model.features.site.NodeValues`): it travels as the SAE's description with
    ``part`` ``"nodes"`` and is rebuilt as that site, with the same math."""
    from pipatch._model.features.site import NodeValues

    site = _latent_site()
    nodes = site.nodes_site
    op = Op(nodes, 2, nodes.cell(3, [1, 40]), torch.randn(1, 1, 2))
    got = decode(encode(patch_request, [(IDS, (ADAPTER, METRIC, [op], False, None))], 0, ADAPTER), BOUNDS)
    rebuilt = got.jobs[0][1][1][0].site
    assert type(rebuilt) is NodeValues and (rebuilt.name, rebuilt.place_key) == (nodes.name, nodes.place_key)
    x = torch.randn(2, 5, 32)
    assert rebuilt.encode(x).shape[-1] == site.n_latents + 32
    assert torch.equal(rebuilt.encode(x), nodes.encode(x))
    assert torch.equal(rebuilt.decode(nodes.encode(x)), nodes.decode(nodes.encode(x)))


def _sae_edit(change):
    """The request naming a latent site, with ``change`` applied to the site's description."""
    import io

    site = _latent_site()
    blob = encode(patch_request, [(IDS, (ADAPTER, METRIC, [Op(site, 2, site.cell(3, 1))], False, None))], 0, ADAPTER)
    sent = torch.load(io.BytesIO(blob), weights_only=True)
    change(sent["jobs"][0][1][1][0]["site"])
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    return buffer.getvalue()


BAD_SAES = {
    "a missing field": (lambda d: d.pop("k"), "the SAE's description is not"),
    "an unknown part": (lambda d: d.update(part="weights"), "part 'weights' is not one of latents, error, nodes"),
    "an unknown activation": (lambda d: d.update(activation="gelu"), "activation 'gelu' is not one of"),
    "a layer the model lacks": (lambda d: d.update(reads=[9, *d["reads"][1:]]), "reads layer 9 is not in [0, 4)"),
    "a module path of its own": (lambda d: d.update(reads=[2, "resid_post", "mlp.__class__", False]),
                                 "is no place pipatch reads in this gemma3_text model"),
    "another model's width": (lambda d: d["tensors"].update(W_enc=torch.randn(64, 48)),
                              "tensor W_enc is [64, 48] float32, not [32, 48] float32"),
    "a decoder of another size": (lambda d: d["tensors"].update(W_dec=torch.randn(40, 32)), "tensor W_dec is [40, 32]"),
    "integer weights": (lambda d: d["tensors"].update(b_dec=torch.zeros(32, dtype=torch.int64)),
                        "tensor b_dec is not a dense float tensor"),
    "no threshold for a JumpReLU": (lambda d: d["tensors"].update(threshold=None), "only one, has a threshold"),
    "a k for a JumpReLU": (lambda d: d.update(k=3), "k is for TopK SAEs only"),
    "a transcoder writing elsewhere": (lambda d: d.update(hook_out="x"), "a transcoder reads a layer's MLP input"),
    "a multi-line name": (lambda d: d.update(name="L2\nresid"), "name is not a name of 1 to 200 printable"),
}


@pytest.mark.parametrize("case", BAD_SAES, ids=list(BAD_SAES))
def test_a_malformed_sae_is_refused_in_one_line(case):
    change, words = BAD_SAES[case]
    with pytest.raises(BadRequest) as error:
        decode(_sae_edit(change), BOUNDS)
    message = str(error.value)
    assert "\n" not in message and words in message and message.startswith("jobs[0] ops[0].site:"), message


def test_a_request_over_the_servers_limits_names_the_flag():
    """Invokes and prompt tokens over the server's limits are refused (413: OverLimit) before
    the request's own checks, naming the flag; within them the request decodes."""
    from pipatch._backends._served_programs import OverLimit
    from pipatch._serving.guard import Limits

    bounds = dataclasses.replace(BOUNDS, limits=Limits(request_bytes=10**6, invokes=2, prompt_tokens=5))
    job = (IDS[:5], (ADAPTER, METRIC, [], False, None))
    assert len(decode(encode(patch_request, [job, job], 0, ADAPTER), bounds).jobs) == 2
    for jobs, words in (([job] * 3, "the request has 3 invokes, over this server's limit of 2 (pipatch serve --max-invokes)"),
                        ([job, (IDS, job[1])], "invoke 1's prompt has 6 tokens, over this server's limit of 5 "
                                               "(pipatch serve --max-prompt-tokens)")):
        with pytest.raises(OverLimit, match=words.replace("(", r"\(").replace(")", r"\)")):
            decode(encode(patch_request, jobs, 0, ADAPTER), bounds)


def test_a_prompt_over_the_context_names_the_limit_only_where_the_limit_is_below_it():
    """A prompt longer than the context: 413 naming --max-prompt-tokens where the server's limit
    is below the context (raising it helps up to the context), 400 where it is not."""
    from pipatch._backends._served_programs import OverLimit
    from pipatch._serving.guard import Limits

    long_job = (list(range(1, 101)), (ADAPTER, METRIC, [], False, None))  # 100 tokens; the context is 64
    below = dataclasses.replace(BOUNDS, limits=Limits(request_bytes=10**6, invokes=2, prompt_tokens=5))
    with pytest.raises(OverLimit, match="100 tokens, over this server's limit of 5"):
        decode(encode(patch_request, [long_job], 0, ADAPTER), below)
    at_context = dataclasses.replace(BOUNDS, limits=Limits(request_bytes=10**6, invokes=2, prompt_tokens=64))
    with pytest.raises(BadRequest) as refused:
        decode(encode(patch_request, [long_job], 0, ADAPTER), at_context)
    assert not isinstance(refused.value, OverLimit) and "more than 63" in str(refused.value)


# --------------------------------------------------------------------------------------------
# A program with declared inputs: its request encoded and checked from its declaration
# --------------------------------------------------------------------------------------------

from dataclasses import dataclass as _dataclass  # noqa: E402
from typing import Annotated  # noqa: E402

from pipatch._programs import PROGRAMS as _REGISTERED  # noqa: E402
from pipatch._programs import Floats, Layer, Needs, Position, Program, TokenIds, per_row  # noqa: E402
from pipatch._programs._inputs import rows_apart  # noqa: E402


@_dataclass
class _Everything:
    """A request of every kind a declaration may say (the wire format comes from these hints)."""

    ids: TokenIds
    metric: Metric
    site: Site
    sites: list[Site]
    ops: list[list[Op]] = per_row()
    layer: Layer = 0
    position: Position = -1
    scale: float = 1.0
    flag: bool = False
    label: str = ""
    state: Annotated[torch.Tensor, Floats(dims=(2,), width=True)] | None = None
    means: Baselines | None = None
    positions: tuple[int, ...] = ()


def _program(name: str = "test_everything", version: int = 1) -> Program:
    program = Program(name, version, Needs(), lambda view, request: [], "every kind of field", inputs=_Everything)
    _REGISTERED[name] = program  # registered as a module's import would (kept: later tests read it)
    return program


def _jobs(request, name="test_everything"):
    return [(part.ids[0].tolist(), (ADAPTER, name, part)) for part in rows_apart(request)]


def _everything(rows: int = 2) -> _Everything:
    ops = [[Op(HEAD, 2, (slice(None), slice(-1, None), slice(8, 16)), torch.randn(1, 1, 8))] for _ in range(rows)]
    return _Everything(torch.tensor([IDS] * rows), METRIC, MLP, [RESID, HEAD], ops, 3, -2, 0.5, True, "a label",
                       torch.randn(6, 32), Baselines(*(torch.randn(1, 4, 6, 32) for _ in Baselines._fields)), (0, -1))


def test_a_declared_request_arrives_row_by_row_as_it_was_sent():
    """Each row travels as one invoke: its token ids, its per-row fields cut to it, the other
    fields as they are; the server rebuilds the request type from its own declaration."""
    _program()
    request = _everything()
    got = decode(encode(program_request, _jobs(request), 0, ADAPTER), BOUNDS)
    assert got.program == "test_everything" and got.body is program_request and got.skip == 0
    for (ids, (name, part)), want in zip(got.jobs, rows_apart(request)):
        assert ids == IDS and name == "test_everything" and type(part) is _Everything
        for item in dataclasses.fields(_Everything):
            assert same(getattr(part, item.name), getattr(want, item.name)), item.name
    assert part.site is MLP and part.sites[0] is RESID  # the server's own sites, by name


BAD_FIELDS = [
    ("layer", 4, "layer is 4, not a whole number in [0, 4)"),
    ("position", 64, "position is 64, not a whole number in [-64, 64)"),
    ("scale", float("nan"), "scale is nan, not a finite number"),
    ("flag", 1, "flag is 1, not True or False"),
    ("label", "two\nlines", "label is 'two\\nlines', not a line"),
    ("state", torch.randn(6, 33), "33 wide, not the model's 32"),
    ("state", torch.randn(6), "of 2 dimensions"),
    ("site", "embed_tokens.weight", "no site of this model"),
    ("metric", {"name": "exec", "answer": [1], "foil": None}, "no metric"),
    ("means", {"x": torch.zeros(1)}, "not Baselines {embedded, x, z, x_mid, mlp, x_final}"),
    ("positions", [0, 1], "not a tuple"),
]


@pytest.mark.parametrize("field, value, words", BAD_FIELDS, ids=[f"{case[0]}={case[1]!r}"[:40] for case in BAD_FIELDS])
def test_a_declared_field_that_does_not_fit_is_refused_in_one_line(field, value, words):
    import io

    program = _program()
    blob = encode(program_request, _jobs(_everything(1)), 0, ADAPTER)
    sent = torch.load(io.BytesIO(blob), weights_only=True)
    sent["jobs"][0][1][field] = value
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    with pytest.raises(BadRequest) as error:
        decode(buffer.getvalue(), BOUNDS)
    message = str(error.value)
    assert "\n" not in message and words in message and message.startswith(f"jobs[0] {field}"), message
    assert program.name in _REGISTERED


def test_a_program_the_server_lacks_or_runs_in_another_version_is_refused():
    import io

    _program()
    blob = encode(program_request, _jobs(_everything(1)), 0, ADAPTER)
    for change, words in ((dict(version=2), "runs the test_everything program version 1, the request is for version 2"),
                          (dict(program="test_nothing"), "unknown program 'test_nothing'"),
                          (dict(skip=2), "skips 2 blocks but its invokes skip none")):
        sent = torch.load(io.BytesIO(blob), weights_only=True)
        sent.update(change)
        buffer = io.BytesIO()
        torch.save(sent, buffer)
        with pytest.raises(BadRequest) as error:
            decode(buffer.getvalue(), BOUNDS)
        assert "\n" not in str(error.value) and words in str(error.value), str(error.value)


def test_a_request_type_without_runs_is_refused_when_the_program_is_made():
    @_dataclass
    class NoRuns:
        site: Site

    with pytest.raises(TypeError, match="needs a field ids: TokenIds"):
        Program("no_runs", 1, Needs(), lambda view, request: [], "", inputs=NoRuns)
