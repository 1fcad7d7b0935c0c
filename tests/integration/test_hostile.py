"""Hostile strings through the Python side: strict JSON out, no crash on lone surrogates.

Front-end behaviour (nothing executes, text shown as written) is in
tests/e2e/test_hardening_browser.py; this file checks what the kernel sends and saves.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def test_a_prompt_with_a_lone_surrogate_is_refused_in_one_line() -> None:
    """The tokenizer used to end such a prompt in a raw TypeError."""
    import pipatch
    from tests._tiny import tiny_model

    tiny = tiny_model("llama")
    prompt = "The Eiffel Tower \ud800 is in the city of"
    with pytest.raises(pipatch.PipatchError, match=r"the prompt holds the surrogate code point U\+D800 at character 17") as info:
        pipatch.trace(tiny, prompt, subject="Eiffel Tower", answer=" Paris")
    assert "\n" not in str(info.value) and "\ud800" not in str(info.value)
    with pytest.raises(pipatch.PipatchError, match=r"the corrupt prompt holds the surrogate code point U\+DFFF"):
        pipatch.patch(tiny, clean="The Eiffel Tower is in the city of", corrupt="The Colosseum \udfff is in the city of",
                      answer=" Paris", foil=" Rome")
    with pytest.raises(pipatch.PipatchError, match=r"the answer holds the surrogate code point U\+D800"):
        pipatch.patch(tiny, clean="The Eiffel Tower is in the city of", corrupt="The Big Ben is in the city of",
                      answer=" Par\ud800is", foil=" Rome")
