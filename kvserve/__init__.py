"""kvserve: an LLM inference engine that measures and explains where every millisecond goes."""
import os as _os

# Idle OpenMP threads (PyTorch's intra-op pool and kvserve's C kernels share libgomp's) spin a short
# while and then sleep, unless the user chose a wait policy. libgomp's default spin (300,000 rounds)
# is fastest on an idle machine but collapses when another process holds a core: a decode step then
# waits for a descheduled spinning thread (SmolLM2 int4, 2 cores, one busy: 172 ms per token vs 26 ms
# with 2,000 rounds; idle: ~9.5 ms vs ~10 ms; OMP_WAIT_POLICY=PASSIVE: 14 ms busy, 19 ms idle). Takes
# effect only if this runs before torch is first imported. KVSERVE_OMP_DEFAULTS=1 leaves libgomp's own
# defaults (the llama.cpp peer of `bench latency` runs with them).
# The wait policy is set to ACTIVE with the same 2,000 rounds: libgomp spins only 100 rounds (a few µs)
# when it manages more threads than there are CPUs, which is the case whenever a thread other than the
# main one runs the parallel regions (the server's engine thread): every barrier of a decode step then
# sleeps and wakes (SmolLM2 step 32 ms in a thread vs 11 ms in the main thread). ACTIVE raises that
# throttled spin to 1,000 rounds (engine thread: 12-13 ms) and changes nothing else here.
GOMP_SPINCOUNT_DEFAULT = "2000"
SET_GOMP_SPINCOUNT = not ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVSERVE_OMP_DEFAULTS"} & set(_os.environ))
if SET_GOMP_SPINCOUNT:
    _os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT
    _os.environ["OMP_WAIT_POLICY"] = "ACTIVE"

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
