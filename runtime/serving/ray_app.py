"""`dspark serve --ray`: the same OpenAI-compatible application on Ray Serve, one engine per replica.

    ray start --head                                   # or let `dspark serve --ray` start a local one
    dspark serve --bundle engines/smollm2 --ray --replicas 2 --threads 1 --ray-address auto

Ray routes each HTTP request to a replica (its proxy listens on --host/--port) and, with
`autoscale_max`, adds and removes replicas on `target_ongoing_requests`; each replica is a Ray actor
that loads the bundle into an AsyncEngine and serves `create_app` over it, so batching, 429s and
errors are the engine's own. A replica asks for `num_cpus` CPUs and `max_ongoing_requests` is
slots + queue: Serve then hands every request to an engine, and a full engine answers 429 itself.

For a cluster of several machines, every node needs the bundle at the same path and this package
installed; `serve run dspark.runtime.serving.ray_app:build bundle=/path/to/bundle replicas=4` (the
builder below) or a Serve config file deploys it from any node."""
from __future__ import annotations

import signal
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ray import serve

from ..async_engine import AsyncEngine
from .app import MAX_BODY_BYTES, create_app

APP_NAME = "dspark"


@dataclass
class ReplicaConfig:
    """What one replica loads and how it serves (the `dspark serve` options)."""

    bundle: str
    slots: int = 4
    max_queue: int = 64
    model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    scheduler: str = "auto"
    threshold: float = 0.5
    max_seq: int | None = None
    backend: str = "onnxruntime"
    load: dict = field(default_factory=dict)  # the rest of Engine.load's options (threads, provider, ...)

    def model(self) -> str:
        return self.model_name or Path(self.bundle).resolve().name


@dataclass
class ClusterConfig:
    """How many replicas Serve runs and what each asks of Ray."""

    replicas: int = 1
    autoscale_max: int | None = None  # autoscale between `replicas` and this many
    target_ongoing_requests: float | None = None  # per replica, for autoscaling (default: the replica's slots)
    num_cpus: float = 1.0


@serve.deployment(name="DSparkReplica")
@serve.ingress()
class DSparkReplica:
    """One engine and the HTTP application over it."""

    def __init__(self, config: dict):
        self.config = ReplicaConfig(**config)
        c = self.config
        self.engine = AsyncEngine.load(c.bundle, slots=c.slots, max_waiting=c.max_queue, scheduler=c.scheduler,
                                       threshold=c.threshold, max_seq=c.max_seq, backend=c.backend, **c.load)

    def __serve_build_asgi_app__(self):
        c = self.config
        return create_app(self.engine, c.model(), c.api_key, c.max_body_bytes)

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine thread died is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the engine is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def application(replica: ReplicaConfig, cluster: ClusterConfig):
    """The bound Serve application."""
    options: dict = {"ray_actor_options": {"num_cpus": cluster.num_cpus},
                     "max_ongoing_requests": replica.slots + replica.max_queue}
    if cluster.autoscale_max is not None and cluster.autoscale_max > cluster.replicas:
        options["autoscaling_config"] = {
            "min_replicas": cluster.replicas, "initial_replicas": cluster.replicas,
            "max_replicas": cluster.autoscale_max,
            "target_ongoing_requests": cluster.target_ongoing_requests or replica.slots}
    else:
        options["num_replicas"] = cluster.replicas
    return DSparkReplica.options(**options).bind(asdict(replica))


def build(args: dict):
    """`serve run dspark.runtime.serving.ray_app:build bundle=DIR [replicas=N] [slots=N] ...`: the
    fields of ReplicaConfig and ClusterConfig by name (strings, as `serve run` passes them) and
    `threads`, the intra-op threads of each replica's engine (default 1)."""
    args = dict(args)
    load = {"threads": int(args.pop("threads", 1))}
    kinds = {f.name: f.type for f in (*fields(ReplicaConfig), *fields(ClusterConfig)) if f.name != "load"}
    unknown = set(args) - set(kinds)
    if unknown:
        raise ValueError(f"unknown arguments {sorted(unknown)}; known: {sorted(kinds) + ['threads']}")
    if "bundle" not in args:
        raise ValueError("bundle=DIR is required")

    def value(name: str, text: str):
        kind = kinds[name]
        for t in (int, float):
            if t.__name__ in kind:
                return t(text)
        return text

    typed = {k: value(k, v) for k, v in args.items()}
    replica = ReplicaConfig(**{k: v for k, v in typed.items() if k in {f.name for f in fields(ReplicaConfig)}},
                            load=load)
    cluster = ClusterConfig(**{k: v for k, v in typed.items() if k in {f.name for f in fields(ClusterConfig)}})
    return application(replica, cluster)


def run(replica: ReplicaConfig, cluster: ClusterConfig, host: str = "127.0.0.1", port: int = 8000,
        address: str | None = None) -> None:
    """Deploy on the Ray cluster at `address` (None: start a local one) and serve until SIGINT or
    SIGTERM, then delete the application (and stop the local cluster, if this started it)."""
    import ray

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait below, not as exceptions
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(replica, cluster), name=APP_NAME, route_prefix="/")
        print(f"serving {replica.model()} on http://{host}:{port}/v1 through Ray Serve ({cluster.replicas} "
              f"replicas of {replica.slots} slots)", file=sys.stderr, flush=True)
        signal.sigwait(stop)
    finally:
        serve.delete(APP_NAME)
        ray.shutdown()
