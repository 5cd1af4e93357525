"""`dspark serve --ray` on a local Ray cluster (loopback, 2 CPUs): two replicas of the tiny bundle
serve concurrent requests, each greedy output its solo run's; then one replica's process is killed
while requests stream. What the accepted requests get: those on the living replica finish with
their solo output; those on the killed one end with an error (an HTTP 5xx, or a stream cut before
its last event), since Serve does not replay a request whose replica died; none hangs. New requests
go to the living replica at once and Serve starts a replacement."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
from factories import reference_logits
from servers import free_port, wait_healthy

from dspark.runtime import Engine
from dspark.runtime.tools.parity import greedy_match

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

MODEL = "tiny"
SLOTS = 2
TIMEOUT = 120  # s: every wait is bounded
PROMPTS = [f"Request {i}: {w}" for i, w in enumerate(["dragons", "the sea", "clips", "17 * 23", "a poem", "cats",
                                                      "rain", "Paris"])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Ray cluster on 127.0.0.1 with 2 CPUs, this test's alone. Yields its address.
    Serve's controller gives its HTTP proxy 60 s to report ready instead of 5: on two cores busy
    with the other test worker the proxy's imports alone can take longer, and after three missed
    checks Serve restarts it and `serve.start` fails."""
    ray_cli = shutil.which("ray") or pytest.fail("the `ray` command is not on PATH")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
    subprocess.run([ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
                   check=True, capture_output=True, env=env, timeout=TIMEOUT)
    address = f"127.0.0.1:{port}"
    ray.init(address=address, log_to_driver=False)
    yield address
    ray.shutdown()
    subprocess.run([ray_cli, "stop", "--force"], capture_output=True, env=env, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def server(cluster, profiled, tmp_path_factory):
    """`dspark serve --ray --replicas 2` on the cluster. Yields its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "server.log"
    cmd = [sys.executable, "-m", "dspark.runtime.tools.cli", "serve", "--bundle", str(profiled), "--ray",
           "--ray-address", cluster, "--replicas", "2", "--port", str(port), "--slots", str(SLOTS), "--max-queue",
           "8", "--model-name", MODEL]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None, TIMEOUT)
    except (AssertionError, TimeoutError):
        proc.kill()
        raise AssertionError(f"`dspark serve --ray` did not start:\n{log.read_text()}") from None
    yield url
    proc.send_signal(signal.SIGTERM)  # deletes the application
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def reference(profiled):
    return Engine.load(profiled, slots=SLOTS, threads=1)


def replicas() -> list:
    """Handles of the application's replica actors that answer and hold their engine (a replica
    still loading its bundle has no DSparkReplica yet)."""
    alive = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::dspark#"):
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            try:
                loaded = on_replica(handle, lambda r: r is not None)
            except (ray.exceptions.RayError, TimeoutError, AttributeError):
                continue
            if loaded:
                alive.append(handle)
    return alive


def both_replicas() -> list:
    """The two replicas, once both have loaded: `dspark serve --ray` is healthy as soon as one has."""
    deadline = time.monotonic() + TIMEOUT
    while len(handles := replicas()) < 2:
        assert time.monotonic() < deadline, f"{len(handles)} of 2 replicas loaded after {TIMEOUT} s"
        time.sleep(1)
    return handles


def on_replica(handle, fn):
    """fn(the replica's DSparkReplica) run inside that replica's process. Serve wraps the deployment
    in its own actor; the path to the user object is Ray Serve's internal one (ray 2.5x)."""
    return ray.get(handle.__ray_call__.remote(
        lambda actor: fn(actor._replica_impl._user_callable_wrapper.user_callable)), timeout=10)


def served(handle) -> int:
    """Requests the replica's engine has finished."""
    return on_replica(handle, lambda r: sum(r.engine.state().finished.values()))


def running(handle) -> int:
    """Requests in the replica's engine (in a slot or waiting for one)."""
    return on_replica(handle, lambda r: r.engine.state().running + r.engine.state().waiting)


def stream(url: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streaming chat request; its token ids, or the error that ended it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    got: dict = {"tokens": [], "finish": None, "error": None}
    try:
        for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True}):
            if c.model_extra.get("dspark"):
                got["tokens"] += c.model_extra["dspark"]["token_ids"]
            got["finish"] = c.choices[0].finish_reason or got["finish"]
    except Exception as e:  # an HTTP error status, a cut connection, a malformed stream
        got["error"] = f"{type(e).__name__}: {e}"
    return got


def concurrently(url: str, prompts: list[str], max_tokens: int, during=None) -> list[dict]:
    """Stream every prompt at once, each on its own thread; run `during()` while they do."""
    results: list[dict] = [{} for _ in prompts]
    threads = [threading.Thread(target=lambda i=i: results[i].update(stream(url, prompts[i], max_tokens)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a request hung"
    return results


def solo_match(reference, tiny_bundle, prompt: str, tokens: list[int], max_tokens: int) -> bool:
    alone = reference.generate(prompt, max_new_tokens=max_tokens)
    logits = reference_logits(tiny_bundle.target, reference.encode(prompt), alone.token_ids)
    return greedy_match(alone.token_ids, tokens, logits).ok


@pytest.mark.slow
def test_two_replicas_serve_concurrent_requests(server, reference, tiny_bundle):
    """Every burst's streams equal their solo runs, and both replicas serve. Ray's proxy may learn
    of the second replica a moment after it is up (seconds, on a busy machine): up to three bursts
    are sent until both have served."""
    handles = both_replicas()
    assert len(handles) == 2
    before = [served(h) for h in handles]
    for burst in range(1, 4):
        results = concurrently(server, PROMPTS, 24)
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        for prompt, r in zip(PROMPTS, results):
            assert solo_match(reference, tiny_bundle, prompt, r["tokens"], 24), prompt
        counts = [served(h) - b for h, b in zip(handles, before)]
        assert sum(counts) == burst * len(PROMPTS), f"requests per replica: {counts}"
        if min(counts) > 0:
            break
    assert min(counts) > 0, f"requests per replica after {burst} bursts: {counts}"


@pytest.mark.slow
def test_a_killed_replica_fails_its_requests_and_service_continues(server, reference, tiny_bundle):
    handles = both_replicas()
    max_tokens = 400  # long enough to be streaming when the replica dies
    killed: dict = {}

    def kill_a_busy_replica() -> None:
        deadline = time.monotonic() + TIMEOUT
        while not all(running(h) for h in handles):  # both replicas hold requests
            assert time.monotonic() < deadline, "the requests did not reach both replicas"
            time.sleep(0.05)
        killed["pid"] = on_replica(handles[0], lambda r: os.getpid())
        os.kill(killed["pid"], signal.SIGKILL)

    prompts = PROMPTS[:6]
    results = concurrently(server, prompts, max_tokens, during=kill_a_busy_replica)
    ok = [r for r in results if r["error"] is None and r["finish"] is not None]
    failed = [r for r in results if r not in ok]
    assert ok and failed, f"expected requests on both replicas: {results}"
    for prompt, r in zip(prompts, results):
        if r in ok:
            assert solo_match(reference, tiny_bundle, prompt, r["tokens"], max_tokens), prompt

    after = concurrently(server, PROMPTS[:4], 16)  # the living replica takes new requests at once
    assert all(r["error"] is None and r["finish"] == "length" for r in after), after
    both_replicas()  # Serve replaces the dead replica
    wait_healthy(server, timeout=TIMEOUT)


def test_serve_run_builder_types_its_arguments():
    """`serve run dspark.runtime.serving.ray_app:build k=v ...` passes strings; build types them."""
    from dspark.runtime.serving.ray_app import build

    app = build({"bundle": "/b", "replicas": "2", "autoscale_max": "4", "slots": "3", "threshold": "0.25",
                 "threads": "1"})
    options = app._bound_deployment._deployment_config
    assert options.autoscaling_config.max_replicas == 4 and options.max_ongoing_requests == 3 + 64
    config = app._bound_deployment.init_args[0]
    assert config["slots"] == 3 and config["threshold"] == 0.25 and config["load"] == {"threads": 1}
    with pytest.raises(ValueError, match="unknown arguments"):
        build({"bundle": "/b", "slot": "3"})
    with pytest.raises(ValueError, match="bundle=DIR"):
        build({"replicas": "2"})
