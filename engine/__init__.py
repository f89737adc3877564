"""specserve.engine: the offline engine API and its configuration."""
from specserve.engine.api import Engine
from specserve.engine.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.outputs import GenerateOutput, StepOutput

__all__ = ["Engine", "EngineConfig", "SamplingParams", "SpecConfig", "GenerateOutput", "StepOutput"]
