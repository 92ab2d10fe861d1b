"""`load_engine` and `shoal serve`'s engine options: what a deployment points the engine at."""

from __future__ import annotations

import argparse

import huggingface_hub.constants
import pytest
from test_checkpoint import fake_hf_cache

from shoal.demo import write_demo_checkpoint
from shoal.engine import load_engine
from shoal.server import cli


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo")


def test_hf_repo_id_finds_model_and_codec_in_the_snapshot(demo_dir, tmp_path, monkeypatch):
    """The codec lives in the resolved snapshot, not in a local folder named like the repo id."""
    fake_hf_cache(tmp_path / "hub", "fishaudio/s2-pro", demo_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no ./fishaudio/s2-pro here
    engine = load_engine("fishaudio/s2-pro", device="cpu", warmup=False)
    assert engine.model_name == "s2-pro" and engine.sample_rate == 44100


def test_a_given_config_takes_the_resolved_device_and_dtype(demo_dir):
    from shoal.config import EngineConfig

    engine = load_engine(demo_dir, device="cpu", config=EngineConfig(max_running_requests=3), warmup=False)
    assert (engine.config.device, engine.config.dtype) == ("cpu", "float32")
    assert engine.config.max_running_requests == 3


def test_serve_engine_options_reach_the_engine(demo_dir, monkeypatch):
    for name in ("WEIGHT_FORMAT", "MAX_RUNNING_REQUESTS", "OVERLAP_STEPS", "QUEUE_LIMITS"):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--checkpoint", str(demo_dir), "--device", "cpu", "--max-running-requests", "5", "--overlap-steps"]
        + ["--queue-limit", "batch=0"]
    )
    engine = cli.build_engine(args)
    config = engine.config
    assert (config.max_running_requests, config.overlap_steps, config.weight_format) == (5, True, "bf16")
    assert config.queue_limits["batch"] == 0 and config.device == "cpu"
    monkeypatch.setenv("SHOAL_WEIGHT_FORMAT", "fp8")
    fresh = argparse.ArgumentParser()
    cli.add_arguments(fresh)
    assert fresh.parse_args(["--checkpoint", "x"]).weight_format == "fp8"
    with pytest.raises(SystemExit):
        fresh.parse_args(["--checkpoint", "x", "--weight-format", "int4"])


def test_serve_kv_cache_dtype_reaches_the_cache(demo_dir, monkeypatch):
    """`--kv-cache-dtype fp8` (or SHOAL_KV_CACHE_DTYPE) gives the engine e4m3 pages with scales."""
    import torch

    monkeypatch.delenv("SHOAL_KV_CACHE_DTYPE", raising=False)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(["--checkpoint", "x"]).kv_cache_dtype == "auto"
    args = parser.parse_args(["--checkpoint", str(demo_dir), "--device", "cpu", "--kv-cache-dtype", "fp8"])
    engine = cli.build_engine(args)
    assert engine.config.kv_cache_dtype == "fp8"
    kv = engine.core.runner.kv
    assert kv.k.dtype == torch.float8_e4m3fn and kv.k_scales is not None
    monkeypatch.setenv("SHOAL_KV_CACHE_DTYPE", "fp8")
    fresh = argparse.ArgumentParser()
    cli.add_arguments(fresh)
    assert fresh.parse_args(["--checkpoint", "x"]).kv_cache_dtype == "fp8"
