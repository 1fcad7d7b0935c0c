"""Studies (#32): one experiment over many facts, into a durable SQLite store, averaged.

Real nnsight, ROME's own ``known_1000.json`` as pipatch ships it (:func:`pipatch.known_facts`),
the embedded model, and a tiny random-weight model (:mod:`tests._tiny`) where a check needs
many cells. Kept cheap: short known facts, the residual kind, one or two seeds at a fixed
noise scale (no scale search), the fast paths on (a study plans each fact as the single trace
does: alone, it equals that trace bit for bit; four run as one share the metric's pass).
"""

from __future__ import annotations

import csv
import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipatch
from tests._tiny import save_tiny, tiny_model
from tests.unit.test_facts import KNOWN, UNKNOWN, records

#: The facts of the study the aggregate tests read: two relations (P36 twice).
SIX = KNOWN[:6]
#: A cheap trace: one residual grid, a fixed scale.
CHEAP = {"sites": "resid", "seeds": 1, "scale": 3.0}


@pytest.fixture(scope="module")
def six(model, tmp_path_factory):
    """A 6-fact study of known facts (resid, one seed), and what its progress hook saw."""
    store = tmp_path_factory.mktemp("study") / "six.sqlite"
    seen = []
    found = pipatch.study(model, records(SIX), store=store, progress=lambda i, r, res: seen.append((i, res)), **CHEAP)
    return found, seen


# --------------------------------------------------------------------------------------------
# Each fact is its single trace; the aggregate is the list-form dataset trace
# --------------------------------------------------------------------------------------------


def test_each_fact_of_a_study_is_its_single_trace(model, six, tmp_path):
    """Alone (``in_flight=1``) a fact is its single trace bit for bit; run as one with three
    others (the default in process), its cells share packed traces and the metric's pass over
    the unembedding with theirs: the same values up to float32 rounding, the same baselines."""
    found, seen = six
    assert found.counts()["done"] == 6 and [i for i, _ in seen] == list(range(6))
    assert all(result is not None for _, result in seen)
    alone = pipatch.study(model, records(SIX[:2]), store=tmp_path / "alone.sqlite", in_flight=1, **CHEAP)
    for i, fact in list(enumerate(records(SIX)))[:2]:
        single = pipatch.trace(model, fact["prompt"], subject=fact["subject"], answer=" " + fact["attribute"], **CHEAP)
        assert single.meta["engine"]["fast"] is True
        assert torch.equal(alone[i].raw["resid"], single.raw["resid"]), i
        assert found[i].meta["engine"]["chained"] == 4 and "chained" not in alone[i].meta["engine"]
        assert torch.allclose(found[i].raw["resid"], single.raw["resid"], atol=2e-5, rtol=0), i
        for mine in (alone[i], found[i]):
            assert torch.equal(mine.corrupt_seeds, single.corrupt_seeds) and mine.clean == single.clean
            assert mine.tokens == single.tokens


def test_facts_run_as_one_share_packed_traces_and_the_unembedding_pass_and_repeat_their_bits(model, tmp_path):
    """Four facts run as one (a Chain): their cells run in fewer packed traces than the same
    traces one by one, most of them holding cells of several facts, and their metrics take
    fewer, larger passes over the unembedding; a second run (a resume gives each fact the
    same company) stores the same bits."""
    from pipatch._backends import backend_for

    backend = backend_for(model)  # held: every run below shares it, and its call log
    log = backend.log

    def counted(events):
        """Per pass over the unembedding its positions; per packed trace its facts and cells."""
        return ([e["positions"] for e in events if e["event"] == "unembedding"],
                [(e["bases"], e["cells"]) for e in events if e["event"] == "packed"])

    facts, options = records(KNOWN[:4]), {"sites": "resid,mlp", "seeds": 2, "scale": 3.0}
    with log.recording() as events:
        for fact in facts:
            pipatch.trace(model, fact["prompt"], subject=fact["subject"], answer=" " + fact["attribute"], **options)
    alone, alone_traces = counted(events)
    with log.recording() as events:
        first = pipatch.study(model, facts, store=tmp_path / "a.sqlite", **options)
    together, together_traces = counted(events)
    with log.recording() as events:
        again = pipatch.study(model, facts, store=tmp_path / "b.sqlite", **options)
    passes = counted(events)[0]
    assert passes == together and sum(together) == sum(alone)  # the same positions, in fewer passes
    assert len(together) < len(alone) / 2, (together, alone)
    # The same cells in fewer traces, and most traces hold several facts' cells.
    assert sum(n for _, n in together_traces) == sum(n for _, n in alone_traces)
    assert all(facts_in == 1 for facts_in, _ in alone_traces)
    assert len(together_traces) < len(alone_traces), (together_traces, alone_traces)
    mixed = [n for facts_in, n in together_traces if facts_in > 1]
    assert sum(mixed) > sum(n for _, n in together_traces) / 2, together_traces
    print(f"packed traces: {len(alone_traces)} one by one, {len(together_traces)} as one "
          f"({len(mixed)} holding several facts)")
    for i in range(4):
        assert first[i].meta["engine"]["chained"] == 4
        for view in ("resid", "mlp"):
            assert torch.equal(first[i].raw[view], again[i].raw[view]), (i, view)


#: Twenty facts the tiny model's word-level tokenizer reads one token a word (4 relations).
TINY_SUBJECTS = ["Eiffel Tower", "Colosseum", "Big Ben", "Brandenburg Gate", "Kremlin"]
TINY_TEMPLATES = {"city": ("The {} is located in the city of", " Paris"),
                  "country": ("The {} is in the country of", " France"),
                  "famous": ("The {} is famous for the", " king"),
                  "people": ("The people who lived at the {} speak", " French")}


def tiny_facts():
    return [{"prompt": template.format(subject), "subject": subject, "attribute": answer.strip(),
             "relation_id": relation, "known_id": 100 * r + s}
            for r, (relation, (template, answer)) in enumerate(TINY_TEMPLATES.items())
            for s, subject in enumerate(TINY_SUBJECTS)]


def test_a_twenty_fact_studys_aggregate_equals_the_list_form_dataset_trace(tmp_path):
    # A random model knows no fact: known_only=False runs them all. Each cell run in full
    # (fast=False) on both sides: the list form packs the cells of all its prompts together,
    # a fact alone packs its own, and the sums then differ in the last bits (~1e-5 on Gemma).
    # One seed: with several, a study averages each fact's seeds first (ROME's order), the
    # list form every (prompt, seed) row at once; they differ where a seed cannot be normalised.
    tiny = tiny_model("gemma3")
    facts = tiny_facts()
    exact = {"sites": "resid,mlp", "seeds": 1, "scale": 3.0, "window": 2, "fast": False}
    found = pipatch.study(tiny, facts, store=tmp_path / "tiny.sqlite", known_only=False, **exact)
    assert found.counts()["done"] == 20, found.facts().message.tolist()
    dataset = pipatch.trace(tiny, [f["prompt"] for f in facts], subject=[f["subject"] for f in facts],
                            answer=[" " + f["attribute"] for f in facts], **exact)
    assert found.aggregate()["group"].unique().tolist() == dataset.columns
    for view in ("resid", "mlp"):
        mine, want = found.grid(view), dataset.mean(view)
        assert mine.shape == want.shape == (3, 7)
        # The same runs' recoveries averaged in another order (per fact, then over facts): float32
        # rounding of values below 10, a few ulps, inside 1e-6.
        assert float(want.nan_to_num().abs().max()) < 10
        assert torch.allclose(mine, want, atol=1e-6, rtol=0, equal_nan=True), (mine - want).abs().nan_to_num(0).max()
    # ROME's raw effect: P(restored) − P(corrupted), averaged the same way.
    raw = dataset.raw["resid"] - dataset.corrupt_seeds.reshape(-1, 1, 1)
    assert torch.allclose(found.grid("resid", "raw_effect"), torch.nanmean(raw, 0), atol=1e-6, equal_nan=True)
    # The same facts spelled another way resume (a list of sites is the comma-separated text).
    again = pipatch.study(tiny, facts, store=tmp_path / "tiny.sqlite", known_only=False,
                          **{**exact, "sites": ["resid", " mlp"]})
    assert again.counts()["done"] == 20


def test_the_aggregate_has_95_percent_t_intervals_and_a_relation_breakdown(six):
    found, _ = six
    table = found.aggregate()
    last = table[(table.group == "last") & (table.layer == 17) & (table.metric == "recovery")].iloc[0]
    assert last.n == 6 and last.low < last["mean"] < last.high
    # mean ± t(0.975, 5) · sd / √6, t(0.975, 5) = 2.5706 (2.570582 to 4 decimals: 1e-3 relative
    # is that rounding and the float32 sums, with room)
    assert last.high - last["mean"] == pytest.approx(2.5706 * last.sd / 6 ** 0.5, rel=1e-3)
    by = found.aggregate(by="relation_id")
    assert set(by.relation_id) == {f["relation_id"] for f in records(SIX)}
    p36 = by[(by.relation_id == "P36") & (by.metric == "recovery") & (by.kind == "resid")]
    assert p36.n.max() == sum(f["relation_id"] == "P36" for f in records(SIX)) >= 2
    assert torch.allclose(torch.tensor(p36["mean"].to_numpy()).reshape(18, 7).float(),
                          found.grid("resid", relation="P36"), equal_nan=True)


def test_frame_is_tidy_and_each_fact_is_its_own_result(six, tmp_path):
    found, _ = six
    frame = found.frame()
    assert list(frame.columns) == ["fact", "fact_id", "relation", "subject", "kind", "layer", "group", "metric", "value"]
    assert len(frame) == 6 * 2 * 1 * 18 * 7  # facts × metrics × kinds × layers × groups
    assert frame.fact_id.iloc[0] == str(SIX[0]) and frame.relation.iloc[0] == records(SIX)[0]["relation_id"]
    one = found[0]
    assert isinstance(one, pipatch.Result) and one.meta["prompt"] == records(SIX)[0]["prompt"]
    mine = frame[(frame.fact == 0) & (frame.metric == "recovery") & (frame.group == "last")].value.to_numpy()
    # The fact's own recoveries, in float64 in the frame: float32 rounding, inside 1e-6 (+ 1e-5 relative).
    assert torch.allclose(torch.tensor(mine).float(), one.grid[:, -1], atol=1e-6)
    path = found.to_csv(tmp_path / "frame.csv")
    with open(path, newline="") as handle:
        assert sum(1 for _ in csv.DictReader(handle)) == len(frame)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(pipatch.PipatchError, match="pip install pyarrow"):
            found.to_parquet(tmp_path / "frame.parquet")


def test_plots_and_heatmap_draw(six):
    found, _ = six
    fig = found.plot()
    assert [ax.get_title() for ax in fig.axes] == ["last subject", "last"]
    assert len(fig.axes[0].lines) == 1 + 1  # one kind, and the zero line
    heat = found.heatmap()
    assert heat.axes[0].images[0].get_array().shape == (18, 7)
    assert "6 of 6 known" in repr(found)
    assert torch.allclose(found.as_result().grid, found.grid(), equal_nan=True)


def test_study_plots_tick_whole_layers_and_the_heatmap_takes_a_colour_range(six):
    found, _ = six
    norm = found.heatmap(scale=(-2, 2)).axes[0].images[0].norm
    assert (norm.vmin, norm.vmax) == (-2.0, 2.0)
    fig = found.plot()
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
        assert all(label.get_text().lstrip("−-").isdigit() for label in ax.get_xticklabels() if label.get_text())


# --------------------------------------------------------------------------------------------
# The store: resume, refuse another configuration, read a half-finished one
# --------------------------------------------------------------------------------------------


def test_a_rerun_resumes_and_another_configuration_is_refused_in_one_line(model, six, tmp_path):
    found, _ = six
    ran = []
    again = pipatch.study(model, records(SIX), store=found.path, progress=lambda i, r, res: ran.append(res),
                          **{**CHEAP, "sites": ["resid"]})  # the same configuration, spelled as a list
    assert again.counts()["done"] == 6 and ran == [None] * 6  # nothing ran twice
    with pytest.raises(pipatch.PipatchError) as error:
        pipatch.study(model, records(SIX), store=found.path, **{**CHEAP, "seeds": 2})
    message = str(error.value)
    assert "\n" not in message and "options.seeds" in message and "new store path" in message
    with pytest.raises(pipatch.PipatchError, match="another record 0"):
        pipatch.study(model, records(SIX[::-1]), store=found.path, **CHEAP)


def test_load_study_reads_a_half_finished_store_without_a_model(model, tmp_path):
    store = tmp_path / "half.sqlite"
    done = []

    def stop():
        return len(done) >= 2

    pipatch.study(model, records(KNOWN[:3]), store=store, progress=lambda i, r, res: done.append(i), stop=stop,
                  in_flight=1, **CHEAP)
    half = pipatch.load_study(store)
    assert half.counts() == {"total": 3, "done": 2, "unknown": 0, "error": 0, "pending": 1, "checked": 2}
    assert "2 done, 0 errors, 1 pending" in half.summary()
    assert half.grid().shape == (18, 7) and half[1].meta["subject"] == records(KNOWN)[1]["subject"]
    with pytest.raises(pipatch.PipatchError, match="fact 2 is not in the store"):
        half[2]
    with pytest.raises(pipatch.PipatchError, match="no study store"):
        pipatch.load_study(tmp_path / "missing.sqlite")


def test_the_known_filter_keeps_filtered_facts_with_the_models_top_token(model, tmp_path):
    from pipatch._experiments._api import backend_of

    facts = records(UNKNOWN + KNOWN[:1])
    found = pipatch.study(model, facts, store=tmp_path / "known.sqlite", **CHEAP)
    rows = found.facts().to_dict("records")
    assert [r["status"] for r in rows] == ["unknown"] * 3 + ["done"]
    hf = backend_of(model)._hf
    for row, fact in zip(rows, facts):
        ids = backend_of(model).tokenizer(fact["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            top = int(hf(ids).logits[0, -1].argmax())
        assert row["top1"] == backend_of(model).tokenizer.decode([top]), (fact["prompt"], row["top1"])
        first = backend_of(model).tokenizer(" " + fact["attribute"], add_special_tokens=False)["input_ids"][0]
        assert (top == first) == (row["status"] == "done"), fact["prompt"]
    assert "1 of 4 known" in found.summary()
    every = pipatch.study(model, facts[:1], store=tmp_path / "all.sqlite", known_only=False, **CHEAP)
    assert every.facts().iloc[0]["status"] == "done" and every.facts().iloc[0]["known"] == 0


def test_a_malformed_record_is_one_line_and_the_others_run(model, tmp_path):
    good = records(KNOWN[:2])
    bad = {k: v for k, v in records([KNOWN[2]])[0].items() if k != "subject"}
    facts = [good[0], bad, "not a record", {**good[1], "prompt": 7}, good[1]]
    found = pipatch.study(model, facts, store=tmp_path / "bad.sqlite", **CHEAP)
    rows = found.facts().to_dict("records")
    assert [r["status"] for r in rows] == ["done", "error", "error", "error", "done"]
    assert rows[1]["message"] == f"record 1 (id {KNOWN[2]}): no 'subject' field (columns={{'subject': ...}} reads another name)"
    assert rows[2]["message"] == "record 2 is a str, not a dict of fields"
    assert rows[3]["message"] == f"record 3 (id {KNOWN[1]}): the 'prompt' field is a int, not text"
    assert all("\n" not in r["message"] for r in rows[1:4])
    # A record the planner refuses (its subject is not in its prompt) fails alone too.
    odd = {**good[0], "subject": "Nowhere Land"}
    also = pipatch.study(model, [odd], store=tmp_path / "odd.sqlite", known_only=False, **CHEAP)
    assert also.facts().iloc[0]["status"] == "error" and "not in the prompt" in also.facts().iloc[0]["message"]


# --------------------------------------------------------------------------------------------
# Other experiments
# --------------------------------------------------------------------------------------------

PAIRS = [
    {"clean": "The Eiffel Tower is in the city of", "corrupt": "The Colosseum is in the city of",
     "answer": " Paris", "foil": " Rome", "relation_id": "city"},
    {"clean": "The Colosseum is in the city of", "corrupt": "The Eiffel Tower is in the city of",
     "answer": " Rome", "foil": " Paris", "relation_id": "city"},
    {"clean": "The Louvre is in the city of", "corrupt": "The Vatican is in the city of",
     "answer": " Paris", "foil": " Rome", "id": "louvre"},
]


def test_the_patch_experiment_runs_as_a_study_of_pairs(model, tmp_path):
    found = pipatch.study(model, PAIRS, "patch", store=tmp_path / "pairs.sqlite", known_only=False)
    rows = found.facts().to_dict("records")
    assert [r["status"] for r in rows] == ["done"] * 3, [r["message"] for r in rows]
    singles = [pipatch.patch(model, clean=p["clean"], corrupt=p["corrupt"], answer=p["answer"], foil=p["foil"])
               for p in PAIRS]
    for i, single in enumerate(singles):
        assert torch.equal(found[i].raw["resid"], single.raw["resid"])
    names = found.aggregate()["group"].unique().tolist()
    assert "first changed" in names and "last" in names
    dataset = pipatch.patch(model, clean=[p["clean"] for p in PAIRS], corrupt=[p["corrupt"] for p in PAIRS],
                            answer=[p["answer"] for p in PAIRS], foil=[p["foil"] for p in PAIRS])
    # Each fact is its single patch bit for bit (above); the dataset averages the same recoveries
    # in another order: float32 rounding, inside 1e-6 (+ 1e-5 relative).
    assert torch.allclose(found.grid("resid"), dataset.grid, atol=1e-6, equal_nan=True)
    assert rows[2]["fact_id"] == "louvre"


def test_the_lens_runs_as_a_study_grouped_around_the_records_subject(model, tmp_path):
    found = pipatch.study(model, records(KNOWN[:2]), "lens", store=tmp_path / "lens.sqlite")
    assert found.facts().status.tolist() == ["done", "done"]
    assert found.aggregate()["group"].unique().tolist()[-1] == "last"
    single = pipatch.lens(model, records(KNOWN[:1])[0]["prompt"], answer=" " + records(KNOWN[:1])[0]["attribute"])
    # Two facts run as one: the metric's pass shared, the same values up to float32 rounding.
    assert torch.allclose(found[0].raw["resid"], single.raw["resid"], atol=2e-5, rtol=0)


def test_options_are_checked_by_the_experiments_declaration(model, tmp_path):
    with pytest.raises(pipatch.PipatchError, match="unexpected argument 'sedes'"):
        pipatch.study(model, records(KNOWN[:1]), store=tmp_path / "x.sqlite", sedes=2)
    with pytest.raises(pipatch.PipatchError, match="seeds=0"):
        pipatch.study(model, records(KNOWN[:1]), store=tmp_path / "y.sqlite", seeds=0)
    with pytest.raises(pipatch.PipatchError, match="come from the facts"):
        pipatch.study(model, records(KNOWN[:1]), store=tmp_path / "z.sqlite", prompt="x")


# --------------------------------------------------------------------------------------------
# The command: SIGKILL at random moments, then the same store as an uninterrupted run
# --------------------------------------------------------------------------------------------


def _study_command(facts: Path, store: Path, *extra: str, model: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "pipatch.cli", "study", str(facts), "--store", str(store), "--kind", "resid",
            "--seeds", "2", "--scale", "3", *(["--model", str(model), "--all-facts", "--in-flight", "2"] if model else []),
            *extra]


def _rows(store: Path) -> dict[int, tuple]:
    db = sqlite3.connect(str(store))
    try:
        return {row[0]: row[1:] for row in db.execute("SELECT idx, status, fact_key, top1, tensors FROM facts")}
    finally:
        db.close()


def _started(process: subprocess.Popen) -> float:
    """Block until ``process`` (a ``pipatch study``) shows its progress bar, i.e. the model is
    loaded and the facts are read: the study's loop starts now. Its time."""
    process.stderr.read(1)  # tqdm's first frame (b"" if it died first)
    return time.perf_counter()


def test_sigkill_at_random_moments_loses_at_most_the_facts_in_flight(tmp_path):
    # A real ``pipatch study`` process, on a tiny model saved to a folder (its facts take
    # milliseconds, so the ten kills cost the processes' start-ups, not the model).
    model = save_tiny("gemma3", tmp_path / "tiny")
    facts = tmp_path / "facts.jsonl"
    facts.write_text("\n".join(json.dumps(f) for f in tiny_facts()[:8]) + "\n")
    reference = tmp_path / "reference.sqlite"
    process = subprocess.Popen(_study_command(facts, reference, model=model), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    began = _started(process)
    out, err = process.communicate(timeout=600)
    work = time.perf_counter() - began  # the study loop's time, start-up excluded
    assert process.returncode == 0, err
    assert b"8 done, 0 errors, 0 pending" in out
    want = _rows(reference)
    assert len(want) == 8

    store = tmp_path / "killed.sqlite"
    rng = random.Random(32)
    kills, runs, finished_counts = 0, 0, []
    while kills < 10 and runs < 30:
        runs += 1
        process = subprocess.Popen(_study_command(facts, store, model=model), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
        _started(process)
        try:
            process.wait(timeout=rng.uniform(0, work))  # a random moment of the loop: a fact, a commit
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
        process.stderr.close()
        db = sqlite3.connect(str(store))
        try:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        finally:
            db.close()
        rows = _rows(store)
        finished_counts.append(len(rows))
        for index, row in rows.items():  # whatever is stored is a whole fact, the reference's
            assert row == want[index], index
        if len(rows) == 8 and kills < 10:
            store.unlink()  # start over: every kill should land while facts are still running
            for suffix in ("-wal", "-shm"):
                Path(str(store) + suffix).unlink(missing_ok=True)
    assert kills == 10, (kills, runs)
    finish = subprocess.run(_study_command(facts, store, model=model), capture_output=True, timeout=600)
    assert finish.returncode == 0, finish.stderr
    assert _rows(store) == want  # every fact bit for bit: raw values of every seed, baselines, tokens
    assert any(0 < n < 8 for n in finished_counts), finished_counts  # some kills landed between runs of facts
    assert pipatch.load_study(store).summary() == pipatch.load_study(reference).summary()


def test_the_command_refuses_another_configuration_in_one_line(tmp_path):
    folder = save_tiny("gemma3", tmp_path / "tiny")
    facts = tmp_path / "one.json"
    facts.write_text(json.dumps(tiny_facts()[:1]))
    store = tmp_path / "one.sqlite"
    pipatch.study(pipatch.load_model(str(folder)), facts, store=store, known_only=False, sites="resid", seeds=2,
                  scale=3.0)
    same = subprocess.run(_study_command(facts, store, "--quiet", model=folder), capture_output=True, text=True,
                          timeout=600)
    assert same.returncode == 0 and "1 done" in same.stdout, same.stderr  # the same study, resumed
    out = subprocess.run(_study_command(facts, store, "--seeds", "1", "--quiet", model=folder), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipatch study: error:") and "options.seeds" in lines[0], out.stderr


# --------------------------------------------------------------------------------------------
# The magics
# --------------------------------------------------------------------------------------------


def test_study_magics_bind_the_study(model, tmp_path):
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "pipatch")
    shell.user_ns["m"] = model
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(records(KNOWN[:1])))
    store = tmp_path / "magic.sqlite"
    shell.run_line_magic("study", f"{facts} --store {store} --model m --kind resid --seeds 1 --scale 3 -o known")
    assert isinstance(shell.user_ns["known"], pipatch.Study) and len(shell.user_ns["known"]) == 1
    body = "\n".join(json.dumps(f) for f in records(KNOWN[:2]))
    shell.run_cell_magic("study", f"--store {store} --model m --kind resid --seeds 1 --scale 3 -o again", body)
    assert shell.user_ns["again"].counts()["done"] == 2
    with pytest.raises(UsageError, match="options.seeds"):
        shell.run_cell_magic("study", f"--store {store} --model m --seeds 2 --scale 3", body)
    with pytest.raises(UsageError, match="--store"):
        shell.run_line_magic("study", f"{facts}")
    # Where the model runs is a study's flag too: --serve / --remote reach the model's loader.
    with pytest.raises(UsageError, match="--model m is loaded already: drop --remote"):
        shell.run_line_magic("study", f"{facts} --store {store} --model m --remote local")
    with pytest.raises(UsageError, match="--serve runs the model on the server"):
        shell.run_line_magic("study", f"{facts} --store {store} --backend transformers --serve http://127.0.0.1:9")


# --------------------------------------------------------------------------------------------
# The live view (the browser's side: tests/e2e/test_study_browser.py)
# --------------------------------------------------------------------------------------------


def test_the_live_view_streams_the_aggregate_and_draws_one_fact_on_a_click(tmp_path, monkeypatch):
    from pipatch._studies._view import AGGREGATE, StudyView

    tiny = tiny_model("gemma3")
    facts = tiny_facts()[:4]
    views: list = []
    original = StudyView.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        views.append(self)

    monkeypatch.setattr(StudyView, "__init__", remember)
    snapshots: list = []
    clicks: list = []

    def watch(index, record, result):  # what the browser sees after each fact (the view's hook ran first)
        view = views[-1]
        view.grid.flush()
        snapshots.append((view.grid.message, list(view.grid.seed_labels), len(view.facts.options),
                          _grid_of(view.grid)))
        if index == 2:  # a click on fact 1 while the study runs draws its own grid; the average comes back
            view.facts.value = 1
            clicks.append((view.grid.kind, _grid_of(view.grid)))
            view.facts.value = AGGREGATE
            clicks.append((view.grid.kind, _grid_of(view.grid)))

    found = pipatch.study(tiny, facts, store=tmp_path / "live.sqlite", known_only=False, show=True, progress=watch,
                          in_flight=1, **CHEAP)  # one by one (by default, four at a time: the view moves by four)
    # Facts stream into the aggregate: after fact i, i+1 done, i+1 rows (facts) under the average.
    assert [s[0].split(" · ")[0] for s in snapshots] == ["1 done", "2 done", "3 done", "4 done"]
    assert all(" · 4 total · " in s[0] and "facts/min" in s[0] for s in snapshots)
    assert [len(s[1]) for s in snapshots] == [1, 2, 3, 4] and [s[2] for s in snapshots] == [2, 3, 4, 5]
    # The live view's grids are the study's own numbers, averaged as it goes: rounding only.
    assert torch.allclose(snapshots[-1][3], found.grid().nan_to_num(-9), atol=1e-6)
    assert clicks[0][0] == "trace" and torch.allclose(clicks[0][1], found[1].grid.nan_to_num(-9), atol=1e-6)
    assert clicks[1][0] == "study" and torch.allclose(clicks[1][1], snapshots[2][3])
    assert views[-1].grid.status == "done" and not views[-1].grid.stoppable
    # Stop keeps what finished: the study ends after the facts in flight, the rest pending.
    pressed: list = []

    def press_stop(index, record, result):
        pressed.append(index)
        if len(pressed) == 2:
            views[-1].grid.stop_requested = True

    half = pipatch.study(tiny, facts, store=tmp_path / "stopped.sqlite", known_only=False, show=True,
                         progress=press_stop, in_flight=2, **CHEAP)  # Stop after the first two, run as one
    assert half.counts()["done"] == 2 and half.counts()["pending"] == 2
    assert views[-1].grid.status == "stopped" and "run again to resume" in views[-1].grid.message


def _grid_of(widget) -> torch.Tensor:
    """The mean grid a widget draws (its first view), NaN as -9: what ``selectMatrix`` reads."""
    from pipatch._results.views.schema import select_matrix

    matrix = select_matrix(widget.get_state_dict(), widget.views[0])
    assert matrix is not None
    return torch.from_numpy(matrix.astype("float32")).nan_to_num(-9)


def test_facts_in_flight_above_the_backends_hint_are_refused_in_one_line(model, tmp_path):
    """``in_flight`` above the backend's hint (4 run as one in process) is one line naming the
    fix, before any fact runs."""
    with pytest.raises(pipatch.PipatchError, match=r"in_flight=5: the transformers backend runs 4 facts at a time "
                                                   r"at most: leave in_flight out, or give 1 to 4$"):
        pipatch.study(model, records(KNOWN[:1]), store=tmp_path / "s.sqlite", in_flight=5, **CHEAP)
    assert not (tmp_path / "s.sqlite").exists()
    with pytest.raises(pipatch.PipatchError, match="in_flight"):
        pipatch.study(model, records(KNOWN[:1]), store=tmp_path / "s.sqlite", in_flight=0, **CHEAP)
