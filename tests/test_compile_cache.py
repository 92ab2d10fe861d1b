"""`engine/compile_cache.py`: the compilers' caches go to the data directory unless the operator
chose a place."""

from __future__ import annotations

from pathlib import Path

from shoal.engine.compile_cache import compile_cache_environment


def test_caches_in_the_data_directory_unless_already_set():
    assert compile_cache_environment(Path("/srv/shoal"), environ={}) == {
        "TRITON_CACHE_DIR": "/srv/shoal/compile-cache/triton",
        "TORCHINDUCTOR_CACHE_DIR": "/srv/shoal/compile-cache/inductor",
    }
    chosen = {"TRITON_CACHE_DIR": "/fast-disk/triton"}
    assert compile_cache_environment("/srv/shoal", environ=chosen) == {
        "TORCHINDUCTOR_CACHE_DIR": "/srv/shoal/compile-cache/inductor"
    }
