"""`dspark serve` (runtime/serving/) on the tiny bundle: a real server process (or uvicorn in a
thread) and the real `openai` client. Greedy and seeded outputs are the engine's own, concurrent
streams are their solo runs, a client that disconnects frees its slot, every bad request gets its
status and an OpenAI error object (and the next good request succeeds), a full queue answers 429.
The slow test serves the real SmolLM2 bundle."""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from factories import reference_logits
from servers import free_port, wait_healthy

from dspark.runtime import AsyncEngine, Engine
from dspark.runtime.tools.parity import greedy_match

MODEL = "tiny"
KEY = "test-key"
SLOTS = 3
BODY_LIMIT = 16384
PROMPT = "Hello there, how are you?"
TIMEOUT = 60  # s: every wait is bounded


@pytest.fixture(scope="module")
def server(profiled, tmp_path_factory):
    """`dspark serve` in its own process: SLOTS slots, the API key from $DSPARK_API_KEY. Yields its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "dspark.runtime.tools.cli", "serve", "--bundle", str(profiled), "--port", str(port),
           "--slots", str(SLOTS), "--max-queue", "64", "--threads", "1", "--model-name", MODEL,
           "--max-body-bytes", str(BODY_LIMIT), "--log-level", "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "DSPARK_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None)
    except (AssertionError, TimeoutError):
        proc.kill()
        raise AssertionError(f"`dspark serve` did not start:\n{log.read_text()}") from None
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def thread_server(engine: AsyncEngine, model: str = MODEL, **kwargs):
    """create_app + uvicorn in a background thread (what a process embedding the server does). Yields its URL."""
    import uvicorn

    from dspark.runtime.serving.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model, **kwargs), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", thread.is_alive)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(profiled):
    """An engine loaded as the server loads it (same slots, graphs and scheduler)."""
    return Engine.load(profiled, slots=SLOTS, threads=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def post(url: str, path: str, body, headers: dict | None = None, chunked: bool = False):
    """A raw request: (status, headers with lower-case names, parsed JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        hdrs = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        if chunked:
            conn.request("POST", path, iter([data[i:i + 4096] for i in range(0, len(data), 4096)]), hdrs,
                         encode_chunked=True)
        else:
            conn.request("POST", path, data, hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"null")
    finally:
        conn.close()


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(dspark_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def dspark_field(obj) -> dict:
    return obj.model_extra["dspark"]


# --- outputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 7)])
def test_chat_completion_is_the_engines_output(client, reference, temperature, seed):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=40,
                                       temperature=temperature, seed=seed, extra_body={"return_token_ids": True})
    e = reference.generate(PROMPT, max_new_tokens=40, temperature=temperature, seed=seed)
    ext = dspark_field(r)
    assert ext["token_ids"] == e.token_ids and r.choices[0].message.content == e.text
    assert r.choices[0].finish_reason == {"length": "length", "stop": "stop"}[e.finish_reason]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    n = len(reference.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, len(e.token_ids),
                                                                                       n + len(e.token_ids))
    cached = r.usage.prompt_tokens_details.cached_tokens  # the same prompt may sit in a slot from an earlier test
    assert cached in (0, n - 1) and ext["prefilled_tokens"] == n - cached
    assert ext["tau"] == e.stats.tau and ext["prefill_s"] > 0 and len(ext["per_position_acceptance"]) == 4


def test_a_follow_up_turn_reuses_the_prefix(client, reference):
    """The second turn's prompt starts with the first turn's prompt and answer: the server
    prefills only the rest, and the answer equals a fresh engine's."""
    first = [{"role": "user", "content": "Tell me a story about a dragon."}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=30, temperature=0)
    turn = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=30, temperature=0,
                                        extra_body={"return_token_ids": True})
    n = len(reference.encode(turn))
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(reference.encode(first)), "the first turn's prompt was prefilled again"
    assert dspark_field(r2)["prefilled_tokens"] == n - cached and dspark_field(r2)["prefill_s"] > 0
    assert dspark_field(r2)["token_ids"] == reference.generate(turn, max_new_tokens=30).token_ids


def test_streaming_chat(client, reference):
    stop = reference.generate(PROMPT, max_new_tokens=40).text[9:11]  # a stop string inside the greedy text
    e = reference.generate(PROMPT, max_new_tokens=40, stop=[stop])
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=40, temperature=0, stop=stop, stream=True,
                                                 stream_options={"include_usage": True}))
    *content, usage = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == e.text and e.finish_reason == "stop_string"
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["stop"]
    assert dspark_field(content[-1])["tau"] == e.stats.tau
    assert usage.choices == [] and usage.usage.completion_tokens == len(e.token_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


@pytest.mark.parametrize("stream", [False, True])
def test_text_completion(client, reference, stream):
    e = reference.generate(PROMPT, max_new_tokens=30, chat=False)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=stream)
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == e.text
    if not stream:
        assert r.object == "text_completion" and r.usage.prompt_tokens == len(reference.encode(PROMPT, chat=False))


def test_concurrent_streams_are_their_solo_runs(server, reference, tiny_bundle):
    """16 streaming clients on SLOTS slots: each completes once, none lost or duplicated, and each
    greedy output is its solo run's (identical in the floating-point sense of dspark.md §1)."""
    prompts = [f"Request {i}: {w}" for i, w in enumerate(["dragons", "the sea", "clips", "17 * 23", "a poem", "cats",
                                                          "rain", "Paris", "numbers", "a story", "music", "stars",
                                                          "bread", "trains", "snow", "chess"])]
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)

    async def one(prompt: str) -> dict:
        stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                       max_tokens=24, temperature=0, stream=True,
                                                       extra_body={"return_token_ids": True})
        got = {"ids": set(), "text": "", "tokens": [], "finishes": 0, "ext": None}
        async for c in stream:
            got["ids"].add(c.id)
            got["text"] += c.choices[0].delta.content or ""
            got["tokens"] += dspark_field(c)["token_ids"] if c.model_extra.get("dspark") else []
            if c.choices[0].finish_reason is not None:
                got["finishes"] += 1
                got["ext"] = dspark_field(c)
        return got

    async def all_of_them():
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), TIMEOUT)

    results = asyncio.run(all_of_them())
    assert all(r["finishes"] == 1 and len(r["ids"]) == 1 for r in results)
    assert len({next(iter(r["ids"])) for r in results}) == len(prompts)
    assert max(r["ext"]["mean_batch"] for r in results) > 1, "the requests should have shared steps"
    for prompt, r in zip(prompts, results):
        alone = reference.generate(prompt, max_new_tokens=24)
        ids = reference.encode(prompt)
        m = greedy_match(alone.token_ids, r["tokens"], reference_logits(tiny_bundle.target, ids, alone.token_ids))
        assert m.ok, f"{prompt!r}: {m}"
        if r["tokens"] == alone.token_ids:
            assert r["text"] == alone.text


def test_a_client_that_disconnects_frees_its_slot(server, client, reference, tiny_bundle):
    """A stream closed after its first event is aborted in the engine (its slot freed) while another
    request goes on. The victim asks for the whole context (about 100 steps); should it still end
    before the server sees the disconnect, the attempt is repeated."""
    host, port = server.removeprefix("http://").split(":")
    before = metrics(server)['dspark_requests_total{outcome="abort"}']
    for _ in range(3):
        other = {}
        worker = threading.Thread(target=lambda: other.update(r=client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=300, temperature=0,
            extra_body={"return_token_ids": True})))
        worker.start()
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat(PROMPT, temperature=0, stream=True)),
                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline()  # the first event
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        worker.join(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while (m := metrics(server))["dspark_running_requests"] or m["dspark_waiting_requests"]:
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        if m['dspark_requests_total{outcome="abort"}'] > before:
            break
    assert m['dspark_requests_total{outcome="abort"}'] == before + 1
    alone = reference.generate("Hi", max_new_tokens=300)  # the other request went on undisturbed
    logits = reference_logits(tiny_bundle.target, reference.encode("Hi"), alone.token_ids)
    assert greedy_match(alone.token_ids, dspark_field(other["r"])["token_ids"], logits).ok


# --- errors ----------------------------------------------------------------------------------------

BAD = {  # name: (path, body, headers, status, param)
    "malformed_json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', {}, 400, None),
    "not_an_object": ("/v1/chat/completions", [], {}, 400, None),
    "missing_messages": ("/v1/chat/completions", {"model": MODEL}, {}, 400, "messages"),
    "empty_messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, {}, 400, "messages"),
    "messages_not_a_list": ("/v1/chat/completions", {"model": MODEL, "messages": "Hi"}, {}, 400, "messages"),
    "temperature_a_string": ("/v1/chat/completions", chat("Hi", temperature="0.5"), {}, 400, "temperature"),
    "max_tokens_a_string": ("/v1/chat/completions", chat("Hi", max_tokens="5"), {}, 400, "max_tokens"),
    "stream_a_string": ("/v1/chat/completions", chat("Hi", stream="yes"), {}, 400, "stream"),
    "unknown_role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "Hi"}]}, {},
                     400, "messages.0.role"),
    "image_content": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, {}, 400, "messages.0.content"),
    "negative_temperature": ("/v1/chat/completions", chat("Hi", temperature=-0.5), {}, 400, "temperature"),
    "negative_seed": ("/v1/chat/completions", chat("Hi", seed=-1), {}, 400, "seed"),
    "empty_stop_string": ("/v1/chat/completions", chat("Hi", stop=[""]), {}, 400, None),
    "n_2": ("/v1/chat/completions", chat("Hi", n=2), {}, 400, "n"),
    "max_tokens_beyond_the_context": ("/v1/chat/completions", chat("Hi", max_tokens=100_000), {}, 400, None),
    "prompt_beyond_the_context": ("/v1/chat/completions", chat("x" * 600, max_tokens=4), {}, 400, None),
    "prompt_not_a_string": ("/v1/completions", {"model": MODEL, "prompt": [1, 2]}, {}, 400, "prompt"),
    "unknown_model": ("/v1/chat/completions", {**chat("Hi"), "model": "gpt-4o"}, {}, 404, "model"),
    "missing_key": ("/v1/chat/completions", chat("Hi"), {"Authorization": ""}, 401, None),
    "wrong_key": ("/v1/chat/completions", chat("Hi"), {"Authorization": "Bearer test-kez"}, 401, None),
    "body_too_large": ("/v1/chat/completions", chat("x" * BODY_LIMIT), {}, 413, None),
    "body_too_large_chunked": ("/v1/chat/completions", chat("x" * BODY_LIMIT), {"chunked": True}, 413, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request(server, case):
    path, body, headers, status, param = BAD[case]
    headers = dict(headers)
    got, _, answer = post(server, path, body, headers, chunked=headers.pop("chunked", False))
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"], answer
    assert answer["error"]["param"] == param, answer
    good, _, ok = post(server, "/v1/chat/completions", chat("Hi", max_tokens=4, temperature=0))
    assert good == 200 and ok["choices"][0]["finish_reason"] in ("stop", "length")


def test_errors_through_the_openai_client(server, client):
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/chat/completions", 405)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{server}{path}", method=method), timeout=TIMEOUT)
        assert e.value.code == status and set(json.loads(e.value.read())["error"]) == {"message", "type", "param",
                                                                                         "code"}
    assert metrics(server)['dspark_requests_total{outcome="invalid"}'] >= 2


def test_a_full_queue_answers_429(profiled):
    """One slot, no queue: while a long request streams, another is refused with Retry-After. (Should
    the long one end before the second arrives, the attempt is repeated.)"""
    engine = AsyncEngine.load(profiled, slots=1, max_waiting=0, threads=1)
    with thread_server(engine) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(3):
            conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
            conn.request("POST", "/v1/chat/completions", json.dumps(chat(PROMPT, temperature=0, stream=True)),
                         {"Content-Type": "application/json"})
            long = conn.getresponse()
            assert long.status == 200 and long.readline()  # in flight
            status, headers, answer = post(url, "/v1/chat/completions", chat("Hi", max_tokens=4))
            rest = long.read().decode()
            conn.close()
            assert rest.rstrip().endswith("data: [DONE]")  # the long request was not disturbed
            if status == 429:
                break
            assert '"finish_reason": "length"' in rest  # it had ended: try again
        assert status == 429 and headers["retry-after"] == "1"
        assert answer["error"]["type"] == "rate_limit_error" and answer["error"]["code"] == "queue_full"
        status, _, _ = post(url, "/v1/chat/completions", chat("Hi", max_tokens=4))
        assert status == 200
        assert metrics(url)['dspark_requests_total{outcome="rejected"}'] >= 1


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(urllib.request.urlopen(f"{server}/health", timeout=TIMEOUT).read()) == {"status": "ok"}
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                   temperature=0)
    m = metrics(server)
    for name in ("dspark_running_requests", "dspark_waiting_requests", "dspark_slots", "dspark_tau",
                 "dspark_mean_verified", "dspark_drafter_skipped_share", "dspark_generation_tokens_total",
                 "dspark_time_to_first_token_seconds_count", "dspark_inter_token_latency_seconds_count",
                 "dspark_e2e_request_latency_seconds_count", 'dspark_requests_total{outcome="length"}',
                 'dspark_acceptance_rate{position="1"}', 'dspark_acceptance_rate{position="4"}'):
        assert name in m, name
    assert m["dspark_slots"] == SLOTS and m["dspark_tau"] >= 1 and m["dspark_generation_tokens_total"] >= 8
    assert m["dspark_e2e_request_latency_seconds_count"] >= 1 and 0 <= m["dspark_drafter_skipped_share"] < 1


def test_serve_help(capsys):
    from dspark.runtime.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f in out for f in ("--bundle", "--host", "--port", "--slots", "--max-queue",
                                                        "--api-key", "--model-name", "--max-body-bytes", "--threads"))


@pytest.mark.parametrize("flags, message", [
    (["--prefill-chunk", "-1"], "--prefill-chunk must be 0"),
    (["--replicas", "2"], "--replicas apply only with --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be at least 1"),
    (["--ray", "--replicas", "2", "--autoscale-max", "1"], "--autoscale-max (1) must be at least --replicas (2)"),
])
def test_serve_flags_are_checked_before_loading(flags, message, capsys):
    from dspark.runtime.tools.cli import main

    assert main(["serve", "--bundle", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serving_does_not_load_with_the_lean_runtime():
    code = "import sys, dspark.runtime; dspark.runtime.AsyncEngine; assert 'fastapi' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT)


# --- the real model --------------------------------------------------------------------------------

@pytest.mark.slow
def test_default_bundle_chat_completion_is_engine_generate(default_bundle):
    prompt = "What is 17 * 23?"
    expected = Engine.load(default_bundle.path).generate(prompt, max_new_tokens=48, scheduler="fixed")
    engine = AsyncEngine.load(default_bundle.path, scheduler="fixed")
    with thread_server(engine, "smollm2") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=48, temperature=0, extra_body={"return_token_ids": True})
    assert dspark_field(r)["token_ids"] == expected.token_ids and r.choices[0].message.content == expected.text
