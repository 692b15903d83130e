"""`dew serve` against bad input and hostile clients: OpenAI-shaped errors, limits, timeouts, a key.

The tiny checkpoint of tests/test_serve.py, served by uvicorn on 127.0.0.1 the way `dew serve`
serves it (`running`, the launcher's protocol and middleware), attacked over real HTTP with httpx,
the `openai` client and raw sockets: bodies that are not UTF-8, not JSON or nested too deep,
sampling values out of range, bodies over the size limit, budgets over the ceiling, a client that
sends its headers and stalls, one that stalls mid-headers, a stream whose reader stops reading,
and requests without the API key.

Shapes from vLLM's source (read, not copied): the error JSON of
vllm/entrypoints/serve/exception_handling/handlers/http.py @ 0f17ee061e413bf8ab7927f926f69cdff24dc63e
(the status's phrase as `type`) and validation.py @ 4da14a5cf11a5a5ed50bd267b7460d9957f84c35;
the bearer check of vLLM's AuthenticationMiddleware (health left open); OpenAI's 401 for a
missing or wrong key.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import test_serve
from test_serve import NAME, ROOT, SLOTS, slowed

from dew_lib.sampling import Sampling
from dew_lib.serve import ServeOptions, check_sampling, create_app, launch, running
from dew_lib.serve.protocol import CompletionRequest, ServeError

checkpoint = test_serve.checkpoint  # the same tiny checkpoint
LIMITED = ServeOptions(max_request_bytes=4096, max_tokens_limit=8, read_timeout=1.0, write_timeout=1.0)
KEY = "sesame-1234"
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def policy(checkpoint):
    served = test_serve.warm_policy(checkpoint)
    yield served
    served.close()


@pytest.fixture(scope="module")
def default(policy):
    with running(create_app(policy)) as url:
        yield url


@pytest.fixture(scope="module")
def limited(policy):
    with running(create_app(policy, options=LIMITED)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed(policy):
    with running(create_app(policy, dev_endpoints=True, options=ServeOptions(api_key=KEY))) as url:
        yield url


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(response.json()) == {"error"} and set(error) == ERROR_FIELDS, response.text
    assert error["code"] == status and isinstance(error["message"], str) and isinstance(error["type"], str)
    return error


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(body: bytes, *, path: str = "/v1/completions", length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def read_all(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    sock.settimeout(seconds)
    begun, data = time.monotonic(), b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - begun


# ---- item 5: every 4xx in OpenAI's shape -------------------------------------------------------

@pytest.mark.parametrize(("name", "method", "path", "content", "headers", "status", "param", "words"), [
    ("invalid UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}', {}, 400, "body",
     "not valid UTF-8"),
    ("invalid JSON", "POST", "/v1/completions", b'{"prompt": [1, 2', {}, 400, "body", "not valid JSON"),
    ("nested too deep", "POST", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {},
     400, "body", "nests JSON arrays or objects too deeply"),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", {}, 400, "body", "validation error"),
    ("empty body", "POST", "/v1/chat/completions", b"", {}, 400, "body", "Field required"),
    ("text/plain", "POST", "/v1/completions", b'{"prompt": [1]}', {"content-type": "text/plain"}, 400, "body",
     "must be JSON sent with Content-Type: application/json (this one's Content-Type is text/plain)"),
    ("no content type", "POST", "/v1/completions", b'{"prompt": [1]}', {"content-type": ""}, 400, "body",
     "Content-Type is missing"),
    ("NaN temperature", "POST", "/v1/completions", b'{"prompt": [1], "temperature": NaN}', {}, 400,
     "temperature", "out of range"),
    ("wrong type", "POST", "/v1/completions", b'{"prompt": [1], "max_tokens": "many"}', {}, 400,
     "body.max_tokens", "valid integer"),
    ("unknown route", "GET", "/v1/nothing", b"", {}, 404, None, "is not a route of this server"),
    ("wrong method", "GET", "/v1/completions", b"", {}, 405, None, "GET is not allowed"),
    ("development route off", "POST", "/pause", b"", {}, 404, None, "--dev-endpoints"),
])
def test_every_bad_request_gets_the_openai_error_shape(default, name, method, path, content, headers, status,
                                                       param, words):
    headers = {"content-type": "application/json", **headers}  # what clients send (curl -d sends a form's)
    response = httpx.request(method, f"{default}{path}", content=content, headers=headers, timeout=60)
    error = openai_error(response, status)
    assert error["param"] == param and words in error["message"], (name, error)


def test_a_malformed_body_cannot_amplify_its_error(default):
    """vLLM #49239: every validation error echoed the input. Here at most ten, each shortened."""
    bias = {"x" * 1000 + str(k): "not a number" for k in range(2000)}  # 2 MB in, 4 GB out if echoed
    response = httpx.post(f"{default}/v1/completions", json={"prompt": [1], "logit_bias": bias}, timeout=60)
    error = openai_error(response, 400)
    assert error["message"].startswith("2000 validation errors") and len(response.content) < 4000


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("temperature", -1.0, "temperature is a number >= 0"),
    ("temperature", -1e-9, "temperature is a number >= 0"),
    ("top_p", 0.0, "top_p is a number in (0, 1]"),
    ("top_p", 1.5, "top_p is a number in (0, 1]"),
    ("min_p", 1.0, "min_p is a number in [0, 1)"),
    ("top_k", -2, "top_k is -1 or 0 (none) or a positive integer"),
])
@pytest.mark.parametrize("served", [Sampling(temperature=0.8, top_k=20), Sampling(temperature=0.0)])
def test_sampling_values_out_of_range_are_refused_saying_what_is_accepted(field, value, rule, served):
    """A greedy server used to serve temperature=-1 as greedy; a default one advised relaunching
    with --temperature -1.0, which the launcher refuses. Now both refuse it and say what is valid."""
    with pytest.raises(ServeError) as refused:
        check_sampling(CompletionRequest(prompt=[1], **{field: value}), served)
    assert refused.value.param == field and rule in refused.value.message and "relaunch" not in refused.value.message


def test_every_relaunch_advice_is_a_launch_dew_serve_accepts(default):
    for field, value in (("temperature", 0.5), ("temperature", 0.0), ("top_p", 0.9), ("min_p", 0.1), ("top_k", 5)):
        error = openai_error(httpx.post(f"{default}/v1/completions", json={"prompt": [1], field: value}), 400)
        flag, shown = error["message"].split("relaunch dew serve with ")[1].split()
        Sampling(**{flag.removeprefix("--").replace("-", "_"): type(value)(shown)})  # the advice launches
    error = openai_error(httpx.post(f"{default}/v1/completions", json={"prompt": [1], "temperature": -1}), 400)
    assert "out of range" in error["message"] and "--temperature -1" not in error["message"]


# ---- item 6: size, budget and time limits ------------------------------------------------------

def test_a_body_over_the_size_limit_gets_413_declared_or_streamed(limited):
    big = json.dumps({"prompt": [1] * 2000, "max_tokens": 1}).encode()  # 6 KB against 4 KiB
    error = openai_error(httpx.post(f"{limited}/v1/completions", content=big, timeout=60), 413)
    assert "4096 bytes, its --max-request-bytes" in error["message"] and "declares 6" in error["message"]
    chunked = httpx.post(f"{limited}/v1/completions", content=iter([big[:3000], big[3000:]]), timeout=60)
    assert "transfer-encoding" in chunked.request.headers  # no Content-Length: counted as it arrives
    error = openai_error(chunked, 413)
    assert "--max-request-bytes" in error["message"]
    fits = httpx.post(f"{limited}/v1/completions", json={"prompt": [1] * 100, "max_tokens": 1}, timeout=60)
    assert fits.status_code == 200, fits.text


def test_max_tokens_over_the_ceiling_is_refused_and_defaults_stay_under_it(limited, policy):
    for route, field in (("completions", "max_tokens"), ("chat/completions", "max_tokens"),
                         ("chat/completions", "max_completion_tokens")):
        base = {"prompt": [1, 2]} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
        error = openai_error(httpx.post(f"{limited}/v1/{route}", json={**base, field: 9}, timeout=60), 400)
        assert error["param"] == field and f"{field}=9 is more than" in error["message"]
        assert "(8, its --max-tokens-limit)" in error["message"]
        assert httpx.post(f"{limited}/v1/{route}", json={**base, field: 8}, timeout=60).status_code == 200
    seed = next(s for s in range(100) if len(test_serve.reference(policy, [3, 4], 16, s)) > 8)
    plain = httpx.post(f"{limited}/v1/completions", json={"prompt": [3, 4], "seed": seed}, timeout=60).json()
    assert plain["usage"]["completion_tokens"] == 8  # the completions default (16) lowered to the ceiling
    chat = httpx.post(f"{limited}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=60).json()
    assert 1 <= chat["usage"]["completion_tokens"] <= 8  # the chat default (what the capacity leaves) too



def test_a_client_that_sends_headers_and_stalls_gets_408_and_is_dropped(limited, policy):
    with socket.create_connection(address(limited)) as sock:
        sock.sendall(raw_request(b'{"prompt": [1, 2', length=100))  # 16 of the 100 bytes it announces
        data, took = read_all(sock, 30)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), data
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == 408
    assert "within 1 s of its headers (16 bytes came)" in error["message"]
    assert 0.9 <= took < 10, took  # then the server closed the connection
    assert policy.in_flight == 0


@pytest.mark.parametrize("first", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"])
def test_a_client_that_stalls_mid_headers_is_disconnected(limited, first):
    """uvicorn has no deadline for headers: such a client held its socket for ever (slowloris)."""
    with socket.create_connection(address(limited)) as sock:
        if first:  # on a kept-alive connection, after a response, the next request's headers
            sock.sendall(first)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        data, took = read_all(sock, 30)
    assert data == b"" and 0.5 <= took < 10, (data, took)


def test_a_stream_whose_reader_stopped_reading_gives_its_slots_back(policy, monkeypatch):
    """A stream's draws do not wait for its reader, so a reader that stops would keep up to every
    slot busy until its prompts are drawn, and its socket for ever. Once a write waits longer than
    write_timeout the request ends: its draws are cancelled and the connection is reset."""
    bind = launch.bind

    def small_buffers(host, port):  # accepted sockets inherit it: buffers fill after ~100 KB, not ~3 MB
        sock = bind(host, port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return sock

    monkeypatch.setattr(launch, "bind", small_buffers)
    outcomes, draw = [], policy.draw

    async def recorded(*args, **kwargs):
        try:
            result = await draw(*args, **kwargs)
        except BaseException as error:
            outcomes.append(type(error).__name__)
            raise
        outcomes.append("drawn")
        return result

    monkeypatch.setattr(policy, "draw", recorded)
    engine = policy.native.server
    body = json.dumps({"prompt": [[10 + k, 11] for k in range(32)], "max_tokens": 120, "seed": 3, "logprobs": 0,
                       "stream": True, "return_token_ids": True, "return_tokens_as_token_ids": True}).encode()
    with running(create_app(policy, options=ServeOptions(write_timeout=1.0))) as url, slowed(policy, 0.02):
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(address(url))
        try:
            reader.sendall(raw_request(body))
            assert reader.recv(1024).startswith(b"HTTP/1.1 200")  # then it reads nothing more
            deadline = time.monotonic() + 120
            while len(outcomes) < 32 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(outcomes) == 32, outcomes
            while (engine.free < SLOTS or engine.busy) and time.monotonic() < deadline:  # freed at its next call
                time.sleep(0.02)
            assert policy.in_flight == 0 and engine.free == SLOTS and not engine.busy
            # ~100 KB fill the buffers: the first few prompts' worth; the rest never start or are cut
            assert outcomes.count("CancelledError") >= 16, f"the stalled stream was not cut: {outcomes}"
            data, _ = read_all(reader, 30)
            assert b"data: [DONE]" not in data
        finally:
            reader.close()


# ---- item 6: the API key and the development routes ---------------------------------------------

def test_without_the_key_every_route_but_health_is_refused_with_401(keyed):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("POST", "/pause"), ("POST", "/collective_rpc"), ("GET", "/is_paused"),
                         ("GET", "/v1/nothing")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            response = httpx.request(method, f"{keyed}{path}", headers=headers, json={"prompt": [1]}, timeout=60)
            error = openai_error(response, 401)
            assert response.headers["www-authenticate"] == "Bearer" and KEY not in response.text, (path, headers)
            assert error["type"] == "Unauthorized"
    assert httpx.get(f"{keyed}/health").status_code == 200


def test_the_openai_client_with_the_key_is_served_and_without_it_refused(keyed):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2, seed=1).choices[0].text is not None
    key = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{keyed}/pause", params={"mode": "wait"}, headers=key).json() == {"status": "paused"}
    assert httpx.post(f"{keyed}/resume", headers=key).json() == {"status": "resumed"}


def test_the_launcher_warns_about_open_doors():
    assert launch.launch_warnings("127.0.0.1", False, ServeOptions()) == []
    assert launch.launch_warnings("0.0.0.0", True, ServeOptions(api_key=KEY)) == []
    (open_port,) = launch.launch_warnings("0.0.0.0", False, ServeOptions())
    assert "listening on 0.0.0.0 with no API key" in open_port and "--api-key" in open_port
    (dev,) = launch.launch_warnings("127.0.0.1", True, ServeOptions())
    assert "development routes are on with no API key: any process on this machine" in dev
    assert len(launch.launch_warnings("10.1.2.3", True, ServeOptions())) == 2
    with pytest.raises(ValueError, match="api_key"):
        ServeOptions(api_key="has space")


def test_dew_serve_refuses_an_empty_key_in_one_line(checkpoint):
    out = subprocess.run([sys.executable, "-m", "dew_lib.cli", "serve", str(checkpoint[0]), "--api-key", ""],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("dew serve: ServeOptions.api_key") and out.stdout == ""
