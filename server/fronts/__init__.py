"""The server's fronts: how clients reach the shared generation core (server/generation.py).
grpc/ is the gRPC API, openai/ the OpenAI-compatible HTTP API. A front may import the text
pipeline (server/text/), ops (server/ops/) and the core; nothing below imports a front."""
