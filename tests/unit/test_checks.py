"""The one whole-number / yes-no validator (pipatch._base.checks) and the parameters that use it."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import pipatch
from pipatch._base.checks import flag, whole_number
from pipatch._model.models import PipatchError

# --------------------------------------------------------------------------------------------
# whole_number
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [(0, 0), (7, 7), (-3, -3), ("10", 10), (" 12 ", 12), ("+4", 4), ("-2", -2), (np.int64(5), 5), (10**30, 10**30)],
)
def test_whole_number_takes_ints_and_base_10_text(value, want):
    got = whole_number(value, "seeds", minimum=None)
    assert got == want and type(got) is int


@pytest.mark.parametrize("value", [True, False, 3.0, 2.5, float("nan"), "1.5", "", " ", "ten", "0x10", "1_000",
                                   "٣", "1e3", None, [1], b"3", np.float32(2.0)])
def test_whole_number_refuses_bools_floats_and_other_text(value):
    with pytest.raises(PipatchError) as info:
        whole_number(value, "seeds", minimum=1)
    assert str(info.value) == f"seeds must be a whole number ≥ 1, got {value!r}"


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (0, {"minimum": 1}, "batch_size must be a whole number ≥ 1, got 0"),
        ("0", {"minimum": 1}, "batch_size must be a whole number ≥ 1, got '0'"),
        (-1, {}, "batch_size must be a whole number ≥ 0, got -1"),  # the default minimum is 0
        (9, {"maximum": 3}, "batch_size 9 is out of range: use 0..3"),
        (-1, {"maximum": 3}, "batch_size -1 is out of range: use 0..3"),
        ("x", {"maximum": 3}, "batch_size must be a whole number in 0..3, got 'x'"),
        (5, {"minimum": None, "maximum": 4}, "batch_size must be a whole number ≤ 4, got 5"),
    ],
)
def test_whole_number_out_of_bounds_is_one_line_naming_what_the_value_and_the_bounds(value, kwargs, message):
    with pytest.raises(PipatchError) as info:
        whole_number(value, "batch_size", **kwargs)
    assert str(info.value) == message and "\n" not in message


def test_whole_number_bounds_are_inclusive():
    assert whole_number(1, "n", minimum=1, maximum=1) == 1
    assert whole_number(0, "n") == 0


# --------------------------------------------------------------------------------------------
# flag
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [(True, True), (False, False), ("true", True), ("False", False), (" yes ", True), ("no", False), ("ON", True),
     ("off", False), ("1", True), ("0", False)],
)
def test_flag_takes_bools_and_yes_no_words(value, want):
    assert flag(value, "fast") is want


@pytest.mark.parametrize("value", ["maybe", "", "t", 1, 0, 1.0, None, [], np.float64(1.0)])
def test_flag_refuses_everything_else(value):
    # fast="no" must not pass as true because the string is not empty, nor 1 as True.
    with pytest.raises(PipatchError) as info:
        flag(value, "fast")
    assert str(info.value) == f"fast must be True or False, got {value!r}"


# --------------------------------------------------------------------------------------------
# The module stays a leaf, and the hand-written checks are gone
# --------------------------------------------------------------------------------------------

PACKAGE = pathlib.Path(pipatch.__file__).parent


def test_the_checks_module_imports_only_the_error():
    tree = ast.parse((PACKAGE / "_base" / "checks.py").read_text("utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
    assert imported == {"errors"}


def test_no_module_checks_for_a_bool_by_hand():
    """``isinstance(x, bool)`` guards (an int that is not a bool) belong in _base/checks.py alone.

    """
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "_base" / "checks.py":
            continue
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if "isinstance(" in line and "bool)" in line and ", int)" in line:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_serve_refuses_a_port_out_of_range(capsys):
    from pipatch._serving.serve import main

    assert main(["--port", "70000"]) == 2
    assert capsys.readouterr().err == "pipatch serve: error: --port 70000 is out of range: use 1..65535\n"


def test_serve_hands_unknown_flags_and_their_values_to_the_engine():
    from pipatch._serving.serve import _split_engine_words, build_parser

    parser = build_parser()
    ours, engine = _split_engine_words(parser, ["--api-key", "k", "--tensor-parallel-size", "2", "--port", "1"])
    assert parser.parse_args(ours).model is None  # "2" is the ranks, not a model named "2"
    assert engine == ["--tensor-parallel-size", "2"]
    ours, engine = _split_engine_words(parser, ["gpt2", "--max-model-len=512", "--dtype", "bfloat16"])
    assert parser.parse_args(ours).model == "gpt2" and engine == ["--max-model-len=512"]


def test_serve_admits_one_skip_at_a_time_first_come_first_served():
    """pipatch serve's rooms: requests that skip as many blocks share the engine; another
    depth waits until they have finished; a later request of the first depth waits behind
    it (no stream of one depth keeps another out). Each request stays inside until its gate
    opens: the order is the rooms', not the clock's."""
    import asyncio
    import concurrent.futures

    from pipatch._serving.guard import Rooms as _Rooms

    async def scenario() -> list[list[str]]:
        rooms, entered, inside, seen = _Rooms(), [], {}, []
        gates = {name: asyncio.Event() for name in "abcd"}

        async def request(name: str, depth: int) -> None:
            async with rooms.room(depth):
                inside[name] = depth
                assert len(set(inside.values())) == 1, inside  # one depth in the engine at a time
                entered.append(name)
                await gates[name].wait()
                del inside[name]

        async def settle() -> None:  # let every waiter that can move, move
            for _ in range(50):
                await asyncio.sleep(0)

        tasks = []
        for name, depth in [("a", 3), ("b", 3), ("c", 0), ("d", 3)]:
            tasks.append(asyncio.create_task(request(name, depth)))
            await settle()
        seen.append(list(entered))  # a and b together; c waits for them; d waits behind c
        for name in "abcd":
            gates[name].set()
            await settle()
            seen.append(list(entered))
        await asyncio.gather(*tasks)
        return seen

    # A loop of its own on a thread of its own: an earlier test in this process (Playwright's
    # sync API) may leave an event loop running on the main thread, where asyncio.run refuses.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        seen = pool.submit(asyncio.run, scenario()).result()
    assert seen == [["a", "b"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"],
                    ["a", "b", "c", "d"]]
