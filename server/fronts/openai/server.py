"""uvicorn inside the gRPC server's event loop: no second loop, no thread, no signal handlers.

`uvicorn.Server.serve()` would install its own SIGINT/SIGTERM handlers (and re-raise the
signals when it stops), taking shutdown away from the server's drain; so only its startup and
shutdown halves run here, plus its once-a-tick loop (it keeps the Date header fresh). Its
connections are uvicorn's h11 protocol with a cap and read deadlines (connections.py).
"""
from __future__ import annotations

import asyncio
import functools
import socket
from typing import Optional

import uvicorn
from fastapi import FastAPI

from specserve.server.fronts.openai.connections import ConnectionLimits, GuardedH11Protocol

STOP_GRACE_S = 1.0  # after the drain: time for connections still open to close


class HttpApiServer:
    def __init__(self, app: FastAPI, host: str, port: int, limits: ConnectionLimits,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 reuse_port: bool = False):
        """reuse_port: the port is shared with other front processes (SO_REUSEPORT)."""
        self.limits = limits
        self.reuse_port = reuse_port
        # The gRPC port's certificate, if it has one: both fronts are then TLS only.
        self.config = uvicorn.Config(app, host=host, port=port, lifespan="off",
                                     http=functools.partial(GuardedH11Protocol, limits=limits),
                                     ws="none",  # no WebSocket routes: an upgrade is plain HTTP
                                     log_config=None, access_log=False,
                                     ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                     timeout_graceful_shutdown=STOP_GRACE_S)
        self._socket: Optional[socket.socket] = None
        self._server: Optional[uvicorn.Server] = None
        self._ticker: Optional[asyncio.Task] = None

    def bind(self) -> int:
        """Bind and listen (OSError saying why if the port cannot be used); the bound port."""
        host, port = self.config.host, self.config.port
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            sock.listen(self.config.backlog)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._socket = sock
        return sock.getsockname()[1]

    async def start(self) -> None:
        """Serve on the bound socket."""
        self.config.load()
        server = uvicorn.Server(self.config)
        server.lifespan = self.config.lifespan_class(self.config)  # what serve() would set
        await server.startup(sockets=[self._socket])
        self._server = server
        self._ticker = asyncio.get_running_loop().create_task(server.main_loop())

    async def stop(self) -> None:
        if self._server is None:
            if self._socket is not None:
                self._socket.close()
            return
        self._server.should_exit = True
        await self._ticker
        await self._server.shutdown(sockets=[self._socket])
