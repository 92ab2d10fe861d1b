"""`scripts/probe_kv_layout.py`: its read kernel sums exactly the table's pages in both pool
layouts (the interpreter on the CPU; the timing itself needs a GPU), so the two layouts' times
compare the same bytes read."""

from __future__ import annotations

import pytest
import torch
from script_testing import load_script


def test_both_layouts_read_the_pages_of_the_table() -> None:
    script = load_script("probe_kv_layout")
    script.check()


def test_a_wrong_page_changes_the_sums() -> None:
    """The check can fail: a table pointing at one other page gives other sums."""
    script = load_script("probe_kv_layout")
    k, v, tables = script.make_case(2, 4 * script.PAGE, "cpu")
    expected = script.reference_sums(k, v, tables, 2)
    wrong = tables.clone()
    wrong[0, 0] = tables[1, 0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(script.read_pages(k, v, wrong, False, 2), expected, rtol=1e-4, atol=1e-2)


def test_splits_must_divide_the_row() -> None:
    script = load_script("probe_kv_layout")
    k, v, tables = script.make_case(1, 3 * script.PAGE, "cpu")
    with pytest.raises(ValueError, match="do not split"):
        script.read_pages(k, v, tables, False, 2)
