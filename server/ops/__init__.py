"""Operating the server: gRPC health status, Prometheus metrics, the engine watchdog, and the
HTTP side port (--metrics-port) that serves /metrics and /health. It never imports a front."""
