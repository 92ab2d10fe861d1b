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
    assert parser.parse_args(["--checkpoint", "x"]).weight_format == "auto"
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


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory):
    """A bf16 S2 checkpoint whose greedy decoding has margins of several nats (the gate's model)."""
    from shoal.bench.gate_correctness import planted_margin_model
    from shoal.models.writer import write_checkpoint

    model = planted_margin_model()
    directory = tmp_path_factory.mktemp("planted") / "s2"
    write_checkpoint(directory, model.config, {k: v for k, v in model.state_dict().items()})
    return directory


def test_auto_serves_fp8_where_it_decodes_what_bf16_decodes(planted_dir):
    """ "auto" on a bf16 checkpoint checks FP8 on the loaded weights and keeps it when it passes."""
    from shoal.engine.load import load_engine_model
    from shoal.quant.fp8_linear import fp8_layers

    model, weight_format = load_engine_model(planted_dir, "cpu", "float32", "auto", validate_fp8=True)
    assert weight_format == "fp8" and fp8_layers(model)


def test_auto_falls_back_to_bf16_with_the_reason_logged(planted_dir, monkeypatch, caplog):
    """A check that fails (here: no logit error tolerated) serves the bf16 weights, reloaded."""
    import logging

    from shoal.engine import fp8_validation
    from shoal.engine.load import load_engine_model
    from shoal.quant.fp8_linear import fp8_layers

    monkeypatch.setattr(fp8_validation, "MAX_LOGIT_ERROR", 0.0)
    with caplog.at_level(logging.WARNING, logger="shoal.engine.load"):
        model, weight_format = load_engine_model(planted_dir, "cpu", "float32", None, validate_fp8=True)
    assert weight_format == "bf16" and not fp8_layers(model)
    assert "FP8 did not validate" in caplog.text and "logit relative error" in caplog.text


def test_auto_keeps_bf16_off_hopper_and_explicit_formats_win(planted_dir):
    """Without a Hopper GPU nothing is checked: bf16. An explicit format is never second-guessed."""
    from shoal.engine.load import fp8_validates_here, load_engine_model
    from shoal.quant.fp8_linear import fp8_layers

    assert not fp8_validates_here("cpu", "float32")
    model, weight_format = load_engine_model(planted_dir, "cpu", "float32", "auto")
    assert weight_format == "bf16" and not fp8_layers(model)
    model, weight_format = load_engine_model(planted_dir, "cpu", "float32", "fp8")
    assert weight_format == "fp8" and fp8_layers(model)


def test_realtime_admission_options_reach_the_engine_in_and_out_of_process(monkeypatch):
    """`--realtime-admission on --max-queue-wait 0.5 --realtime-min-speed 2` set the engine's
    policy, in this process and through the engine process's spec (JSON and back)."""
    from shoal.config import RealtimePolicy
    from shoal.engine.process import EngineSpec

    for name in ("REALTIME_ADMISSION", "MAX_QUEUE_WAIT", "REALTIME_MIN_SPEED"):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    defaults = cli.engine_config(parser.parse_args(["--checkpoint", "x"]))
    assert defaults.realtime == RealtimePolicy()  # auto: decided by the device
    argv = ["--checkpoint", "x", "--realtime-admission", "on", "--max-queue-wait", "0.5"]
    args = parser.parse_args([*argv, "--realtime-min-speed", "2"])
    expected = RealtimePolicy(enabled=True, min_speed=2.0, max_queue_wait_seconds=0.5)
    assert cli.engine_config(args).realtime == expected
    spec = EngineSpec.from_json(cli.engine_spec(args).to_json())
    assert spec.engine_config().realtime == expected
    off = cli.engine_config(parser.parse_args(["--checkpoint", "x", "--realtime-admission", "off"]))
    assert off.resolved_realtime().enabled is False
