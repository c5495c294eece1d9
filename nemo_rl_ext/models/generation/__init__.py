"""Generation backends behind one interface."""

from nemo_rl_ext.models.generation.interfaces import (
    EngineLoad,
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    StreamEvent,
    StructuredOutput,
    TokenDelta,
)

__all__ = [
    "EngineLoad",
    "FinishReason",
    "GenerationConfig",
    "GenerationInterface",
    "GenerationOutput",
    "StreamEvent",
    "StructuredOutput",
    "TokenDelta",
]
