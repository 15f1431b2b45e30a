"""Request timelines (TTFT, ITL, TPOT, E2E, queue) and per-step byte/bandwidth statistics."""
