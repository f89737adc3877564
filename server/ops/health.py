"""Standard grpc.health.v1 status for the server ("") and for the generation service, and for
the engine's grammar service ("specserve.grammar": structured outputs).

The first two stay NOT_SERVING until the engine is loaded and warm, and return to NOT_SERVING
for good when the engine dies, the engine watchdog finds it frozen or stuck, or the server
drains. "specserve.grammar" is SERVING while those are and the engine reports its grammar
process up and warm: NOT_SERVING while the process restarts after a death (constrained
requests fail with UNAVAILABLE meanwhile; the others are served), and for a model without a
tokenizer.json (no structured outputs).
"""
from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from specserve.proto import generate_pb2 as pb

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_SERVICE_NAMES = ("", GENERATION_SERVICE)
GRAMMAR_SERVICE = "specserve.grammar"


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


class HealthStatus:
    def __init__(self):
        self.servicer = health_aio.HealthServicer()
        self.serving = False  # also read by the HTTP /health thread (a bool is read atomically)
        self.grammar_serving = False  # the engine's grammar service, as it last reported

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        for name in HEALTH_SERVICE_NAMES:
            await self.servicer.set(name, _status(serving))
        await self.servicer.set(GRAMMAR_SERVICE, _status(serving and self.grammar_serving))

    async def set_grammar_serving(self, serving: bool) -> None:
        self.grammar_serving = serving
        await self.servicer.set(GRAMMAR_SERVICE, _status(self.serving and serving))
