"""gRPC server reflection under both names clients ask for: grpc.reflection.v1 and v1alpha.

grpcio-reflection serves v1alpha only. The v1 protocol is the same messages in another proto
package (the two reflection.proto files differ in their package line), so the one servicer
also answers the v1 method path, with the v1alpha message classes: the bytes are the same.
"""
from __future__ import annotations

from typing import Iterable

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as pb
from grpc_reflection.v1alpha import reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Reflection over `service_names` (and the reflection services themselves)."""
    servicer = reflection.aio.ReflectionServicer(
        (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=pb.ServerReflectionRequest.FromString,
            response_serializer=pb.ServerReflectionResponse.SerializeToString)}),))
