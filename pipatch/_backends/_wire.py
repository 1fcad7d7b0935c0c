"""What a served client (:mod:`.served`) and ``pipatch serve`` (:mod:`pipatch._serving.serve`)
agree on: the paths and headers of the wire, the environment variable a key is read from, and
the per-request limits (:class:`Limits`) a server announces and a client fits its requests to.

Kept here, below both: the client checks a request against the server's limits before it
sends it (:mod:`._served_programs`), and the server's gates (:mod:`pipatch._serving.guard`)
enforce them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["INFO_PATH", "GENERATE_PATH", "LOAD_PATH", "SKIP_HEADER", "KEY_HEADER", "CLIENT_HEADER", "KEY_ENV",
           "MAX_REQUEST_BYTES", "MAX_INVOKES", "REQUEST_SECONDS", "REQUESTS_IN_FLIGHT", "Limits"]

#: Where a client asks the server what it serves (``pipatch serve``'s info).
INFO_PATH = "/v1/pipatch/info"
#: Where a client sends a program by name and its jobs' data; each invoke's saves come back
#: apart.
GENERATE_PATH = "/v1/pipatch/generate"
#: Where a client reads the server's load: requests in flight (its own and all), waiting, and
#: those cancelled for their time or their client gone.
LOAD_PATH = "/v1/pipatch/load"
#: The header a request names, by their count, the blocks its invokes skip with (0: none;
#: ``pipatch serve``'s rooms).
SKIP_HEADER = "X-Pipatch-Skip"
#: The header a client's key travels in (nnsight's ``nnsight-serve`` client's name for it).
KEY_HEADER = "ndif-api-key"
#: The header a pipatch client names itself in (a random id per connection pool): who a
#: request is from on a server without keys.
CLIENT_HEADER = "X-Pipatch-Client"
#: The environment variable a server (and a client) reads its key from.
KEY_ENV = "PIPATCH_API_KEY"
#: Default largest request body: a batch of 64 cells of a 640-wide model over 9 tokens is
#: 0.3 MB; a client splits a batch whose request would be larger (the server's info says).
MAX_REQUEST_BYTES = 32 * 2**20
#: Default most invokes in one request: the served client's batch (``INVOKES_PER_REQUEST``).
MAX_INVOKES = 64
#: Default longest a request may take on the server, from its first byte to its answer
#: (waiting its turn included): a client's own timeout is 600 s, so this one answers first.
REQUEST_SECONDS = 300
#: Default most POSTs one client (one key) may have in flight: twice the served client's own
#: (``CONCURRENCY``), so two notebooks on one key fit, and a flood of one key's requests does not.
REQUESTS_IN_FLIGHT = 64


@dataclasses.dataclass(frozen=True)
class Limits:
    """How large one request may be; each bound has a ``pipatch serve`` flag (:data:`FLAGS`).

    Attributes
    ----------
    request_bytes
        The request body (``--max-request-bytes``; default :data:`MAX_REQUEST_BYTES`).
    invokes
        Invokes in one request (``--max-invokes``; default :data:`MAX_INVOKES`).
    prompt_tokens
        Tokens in one invoke's prompt (``--max-prompt-tokens``; default: the engine's
        ``max_model_len``, over which the engine cannot run a prompt anyway).
    seconds
        Seconds one request may take, its wait for a turn included
        (``--max-request-seconds``; default :data:`REQUEST_SECONDS`).
    in_flight
        POSTs one client (one key) may have in flight at once (``--max-requests-in-flight``;
        default :data:`REQUESTS_IN_FLIGHT`).
    """

    request_bytes: int = MAX_REQUEST_BYTES
    invokes: int = MAX_INVOKES
    prompt_tokens: int = 2048
    seconds: float = REQUEST_SECONDS
    in_flight: int = REQUESTS_IN_FLIGHT

    FLAGS = {"request_bytes": "--max-request-bytes", "invokes": "--max-invokes", "prompt_tokens": "--max-prompt-tokens",
             "seconds": "--max-request-seconds", "in_flight": "--max-requests-in-flight"}

    def over(self, name: str, what: str, fix: str = "send smaller requests") -> str:
        """The refusal line for limit ``name``: ``what`` the request had, the limit, the flag, ``fix``."""
        unit = " s" if name == "seconds" else ""
        return (f"{what}, over this server's limit of {getattr(self, name):,}{unit} "
                f"(pipatch serve {self.FLAGS[name]}): {fix}, or raise the limit")

    def refusal(self, prompts: list, tokenizer: Any) -> str | None:
        """A built request's invokes (``prompts``, one each) checked against :attr:`invokes`
        and :attr:`prompt_tokens`: the refusal line, or ``None`` when it fits."""
        if len(prompts) > self.invokes:
            return self.over("invokes", f"the request has {len(prompts):,} invokes")
        for i, prompt in enumerate(prompts):
            tokens = _prompt_tokens(prompt, tokenizer)
            if tokens > self.prompt_tokens:
                return self.over("prompt_tokens", f"invoke {i}'s prompt has {tokens:,} tokens")
        return None


def _prompt_tokens(prompt: Any, tokenizer: Any) -> int:
    """Tokens in one of vLLM's prompts: its token ids, or its text tokenized; another form
    (embeddings, multimodal) counts 0 (the engine bounds it by ``max_model_len``)."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return len(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return 0
