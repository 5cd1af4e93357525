"""The OpenAI-compatible server (`dspark serve`): app.py (routes), protocol.py (the wire format),
metrics.py (Prometheus). Needs the `serve` extra (FastAPI, uvicorn, pydantic, prometheus-client);
`import dspark.runtime` never imports it."""
