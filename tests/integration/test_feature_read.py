"""Reading features (issue #46): :func:`pipatch.features`, latent labels and
:func:`pipatch.feature_contexts`, on tiny random models of three families with random SAEs of
each architecture (:mod:`tests._saes`), against hand computations: the module's value taken
by a torch hook and encoded with the SAE's math written out (``tests/integration/test_features.py``).

* each position's top-k latents (ids and values) equal the hand-encoded latents' top-k;
* labels from Neuronpedia's export, a ``{id: label}`` JSON and a dict reach the table;
* each latent's top contexts over a corpus equal the hand-encoded corpus's top-k, and are
  read back by ``features()``;
* the result saves and loads (safetensors and JSON) to the same table;
* bad input is one line.
"""

from __future__ import annotations

import json

import pytest
import torch

import pipatch
from pipatch._experiments._feature_contexts import BEFORE, TENSORS_FILE, TEXT_FILE, load_contexts
from pipatch._model.features.labels import LABELS_FILE
from tests._saes import KINDS, sae_folder
from tests.integration.test_features import FAMILIES, hand_latents, saelens_folder

PROMPT = "The Colosseum is in the city of"
CORPUS = ["The Eiffel Tower is in Paris", "Rome is a city in Italy", "The Kremlin is in the city of Moscow",
          "Big Ben is in London"]


def hand_top(latents: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """At each position of ``latents`` ([T, d_sae]): the ``k`` largest positive latents, as
    ``(id, value)``, largest first."""
    out = []
    for row in latents:
        order = sorted(range(row.numel()), key=lambda i: -float(row[i]))[:k]
        out.append([(i, float(row[i])) for i in order if row[i] > 0])
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_top_latents_equal_the_hand_encoded_ones(family, kind, tmp_path):
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    want = hand_top(hand_latents(model, weights, kind, ids)[0], 4)
    result = pipatch.features(model, PROMPT, saes=site, k=4, progress=False)
    frame = result.frame()
    got = [[(int(r.latent), float(r.value)) for r in frame[frame.position == p].itertuples()] for p in range(ids.shape[1])]
    assert [[i for i, _ in row] for row in got] == [[i for i, _ in row] for row in want]
    for got_row, want_row in zip(got, want):
        assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(got_row, want_row))
    assert sum(len(row) for row in want) > ids.shape[1]  # latents fire: the comparison compares something
    assert list(frame.columns) == ["sae", "position", "token", "rank", "latent", "value", "label"]
    assert frame.token.tolist() == [result.tokens[p] for p in frame.position]


def test_several_saes_at_chosen_positions_in_one_read(tmp_path):
    model, jump, jump_folder = saelens_folder(tmp_path, "llama", "jumprelu")
    _, relu, relu_folder = saelens_folder(tmp_path, "llama", "relu", seed=1)
    sites = [pipatch.load_sae(jump_folder, model, name="jump"), pipatch.load_sae(relu_folder, model, name="relu")]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    result = pipatch.features(model, PROMPT, saes=sites, k=2, positions=[1, -1], progress=False)
    assert result.views == ["jump", "relu"] and result.columns == [result.tokens[1], result.tokens[-1]]
    for name, weights, kind in (("jump", jump, "jumprelu"), ("relu", relu, "relu")):
        want = hand_top(hand_latents(model, weights, kind, ids)[0], 2)
        got = result.latents(name)
        for col, position in enumerate([1, ids.shape[1] - 1]):
            assert [int(i) for i in got[:, col] if i >= 0] == [i for i, _ in want[position]]
    assert result.meta["engine"]["cells"] == 0  # one read, no patched run


def test_labels_from_both_file_formats_and_a_dict_reach_the_table(tmp_path):
    model, weights, folder = saelens_folder(tmp_path, "gpt2", "jumprelu")
    site = pipatch.load_sae(folder, model)
    shown = sorted(set(pipatch.features(model, PROMPT, saes=site, k=3, progress=False).frame().latent))
    words = {i: f"<i>latent</i> {i} & co" for i in shown[:3]}  # text, never HTML
    neuronpedia = tmp_path / "export.json"
    neuronpedia.write_text(json.dumps([{"index": str(i), "description": w} for i, w in words.items()]))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({str(i): w for i, w in words.items()}))
    (folder / LABELS_FILE).write_text(json.dumps({str(i): w for i, w in words.items()}))
    for labels in (neuronpedia, plain, words, None):  # None: the labels file next to the SAE
        frame = pipatch.features(model, PROMPT, saes=site, k=3, labels=labels, progress=False).frame()
        assert {int(r.latent): r.label for r in frame.itertuples() if r.label} == words
        assert set(frame[frame.label == ""].latent) == set(shown) - set(words)
    result = pipatch.features(model, PROMPT, saes=[site], k=3, labels={site.name: words}, progress=False)
    assert result.label(shown[0]) == words[shown[0]]


def test_the_top_contexts_equal_the_hand_computed_ones_and_features_reads_them(tmp_path):
    model, weights, folder = saelens_folder(tmp_path, "gemma3", "topk")
    site = pipatch.load_sae(folder, model)
    tok = model.tokenizer
    special = set(tok.all_special_ids)
    values, where = [], []
    for t, text in enumerate(CORPUS):
        ids = tok(text, return_tensors="pt").input_ids
        latents = hand_latents(model, weights, "topk", ids)[0]
        for p in range(ids.shape[1]):
            values.append(latents[p] * (int(ids[0, p]) not in special))
            where.append((t, p))
    values = torch.stack(values)  # [contexts, d_sae]
    contexts = pipatch.feature_contexts(model, site, CORPUS, k=3)
    assert (folder / TENSORS_FILE).is_file() and (folder / TEXT_FILE).is_file()
    compared = 0
    for latent in range(site.n_latents):
        column = values[:, latent]
        order = sorted(range(len(column)), key=lambda i: -float(column[i]))[:3]
        want = [(where[i], float(column[i])) for i in order if column[i] > 0]
        got = [((contexts.contexts[c]["text"], contexts.contexts[c]["position"]), float(a))
               for c, a in zip(contexts.context[latent].tolist(), contexts.activation[latent].tolist()) if c >= 0]
        assert [w for w, _ in got] == [w for w, _ in want], latent
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(got, want))
        compared += len(want)
    assert compared > site.n_latents  # most latents have contexts
    again = load_contexts(folder)
    assert torch.equal(again.context, contexts.context) and again.contexts == contexts.contexts
    result = pipatch.features(model, PROMPT, saes=site, k=3, progress=False)
    latent = int(result.frame().latent[0])
    assert result.contexts(latent) == [(w, pytest.approx(a)) for w, a in contexts.top(latent)]
    record = contexts.contexts[contexts.context[latent, 0]]
    assert contexts.top(latent)[0][0] == f"{record['before']}«{record['token']}»{record['after']}"


def test_a_context_window_shows_no_special_token(tmp_path):
    """The BOS token opens every text of the corpus; a window near the start leaves it out
    rather than show its markup as if it were text, here and in the result's notes."""
    model, _, folder = saelens_folder(tmp_path, "gemma3", "topk")
    site = pipatch.load_sae(folder, model)
    tok = model.tokenizer
    assert tok(CORPUS[0]).input_ids[0] in tok.all_special_ids  # there is a BOS to leave out
    contexts = pipatch.feature_contexts(model, site, CORPUS, k=3)
    windows = [text for latent in range(site.n_latents) for text, _ in contexts.top(latent)]
    assert any(record["position"] <= BEFORE for record in contexts.contexts)  # windows that reach the BOS
    assert windows and not [text for text in windows if any(s in text for s in tok.all_special_tokens)]
    result = pipatch.features(model, PROMPT, saes=site, k=3, progress=False)
    notes = [text for latent in result.frame().latent for text, _ in result.contexts(int(latent))]
    assert notes and not [text for text in notes if tok.bos_token in text]


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_a_saved_feature_read_loads_to_the_same_table(tmp_path, suffix):
    model, _, folder = saelens_folder(tmp_path, "llama", "jumprelu")
    site = pipatch.load_sae(folder, model)
    result = pipatch.features(model, PROMPT, saes=site, k=3, labels={0: "zero", 1: "one"}, progress=False)
    loaded = pipatch.load_result(result.save(tmp_path / f"read{suffix}"))
    assert type(loaded).__name__ == "LatentsResult"
    assert loaded.frame().equals(result.frame())
    torch.testing.assert_close(loaded.raw[site.name], result.raw[site.name], equal_nan=True)


def test_bad_input_is_one_line(tmp_path):
    model, _, folder = saelens_folder(tmp_path, "gpt2", "jumprelu")
    site = pipatch.load_sae(folder, model)
    other = pipatch.load_sae(sae_folder(64, 0), model, name="other")
    cases = [
        (lambda: pipatch.features(model, PROMPT, saes=[], progress=False), "features\\(\\) needs saes="),
        (lambda: pipatch.features(model, [PROMPT, PROMPT], saes=site, progress=False), "one prompt at a time"),
        (lambda: pipatch.features(model, PROMPT, saes=site, k=0, progress=False), "k \\(latents shown"),
        (lambda: pipatch.features(model, PROMPT, saes=[site, other], labels={0: "x"}, progress=False),
         "labels= for 2 SAEs must name each one's labels"),
        (lambda: pipatch.features(model, PROMPT, saes=str(tmp_path), progress=False), "holds no SAE"),
        (lambda: pipatch.features(model, PROMPT, saes=site, labels=tmp_path / "no.json", progress=False),
         "no labels file at"),
        (lambda: pipatch.feature_contexts(model, site, "one text"), "texts must be a non-empty list"),
        (lambda: pipatch.feature_contexts(model, folder, CORPUS), "needs a latent site"),
    ]
    for call, said in cases:
        with pytest.raises(pipatch.PipatchError, match=said) as caught:
            call()
        assert "\n" not in str(caught.value)
    site.sae.folder = None
    with pytest.raises(pipatch.PipatchError, match="was not read from a folder.*pass folder="):
        pipatch.feature_contexts(model, site, CORPUS)
    assert pipatch.feature_contexts(model, site, CORPUS, k=1, folder=tmp_path / "kept").k == 1
    (tmp_path / "kept" / TEXT_FILE).write_text("{broken")
    with pytest.raises(pipatch.PipatchError, match="cannot be read"):
        load_contexts(tmp_path / "kept")


def test_the_magic_reads_the_same_features(ip):
    from tests._tiny import tiny_model

    model = tiny_model("gpt2")
    folder = sae_folder(64, 1)
    want = pipatch.features(model, PROMPT, saes=folder, k=2, progress=False)
    ip.user_ns["small"] = model
    ip.run_cell_magic("features", f"--model small --saes {folder} --k 2 -o read", PROMPT)
    assert ip.user_ns["read"].frame().equals(want.frame())
