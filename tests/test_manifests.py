"""Built from the official full-size configs, the module tree has exactly the official tensor
names and shapes (checked on the meta device, in each file's own key naming)."""

from __future__ import annotations

import json

import pytest

from shoal.models.checkpoint import build_model, native_to_file_key
from shoal.models.config import parse_config

MANIFESTS = {
    "s2_pro_full_manifest.json": ("s2", 4.56e9),
    "s1_mini_full_manifest.json": ("s1", 0.86e9),
    "fish_speech_1_5_full_manifest.json": ("1.5", 0.64e9),
}


@pytest.mark.parametrize("manifest_name", sorted(MANIFESTS))
def test_module_tree_matches_official_manifest(golden_dir, manifest_name):
    family, approximate_params = MANIFESTS[manifest_name]
    manifest = json.loads((golden_dir / manifest_name).read_text())
    config = parse_config(manifest["config"])
    assert config.family == family
    model = build_model(config)
    built = {native_to_file_key(name, family): list(t.shape) for name, t in model.state_dict().items()}
    official = {name: entry["shape"] for name, entry in manifest["tensors"].items()}
    assert sorted(set(official) - set(built)) == []
    assert sorted(set(built) - set(official)) == []
    mismatched = {name: (built[name], shape) for name, shape in official.items() if built[name] != shape}
    assert mismatched == {}
    params = sum(t.numel() for t in model.state_dict().values())
    assert abs(params - approximate_params) / approximate_params < 0.02


def test_full_size_configs_follow_reference_defaults(golden_dir):
    s2 = parse_config(json.loads((golden_dir / "s2_pro_full_manifest.json").read_text())["config"])
    assert (s2.semantic_begin_id, s2.semantic_end_id, s2.im_end_id) == (151678, 155773, 151645)
    assert s2.scale_codebook_embeddings and s2.norm_fastlayer_input and s2.tie_word_embeddings
    assert (s2.codebook_size, s2.num_codebooks, s2.fast_head_dim) == (4096, 10, 128)
    s1 = parse_config(json.loads((golden_dir / "s1_mini_full_manifest.json").read_text())["config"])
    assert s1.scale_codebook_embeddings and not s1.norm_fastlayer_input and not s1.tie_word_embeddings
    assert (s1.head_dim, s1.fast_head_dim, s1.fast_attention_qk_norm) == (128, 64, False)
    v15 = parse_config(json.loads((golden_dir / "fish_speech_1_5_full_manifest.json").read_text())["config"])
    assert not v15.scale_codebook_embeddings and not v15.attention_qk_norm
    assert (v15.head_dim, v15.n_local_heads, v15.codebook_size) == (64, 2, 1024)
