"""Docs are part of the contract: every config key, flag, RPC and stats counter is documented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from expstore_proto.v1 import expstore_pb2 as pb
from expstore.spec import PacingSpec, RateLimiterSpec, SamplerSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.catalog import Catalog
from expstore.table import Table
from expstore.tiers.remote import RemoteTier
from expstore_server import config as server_config
from expstore_server.main import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def documented(page: str) -> set[str]:
    """Every `code` span of a docs page."""
    return set(re.findall(r"`([^`]+)`", (DOCS / page).read_text()))


def test_every_server_key_is_documented():
    keys = {f.name for f in dataclasses.fields(server_config.ServerConfig)} - {"tokens", "tables", "tls_cert", "tls_key", "remote"}
    keys |= {"tokens", "cert", "key", "name", "roles", "token", "token_env"}
    keys |= {f.name for f in dataclasses.fields(server_config.RemoteConfig)}
    assert keys - documented("config.md") == set()


def test_every_table_key_is_documented():
    keys = {f.name for f in dataclasses.fields(TableSpec)} - {"schema"} | {"columns"}
    keys |= {f.name for f in dataclasses.fields(SamplerSpec)} | {f.name for f in dataclasses.fields(RateLimiterSpec)}
    keys |= {f.name for f in dataclasses.fields(PacingSpec)}
    assert keys - documented("config.md") == set()


def test_every_flag_is_documented():
    flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert flags - {"--help"} - documented("config.md") == set()


def test_every_rpc_is_documented():
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ExperienceStore"].methods}
    assert methods - documented("rpc.md") == set()


def documented_name(key: str) -> str:
    """stats.md writes per-group and per-task keys with placeholders."""
    key = re.sub(r"^group\.g\.", "group.<name>.", key)
    key = re.sub(r"^staleness\.(sample|stream)\.(le_\d+|sum)$",
                 lambda m: "staleness.<op>." + ("sum" if m[2] == "sum" else "le_<N>"), key)
    return re.sub(r"^sampler\.task\.[^.]+\.(.+)$",
                  lambda m: "sampler.task.<name>." + ("items" if m[1] == "items" else "<key>"), key)


@pytest.mark.parametrize("sampler", [
    SamplerSpec(type="uniform"), SamplerSpec(type="fifo"), SamplerSpec(type="prioritized", alpha=0.5),
    SamplerSpec(type="group", group_size=2), SamplerSpec(type="prioritized", task_weights={"math": 1.0}),
])
def test_every_stats_counter_is_documented(sampler):
    table = Table(TableSpec(name="t", sampler=sampler))
    table.insert(trajectories(4, groups=2))
    table.stream("g", 2)
    names = {documented_name(k) for k in table.stats()}
    assert names - documented("stats.md") == set()


def test_every_stats_counter_of_a_table_with_retention_windows_is_documented(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    store = Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name))
    table = store.create_table(TableSpec(name="t", tiers="remote", archive=True, hot_retention_s=60.0,
                                         retention_bytes=1 << 30))
    table.insert(trajectories(4, groups=2))
    names = {documented_name(k) for k in table.stats()}
    store.close()
    assert "removed_retention" in names and names - documented("stats.md") == set()


def test_every_stats_counter_of_a_paced_table_is_documented():
    table = Table(TableSpec(name="t", max_staleness=1, pacing=PacingSpec(4)))
    table.reserve(2, timeout=0)
    names = {documented_name(k) for k in table.stats()}
    assert {"pacing_admitted", "reserve_waits"} <= names and names - documented("stats.md") == set()


def test_every_stats_counter_of_a_durable_tiered_table_is_documented(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    store = Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name))
    table = store.create_table(TableSpec(name="t", tiers="remote", archive=True))
    table.insert(trajectories(4, groups=2))
    names = {documented_name(k) for k in table.stats()}
    store.close()
    assert names - documented("stats.md") == set()


def test_generated_stubs_are_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_proto", DOCS.parent / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.stale() == [], "run `make proto`"
