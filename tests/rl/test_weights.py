import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import transformers

from expstore_rl import weights
from expstore_rl.model import ModelConfig, build_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models():
    return build_model(ModelConfig(), seed=0), build_model(ModelConfig(), seed=1)


def test_publish_local_hf_layout_loadable_by_from_pretrained(tmp_path, models):
    m, _ = models
    uri = f"file://{tmp_path}/w"
    assert weights.latest_version(uri) is None
    assert weights.publish(m.state_dict(), m.config.to_dict(), uri, 3) == f"{uri}/v3"
    vdir = tmp_path / "w" / "v3"
    assert sorted(p.name for p in vdir.iterdir()) == ["_PUBLISHED", "config.json", "model.safetensors"]
    assert json.loads((vdir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(vdir))
    x = torch.randint(0, m.config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, m(x).logits, rtol=0, atol=0)
    assert weights.latest_version(uri) == 3 and weights.local_path(uri, 3) == str(vdir)


def test_load_state_dict_restores_the_tied_head_and_loads_strictly(tmp_path, models):
    m, m2 = models
    weights.publish(m2.state_dict(), m2.config.to_dict(), str(tmp_path), 1)
    sd = weights.load_state_dict(str(tmp_path), 1)
    assert "lm_head.weight" in sd
    fresh = build_model(ModelConfig(), seed=5)
    fresh.load_state_dict(sd)  # strict
    assert torch.equal(fresh.model.embed_tokens.weight, m2.model.embed_tokens.weight)


def test_a_version_without_its_marker_is_invisible(tmp_path, models):
    m, _ = models
    weights.publish(m.state_dict(), m.config.to_dict(), str(tmp_path), 1)
    half = tmp_path / "v2"  # a publisher that died before the marker
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    assert weights.versions(str(tmp_path)) == [1]
    with pytest.raises(FileNotFoundError, match="not published"):
        weights.load_state_dict(str(tmp_path), 2)


def test_versions_are_never_rewritten(tmp_path, models):
    m, m2 = models
    weights.publish(m.state_dict(), m.config.to_dict(), str(tmp_path), 0)
    with pytest.raises(FileExistsError):
        weights.publish(m2.state_dict(), m2.config.to_dict(), str(tmp_path), 0)
    assert not [p for p in (tmp_path / "v0").iterdir() if p.name.endswith(".tmp")]


def test_remote_uri_downloads_once_to_the_local_cache(tmp_path, models, monkeypatch):
    m, m2 = models
    monkeypatch.setattr(weights, "CACHE_DIR", tmp_path / "cache")
    uri = f"memory://weights-{uuid.uuid4().hex}"
    weights.publish(m.state_dict(), m.config.to_dict(), uri, 0)
    weights.publish(m2.state_dict(), m2.config.to_dict(), uri, 1)
    assert weights.latest_version(uri) == 1
    path = weights.local_path(uri, 1)
    assert path.startswith(str(tmp_path / "cache"))
    assert torch.equal(weights.load_dir(path)["model.norm.weight"], m2.model.norm.weight)
    fsspec.filesystem("memory").rm(uri.split("://")[1] + "/v1/model.safetensors")
    assert weights.local_path(uri, 1) == path  # served from the cache


def test_a_version_carries_the_models_other_files_and_a_remote_one_downloads_them(tmp_path, models, monkeypatch):
    m, _ = models
    files = {"tokenizer.json": b'{"t": 1}', "chat_template.jinja": b"{{ messages }}"}
    monkeypatch.setattr(weights, "CACHE_DIR", tmp_path / "cache")
    for uri in (f"file://{tmp_path}/w", f"memory://weights-{uuid.uuid4().hex}"):
        weights.publish(m.state_dict(), m.config.to_dict(), uri, 0, files)
        path = weights.local_path(uri, 0)
        got = {p.name: p.read_bytes() for p in Path(path).iterdir()}
        assert set(got) == {"_PUBLISHED", "config.json", "model.safetensors", *files}
        assert {k: got[k] for k in files} == files
    for name in ("config.json", "_PUBLISHED", "model.safetensors", "../x", ".hidden"):
        with pytest.raises(ValueError, match="cannot be an extra file"):
            weights.publish(m.state_dict(), m.config.to_dict(), str(tmp_path / "bad"), 0, {name: b""})
    assert weights.versions(str(tmp_path / "bad")) == []
