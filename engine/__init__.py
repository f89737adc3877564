"""specserve.engine: the offline engine API and its configuration.

`Engine` is imported on first use, so that `from specserve.engine import SamplingParams`
(the server, the CLI) does not load torch.
"""
from specserve.engine.config import EngineConfig, GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.outputs import GenerateOutput, StepOutput

__all__ = ["Engine", "EngineConfig", "GrammarSpec", "SamplingParams", "SpecConfig", "GenerateOutput", "StepOutput"]


def __getattr__(name):
    if name == "Engine":
        from specserve.engine.api import Engine

        return Engine
    raise AttributeError(f"module 'specserve.engine' has no attribute {name!r}")
