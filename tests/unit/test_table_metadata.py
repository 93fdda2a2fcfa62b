"""Table metadata: string notes (e.g. the console's tokenizer) kept with the table's config."""

from __future__ import annotations

import pytest

from expstore.errors import InvalidArgument
from expstore.spec import TableSpec
from expstore.catalog import Catalog
from expstore_server.convert import spec_from_proto, spec_to_proto

TOKENIZER = {"tokenizer": "expstore_rl.tokenizer:CharTokenizer"}


def test_metadata_survives_the_toml_dict_and_the_proto():
    spec = TableSpec.from_dict({"name": "t", "metadata": TOKENIZER})
    assert spec.metadata == TOKENIZER
    assert TableSpec.from_dict(spec.to_dict()) == spec
    assert spec_from_proto(spec_to_proto(spec)) == spec
    assert spec_from_proto(spec_to_proto(TableSpec(name="t"))).metadata is None


def test_empty_metadata_is_no_metadata():
    assert TableSpec(name="t", metadata={}) == TableSpec(name="t")


@pytest.mark.parametrize("metadata, words", [
    ({"": "x"}, "metadata key ''"),
    ({"k" * 129: "x"}, "1 to 128 characters"),
    ({"k": "x" * 4097}, "at most 4096 characters"),
    ({"k": 3}, "metadata['k'] must be a string"),
    ({f"k{i}": "" for i in range(65)}, "65 entries; at most 64"),
    (["tokenizer"], "metadata must map names to strings"),
])
def test_bad_metadata_is_refused_by_name(metadata, words):
    with pytest.raises(InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")):
        TableSpec(name="t", metadata=metadata)


def test_metadata_is_restored_after_a_restart(tmp_path):
    store = Catalog(tmp_path / "d")
    store.create_table(TableSpec(name="t", metadata=TOKENIZER))
    store.close()
    store = Catalog(tmp_path / "d")
    try:
        assert store.table("t").spec.metadata == TOKENIZER
    finally:
        store.close()
