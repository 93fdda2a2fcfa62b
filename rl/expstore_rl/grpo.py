"""GRPO against an expstore table: whole groups from the group sampler (or, with
``--stream``, from a consumer group, exactly once), group-normalised advantages, the
decoupled clipped surrogate with truncated importance weights, versioned weight
publishing.

    python -m expstore_rl.grpo --target 127.0.0.1:50051 --table rollouts --group-size 8
    python -m expstore_rl.grpo ... --stream                  # every group exactly once
    torchrun --nproc-per-node 2 -m expstore_rl.grpo ...      # FSDP2 over 2 processes
    python -m expstore_rl.grpo ... --model ./my-qwen         # a Hugging Face model directory

Producers (``python -m expstore_rl.producer``) fill the table with groups of
``group_size`` answers per prompt and reload weights as versions appear.

``train`` reads top to bottom as the algorithm: the objective is written out in the
loop (the terms come from losses.py and advantages.py); lines marked "plumbing" call
trainer.py for what every algorithm needs (the store, FSDP's micro-batches, publishing,
checkpoints, the metrics log). Shapes: B rows of this rank's batch, T tokens (prompt,
answers and tool observations, right-padded), V the vocabulary; b, t for a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import distributed, trainer
from .advantages import group_advantages
from .batching import minibatches
from .losses import aggregate, entropy, importance_weights, kl, normaliser, policy_loss
from .model import process_logits, token_logprobs
from .trainer import TrainConfig


@dataclass
class GRPOConfig(TrainConfig):
    """GRPO: TrainConfig plus the group shape."""

    group_size: int = 8
    """answers per prompt (the store's group sampler returns whole groups)"""
    groups_per_step: int = 16
    """prompts per batch; a multiple of the number of ranks"""
    scale_std: bool = True
    """divide advantages by the group's reward std (off: Dr. GRPO)"""


def train(cfg: GRPOConfig, source: trainer.StoreSource | None = None) -> trainer.LoopState:
    """Run cfg.steps steps (from where a checkpoint left off). ``source`` replaces the
    store (tests); None connects to cfg.target."""
    # plumbing: processes, the policy and its optimizer, the store, start or resume
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = distributed.init()
    if cfg.groups_per_step % d.world:
        raise ValueError("groups_per_step must be a multiple of the number of ranks")
    policy, version = trainer.initial_policy(cfg)
    policy = distributed.shard(policy, d)
    optimizer = trainer.make_optimizer(policy, cfg.lr, cfg.weight_decay)
    if source is None:
        source = trainer.store_source(cfg, d, cfg.groups_per_step * cfg.group_size, cfg.group_size)
    run = trainer.Run(cfg, {"policy": (policy, optimizer)}, version, source, d)
    reference = trainer.reference_model(cfg, run.state, d)  # frozen pi_ref, the run's first version (kl_coef > 0)
    sampling = (cfg.temperature, cfg.top_k, cfg.top_p)  # the producers' distribution: logprobs are of it
    kl_in_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward  # --kl-in-reward puts it in the reward instead

    def logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:  # (b, t) -> (b, t)
        return token_logprobs(model(input_ids=tokens).logits, tokens, *sampling)

    while not run.done:
        # 1. whole groups from the store, the same batch on every rank; each keeps its own
        #    contiguous share of whole groups
        batch, metrics = run.sample()
        rollouts = batch.shard(d.rank, d.world)
        x, mask = rollouts.extras, rollouts.loss_mask  # mask (B, T): 1 on the tokens the policy generated

        # 2. recompute the pre-update ("proximal") policy's logprobs and the reference's; the
        #    truncated importance weight w = min(pi_prox / mu, is_cap) corrects for the stale
        #    behaviour policy mu whose logprobs the producer stored with the row
        x["proximal"] = trainer.per_token(lambda t: logprobs(policy, t), rollouts, cfg.token_budget, d)  # (B, T)
        if reference is not None:
            x["ref"] = trainer.per_token(lambda t: logprobs(reference, t), rollouts, cfg.token_budget, d)  # (B, T)
        x["is_weights"] = importance_weights(x["proximal"], rollouts.logprobs, cfg.is_cap)  # (B, T)
        metrics |= trainer.off_policy_metrics(rollouts, cfg, d)

        # 3. advantages: each answer's reward minus its group's mean, divided by the group's
        #    std (unless Dr. GRPO), one per sequence for all of its tokens
        rewards = rollouts.rewards  # (B,)
        if cfg.kl_coef > 0 and cfg.kl_in_reward:
            per_token_kl = kl(x["proximal"], x["ref"], cfg.kl_estimator)  # (B, T)
            rewards = rewards - cfg.kl_coef * (per_token_kl * mask).sum(-1)
        x["advantages"] = group_advantages(rewards, rollouts.group_index, cfg.scale_std)[:, None]  # (B, 1)

        # 4. update_epochs passes of num_minibatches optimizer steps, whole groups per
        #    minibatch; a minibatch runs as micro-batches of at most token_budget tokens
        #    whose gradients accumulate
        totals, grad_norms = trainer.StepTotals(), []
        for _ in range(cfg.update_epochs):
            for rows in minibatches(len(rollouts), cfg.num_minibatches, run.state.generator, rollouts.group_index):
                mini = rollouts.select(rows)
                # losses divide by the minibatch's count on every rank (tokens or sequences), not a
                # micro-batch's: the micro-batches and ranks add up to the whole minibatch's loss
                norm = float(d.all_reduce(torch.tensor([normaliser(mini.loss_mask, cfg.loss_agg)])))
                optimizer.zero_grad(set_to_none=True)
                parts = trainer.synced_micro_batches(mini, cfg.token_budget, d)  # plumbing: same count per rank
                for i, (index, weight) in enumerate(parts):
                    distributed.gradient_sync(policy, i == len(parts) - 1)  # plumbing: one reduce-scatter
                    mb = mini.select(index).to(d.device)
                    m, mx = mb.loss_mask, mb.extras  # (b, t)
                    logits = policy(input_ids=mb.tokens).logits  # (b, t, V)
                    logp = token_logprobs(logits, mb.tokens, *sampling)  # (b, t) log pi_theta

                    # the decoupled clipped surrogate -w min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
                    # with r = pi_theta / pi_prox (from a log-ratio clamped to +-20); w weighs it
                    loss, diag = policy_loss(logp, mx["proximal"], mx["advantages"], m, clip_low=cfg.clip_low,
                                             clip_high=cfg.clip_high, is_weights=mx["is_weights"],
                                             agg=cfg.loss_agg, norm=norm)
                    sums = {"losses/policy": loss.detach(), "policy/clip_frac": (diag["clipped"] * m).sum(),
                            "policy/ratio_mean": (diag["ratio"] * m).sum()}
                    # + kl_coef KL(pi_theta || pi_ref), unless the KL went into the reward
                    if kl_in_loss:
                        kl_term = aggregate(kl(logp, mx["ref"], cfg.kl_estimator), m, cfg.loss_agg, norm)
                        loss = loss + cfg.kl_coef * kl_term
                        sums["losses/kl"] = kl_term.detach()
                    # - entropy_coef H(pi_theta): entropy[:, t] is that of the step that chose token t
                    ent = F.pad(entropy(process_logits(logits[:, :-1], *sampling)), (1, 0))  # (b, t)
                    if cfg.entropy_coef > 0:
                        loss = loss - cfg.entropy_coef * aggregate(ent, m, cfg.loss_agg, norm)
                    sums["policy/entropy"] = (ent.detach() * m).sum()

                    (loss * weight * d.loss_scale).backward()  # loss_scale: FSDP averages over ranks
                    totals.add(sums, weight)
                totals.count(mini.loss_mask)
                grad_norms.append(distributed.clip_grad_norm(list(policy.parameters()), cfg.max_grad_norm))
                optimizer.step()
        metrics |= totals.means(cfg.update_epochs * cfg.num_minibatches, d)
        metrics["optim/grad_norm"] = float(np.mean(grad_norms))

        # 5. plumbing: commit the step's cut, publish version N+1, move the store's version
        #    forward, checkpoint, log
        run.finish_step(metrics)

    return run.finish("GRPO")


def main(argv: list[str] | None = None) -> None:
    train(trainer.parse(GRPOConfig, argv))
    distributed.close()


if __name__ == "__main__":
    main()
