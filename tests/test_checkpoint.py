"""Checkpoint layouts round-trip through writer + loader; bad checkpoints fail clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shoal.models import CheckpointError, load_model
from shoal.models.writer import random_state_dict, tiny_config, write_checkpoint

FAMILIES = ("s2", "s1", "1.5")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> (directory, expected config, fp32 state dict) for one tiny checkpoint each."""
    out = {}
    for family in FAMILIES:
        directory = tmp_path_factory.mktemp(family.replace(".", "_"))
        config = tiny_config(family)
        state = random_state_dict(config, seed=3)
        expected = write_checkpoint(directory, config, state, dtype=torch.float32)
        out[family] = (directory, expected, state)
    return out


def copy_of(written, family, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(written[family][0], directory)
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(written, family):
    directory, expected, state = written[family]
    model = load_model(directory)
    assert model.family == family and model.config == expected
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert model.tokenizer.semantic_begin_id == expected.semantic_begin_id
    prompt = torch.zeros(expected.num_codebooks + 1, 6, dtype=torch.long)
    prompt[0] = torch.tensor([1, 2, 3, expected.semantic_begin_id + 5, 4, 5])
    prompt[1:, 3] = torch.tensor([5, 1, 2, 3])
    assert torch.isfinite(model.prefill_logits(prompt)).all()


def test_files_in_official_layouts(written):
    s2 = written["s2"][0]
    config = json.loads((s2 / "config.json").read_text())
    assert config["model_type"] == "fish_qwen3_omni" and "text_config" in config
    index = json.loads((s2 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert "audio_decoder.codebook_embeddings.weight" in index["weight_map"]
    assert "text_model.model.layers.0.attention.q_norm.weight" in index["weight_map"]
    for family in ("s1", "1.5"):
        flat = json.loads((written[family][0] / "config.json").read_text())
        assert flat["model_type"] == "dual_ar" and "text_config" not in flat
    assert (written["s1"][0] / "special_tokens.json").exists()
    assert not (written["1.5"][0] / "special_tokens.json").exists()


def test_bfloat16_files_load_in_requested_dtype(tmp_path):
    config = tiny_config("s1")
    state = random_state_dict(config, seed=1)
    write_checkpoint(tmp_path, config, state)  # bf16 on disk, as the official files
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.embeddings.weight.dtype == torch.float32
    assert torch.equal(model.embeddings.weight, state["embeddings.weight"].bfloat16().float())
    assert load_model(tmp_path, dtype=torch.bfloat16).output.weight.dtype == torch.bfloat16


def test_lightning_wrapped_and_prefixed_pth(tmp_path):
    config = tiny_config("s1")
    state = random_state_dict(config, seed=2)
    write_checkpoint(tmp_path, config, state, dtype=torch.float32, lightning_wrapped=True)
    raw = torch.load(tmp_path / "model.pth", weights_only=True)
    assert set(raw) == {"state_dict"} and next(iter(raw["state_dict"])).startswith("model.")
    assert torch.equal(load_model(tmp_path).codebook_embeddings.weight, state["codebook_embeddings.weight"])
    # Prefixed but not wrapped, plus the dead audio_projector tensors the reference drops.
    prefixed = {f"model.{k}": v for k, v in state.items()}
    prefixed["model.audio_projector.weight"] = torch.zeros(3, 3)
    torch.save(prefixed, tmp_path / "model.pth")
    assert torch.equal(load_model(tmp_path).fast_output.weight, state["fast_output.weight"])


def test_legacy_separate_qkv_is_fused(tmp_path):
    config = tiny_config("1.5")
    state = random_state_dict(config, seed=4)
    write_checkpoint(tmp_path, config, state, dtype=torch.float32)
    legacy = dict(state)
    fused = legacy.pop("layers.0.attention.wqkv.weight")
    q, k, v = fused.split([config.n_head * config.head_dim, *(2 * [config.n_local_heads * config.head_dim])])
    legacy.update({"layers.0.attention.wq.weight": q, "layers.0.attention.wk.weight": k})
    legacy["layers.0.attention.wv.weight"] = v
    torch.save(legacy, tmp_path / "model.pth")
    assert torch.equal(load_model(tmp_path).layers[0].attention.wqkv.weight, fused)


def test_missing_unexpected_and_misshaped_tensors_are_named(written, tmp_path):
    directory = copy_of(written, "s1", tmp_path)
    state = dict(written["s1"][2])
    del state["layers.1.ffn_norm.weight"]
    state["layers.9.attention.wo.weight"] = torch.zeros(2, 2)
    state["fast_output.weight"] = torch.zeros(3, 64)
    torch.save(state, directory / "model.pth")
    with pytest.raises(CheckpointError) as error:
        load_model(directory)
    message = str(error.value)
    assert "missing tensors: layers.1.ffn_norm.weight" in message
    assert "unexpected tensors: layers.9.attention.wo.weight" in message
    assert "fast_output.weight (3, 64) (expected (64, 64))" in message


def test_s2_errors_use_file_key_names(written, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = copy_of(written, "s2", tmp_path)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard_name = index["weight_map"]["audio_decoder.output.weight"]
    shard = load_file(str(directory / shard_name))
    del shard["audio_decoder.output.weight"]
    shard["text_model.model.output.weight"] = torch.zeros(1)
    save_file(shard, str(directory / shard_name))
    index["weight_map"].pop("audio_decoder.output.weight")
    index["weight_map"]["text_model.model.output.weight"] = shard_name
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = (
        r"missing tensors: audio_decoder\.output\.weight; unexpected tensors: text_model\.model\.output"
    )
    with pytest.raises(CheckpointError, match=expected):
        load_model(directory)
    # A key outside both prefixes has no place in the model at all.
    shard["lm_head.weight"] = torch.zeros(1)
    save_file(shard, str(directory / shard_name))
    index["weight_map"]["lm_head.weight"] = shard_name
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensors outside.*lm_head.weight"):
        load_model(directory)


def test_missing_shard(written, tmp_path):
    directory = copy_of(written, "s2", tmp_path)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard.*model-00002-of-00002"):
        load_model(directory)


def test_corrupt_files(written, tmp_path):
    s2 = copy_of(written, "s2", tmp_path / "a")
    (s2 / "model-00001-of-00002.safetensors").write_bytes(b"\x10\x00not a safetensors file")
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        load_model(s2)
    s1 = copy_of(written, "s1", tmp_path / "b")
    data = (s1 / "model.pth").read_bytes()
    (s1 / "model.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.pth: cannot read"):
        load_model(s1)


def test_bad_configs(written, tmp_path):
    directory = copy_of(written, "s1", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "naive"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'naive'"):
        load_model(directory)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(directory)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_model(tmp_path / "does" / "not" / "exist")


def fake_hf_cache(root, repo_id, source):
    """The layout huggingface_hub keeps: refs/main -> a commit, snapshots/<commit>/files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo_dir / "snapshots" / commit)


def test_hf_repo_id_resolves_from_cache_offline(written, tmp_path, monkeypatch):
    import huggingface_hub.constants

    fake_hf_cache(tmp_path / "hub", "fishaudio/s2-pro", written["s2"][0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = load_model("fishaudio/s2-pro")
    assert model.family == "s2"
    assert torch.equal(model.embeddings.weight, written["s2"][2]["embeddings.weight"])
    with pytest.raises(CheckpointError, match="fishaudio/not-there.*not in the Hugging Face cache"):
        load_model("fishaudio/not-there")
