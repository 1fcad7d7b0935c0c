"""``Result.code()``: the plain nnsight script recomputes each result's grid, in a fresh process.

Every experiment kind and site on the embedded model: the script, run as
``python script.py OUT.json`` with nothing of pipatch imported, writes grids equal to
``result.grids`` within 1e-4. Results are small (short sweeps, 2 seeds for traces, column
subsets) and each is computed once per module. Then: the script is the same for a result read
back from its file, hostile prompts still give a valid script, what cannot be expressed says
so in one line, and the widget and the CLI carry it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import subprocess
import sys
import time

import pytest
import torch

import pipatch
from pipatch import cli, load_result
from pipatch._model.models import PipatchError
from tests._experiments import TINY
from tests._tiny import save_tiny
from tests._tolerance import assert_recovery_close, recovery_tolerance
from tests.conftest import COLOSSEUM, EIFFEL

LOUVRE, VATICAN = "The Louvre is in the city of", "The Vatican is in the city of"
PARIS = "Paris is in"  # traces cost seeds × kinds × layers × tokens runs: a short prompt
PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}

#: name → (experiment, keyword arguments): every kind, every site, every direction, datasets.
CASES: dict[str, tuple[str, dict]] = {
    "trace resid+mlp+attn": ("trace", {"prompt": PARIS, "subject": "Paris", "answer": " France", "seeds": 2,
                                       "scale": 3.0, "sites": "resid,mlp,attn", "window": 3}),
    "patch resid denoise": ("patch", {**PAIR, "site": "resid", "positions": [2, 4, -1]}),
    "patch attn noise prob": ("patch", {**PAIR, "site": "attn", "direction": "noise", "metric": "prob",
                                        "positions": [3, -1]}),
    "patch mlp zero logprob": ("patch", {**PAIR, "site": "mlp", "direction": "zero", "metric": "logprob",
                                         "positions": [4, -1]}),
    "patch head mean": ("patch", {**PAIR, "site": "head", "direction": "mean", "positions": [-1]}),
    "attribute resid": ("attribute", {**PAIR, "site": "resid"}),
    "attribute head": ("attribute", {**PAIR, "site": "head", "positions": [3, -1]}),
    "path heads to logits": ("path_patch", PAIR),
    "path mlp to q/k/v noise": ("path_patch", {**PAIR, "sender": "mlp", "direction": "noise",
                                               "receivers": [("head", 6, 0, "q"), ("head", 6, 1, "k"),
                                                             ("head", 8, 2, "v")]}),
    "dataset trace": ("trace", {"prompt": [PARIS, "The Colosseum is in"], "subject": ["Paris", "Colosseum"],
                                "answer": [" France", " Rome"], "seeds": 1, "scale": 3.0}),
    "lens": ("lens", {"prompt": EIFFEL, "answer": " Paris"}),
    "lens rank": ("lens", {"prompt": EIFFEL, "answer": " Paris", "metric": "rank"}),
    "lens positions": ("lens", {"prompt": EIFFEL, "answer": " Paris", "positions": [2, -1]}),
    "lens logit_diff": ("lens", {"prompt": EIFFEL, "answer": " Paris", "foil": " Rome", "metric": "logit_diff"}),
    "trace positions": ("trace", {"prompt": PARIS, "subject": "Paris", "answer": " France", "seeds": 1, "scale": 3.0,
                                  "positions": [1, -1]}),
    "dataset patch": ("patch", {"clean": [EIFFEL, LOUVRE], "corrupt": [COLOSSEUM, VATICAN], "answer": " Paris",
                                "foil": " Rome", "positions": [1, 3, -2, -1]}),
    # The grid of a circuit is its edge estimates; the exact checks (verify) do not change it.
    "circuit eap-ig": ("circuit", {**PAIR, "steps": 2, "verify": 0}),
    "dataset circuit": ("circuit", {"clean": [EIFFEL, LOUVRE], "corrupt": [COLOSSEUM, VATICAN], "answer": " Paris",
                                    "foil": " Rome", "method": "eap", "verify": 0}),
}

IOI = {"clean": "When Mary and John went to the store, John gave a book to",
       "corrupt": "When Mary and John went to the store, Mary gave a book to", "answer": " Mary", "foil": " John"}
IOI2 = {"clean": "When Tom and Anna went to the park, Anna gave a ball to",
        "corrupt": "When Tom and Anna went to the park, Tom gave a ball to", "answer": " Tom", "foil": " Anna"}
#: name → (tiny family, experiment, keyword arguments), on the saved tiny checkpoints of
#: tests/_tiny.py: GPT-2 (fused q/k/v, Conv1D, LayerNorm), Llama (grouped-query attention)
#: and Gemma 3 (grouped-query attention, norms after each sublayer, z wider than the stream).
TINY_CASES: dict[str, tuple[str, str, dict]] = {
    **{f"tiny {family} circuit": (family, "circuit", TINY["circuit"]) for family in ("gpt2", "llama", "gemma3")},
    "tiny llama circuit eap": ("llama", "circuit", {**IOI, "method": "eap", "verify": 0}),
    "tiny gemma3 dataset circuit": ("gemma3", "circuit", {**{key: [IOI[key], IOI2[key]] for key in IOI},
                                                          "steps": 3, "verify": 0}),
}


@pytest.fixture(scope="module")
def results(model):
    """``results(name)``: the pipatch result of ``CASES[name]``, computed once per module."""
    cache: dict[str, pipatch.Result] = {}

    def get(name: str) -> pipatch.Result:
        if name not in cache:
            experiment, kwargs = CASES[name]
            kwargs = dict(kwargs)
            args = [kwargs.pop("prompt")] if "prompt" in kwargs else []
            cache[name] = getattr(pipatch, experiment)(model, *args, **kwargs)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    """``tiny_results(name)``: the pipatch result of ``TINY_CASES[name]`` on its tiny family's
    checkpoint, saved to a folder and loaded from it (what the script loads too)."""
    models: dict[str, object] = {}
    cache: dict[str, pipatch.Result] = {}

    def get(name: str) -> pipatch.Result:
        family, experiment, kwargs = TINY_CASES[name]
        if family not in models:
            models[family] = pipatch.load_model(save_tiny(family, tmp_path_factory.mktemp(family)))
        if name not in cache:
            cache[name] = getattr(pipatch, experiment)(models[family], **kwargs)
        return cache[name]

    return get


def run_script(code: str, tmp_path) -> tuple[dict, float]:
    """Run ``code`` as ``python script.py OUT.json`` in a fresh process; its JSON and seconds."""
    script, out = tmp_path / "script.py", tmp_path / "out.json"
    script.write_text(code, encoding="utf-8")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text()), time.perf_counter() - started


def imports(code: str) -> set[str]:
    """Top-level package names a script imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    return names


def max_difference(got: list, want: torch.Tensor) -> float:
    """Largest |got − want| over the cells; NaN must meet NaN (``null`` in the JSON)."""
    worst = 0.0
    assert len(got) == want.shape[0]
    for got_row, want_row in zip(got, want.tolist(), strict=True):
        for a, b in zip(got_row, want_row, strict=True):
            if math.isnan(b):
                assert a is None
            else:
                assert a is not None
                worst = max(worst, abs(a - b))
    return worst


def tolerance(result: pipatch.Result, view: str) -> torch.Tensor:
    """Per cell, how far the script's grid may be from pipatch's. The script runs each cell
    alone, pipatch in batches, so their float32 rounding differs: each metric (the cell's and
    the baselines') by at most 1e-6 + 1e-5·|value| (a probability of 0.002, "Paris is in" →
    " France" noised at 3σ, differs by a few 1e-7 after 18 layers; log-probabilities of two
    batchings by up to 3.6e-6·(1 + |value|), tests/integration/test_lens.py), and a recovery
    by what those move it by (:func:`tests._tolerance.recovery_tolerance`: a seed whose clean
    and corrupt probabilities are 6e-4 apart turns 1e-6 into ~7e-3). The logit lens is its
    metric, within 1e-4 (an absolute value, as the lens's references allow); a rank is
    compared with its band (:func:`test_the_script_recomputes_the_grid`)."""
    if not result.normalized:
        return torch.full_like(result.mean(view), 1e-4)
    return recovery_tolerance(result, 1e-6, 1e-5, view)


def as_grid(rows: list) -> torch.Tensor:
    """A grid from the script's JSON (``null``: NaN)."""
    return torch.tensor([[math.nan if v is None else v for v in row] for row in rows], dtype=torch.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_the_script_recomputes_the_grid(name, results, tmp_path, request):
    result = results(name)
    code = result.code()
    assert imports(code) == {"json", "sys", "torch", "nnsight", "transformers"}
    assert "trust_remote_code" not in code
    data, seconds = run_script(code, tmp_path)
    assert set(data["grids"]) == set(result.views)
    if result.metric == "rank":
        # A count among 262k logits: a near-tie with the answer's flips with the rounding. The
        # script reads the states as the lens's hand reference does; both ranks lie in that
        # reference's band for logits within the lens's log-probability tolerance (1e-5,
        # 2e-5 relative: tests/integration/test_lens.py).
        from tests.integration.test_lens import assert_ranks_in_band

        model, (_, kwargs) = request.getfixturevalue("model"), CASES[name]
        for grid in (as_grid(data["grid"]), result.grid):
            assert_ranks_in_band(grid, model, kwargs["prompt"], kwargs["answer"], 1e-5, 2e-5)
        print(f"{name}: max |Δ| {max_difference(data['grid'], result.grid):.0f} places, script {seconds:.0f}s")
        return
    worst = max(max_difference(data["grids"][view], result.mean(view)) for view in result.views)
    margin = max(float(((as_grid(data["grids"][view]) - result.mean(view)).abs() / tolerance(result, view)).nan_to_num().max())
                 for view in result.views)
    print(f"{name}: max |Δ| {worst:.2e}, at most {margin:.2f} of the derived tolerance, script {seconds:.0f}s")
    assert_recovery_close(as_grid(data["grid"]), result.grid, tolerance(result, result.views[0]))
    for view in result.views:
        assert_recovery_close(as_grid(data["grids"][view]), result.mean(view), tolerance(result, view))


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_the_script_recomputes_the_grid_on_tiny_models(name, tiny_results, tmp_path, request):
    test_the_script_recomputes_the_grid(name, tiny_results, tmp_path, request)


def test_a_result_read_back_from_its_file_gives_the_same_script(results, tmp_path):
    for name in ("dataset trace", "dataset patch", "path mlp to q/k/v noise", "dataset circuit"):
        result = results(name)
        back = load_result(result.save(tmp_path / "r.safetensors"))
        assert back.code() == result.code()


def test_the_script_loads_the_model_the_result_records(results):
    result = results("attribute resid")
    code = result.code()
    assert f"MODEL = {result.meta['model_path']!r}" in code
    assert "dtype=torch.float32" in code
    assert result.meta["model_path"].startswith(str(pipatch._model.models.default_cache_dir()))


HOSTILE = 'He said "no\\" \'\'\' """\nthen {x} $y %s \\n \\\\ Paris is in'


def test_a_hostile_prompt_gives_a_valid_script_that_keeps_it_verbatim(model):
    """Quotes, a newline, backslashes and triple quotes: the script compiles and its literal is the prompt."""
    corrupt = HOSTILE.replace("Paris", "Rome")
    result = pipatch.attribute(model, clean=HOSTILE, corrupt=corrupt, answer=" France", foil=" Italy",
                               site="mlp", positions=[-1])
    code = result.code()
    tree = ast.parse(code)
    compile(code, "script.py", "exec")
    given = {kw.arg: ast.literal_eval(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
             for kw in node.keywords if kw.arg in ("clean_prompt", "corrupt_prompt")}
    assert given == {"clean_prompt": HOSTILE, "corrupt_prompt": corrupt}
    assert "pipatch" not in imports(code)


def test_what_cannot_be_expressed_says_so_in_one_line(results):
    result = results("attribute resid")
    for meta, words in [({**result.meta, "backend": "vllm"}, "vllm"),
                        ({k: v for k, v in result.meta.items() if k != "adapter"}, "module layout"),
                        ({**result.meta, "adapter": {**result.meta["adapter"], "blocks": "model.layers;import os"}},
                         "dotted name")]:
        with pytest.raises(PipatchError, match=words) as error:
            dataclasses.replace(result, meta=meta).code()
        assert "\n" not in str(error.value)
    assert dataclasses.replace(result, meta={**result.meta, "backend": "vllm"}).to_state()["code"] == ""


def test_the_widget_state_carries_the_script(results):
    from pipatch._notebook.widget import GridWidget

    result = results("attribute resid")
    assert result.to_state()["code"] == result.code()
    assert GridWidget(result).code == result.code()


def test_the_cli_writes_the_script(results, tmp_path, capsys):
    path = tmp_path / "attribute.py"
    argv = ["attribute", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome",
            "--site", "resid", "--device", "cpu", "--quiet", "--code", str(path)]
    assert cli.main(argv) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert path.read_text(encoding="utf-8") == results("attribute resid").code()
