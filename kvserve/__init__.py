"""kvserve: an LLM inference engine that measures and explains where every millisecond goes."""
import os as _os

# Idle OpenMP threads (PyTorch's intra-op pool and kvserve's C kernels share libgomp's) spin a short
# while and then sleep, unless the user chose a wait policy. libgomp's default spin (300,000 rounds)
# is fastest on an idle machine but collapses when another process holds a core: a decode step then
# waits for a descheduled spinning thread (SmolLM2 int4, 2 cores, one busy: 172 ms per token vs 26 ms
# with 2,000 rounds; idle: ~9.5 ms vs ~10 ms; OMP_WAIT_POLICY=PASSIVE: 14 ms busy, 19 ms idle). Takes
# effect only if this runs before torch is first imported. KVSERVE_OMP_DEFAULTS=1 leaves libgomp's own
# defaults (the llama.cpp peer of `bench latency` runs with them).
GOMP_SPINCOUNT_DEFAULT = "2000"
SET_GOMP_SPINCOUNT = not ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVSERVE_OMP_DEFAULTS"} & set(_os.environ))
if SET_GOMP_SPINCOUNT:
    _os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT

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
