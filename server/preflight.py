"""What `specserve serve` checks before it binds a port or starts a process: the model folders
(config.json, the safetensors files' headers), the TLS files, the `http` extra behind
--http-port. Each problem is one line naming the flag (run_server logs it and exits 1), where
it used to be a traceback from the engine process or an ImportError after the server had said
"serving on".

What only the engine can find out (a tensor the checkpoint lacks, a device that is not there,
an option the model does not support) still ends the server with one line: the engine process
reports its start-up failure (server/engine_client.py)."""
from __future__ import annotations

import importlib
import ssl
from typing import Optional

from specserve.engine.config import EngineConfig, SpecConfig
from specserve.engine.models.checkpoint_dir import check_checkpoint_dir, read_config
from specserve.engine.models.model_config import ModelConfig
from specserve.server.config import ServerConfig

HTTP_EXTRA_MODULES = ("fastapi", "uvicorn")


class StartupError(Exception):
    """The server cannot start as configured; the message names the flag and says why."""


def check_startup(engine: EngineConfig, server: ServerConfig, local_engine: bool = True) -> None:
    """StartupError for the first problem found. local_engine: the engine runs on this host, so
    its model folders must be here (data-parallel replicas may run on other nodes)."""
    problem = ((local_engine and _model_problem(engine)) or _tls_problem(server)
               or _http_extra_problem(server))
    if problem:
        raise StartupError(problem)


def _model_problem(config: EngineConfig) -> Optional[str]:
    """--model (None: the bundled demo pair, which ships with the package) and --draft-model."""
    dummy = config.load_format == "dummy"  # random weights: config.json is all that is read
    try:
        if config.model is not None:
            raw = (read_config if dummy else check_checkpoint_dir)(config.model, "--model")
            try:
                ModelConfig.from_dict(raw)
            except ValueError as e:  # "model: why"
                return f"--model: {config.model}: {str(e).removeprefix('model: ')}"
            except KeyError as e:
                return f"--model: {config.model}: config.json has no {e}"
            except TypeError as e:
                return f"--model: {config.model}: config.json: a field of the wrong type ({e})"
        spec = config.spec
        if isinstance(spec, SpecConfig) and spec.draft_model is not None:
            (read_config if dummy else check_checkpoint_dir)(spec.draft_model, "--draft-model")
    except ValueError as e:
        return str(e)
    return None


def _tls_problem(config: ServerConfig) -> Optional[str]:
    """Both files readable, and a PEM certificate chain with its (unencrypted) private key:
    gRPC's own error for a bad one is "Failed to bind to address"."""
    if config.tls_cert is None:
        return None
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            return f"{flag} {path}: {e.strerror or e}"
    try:
        # An empty password: an encrypted key fails here instead of prompting (gRPC and
        # uvicorn take no password either).
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            config.tls_cert, config.tls_key, password=lambda: b"")
    except ssl.SSLError as e:
        return (f"--tls-cert {config.tls_cert}, --tls-key {config.tls_key}: not a PEM "
                f"certificate chain and its unencrypted private key ({e.reason or e})")
    return None


def _http_extra_problem(config: ServerConfig) -> Optional[str]:
    if config.http_port is None:
        return None
    for module in HTTP_EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return (f"--http-port: the OpenAI-compatible HTTP front needs the `http` extra "
                    f"(FastAPI, uvicorn): pip install 'specserve[http]' ({e})")
    return None
