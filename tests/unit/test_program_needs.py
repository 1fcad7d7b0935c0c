"""What a program needs is data (:class:`~pipatch._programs.Needs`), and a backend refuses a
program from it alone, in one line: a backend without backward passes refuses every gradient
program naming ``scores=`` and ``backend='transformers'``, whatever the program is called."""

from __future__ import annotations

import dataclasses

import pytest

from pipatch._backends._contract import Capabilities, refusal, refuse
from pipatch._base.errors import PipatchError
from pipatch._programs import PROGRAMS, Needs, Program


class _Backend:
    """A backend as a refusal sees it: its name and its capabilities."""

    def __init__(self, name: str, **capabilities):
        self.backend_name, self.capabilities = name, Capabilities(**capabilities)


def test_a_backend_without_backward_passes_refuses_every_gradient_program_in_one_line():
    inference = _Backend("inference")
    gradient_programs = [p for p in PROGRAMS.values() if p.needs.backward]
    assert {"gradients", "edge_terms", "node_gradients", "edge_pullbacks"} <= {p.name for p in gradient_programs}
    for program in gradient_programs:
        line = refusal(inference, program)
        assert line is not None and "\n" not in line, program
        assert "scores=" in line and "backend='transformers'" in line and program.name in line, line
        assert "backward passes" in line
        with pytest.raises(PipatchError, match=r"^the inference backend cannot run"):
            raise refuse(inference, program)
    full = _Backend("full", gradients=True, circuit_runs=True, pools_unembedding=True)
    assert all(refusal(full, p) is None for p in PROGRAMS.values())


def test_the_refusal_reads_the_needs_not_the_name():
    """A program of any name that declares a backward pass is refused like the built-in ones;
    the same body declaring none is not; each need maps to its capability."""
    def body(view, request):
        return []

    toy = Program("my_saliency", 1, Needs(backward=True), body, "a toy")
    assert "my_saliency" in refusal(_Backend("x"), toy) and "scores=" in refusal(_Backend("x"), toy)
    assert refusal(_Backend("x"), dataclasses.replace(toy, needs=Needs())) is None
    cases = [(Needs(generation=True), "generates", "generation"),
             (Needs(module_calls=True), "circuit_runs", "modules"),
             (Needs(shortcut="pools_unembedding"), "pools_unembedding", "pools_unembedding")]
    for needs, flag, words in cases:
        program = dataclasses.replace(toy, needs=needs)
        assert words in refusal(_Backend("x"), program)
        assert refusal(_Backend("x", **{flag: True}), program) is None
    advised = dataclasses.replace(toy, needs=Needs(backward=True, instead="do this instead, scores=mine"))
    assert refusal(_Backend("x"), advised).endswith(": do this instead, scores=mine")
    assert refusal(_Backend("x"), advised, "or that").endswith(": or that")
