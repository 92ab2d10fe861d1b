"""`shoal bench serve` (the HTTP/WebSocket load generator, against the real app over the ToneEngine
test double on a real port) and `shoal.bench.random_checkpoint` (the fast random-weight S2-layout
checkpoint writer, at demo size on the CPU, read back by the real loaders)."""

from __future__ import annotations

import argparse
import asyncio
import json
from contextlib import contextmanager

import pytest
import torch
from server_fakes import ToneEngine
from server_process import app_in_thread, free_port

from shoal.bench import random_checkpoint as rc
from shoal.bench import serve
from shoal.demo import demo_codec_config, demo_model_config
from shoal.models import load_model
from shoal.models.checkpoint import S2_INDEX_FILE, build_model, native_to_file_key
from shoal.models.codec import load_codec
from shoal.models.config import parse_config, read_config
from shoal.models.tokenizer import load_tokenizer

# ---- the checkpoint writer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("random-demo")
    config = rc.write_random_checkpoint(directory, "demo", device="cpu", seed=3, log=lambda _: None)
    assert config == demo_model_config()
    return directory


def test_demo_checkpoint_loads_with_the_writers_init(demo_dir):
    model = load_model(demo_dir, device="cpu", dtype=torch.float32)
    assert model.family == "s2"
    assert model.config == demo_model_config()
    state = model.state_dict()
    plan = rc.tensor_plan(demo_model_config())
    assert sorted(state) == sorted(name for name, _, _ in plan)
    for name, shape, init in plan:
        tensor = state[name]
        assert tuple(tensor.shape) == shape, name
        if init == "ones":
            assert torch.equal(tensor, torch.ones(shape)), name
        elif init == "zeros":
            assert torch.equal(tensor, torch.zeros(shape)), name
        elif tensor.numel() >= 4096:
            assert abs(tensor.std().item() - demo_model_config().initializer_range) < 0.003, name
            assert abs(tensor.mean().item()) < 0.003, name
    # every tensor in the files is bf16, in the official key naming, and the index matches the shards
    from safetensors import safe_open

    index = json.loads((demo_dir / S2_INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2
    seen = {}
    for shard in shards:
        with safe_open(str(demo_dir / shard), framework="pt") as file:
            for key in file.keys():
                assert file.get_slice(key).get_dtype() == "BF16"
                seen[key] = shard
    assert seen == index["weight_map"]
    assert set(seen) == {native_to_file_key(name, "s2") for name, _, _ in plan}
    total = sum(torch.Size(shape).numel() * 2 for _, shape, _ in plan)
    assert index["metadata"]["total_size"] == total


def test_demo_codec_loads(demo_dir):
    codec = load_codec(demo_dir / rc.CODEC_FILE)
    assert codec.sample_rate == demo_codec_config().sample_rate
    assert json.loads((demo_dir / "codec_config.json").read_text()) == demo_codec_config().to_dict()


def test_same_seed_same_weights(demo_dir, tmp_path):
    rc.write_random_checkpoint(tmp_path, "demo", device="cpu", seed=3, codec=False, log=lambda _: None)
    index = json.loads((tmp_path / S2_INDEX_FILE).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        assert (tmp_path / shard).read_bytes() == (demo_dir / shard).read_bytes()
    assert not (tmp_path / rc.CODEC_FILE).exists()


def test_s2_pro_size_matches_the_official_manifest(golden_dir, tmp_path):
    manifest = json.loads((golden_dir / "s2_pro_full_manifest.json").read_text())
    official = parse_config(manifest["config"])
    config = rc.model_config("s2-pro")
    assert config == official
    plan = {native_to_file_key(name, "s2"): list(shape) for name, shape, _ in rc.tensor_plan(config)}
    assert plan == {name: entry["shape"] for name, entry in manifest["tensors"].items()}
    # config.json and tokenizer.json as written for the full size (the weights are 9 GB: GPU only)
    written = rc.write_metadata(tmp_path, config, "s2-pro")
    for key in ("eos_token_id", "pad_token_id", "audio_pad_token_id", "semantic_start_token_id"):
        assert written[key] == manifest["config"][key], key
    assert read_config(tmp_path) == official
    tokenizer = load_tokenizer(tmp_path, "s2")
    ids = (tokenizer.semantic_begin_id, tokenizer.semantic_end_id, tokenizer.im_end_id)
    assert ids == (official.semantic_begin_id, official.semantic_end_id, official.im_end_id)


def test_split_shards_is_balanced_and_ordered():
    sizes = [800, 10, 10, 300, 300, 300, 300, 10, 300, 300, 300, 300, 10]
    groups = rc.split_shards(sizes, 4)
    assert [i for group in groups for i in group] == list(range(len(sizes)))
    assert all(groups) and len(groups) <= 4
    totals = [sum(sizes[i] for i in group) for group in groups]
    assert max(totals) <= 1.5 * sum(sizes) / len(groups)
    assert rc.split_shards([5, 5], 8) == [[0], [1]]
    assert rc.split_shards([5], 1) == [[0]]


def test_safetensors_writer_round_trips(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 3, 4),
        "d": torch.ones(1, dtype=torch.float16),
    }
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as file:
        file.write(rc.safetensors_header([(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], {}))
        for tensor in tensors.values():
            rc._write_tensor(file, tensor)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key


def test_cli_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert rc.main([str(tmp_path), "--size", "demo", "--device", "cpu", "--no-codec"]) == 1
    assert (tmp_path / "keep.txt").exists()
    assert rc.main([str(tmp_path), "--size", "demo", "--device", "cpu", "--no-codec", "--overwrite"]) == 0
    assert not (tmp_path / "keep.txt").exists()
    assert (tmp_path / "config.json").exists()
    assert "wrote the random demo checkpoint" in capsys.readouterr().out


def test_build_model_plan_has_no_output_head_when_tied():
    names = {name for name, _, _ in rc.tensor_plan(demo_model_config())}
    assert set(build_model(demo_model_config()).state_dict()) == names


# ---- the load generator ------------------------------------------------------------------------

TEXT = "one two three four five six"  # 27 characters: the ToneEngine makes 27 chunks of 0.1 s
SECONDS_PER_REQUEST = 0.1 * 5  # ... capped by max_new_tokens=5


@contextmanager
def tone_server(tmp_path, **settings):
    """The real app over the ToneEngine on a real port (uvicorn in a thread)."""
    from shoal.server.app import create_app
    from shoal.server.settings import ServerSettings
    from shoal.server.store import Store

    engine = ToneEngine(chunk_delay=0.01)
    app = create_app(engine, Store.in_directory(tmp_path), ServerSettings(auth=False, **settings))
    with app_in_thread(app) as url:
        yield url, engine


def bench_args(url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = [
        "--url",
        url,
        "--text",
        TEXT,
        "--max-new-tokens",
        "5",
        "--requests-per-level",
        "2",
        "--timeout",
        "30",
    ]
    return parser.parse_args([*base, *extra])


def test_sweep_reports_every_level_for_http_and_websocket(tmp_path, capsys):
    output = tmp_path / "result.json"
    with tone_server(tmp_path) as (url, engine):
        args = bench_args(
            url, "--concurrency", "1,3", "--ws-concurrency", "2", "--rounds", "2", "--json", str(output)
        )
        assert serve.run(args) == 0
    results = json.loads(output.read_text())
    levels = [(level["mode"], level["concurrency"], level["requests"]) for level in results["levels"]]
    assert levels == [("http", 1, 2), ("http", 3, 6), ("ws", 2, 4)]
    for level in results["levels"]:
        assert level["errors"] == 0 and level["error_examples"] == []
        assert 0 < level["ttfa_p50_ms"] <= level["ttfa_p95_ms"] < 5000
        assert level["audio_seconds_per_request"] == pytest.approx(SECONDS_PER_REQUEST, abs=1e-3)
        expected_rate = level["requests"] * SECONDS_PER_REQUEST / level["wall_seconds"]
        assert level["audio_seconds_per_second"] == pytest.approx(expected_rate, rel=0.1)
    assert results["settings"]["max_new_tokens"] == 5
    # the warm-up requests (one per mode) ran but are not counted
    assert len(engine.submitted) == 2 + 6 + 4 + 2
    printed = capsys.readouterr().out
    assert "TTFA p50" in printed and "12 requests, 0 errors" in printed


def test_reused_websocket_sessions_get_a_row_of_their_own(tmp_path):
    with tone_server(tmp_path) as (url, engine):
        args = bench_args(url, "--mode", "ws", "--concurrency", "2", "--ws-sessions", "3", "--warmup", "0")
        results = asyncio.run(serve.sweep(args))
    assert [(r.mode, r.requests, r.errors) for r in results] == [("ws", 2, 0), ("ws+", 4, 0)]
    assert all(r.audio_seconds_per_request == pytest.approx(SECONDS_PER_REQUEST, abs=1e-3) for r in results)
    assert len(engine.submitted) == 6  # two sockets, three sessions each


def test_errors_are_counted_not_raised(tmp_path):
    with tone_server(tmp_path, max_streams_per_key=1) as (url, _):
        args = bench_args(url, "--concurrency", "4", "--mode", "both", "--warmup", "0")
        results = asyncio.run(serve.sweep(args))
    assert [(r.mode, r.requests) for r in results] == [("http", 4), ("ws", 4)]
    for result in results:
        assert 0 < result.errors < result.requests  # the first stream runs; the others get 429 at once
        assert any("429" in example for example in result.error_examples), result.error_examples
        assert result.ttfa_p50_ms is not None


def test_unreachable_server_fails_every_request():
    args = bench_args(f"http://127.0.0.1:{free_port()}", "--concurrency", "1", "--warmup", "0")
    assert serve.run(args) == 1


def test_time_budget_skips_later_levels(tmp_path, capsys):
    with tone_server(tmp_path) as (url, _):
        args = bench_args(url, "--concurrency", "1,2", "--mode", "http", "--time-budget", "0.001")
        results = asyncio.run(serve.sweep(args))
    assert [r.concurrency for r in results] == [1]
    assert "skipped" in capsys.readouterr().out


class FakeSocket:
    """A live-TTS peer whose `start` takes `start_delay` s (voice prefill), then one audio event."""

    def __init__(self, start_delay: float) -> None:
        self.start_delay = start_delay
        self.replies: list[dict] = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def send(self, data: bytes) -> None:
        import ormsgpack

        event = ormsgpack.unpackb(data)
        if event["event"] == "start":
            await asyncio.sleep(self.start_delay)
        elif event["event"] == "stop":
            self.replies = [
                {"event": "audio", "audio": b"\0\0" * 4410},
                {"event": "finish", "reason": "stop"},
            ]

    async def recv(self) -> bytes:
        import ormsgpack

        return ormsgpack.packb(self.replies.pop(0))


def test_websocket_ttfa_starts_at_the_first_text_event(monkeypatch):
    import websockets.asyncio.client

    monkeypatch.setattr(websockets.asyncio.client, "connect", lambda *a, **k: FakeSocket(0.3))
    args = bench_args("http://127.0.0.1:1")
    (sample,) = asyncio.run(serve.one_websocket(args))
    assert sample.error is None and not sample.reused
    assert sample.seconds >= 0.3  # the whole session includes `start` ...
    assert sample.ttfa < 0.2  # ... time to first audio does not
    assert sample.audio_seconds == pytest.approx(0.1)


def test_helpers():
    assert serve.percentile([], 0.5) is None
    assert serve.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert serve.percentile([float(i) for i in range(1, 101)], 0.95) == 95.0
    assert "".join(serve.text_events("a b  c")) == "a b  c"
    assert serve.text_events("a b")[0] == "a "
    assert serve.websocket_url("https://x.test/base/") == "wss://x.test/base/v1/tts/live"
    assert serve.websocket_url("http://127.0.0.1:8080") == "ws://127.0.0.1:8080/v1/tts/live"
    with pytest.raises(argparse.ArgumentTypeError):
        serve.concurrency_list("1,0")
    assert serve.concurrency_list("1, 8,32") == [1, 8, 32]
