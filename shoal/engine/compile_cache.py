"""Where compiled kernels are kept between starts: Triton's and TorchInductor's caches in the
server's data directory, not in ~/.triton and /tmp, which a container loses with every restart.
A cold start compiles the engine's Triton kernels and the codec's Inductor graphs, minutes on a GPU
(docs/performance.md's ledger); an engine process restarted after a crash, or a redeployed pod on
the same volume, finds them compiled."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# Each compiler's cache variable -> its folder under the cache directory.
CACHE_FOLDERS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def compile_cache_environment(
    data_dir: str | Path, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The variables that point the compilers at `<data_dir>/compile-cache`, leaving out any the
    environment sets already (an operator's own choice wins)."""
    directory = Path(data_dir) / "compile-cache"
    return {name: str(directory / folder) for name, folder in CACHE_FOLDERS.items() if name not in environ}
