"""A same-run peer (llama.cpp, HF transformers) in a fresh Python process, with the OpenMP settings its
own users get: importing kvserve shortens libgomp's spin (``kvserve/__init__.py``), which is kvserve's
tuning, not the peer's; and two OpenMP runtimes in one process (llama.cpp's and torch's) slowed both
here. The peer prints one JSON line last; that is the result."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kvserve.config import ConfigError

OMP_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def peer_env() -> dict[str, str]:
    """This process's environment without the OpenMP variables kvserve set at import (the user's own
    settings stay), and with ``KVSERVE_OMP_DEFAULTS=1`` so the peer's own import of kvserve sets none."""
    import kvserve

    env = dict(os.environ, KVSERVE_OMP_DEFAULTS="1")
    if kvserve.SET_GOMP_SPINCOUNT:
        for name in OMP_VARS:
            env.pop(name, None)
    return env


def run_peer_process(module: str, args: list[str], peer: str, timeout_s: float = 3600):
    """``python -m module args...`` in :func:`peer_env`; returns its last stdout line, parsed as JSON.
    Raises ConfigError naming ``peer`` with the end of its stderr when it fails."""
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout_s, env=peer_env())
    if proc.returncode != 0:
        raise ConfigError(f"{peer} peer failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the OpenMP settings a peer process sees (tests)
    print(json.dumps({name: os.environ.get(name) for name in OMP_VARS}))
