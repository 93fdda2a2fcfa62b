"""The generation interface every engine implements: token ids in, token ids and the
logprobs of the sampling distribution out, weights swappable by version.

Multi-turn episodes go through an ``EpisodeSession``: the history of each sequence stays
with the engine, observations are appended as ids, and the next ``generate`` continues
without re-running the prefix where the engine can (TorchEngine keeps its KV cache;
vLLM's prefix cache finds the prefix again). Nothing is ever re-tokenized.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Protocol, Sequence

Interrupt = Callable[[], bool]
"""Asked between generated tokens (TorchEngine) or before a call (vLLM): True stops the
generation, and the rows still generating come back ``"aborted"`` with what they have."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # > 0; greedy is top_k=1
    top_p: float = 1.0  # 1.0: off
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: nondeterministic
    stop_token_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "stop_token_ids": list(self.stop_token_ids)}


@dataclass
class Generation:
    tokens: list[int]  # generated ids; a stop token that ended generation is included
    logprobs: list[float]  # logprob of each under the processed distribution (model.token_logprobs)
    finish_reason: str  # "stop" (a stop token was produced), "length", or "aborted" (interrupted)


class EpisodeSession(Protocol):
    """The sequences of a batch of episodes. ``tokens[i]`` is the full history of row i."""

    tokens: list[list[int]]

    def generate(self, params: SamplingParams, rows: Sequence[int],
                 interrupt: Interrupt | None = None) -> list[Generation]:
        """Continue rows ``rows`` (one Generation each, in that order); appends the output
        to their histories. Once ``interrupt()`` is true, rows still generating stop
        with finish_reason "aborted" (Interrupt)."""

    def append(self, row: int, tokens: Sequence[int]) -> None:
        """Append ids (a tool observation) to row's history; not generated, no logprobs."""

    def close(self) -> None: ...


class Engine(Protocol):
    version: int  # the policy version of the loaded weights

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def session(self, prompts: list[list[int]]) -> EpisodeSession: ...

    def load_weights(self, path_or_state_dict, version: int) -> None:
        """Swap in new weights (a local HF directory or a state dict) and set ``version``."""


class ResubmitSession:
    """An EpisodeSession for engines that reuse prefixes themselves (vLLM with prefix
    caching): each generate submits the full histories to ``engine.generate``."""

    def __init__(self, engine: Engine, prompts: list[list[int]]) -> None:
        self.engine, self.tokens = engine, [list(p) for p in prompts]

    def generate(self, params: SamplingParams, rows: Sequence[int],
                 interrupt: Interrupt | None = None) -> list[Generation]:
        """One ``engine.generate`` call runs to its end: ``interrupt`` is asked before it."""
        if interrupt is not None and interrupt():
            return [Generation([], [], "aborted") for _ in rows]
        gens = self.engine.generate([self.tokens[i] for i in rows], params)
        for i, g in zip(rows, gens):
            self.tokens[i].extend(g.tokens)
        return gens

    def append(self, row: int, tokens: Sequence[int]) -> None:
        self.tokens[row].extend(tokens)

    def close(self) -> None:
        pass
