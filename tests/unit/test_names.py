"""Names that become paths, keys and dataset URIs (``expstore.names``): matched whole, never
``.`` or ``..``, no separators, and no table named like another table's archive."""

from __future__ import annotations

import pytest

from expstore import names
from expstore.errors import InvalidArgument
from expstore.spec import TableSpec


def test_names_are_matched_whole():
    for name in ["a\n", ".", "..", "", "a/b", "-a", ".a", "a" * 129, None, "a b", "x\n.archive"]:
        with pytest.raises(InvalidArgument):
            names.check_checkpoint(name)
        with pytest.raises(InvalidArgument):
            names.check_consumer_group(name)
        with pytest.raises(InvalidArgument):
            names.check_table(name)
    for bad_table in ["x.archive", "1x", "a\n"]:
        with pytest.raises(InvalidArgument):
            TableSpec(bad_table)
    assert names.check_checkpoint("2024-01-01T00.ckpt_1") and names.check_table("_x.y-z")
    assert names.check_consumer_group("ppo-trainer") and TableSpec("x.archived").name == "x.archived"
