"""Standard grpc.health.v1 status for the server ("") and for the generation service.

Both names stay NOT_SERVING until the engine is loaded and warm, and return to NOT_SERVING
for good when the engine dies, the engine watchdog finds it frozen or stuck, or the server
drains.
"""
from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from specserve.proto import generate_pb2 as pb

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_SERVICE_NAMES = ("", GENERATION_SERVICE)


class HealthStatus:
    def __init__(self):
        self.servicer = health_aio.HealthServicer()
        self.serving = False  # also read by the HTTP /health thread (a bool is read atomically)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in HEALTH_SERVICE_NAMES:
            await self.servicer.set(name, status)
