"""kvserve: an LLM inference engine that measures and explains where every millisecond goes."""
from kvserve.config import ConfigError
from kvserve.outputs import CompletionOutput, LatencyBreakdown, RequestOutput
from kvserve.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LatencyBreakdown",
           "ConfigError", "InvalidRequestError"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing kvserve should not load torch models
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)
