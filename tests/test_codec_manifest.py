"""The full-size codec built from the official config has exactly the official tensor layout."""

from __future__ import annotations

import json

import torch

from shoal.models.codec import Codec, CodecConfig, official_layout
from shoal.models.codec_stream import stream_state_shapes


def test_full_size_module_tree_matches_manifest(golden_dir):
    manifest = json.loads((golden_dir / "codec_full_manifest.json").read_text())
    config = CodecConfig.from_dict(manifest["config"])
    assert config == CodecConfig()  # the defaults are the shipped modded_dac_vq values
    with torch.device("meta"):
        codec = Codec(config)
    layout = official_layout(codec)
    expected = {name: tuple(info["shape"]) for name, info in manifest["tensors"].items()}
    assert sorted(set(layout) - set(expected)) == []
    assert sorted(set(expected) - set(layout)) == []
    assert {k: v for k, v in layout.items() if expected[k] != v} == {}
    assert 390e6 < sum(p.numel() for p in codec.parameters()) < 392e6
    assert codec.frame_length == 2048 and codec.num_codebooks == 10


def test_full_size_streaming_state_is_small():
    with torch.device("meta"):
        codec = Codec()
    shapes = stream_state_shapes(codec)
    values = sum(torch.Size(s).numel() for s in shapes.values())
    kv = 8 * 2 * 16 * 127 * 64  # post_module: 8 layers x (k, v) x 16 heads x 127 frames x 64
    assert kv < values < kv + 200_000  # the conv states add ~130k values
    assert shapes["decoder.model.1.block.4.block.1"] == (54, 768)  # k7 dilation 9: 6 * 9 inputs, time-major
