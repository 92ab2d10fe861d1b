"""Shared test setup: the golden data beside the checkout, and small helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHOAL_SHARED", REPO.parent / "shared"))
GOLDEN = SHARED / "golden"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not GOLDEN.exists():
        pytest.fail(f"golden data not found at {GOLDEN} (set SHOAL_SHARED)")
    return GOLDEN
