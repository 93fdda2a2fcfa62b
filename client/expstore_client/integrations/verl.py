"""verl's ``DataProto`` <-> protocol-v1 trajectory rows (Arrow).

A verl trainer samples GRPO groups from an expstore trajectory table and gets the batch
layout its PPO/GRPO code expects; it writes what it computed (advantages, returns) back
as rows:

    >>> batch = client.sample("rollouts", 256)            # a table with sampler "group"
    >>> data = to_dataproto(batch)                         # verl.DataProto
    >>> adv, ret = core_algos.compute_grpo_outcome_advantage(
    ...     data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"])
    >>> data.batch["advantages"] = adv
    >>> client.insert("rollouts_trained", from_dataproto(data))   # rows with their advantages

``to_dataproto`` splits each trajectory at its first trained token (loss_mask 1): before
it the prompt, from it on the response, tool observations included (response_mask 0
there, as in verl's multi-turn rollouts). ``batch``, (B, P) and (B, R) tensors:

==================== =========================================================
``prompts``          prompt ids, left-padded with ``pad_token_id`` (int64)
``responses``        response ids, right-padded (int64)
``input_ids``        prompts then responses, (B, P + R)
``attention_mask``   1 on real tokens (int64), ``position_ids`` its cumsum - 1
``response_mask``    loss_mask over the response (int64)
``rollout_log_probs`` behaviour logprobs over the response (float32)
``token_level_scores``, ``token_level_rewards``  the reward on the last response token,
                     when every row has one (verl's reward-manager convention)
``advantages``, ``values``  per-token columns when the rows carry them (float32)
``policy_version``   (B,) int64; ``sample_weights`` (B,) importance weights of a sample
==================== =========================================================

``non_tensor_batch``: ``uid`` (the group_id, verl's GRPO grouping key; the traj_id when
there is none), ``traj_id``, ``prompt_id``, ``task``, ``item_id``.

Copies: list columns are read from the received Arrow buffers without a copy; padding
them is one vectorised scatter. When every row has the same prompt and response lengths
(no padding), float32 columns are views of those buffers (read-only memory: clone before
writing in place, as for ``SampleBatch.to_torch``); ids and masks widen to int64 (a copy).

``from_dataproto`` is the inverse: each row's tokens are its prompt and response without
padding, loss_mask 0 over the prompt and ``response_mask`` over the response, logprobs
from ``rollout_log_probs`` (or ``old_log_probs``), the reward ``token_level_scores.sum()``,
and ``advantages``/``values`` spread over the tokens (0 on the prompt), so that the rows
validate as protocol v1. ``traj_id``, ``prompt_id``, ``task``, ``group_id``, ``group_size``
and ``policy_version`` come from the non-tensor batch and ``batch`` when present, else from
the arguments.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from verl import DataProto

from ..batch import SampleBatch

PER_TOKEN_EXTRAS = ("advantages", "values")


def to_dataproto(rows: SampleBatch | pa.Table, *, pad_token_id: int = 0) -> DataProto:
    """Trajectory rows (a sample or stream batch, or an Arrow table) as a verl DataProto."""
    table = rows.data if isinstance(rows, SampleBatch) else rows
    n = table.num_rows
    tokens = _lists(table, "tokens")
    offsets, lengths = tokens.offsets, np.diff(tokens.offsets)
    mask = _lists(table, "loss_mask").values
    rel = np.arange(len(tokens.values)) - np.repeat(offsets[:-1], lengths)
    # the prompt is everything before the first trained token
    first = np.where(mask == 1, rel, np.repeat(lengths, lengths))
    prompt_len = np.zeros(n, np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        prompt_len[nonempty] = np.minimum.reduceat(first, offsets[:-1][nonempty])
    response_len = lengths - prompt_len
    P, R = int(prompt_len.max(initial=0)), int(response_len.max(initial=0))
    in_prompt = rel < np.repeat(prompt_len, lengths)
    row = np.repeat(np.arange(n), lengths)
    layout = _Layout(n, P, R, row, rel, in_prompt, np.repeat(prompt_len, lengths), uniform=bool(
        (prompt_len == P).all() and (response_len == R).all()))

    prompts = layout.prompt(tokens.values, pad_token_id, torch.int64)
    responses = layout.response(tokens.values, pad_token_id, torch.int64)
    real = np.ones(len(tokens.values), np.int64)
    attention_mask = torch.cat([layout.prompt(real, 0, torch.int64), layout.response(real, 0, torch.int64)], dim=1)
    batch: dict[str, torch.Tensor] = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "response_mask": layout.response(mask, 0, torch.int64),
        "rollout_log_probs": layout.response(_lists(table, "logprobs").values, 0, torch.float32),
        "policy_version": torch.from_numpy(table.column("policy_version").to_numpy().astype(np.int64)),
    }
    if "reward" in table.column_names and table.column("reward").null_count == 0 and n:
        reward = torch.from_numpy(table.column("reward").to_numpy().astype(np.float32))
        scores = torch.zeros(n, R, dtype=torch.float32)
        last = torch.from_numpy(np.maximum(response_len - 1, 0))
        scores[torch.arange(n), last] = torch.where(torch.from_numpy(response_len > 0), reward, 0.0)
        batch["token_level_scores"], batch["token_level_rewards"] = scores, scores.clone()
    for name in PER_TOKEN_EXTRAS:
        if name in table.column_names and table.column(name).null_count == 0 and n:
            batch[name] = layout.response(_lists(table, name).values, 0, torch.float32)
    if isinstance(rows, SampleBatch) and rows.weights is not None:
        batch["sample_weights"] = torch.from_numpy(np.asarray(rows.weights, np.float32))

    traj_id = _strings(table, "traj_id")
    group = table.column("group_id") if "group_id" in table.column_names else pa.nulls(n, pa.string())
    non_tensor = {
        "uid": _objects(pc.coalesce(group, table.column("traj_id")).to_pylist()),
        "traj_id": traj_id, "prompt_id": _strings(table, "prompt_id"), "task": _strings(table, "task"),
    }
    if isinstance(rows, SampleBatch):
        non_tensor["item_id"] = np.asarray(rows.ids, np.int64)
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor)


def from_dataproto(data: DataProto, *, policy_version: int | None = None, task: str = "default",
                   group_size: int | None = None, finish_reason: str = "stop") -> pa.Table:
    """A verl DataProto (prompts, responses, attention_mask; response_mask optional) as
    protocol-v1 trajectory rows, with advantages and values when the batch has them.
    ``group_size``: the rollouts per prompt (default: how many rows share each uid here)."""
    b, nt = data.batch, data.non_tensor_batch
    n = len(data)
    prompts, responses = b["prompts"], b["responses"]
    P, R = prompts.shape[1], responses.shape[1]
    attention = b["attention_mask"].bool()
    prompt_real, response_real = attention[:, :P], attention[:, P:P + R]
    response_mask = b["response_mask"].bool() if "response_mask" in b.keys() else response_real
    response_mask = response_mask & response_real
    keep = torch.cat([prompt_real, response_real], dim=1).cpu().numpy()  # (B, P + R)
    lengths = keep.sum(axis=1)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    zeros_prompt = torch.zeros(n, P)

    def per_token(values: torch.Tensor | None, prompt_part: torch.Tensor, dtype) -> pa.ListArray:
        full = torch.cat([prompt_part.to(values.dtype), values], dim=1) if values is not None else prompt_part
        flat = full.detach().cpu().numpy()[keep] if not keep.all() else full.detach().cpu().numpy().reshape(-1)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype, copy=False)))

    logprobs = b["rollout_log_probs"] if "rollout_log_probs" in b.keys() else b.get("old_log_probs", None)
    logprobs = (logprobs if logprobs is not None else torch.zeros(n, R)).float() * response_mask
    columns: dict[str, Any] = {
        "traj_id": _column(nt, "traj_id", n, lambda: [uuid.uuid4().hex for _ in range(n)]),
        "prompt_id": _column(nt, "prompt_id", n, lambda: _column(nt, "uid", n, lambda: [""] * n)),
        "group_id": _column(nt, "uid", n, lambda: [None] * n),
        "task": _column(nt, "task", n, lambda: [task] * n),
        "tokens": per_token(responses, prompts, np.int32),
        "loss_mask": per_token(response_mask.to(torch.uint8), torch.zeros(n, P, dtype=torch.uint8), np.uint8),
        "logprobs": per_token(logprobs, zeros_prompt, np.float32),
        "finish_reason": [finish_reason] * n,
    }
    uids = columns["group_id"]
    if group_size is not None:
        columns["group_size"] = pa.array(np.full(n, group_size, np.int32))
    elif all(u is not None for u in uids):
        counts = {u: 0 for u in uids}
        for u in uids:
            counts[u] += 1
        columns["group_size"] = pa.array([counts[u] for u in uids], pa.int32())
    if "policy_version" in b.keys():
        columns["policy_version"] = pa.array(b["policy_version"].cpu().numpy().astype(np.int64))
    elif policy_version is not None:
        columns["policy_version"] = pa.array(np.full(n, policy_version, np.int64))
    else:
        raise ValueError("from_dataproto: the batch has no policy_version; pass policy_version=")
    if "token_level_scores" in b.keys():
        columns["reward"] = pa.array(b["token_level_scores"].sum(dim=-1).float().cpu().numpy())
    for name in PER_TOKEN_EXTRAS:
        if name in b.keys():
            columns[name] = per_token(b[name].float() * response_mask, zeros_prompt, np.float32)
    return pa.table(columns)


class _Layout:
    """Where each flat token goes in the (B, P) left-padded prompt and (B, R) right-padded
    response tensors."""

    def __init__(self, n, P, R, row, rel, in_prompt, prompt_len, uniform: bool) -> None:
        self.n, self.P, self.R, self.uniform = n, P, R, uniform
        self.prompt_at = (row[in_prompt], (P - prompt_len[in_prompt]) + rel[in_prompt])
        self.response_at = (row[~in_prompt], rel[~in_prompt] - prompt_len[~in_prompt])
        self.in_prompt = in_prompt

    def prompt(self, values: np.ndarray, pad, dtype) -> torch.Tensor:
        return self._place(values, self.in_prompt, self.prompt_at, self.P, pad, dtype, prompt=True)

    def response(self, values: np.ndarray, pad, dtype) -> torch.Tensor:
        return self._place(values, ~self.in_prompt, self.response_at, self.R, pad, dtype, prompt=False)

    def _place(self, values, select, at, width, pad, dtype, prompt: bool) -> torch.Tensor:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        if self.uniform and values.dtype == np_dtype and self.n:  # no padding: a view of the received buffer
            full = values.reshape(self.n, -1)
            return _tensor(full[:, :self.P] if prompt else full[:, self.P:])
        out = np.full((self.n, width), pad, dtype=np_dtype)
        out[at] = values[select]
        return torch.from_numpy(out)


def _tensor(a: np.ndarray) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # read-only wire memory: documented in the module docstring
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _lists(table: pa.Table, name: str):
    """A list column's (values, offsets) as numpy views (no copy for one chunk without nulls)."""
    col = table.column(name)
    arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if arr.null_count:
        raise ValueError(f"column {name!r}: {arr.null_count} null rows; to_dataproto needs every row's {name}")
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return _Lists(values[offsets[0]:offsets[-1]], (offsets - offsets[0]).astype(np.int64))


class _Lists:
    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self.values, self.offsets = values, offsets


def _strings(table: pa.Table, name: str) -> np.ndarray:
    return _objects(table.column(name).to_pylist()) if name in table.column_names else _objects([None] * table.num_rows)


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _column(non_tensor: dict, name: str, n: int, default) -> list:
    return list(non_tensor[name]) if name in non_tensor else list(default())
