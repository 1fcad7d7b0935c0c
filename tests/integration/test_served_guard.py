"""A ``pipatch serve`` a team can trust: keys from a file and the environment, HTTPS with a
self-signed certificate, and limits per request, on one real server.

One server for the module, started as a team would start it on a shared box::

    PIPATCH_API_KEY=$ENV_KEY pipatch serve --api-key-file keys --ssl-certfile cert.pem --ssl-keyfile key.pem \\
        --max-invokes 8 --max-prompt-tokens 512 --max-request-bytes 4000000 \\
        --max-request-seconds 45 --max-requests-in-flight 4

with a certificate made here (``cryptography``) for 127.0.0.1. A client that trusts the
certificate (``verify=cert.pem``) gets the transformers backend's numbers, its batches sent as
requests of at most 8 invokes; a client that does not is refused in one line. Then a table of
bad requests (no key, an invalid key, a removed key, a 50 MB body declared and streamed, a
100k-token prompt, too many invokes): each is refused with its 4xx in one line naming the
limit and its flag, and the server serves a good request right after it, with the same
numbers. Then time and turns: requests held past 45 s are stopped (504) and a fifth in flight
for one key is refused (429), while another key's requests go on; three clients at once (one
SIGKILLed mid-sweep, whose requests the server drops; one sending bad requests between 200
tiny sweeps, the server's memory flat; one running a study, equal to the transformers
backend's); a short sweep started during a long one (216 cells) waits at most about one of
its batches. Then SIGTERM leaves none of the server's processes behind. Last, with that server
gone (one engine's memory at a time): a server SIGKILLed mid-study and a new one started on its
port, where the study run again resumes from its store.

Run apart from the other vLLM suites, one pytest process each.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="the served backend needs pip install 'pipatch[vllm]' (make install-vllm)")
pytest.importorskip("psutil")

import pipatch  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._backends._served_programs import encode  # noqa: E402
from pipatch._backends._vllm_worker import program_request  # noqa: E402
from pipatch._backends.served import ServedBackend, Server  # noqa: E402
from pipatch._model.models import PipatchError  # noqa: E402
from pipatch._serving.serve import GENERATE_PATH, LOAD_PATH, Spawned  # noqa: E402
from tests._equal import assert_same  # noqa: E402
from tests.conftest import COLOSSEUM, EIFFEL  # noqa: E402

pytestmark = pytest.mark.vllm

ALICE, BOB, CAROL, ENV_KEY = "alice-3c9e0f", "bob-71d2aa", "carol-0b55e1", "env-key-d41f"
KEY_FILE = f"# the team's keys\n{ALICE}  # Alice\n{BOB}  # Bob\n# {CAROL}  (Carol left: removed)\n"
PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}
LIMITS = {"request_bytes": 4_000_000, "invokes": 8, "prompt_tokens": 512, "seconds": 45, "in_flight": 4}


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (cert.pem, key.pem);
    made with ``cryptography`` where it is installed, else with the ``openssl`` command."""
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    try:
        from cryptography import x509
    except ImportError:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key_path), "-out", str(cert_path), "-days", "1",
                        "-subj", "/CN=pipatch test server", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        return str(cert_path), str(key_path)
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pipatch test server")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served_guard")
    cert, key = self_signed(folder)
    keys = folder / "keys"
    keys.write_text(KEY_FILE)
    keys.chmod(0o600)
    return {"cert": cert, "key": key, "keys": str(keys)}


@pytest.fixture(scope="module")
def server(files):
    process = Spawned("--api-key-file", files["keys"], "--ssl-certfile", files["cert"], "--ssl-keyfile", files["key"],
                      "--max-invokes", str(LIMITS["invokes"]), "--max-prompt-tokens", str(LIMITS["prompt_tokens"]),
                      "--max-request-bytes", str(LIMITS["request_bytes"]), "--max-request-seconds", str(LIMITS["seconds"]),
                      "--max-requests-in-flight", str(LIMITS["in_flight"]), env={"PIPATCH_API_KEY": ENV_KEY})
    print(f"server ready in {process.start_s:.1f} s at {process.url}, {process.rss_gb():.1f} GB")
    yield process
    try:
        process.stop()
    finally:
        process.kill()


@pytest.fixture(scope="module")
def served(server, files):
    return pipatch.load_model(serve=server.url, api_key=ALICE, verify=files["cert"])


def test_the_server_says_https_and_its_limits(server, served):
    assert server.url.startswith("https://127.0.0.1:")
    assert "pipatch serve: ready at https://127.0.0.1:" in "".join(server.lines)
    assert not any("warning" in line for line in server.lines), server.lines  # no key on its command line
    assert backend_for(served).server.info["limits"] == LIMITS


def test_a_grid_over_https_equals_transformers_in_requests_of_at_most_8_invokes(served, model):
    kwargs = {**PAIR, "site": "resid", "positions": [-2, -1]}
    assert_same(pipatch.patch(served, **kwargs), pipatch.patch(model, **kwargs), backend="served")


def test_verify_default_refuses_the_self_signed_certificate_in_one_line(server):
    with pytest.raises(PipatchError) as error:
        pipatch.load_model(serve=server.url, api_key=ALICE)
    message = str(error.value)
    print(message)
    assert "sent a certificate this client does not trust" in message and "verify=" in message and "\n" not in message
    assert Server(server.url, ALICE, verify=False).describe()["model"] == "gemma-3-270m (embedded)"  # a test's way


def test_health_is_open_and_everything_else_needs_a_key(server, files):
    import httpx

    with httpx.Client(verify=ssl.create_default_context(cafile=files["cert"])) as http:
        assert http.get(server.url + "/health").json() == {"status": "ok"}
        for path, method in (("/v1/pipatch/info", "GET"), (GENERATE_PATH, "POST"), ("/v1/nnsight/generate", "POST"),
                             ("/docs", "GET"), ("/nowhere", "GET")):
            response = http.request(method, server.url + path)
            assert response.status_code == 401, path
            assert response.json()["detail"].startswith("no API key"), path


def test_the_client_reads_its_key_from_the_environment(server, files, monkeypatch):
    monkeypatch.setenv("PIPATCH_API_KEY", BOB)
    model = pipatch.load_model(serve=server.url, verify=files["cert"])
    assert backend_for(model).server.api_key == BOB
    result = pipatch.lens(model, EIFFEL, answer=" Paris")
    assert result.status == "done"


# --------------------------------------------------------------------------------------------
# Bad requests: each refused in one line, the server serves a good one right after
# --------------------------------------------------------------------------------------------


def _raw(server, files, key=ALICE) -> Server:
    client = Server(server.url, key, verify=files["cert"])
    client.info = {"limits": LIMITS}
    return client


def _baselines_jobs(adapter, token_lists) -> list:
    """The served client's invokes of the circuit-baselines program, one per token list."""
    from pipatch._programs.circuit import BaselinesRequest

    return [(ids, (adapter, "circuit_baselines", BaselinesRequest(torch.tensor([ids])))) for ids in token_lists]


def _request_of(served, jobs) -> bytes:
    """A real request of the served client: one circuit-baseline invoke per token list."""
    backend = backend_for(served)
    return encode(program_request, _baselines_jobs(backend.adapter, jobs), 0, backend.adapter)


def _refused(call) -> str:
    with pytest.raises(PipatchError) as error:
        call()
    return str(error.value)


def _streamed_50_mb(server, files) -> str:
    """50 MB sent chunked (no Content-Length): refused once the bytes pass the limit."""
    import httpx

    def chunks():
        for _ in range(50):
            yield b"x" * 1_000_000

    response = httpx.post(server.url + GENERATE_PATH, content=chunks(), headers={"ndif-api-key": ALICE},
                          verify=ssl.create_default_context(cafile=files["cert"]),
                          timeout=60)
    return f"{response.status_code}: {response.json()['detail']}"


BAD = {
    "no key": (lambda s, f, m: _raw(s, f, None).describe(), "refused the API key"),
    "an invalid key": (lambda s, f, m: _raw(s, f, "alice-3c9e0").describe(), "refused the API key"),
    "a removed key": (lambda s, f, m: _raw(s, f, CAROL).describe(), "refused the API key"),
    "a 50 MB body": (lambda s, f, m: _raw(s, f).generate(b"\0" * 50_000_000),
                     "answered 413: the request body has 50,000,000 bytes, over this server's limit of 4,000,000 "
                     "(pipatch serve --max-request-bytes)"),
    "a 100k-token prompt": (lambda s, f, m: _raw(s, f).generate(_request_of(m, [[2] * 100_000])),
                            "answered 413: invoke 0's prompt has 100,000 tokens, over this server's limit of 512 "
                            "(pipatch serve --max-prompt-tokens)"),
    "9 invokes": (lambda s, f, m: _raw(s, f).generate(_request_of(m, [[2, 9079]] * 9)),
                  "answered 413: the request has 9 invokes, over this server's limit of 8 (pipatch serve --max-invokes)"),
}


def test_bad_requests_are_refused_in_one_line_and_the_server_serves_right_after(server, files, served):
    reference = pipatch.lens(served, EIFFEL, answer=" Paris")
    cases = [(what, lambda run=run: run(server, files, served), expected) for what, (run, expected) in BAD.items()]
    cases.append(("a 50 MB body, streamed", lambda: _streamed_50_mb(server, files), "413: the request body (sent in chunks) "
                  "has more than 4,000,000 bytes, over this server's limit of 4,000,000 (pipatch serve --max-request-bytes)"))
    bob = pipatch.load_model(serve=server.url, api_key=BOB, verify=files["cert"])  # the key file's second key
    for what, call, expected in cases:
        started = time.perf_counter()
        message = call() if what.endswith("streamed") else _refused(call)
        print(f"{what}: {time.perf_counter() - started:.2f} s: {message}")
        assert expected in message and "\n" not in message, (what, message)
        for client in (served, bob):
            good = pipatch.lens(client, EIFFEL, answer=" Paris")
            assert torch.equal(good.grid, reference.grid), what


def test_a_batch_over_the_byte_limit_goes_as_requests_that_fit(served, server, files):
    """A client sizes its requests by the server's byte limit (its info): halved until each
    fits, the answers the same as from one request."""
    backend = backend_for(served)
    small = ServedBackend(served, Server(server.url, ALICE, verify=files["cert"]))
    small.server.describe()
    jobs = _baselines_jobs(backend.adapter, [list(range(1000 + 300 * i, 1064 + 300 * i)) for i in range(8)])  # 64 each
    whole, one = (len(encode(program_request, part, 0, backend.adapter)) for part in (jobs, jobs[:1]))
    limit = (whole + one) // 2  # half the jobs fit (a request is a fixed part and a part per invoke), all do not
    fitted = small._fitted(program_request, jobs, 0, limit)
    print(f"8 invokes: {whole:,} bytes; 1: {one:,}; at most {limit:,}: {[len(part) for part, _ in fitted]} invokes")
    assert len(fitted) >= 2 and all(len(blob) <= limit for _, blob in fitted)
    assert [job for part, _ in fitted for job in part] == jobs
    small.server.info["limits"] = {**LIMITS, "request_bytes": limit}  # as a server started with that limit says
    got = small._invokes(program_request, jobs)
    parts = [row for part, _ in fitted for row in backend._invokes(program_request, part)]
    whole = backend._invokes(program_request, jobs)
    assert len(got) == len(parts) == len(whole) == 8
    # Each invoke's baselines, against the same parts sent unlimited and against one request of
    # all 8: the engine schedules the sequences in flight together (the client's parts, sent
    # one after another or at once, may share an engine step or not: 256 tokens or 512), and
    # its float32 GEMMs block the sums by what they hold. Rounding of ε32 · √K (K ≤ 2,048) per
    # layer over 18 layers: ≈ 1e-4 of each tensor's largest |value|. (Bit for bit held on one
    # machine and not on the next: 0.021 on a block state.)
    for (mine,), (same_parts,), (one_request,) in zip(got, parts, whole):  # each invoke: its one row's baselines
        for reference in (same_parts, one_request):
            assert len(mine) == len(reference)
            for a, b in zip(mine, reference):
                assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * b.abs().max(), (
                    tuple(a.shape), float((a - b).abs().max()), float(b.abs().max()))
    message = _refused(lambda: small._fitted(program_request, jobs[:1], 0, 100))
    assert "over the server's limit of 100: start the server with a larger --max-request-bytes" in message
    small.server.close()


# --------------------------------------------------------------------------------------------
# Time, requests in flight, faults, turns
# --------------------------------------------------------------------------------------------


def _load(server, files, key) -> dict:
    """The server's load as ``key`` sees it (``yours``: that key's requests in flight)."""
    client = _raw(server, files, key)
    try:
        return client._call("GET", LOAD_PATH).json()
    finally:
        client.close()


def _wait_for(what, predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _held_open(server, files, key) -> ssl.SSLSocket:
    """A request whose body never comes whole: its headers and 10 of its 1,000 bytes."""
    context = ssl.create_default_context(cafile=files["cert"])
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", server.port)), server_hostname="127.0.0.1")
    sock.sendall((f"POST {GENERATE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nndif-api-key: {key}\r\n"
                  "Content-Length: 1000\r\n\r\n").encode() + b"\0" * 10)
    return sock


def _answer_of(sock: ssl.SSLSocket, timeout: float) -> tuple[int, str]:
    sock.settimeout(timeout)
    response = http.client.HTTPResponse(sock)
    response.begin()
    detail = json.loads(response.read())["detail"]
    sock.close()
    return response.status, detail


def test_a_request_past_its_time_is_stopped_and_a_fifth_in_flight_refused_others_go_on(server, files, served):
    """Four of Bob's requests held open (their bodies never finish) are four in flight: his
    fifth is 429, naming --max-requests-in-flight, while Alice's sweeps run as before; at 45 s
    the four are stopped, each 504 naming --max-request-seconds, and Bob is served again."""
    reference = pipatch.lens(served, EIFFEL, answer=" Paris")
    started = time.perf_counter()
    held = [_held_open(server, files, BOB) for _ in range(LIMITS["in_flight"])]
    _wait_for("4 held", lambda: _load(server, files, BOB)["yours"] == 4, 10)
    message = _refused(lambda: _raw(server, files, BOB).generate(_request_of(served, [[2, 9079]])))
    print(message)
    assert message.endswith("answered 429: this client (its key) has 4 requests in flight, over this server's limit "
                            "of 4 (pipatch serve --max-requests-in-flight): send fewer at once, or raise the limit")
    assert torch.equal(pipatch.lens(served, EIFFEL, answer=" Paris").grid, reference.grid)  # Alice: as before
    answers = [_answer_of(sock, 60) for sock in held]
    elapsed = time.perf_counter() - started
    print(f"held requests answered after {elapsed:.1f} s: {answers[0]}")
    assert answers == [(504, "the request ran for 45 s and was stopped, over this server's limit of 45 s (pipatch "
                             "serve --max-request-seconds): send smaller requests or fewer at once, or raise the limit")] * 4
    assert LIMITS["seconds"] <= elapsed < LIMITS["seconds"] + 15
    load = _load(server, files, BOB)
    assert load["yours"] == 0 and load["timed_out"] >= 4, load
    bob = pipatch.load_model(serve=server.url, api_key=BOB, verify=files["cert"])
    assert torch.equal(pipatch.lens(bob, EIFFEL, answer=" Paris").grid, reference.grid)


#: The killed client: a long sweep (every position, every layer) on the environment's key.
KILLED = """
import sys, pipatch
model = pipatch.load_model(serve=sys.argv[1], api_key=sys.argv[2], verify=sys.argv[3])
pipatch.patch(model, clean=sys.argv[4], corrupt=sys.argv[5], answer=" Paris", foil=" Rome", site="resid", progress=False)
"""

#: Bad requests the third client sends between its sweeps: (what, request, expected).
def _bad_requests(served) -> list:
    return [("garbage", lambda c: c.generate(b"not a request"), "answered 400"),
            ("9 invokes", lambda c: c.generate(_request_of(served, [[2, 9079]] * 9)), "answered 413"),
            ("a wrong skip header", lambda c: c.generate(_request_of(served, [[2, 9079]]), skip=3), "answered 400")]


def test_three_clients_one_killed_one_bad_one_studying(server, files, served, model, tmp_path):
    """Three clients at once: one SIGKILLed mid-sweep (the server drops its requests: none of
    its key's left in flight, and it counts them as their client gone); one sending a bad
    request before each of 200 tiny sweeps (one invoke each: each bad one refused in one line,
    each sweep's answer the first one's; the server's memory after 200 within 0.2 GB of after
    20); one running a study, whose facts equal the same study on the transformers backend."""
    data = json.loads(pipatch.known_facts().read_text())
    facts = [data[3], data[21]]  # facts the embedded model knows
    cheap = {"sites": "resid", "seeds": 1, "scale": 3.0, "progress": False}
    gone_before = _load(server, files, ENV_KEY)["client_gone"]
    killed = subprocess.Popen([sys.executable, "-c", KILLED, server.url, ENV_KEY, files["cert"], EIFFEL, COLOSSEUM],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    studied, bad_said, rss = {}, [], {}
    twenty, studied_done = threading.Event(), threading.Event()

    def study():
        try:
            studied["found"] = pipatch.study(served, facts, store=tmp_path / "served.sqlite", **cheap)
        finally:
            studied_done.set()

    def bad_and_tiny():
        raw = _raw(server, files, BOB)
        cases, tiny = _bad_requests(served), _request_of(served, [[2, 9079]])
        first = raw.generate(tiny)
        for i in range(200):
            what, send, expected = cases[i % len(cases)]
            message = _refused(lambda: send(raw))
            bad_said.append((what, message))
            assert expected in message and "\n" not in message, (what, message)
            answer = raw.generate(tiny)
            mine, theirs = (next(iter(saves.values()))[0] for saves in (answer, first))  # the invoke's one row
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
            if i + 1 == 20:
                studied_done.wait(300)  # both samples with this client alone on the server
                rss[20] = server.rss_gb()
                twenty.set()
        rss[200] = server.rss_gb()
        raw.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=study), threading.Thread(target=bad_and_tiny)]
    for thread in threads:
        thread.start()
    try:
        waited = _wait_for("the killed client's requests in flight", lambda: killed.poll() is not None
                           or _load(server, files, ENV_KEY)["yours"] >= 1, 180)
        assert killed.poll() is None, killed.stdout.read()
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        freed = _wait_for("the killed client's requests dropped", lambda: _load(server, files, ENV_KEY)["yours"] == 0, 15)
    finally:
        if killed.poll() is None:
            killed.kill()
        for thread in threads:
            thread.join(600)
    load = _load(server, files, ENV_KEY)
    print(f"killed after {waited:.1f} s of its sweep; its requests gone {freed:.1f} s later; {len(bad_said)} bad "
          f"requests refused; all in {time.perf_counter() - started:.0f} s; server {rss[20]:.2f} GB after 20 tiny sweeps, "
          f"{rss[200]:.2f} after 200; load {load}")
    assert load["client_gone"] > gone_before, load  # dropped, not run to their end
    assert load["in_flight"] == 0 and load["waiting"] == 0 and load["engine_requests"] == 0, load
    assert len(bad_said) == 200 and abs(rss[200] - rss[20]) <= 0.2, rss
    found = studied["found"]
    assert found.counts()["done"] == 2, found.summary()
    unserved = pipatch.study(model, facts, store=tmp_path / "transformers.sqlite", **cheap)
    for i in range(2):
        assert_same(found[i], unserved[i], backend="served")


#: A prefix that makes the pair 12 positions or longer: the long sweep's 18 layers × 12 positions.
LONG_PREFIX = "Tourists from many countries say that "


def test_a_short_sweep_started_during_a_long_one_waits_at_most_about_one_of_its_batches(server, files, served):
    """Alice's sweep of 216 cells (18 layers × 12 positions) in batches of 18; Bob's one-batch
    sweep, started while it runs, finishes before it, while at most two of her batches start:
    his request waits for the batch in flight (and may run beside her next), never for her
    sweep. Counted in her batches, not seconds: the machine's load (the other lane of make
    test's vLLM modules) slows both alike, so a duration's bound would measure the load."""
    bob = pipatch.load_model(serve=server.url, api_key=BOB, verify=files["cert"])
    pipatch.lens(bob, EIFFEL, answer=" Paris", positions=[-1], progress=False)  # warm
    alice = ServedBackend(served, Server(server.url, ALICE, verify=files["cert"]))
    alice.server.describe()
    long, timing = {}, {}

    def sweep():
        with alice.log.recording() as events:
            long["events"] = events  # read live by the main thread: one "requests" per batch sent
            started = time.perf_counter()
            long["result"] = pipatch.patch(alice, clean=LONG_PREFIX + EIFFEL, corrupt=LONG_PREFIX + COLOSSEUM,
                                           answer=" Paris", foil=" Rome", site="resid", positions=list(range(-12, 0)),
                                           batch_size=18, progress=False)
            long["seconds"], long["batches"] = time.perf_counter() - started, len(
                [event for event in events if event["event"] == "requests"])

    thread = threading.Thread(target=sweep)
    thread.start()
    _wait_for("Alice's sweep on the server", lambda: _load(server, files, ALICE)["yours"] >= 1, 60)

    def batches_sent() -> int:
        return sum(event["event"] == "requests" for event in list(long["events"]))

    before, started = batches_sent(), time.perf_counter()
    short = pipatch.lens(bob, EIFFEL, answer=" Paris", positions=[-1], progress=False)
    timing["short"], during = time.perf_counter() - started, batches_sent() - before
    overlapped = thread.is_alive()
    thread.join(300)
    batch = long["seconds"] / long["batches"]
    print(f"long: {long['batches']} batches in {long['seconds']:.1f} s ({batch:.2f} s each); short, during it: "
          f"{timing['short']:.2f} s, while {during} of her batches were sent")
    assert short.status == long["result"].status == "done" and overlapped
    assert long["result"].grid.numel() >= 200 and long["batches"] >= 11
    assert during <= 2, (during, long["batches"])
    alice.server.close()


def test_sigterm_stops_the_server_and_every_process_it_started(server):
    assert server.stop() == 0
    deadline = time.monotonic() + 60
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.alive() == [], f"left running: {server.alive()}"


# --------------------------------------------------------------------------------------------
# A server restarted mid-study (after the module's server stopped: one server at a time)
# --------------------------------------------------------------------------------------------


def _finished(store) -> dict[int, tuple[str, float]]:
    """``{fact index: (status, when it was stored)}`` of a study's store."""
    import sqlite3

    if not store.exists():
        return {}
    with sqlite3.connect(store) as db:
        try:
            rows = db.execute("SELECT idx, status, finished FROM facts").fetchall()
        except sqlite3.OperationalError:  # the study is making it
            return {}
    return {idx: (status, finished) for idx, status, finished in rows}


def test_a_server_killed_mid_study_and_restarted_lets_the_study_resume(model, tmp_path):
    """A study on a served model, facts one by one; the server SIGKILLed (its whole process
    tree) once the first fact is stored, while the second runs: the second is stored as an
    error. A new server on the same port, the study run again with the same model and store:
    the first fact is not run again (its row as it was), the second is, and both equal the
    same study on the transformers backend."""
    data = json.loads(pipatch.known_facts().read_text())
    facts = [data[3], data[21]]  # facts the embedded model knows
    cheap = {"sites": "resid", "seeds": 1, "scale": 3.0, "progress": False, "in_flight": 1}
    store = tmp_path / "served.sqlite"
    first = Spawned(env={"PIPATCH_API_KEY": ENV_KEY})
    second = None
    try:
        served = pipatch.load_model(serve=first.url, api_key=ENV_KEY)
        studied = {}
        thread = threading.Thread(target=lambda: studied.update(found=pipatch.study(served, facts, store=store, **cheap)))
        thread.start()
        waited = _wait_for("the first fact stored", lambda: 0 in _finished(store), 300)
        first.kill()
        _wait_for("the killed server's processes gone", lambda: not first.alive(), 60)
        thread.join(120)
        before = _finished(store)
        print(f"killed {waited:.1f} s into the study; the store then: {before}")
        assert not thread.is_alive() and before[0][0] == "done" and before[1][0] == "error", before
        assert studied["found"].counts()["done"] == 1, studied["found"].summary()

        second = Spawned(port=first.port, env={"PIPATCH_API_KEY": ENV_KEY})
        found = pipatch.study(served, facts, store=store, **cheap)
        after = _finished(store)
        print(f"second server ready in {second.start_s:.1f} s; the store after the rerun: {after}")
        assert after[0] == before[0]  # stored before the kill: not run again
        assert after[1][0] == "done" and after[1][1] > before[1][1]
        assert found.counts()["done"] == 2, found.summary()
    finally:
        first.kill()
        if second is not None:
            second.stop()
            second.kill()
    unserved = pipatch.study(model, facts, store=tmp_path / "transformers.sqlite", **cheap)
    for i in range(2):
        assert_same(found[i], unserved[i], backend="served")
