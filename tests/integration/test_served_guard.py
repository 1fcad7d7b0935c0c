"""A ``pipatch serve`` a team can trust: keys from a file and the environment, HTTPS with a
self-signed certificate, and limits per request, on one real server.

One server for the module, started as a team would start it on a shared box::

    PIPATCH_API_KEY=$ENV_KEY pipatch serve --api-key-file keys --ssl-certfile cert.pem --ssl-keyfile key.pem \\
        --max-invokes 8 --max-prompt-tokens 512 --max-request-bytes 4000000

with a certificate made here (``cryptography``) for 127.0.0.1. A client that trusts the
certificate (``verify=cert.pem``) gets the transformers backend's numbers, its batches sent as
requests of at most 8 invokes; a client that does not is refused in one line. Then a table of
bad requests (no key, an invalid key, a removed key, a 50 MB body declared and streamed, a
100k-token prompt, too many invokes): each is refused with its 4xx in one line naming the
limit and its flag, and the server serves a good request right after it, with the same
numbers. Last: SIGTERM leaves none of the server's processes behind.

Run apart from the other vLLM suites, one pytest process each.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import time

import pytest
import torch

pytest.importorskip("vllm", reason="the served backend needs pip install 'pipatch[vllm]' (make install-vllm)")
pytest.importorskip("psutil")

import pipatch  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._backends._served_programs import encode  # noqa: E402
from pipatch._backends._vllm_worker import circuit_baselines_request  # noqa: E402
from pipatch._backends.served import ServedBackend, Server  # noqa: E402
from pipatch._models import PipatchError  # noqa: E402
from pipatch._serve import GENERATE_PATH, Spawned  # noqa: E402
from tests._equal import assert_same  # noqa: E402
from tests.conftest import COLOSSEUM, EIFFEL  # noqa: E402

pytestmark = pytest.mark.vllm

ALICE, BOB, CAROL, ENV_KEY = "alice-3c9e0f", "bob-71d2aa", "carol-0b55e1", "env-key-d41f"
KEY_FILE = f"# the team's keys\n{ALICE}  # Alice\n{BOB}  # Bob\n# {CAROL}  (Carol left: removed)\n"
PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}
LIMITS = {"request_bytes": 4_000_000, "invokes": 8, "prompt_tokens": 512}


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
                      "--max-request-bytes", str(LIMITS["request_bytes"]), env={"PIPATCH_API_KEY": ENV_KEY})
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


def _request_of(served, jobs) -> bytes:
    """A real request of the served client: one circuit-baseline invoke per token list."""
    backend = backend_for(served)
    return encode(circuit_baselines_request, [(ids, (backend.adapter,)) for ids in jobs], 0, backend.adapter)


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
    jobs = [(list(range(1000 + 300 * i, 1200 + 300 * i)), (backend.adapter,)) for i in range(8)]  # 200 tokens each
    whole, one = (len(encode(circuit_baselines_request, part, 0, backend.adapter)) for part in (jobs, jobs[:1]))
    limit = (whole + one) // 2  # half the jobs fit (a request is a fixed part and a part per invoke), all do not
    fitted = small._fitted(circuit_baselines_request, jobs, 0, limit)
    print(f"8 invokes: {whole:,} bytes; 1: {one:,}; at most {limit:,}: {[len(part) for part, _ in fitted]} invokes")
    assert len(fitted) >= 2 and all(len(blob) <= limit for _, blob in fitted)
    assert [job for part, _ in fitted for job in part] == jobs
    small.server.info["limits"] = {**LIMITS, "request_bytes": limit}  # as a server started with that limit says
    got, want = small._invokes(circuit_baselines_request, jobs), backend._invokes(circuit_baselines_request, jobs)
    assert len(got) == len(want) == 8
    for mine, reference in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(mine, reference))
    message = _refused(lambda: small._fitted(circuit_baselines_request, jobs[:1], 0, 100))
    assert "over the server's limit of 100: start the server with a larger --max-request-bytes" in message
    small.server.close()


def test_sigterm_stops_the_server_and_every_process_it_started(server):
    assert server.stop() == 0
    deadline = time.monotonic() + 60
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.alive() == [], f"left running: {server.alive()}"
