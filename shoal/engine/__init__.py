"""The batching engine; the server uses `load_engine` and the `api.Engine` it returns."""

from shoal.engine.load import load_engine

__all__ = ["load_engine"]
