"""TorchEngine: batched sampling with a KV cache kept across the turns of an episode.

A session holds one KV cache for its batch of rows. Rows grow unevenly (different
generation lengths, different observations), so each forward pass appends a left-padded
chunk per row (W positions for every row, the padding masked out in the attention mask
for good) and passes each row's true ``position_ids``. The cache therefore has holes, but
every real token sits at its true position and attends exactly to its row's real prefix,
so the logprobs equal those of one forward pass over the whole sequence (up to float
rounding; tests/rl/test_engines.py). A finished row's last sampled token waits in
``pending`` and enters the cache with the next chunk of that row (an observation, or the
next turn), so no token is ever run twice.

Concurrency: any number of sessions, from any threads; one forward pass at a time (a
lock), and ``load_weights`` takes the same lock, so weights change only between forward
passes. A session that spans a weight change keeps the KV entries computed with the old
weights (as vLLM does); the agent records per-token versions for that. A generate call
asks its ``interrupt`` after every token and, once it is true, returns at once: the rows
still generating come back "aborted" with the tokens they have (a partial rollout).
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache

from .. import weights
from ..model import process_logits
from .base import Generation, Interrupt, SamplingParams


class TorchEngine:
    def __init__(self, model: torch.nn.Module, device: str = "cpu", version: int = 0) -> None:
        self.model, self.device, self.version = model.to(device).eval(), torch.device(device), version
        self.max_positions = model.config.max_position_embeddings
        self.pad_id = model.config.pad_token_id or 0
        self._lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        session = self.session(prompts)
        try:
            return session.generate(params, range(len(prompts)))
        finally:
            session.close()

    def session(self, prompts: list[list[int]]) -> "KVSession":
        return KVSession(self, prompts)

    def load_weights(self, path_or_state_dict, version: int) -> None:
        sd = path_or_state_dict
        if isinstance(sd, (str, os.PathLike)):
            sd = weights.load_dir(str(sd))
        with self._lock:
            self.model.load_state_dict(sd)
            self.version = version

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        """Logits (B, V) after appending ids (B, W) to ``cache``; mask (B, L + W) marks the
        real tokens of the cache and chunk, positions (B, W) their positions."""
        with self._lock, torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()


class KVSession:
    """The EpisodeSession of TorchEngine (see the module docstring)."""

    def __init__(self, engine: TorchEngine, prompts: list[list[int]]) -> None:
        if not prompts or not all(prompts):
            raise ValueError("a session needs at least one non-empty prompt per row")
        self.engine, self.tokens = engine, [list(p) for p in prompts]
        self.pending = [list(p) for p in prompts]  # ids of each row not yet in the cache
        dev = engine.device
        self._mask = torch.zeros(len(prompts), 0, dtype=torch.long, device=dev)  # (B, L): 1 = real token
        self._next_pos = torch.zeros(len(prompts), dtype=torch.long, device=dev)  # (B,) real tokens cached
        self._cache = DynamicCache()

    def append(self, row: int, tokens: Sequence[int]) -> None:
        self.tokens[row].extend(tokens)
        self.pending[row].extend(tokens)

    def close(self) -> None:
        self._cache = None

    def _feed(self, ids: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Append the chunk ids (B, W) whose real entries are marked by new (B, W)."""
        positions = self._next_pos[:, None] + (new.cumsum(1) - 1).clamp(min=0)  # (B, W)
        mask = torch.cat([self._mask, new], dim=1)
        logits = self.engine.forward(ids, mask, positions, self._cache)
        self._mask, self._next_pos = mask, self._next_pos + new.sum(1)
        return logits

    def _feed_pending(self, rows: list[int]) -> torch.Tensor:
        """One forward pass over the pending ids of ``rows`` (left-padded); other rows get
        only padding."""
        dev, n = self.engine.device, len(self.tokens)
        chunks = [torch.tensor(self.pending[i] if i in rows else [], dtype=torch.long) for i in range(n)]
        ids = pad_sequence(chunks, batch_first=True, padding_value=-1, padding_side="left").to(dev)  # (B, W)
        new = (ids >= 0).long()
        for i in rows:
            self.pending[i] = []
        return self._feed(ids.clamp(min=self.engine.pad_id), new)

    def generate(self, params: SamplingParams, rows: Sequence[int],
                 interrupt: Interrupt | None = None) -> list[Generation]:
        """Sample up to max_tokens for ``rows``; ``interrupt`` is asked after each token."""
        rows = list(rows)
        dev = self.engine.device
        budget = torch.tensor([min(params.max_tokens, self.engine.max_positions - len(self.tokens[i]))
                               for i in rows], device=dev).clamp(min=0)  # (R,)
        gen = None if params.seed is None else torch.Generator(device=dev).manual_seed(params.seed)
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        steps = int(budget.max()) if rows else 0
        toks = torch.full((len(rows), steps), -1, dtype=torch.long, device=dev)  # (R, S)
        lps = torch.zeros(len(rows), steps, device=dev)
        alive = budget > 0
        stopped = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        aborted = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        row_idx = torch.tensor(rows, dtype=torch.long, device=dev)
        live_rows = [r for r, a in zip(rows, alive.tolist()) if a]
        logits = self._feed_pending(live_rows) if live_rows else None
        for s in range(steps):
            live_logits = torch.where(alive[:, None], logits[row_idx], 0.0)  # finished rows: anything finite
            logp = process_logits(live_logits, params.temperature, params.top_k, params.top_p).log_softmax(-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)  # (R,)
            toks[:, s] = torch.where(alive, tok, -1)
            lps[:, s] = torch.where(alive, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
            stopped |= alive & torch.isin(tok, stop)
            alive &= ~stopped & (budget > s + 1)
            if not alive.any():
                break
            if interrupt is not None and interrupt():
                aborted = alive
                break
            ids = torch.full((len(self.tokens), 1), self.engine.pad_id, dtype=torch.long, device=dev)
            new = torch.zeros_like(ids)
            ids[row_idx[alive], 0], new[row_idx[alive], 0] = tok[alive], 1
            logits = self._feed(ids, new)
        out = []
        for j, i in enumerate(rows):
            n = int((toks[j] >= 0).sum())
            reason = "stop" if stopped[j] else "aborted" if aborted[j] else "length"
            g = Generation(toks[j, :n].tolist(), lps[j, :n].tolist(), reason)
            self.tokens[i].extend(g.tokens)
            if g.tokens:  # its last token is not in the cache yet
                self.pending[i] = g.tokens[-1:]
            out.append(g)
        return out
