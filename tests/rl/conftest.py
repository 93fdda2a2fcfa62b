"""Fixtures of the RL tests: a tiny Hugging Face model directory (tests/rl/hf_model.py),
made once per session, offline."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, here or in subprocesses
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    from . import hf_model

    return hf_model.build(tmp_path_factory.mktemp("hf") / "tiny-qwen2")
