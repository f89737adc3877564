"""The OpenAI-compatible HTTP front (`--http-port`). It imports FastAPI and uvicorn, so only the
server's `--http-port` path imports this package: `specserve serve` runs without them."""
