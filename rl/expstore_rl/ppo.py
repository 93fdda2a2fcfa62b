"""PPO against an expstore table: rollouts read once each (FIFO, or a stream), a critic
with GAE over generated tokens, the decoupled clipped surrogate with truncated importance
weights, a clipped value loss, versioned weight publishing.

    python -m expstore_rl.ppo --target 127.0.0.1:50051 --table rollouts --batch-size 128
    torchrun --nproc-per-node 2 -m expstore_rl.ppo ...       # FSDP2 over 2 processes

The critic is the policy's transformer with a scalar head (initialised from the starting
policy, head at 0); values[:, t] = V(tokens[:t]), the state in which token t is chosen.

``train`` reads top to bottom as the algorithm: the objective is written out in the
loop (the terms come from losses.py and advantages.py); lines marked "plumbing" call
trainer.py for what every algorithm needs (the store, FSDP's micro-batches, publishing,
checkpoints, the metrics log). Shapes: B rows of this rank's batch, T tokens (prompt,
answer and tool observations, right-padded), V the vocabulary; b, t for a micro-batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import distributed, trainer
from .advantages import gae
from .batching import minibatches
from .losses import aggregate, entropy, importance_weights, kl, normaliser, policy_loss, value_loss
from .model import process_logits, token_logprobs
from .trainer import TrainConfig


@dataclass
class PPOConfig(TrainConfig):
    """PPO: TrainConfig plus the critic."""

    batch_size: int = 128
    """trajectories per step (streamed, each once)"""
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.5
    value_clip: float = 0.2
    """clip of the value update around the pre-update values (<= 0: plain MSE)"""
    critic_lr: float = 1e-3
    norm_adv: bool = True
    """whiten advantages over the batch's generated tokens"""
    stream_group: str = "ppo-trainer"
    """consumer group name (``--stream``); its offsets and cuts live on the server"""


class Critic(torch.nn.Module):
    """A transformer body with a linear value head."""

    def __init__(self, backbone: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=tokens).last_hidden_state  # (B, T, H)
        v = self.head(h).squeeze(-1)  # (B, T): v[:, t] values the prefix tokens[: t + 1]
        return torch.nn.functional.pad(v[:, :-1], (1, 0))  # values[:, t] = V(tokens[:t])


def token_rewards(rollouts, extras, cfg: PPOConfig) -> torch.Tensor:
    """(B, T): the trajectory reward on each row's last generated token, minus the KL
    penalty per generated token when the KL is in the reward."""
    mask = rollouts.loss_mask
    T = mask.shape[1]
    last = T - 1 - torch.argmax(mask.flip(-1), dim=-1)  # (B,)
    rewards = torch.zeros_like(mask).scatter_(1, last[:, None], rollouts.rewards[:, None]) * mask
    if cfg.kl_coef > 0 and cfg.kl_in_reward:
        rewards = rewards - cfg.kl_coef * kl(extras["proximal"], extras["ref"], cfg.kl_estimator) * mask
    return rewards


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, d: distributed.Dist) -> float:
    """1 - Var(returns - values) / Var(returns) over the generated tokens of every rank:
    1 when the critic predicts the returns, 0 when it does no better than their mean
    (0.0 also when the returns do not vary). Two all-reduces of float64 sums (means, then
    squared deviations from them), so that equal returns give a spread of exactly 0."""
    m, r = mask.double(), returns.double()
    err = r - values.double()
    n, sum_r, sum_err = d.all_reduce(torch.stack([m.sum(), (r * m).sum(), (err * m).sum()]))
    n = n.clamp(min=1)
    spread, residual = d.all_reduce(torch.stack([((r - sum_r / n) ** 2 * m).sum(),
                                                 ((err - sum_err / n) ** 2 * m).sum()]))
    return float(1 - residual / spread) if spread > 0 else 0.0


def train(cfg: PPOConfig, source: trainer.StoreSource | None = None) -> trainer.LoopState:
    """Run cfg.steps steps (from where a checkpoint left off). ``source`` replaces the
    store (tests); None connects to cfg.target."""
    # plumbing: processes, policy and critic with their optimizers, the store, start or resume
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = distributed.init()
    policy, version = trainer.initial_policy(cfg)
    critic = Critic(copy.deepcopy(policy.base_model), policy.config.hidden_size).train()
    policy, critic = distributed.shard(policy, d), distributed.shard(critic, d)
    optimizer = trainer.make_optimizer(policy, cfg.lr, cfg.weight_decay)
    critic_optimizer = trainer.make_optimizer(critic, cfg.critic_lr, 0.0)
    if source is None:
        source = trainer.store_source(cfg, d, cfg.batch_size)
    run = trainer.Run(cfg, {"policy": (policy, optimizer), "critic": (critic, critic_optimizer)}, version, source, d)
    reference = trainer.reference_model(cfg, run.state, d)  # frozen pi_ref, the run's first version (kl_coef > 0)
    sampling = (cfg.temperature, cfg.top_k, cfg.top_p)  # the producers' distribution: logprobs are of it
    kl_in_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward  # --kl-in-reward puts it in the reward instead

    def logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:  # (b, t) -> (b, t)
        return token_logprobs(model(input_ids=tokens).logits, tokens, *sampling)

    while not run.done:
        # 1. the next trajectories (sampled, or the stream's), the same batch on every rank;
        #    each keeps a contiguous share
        batch, metrics = run.sample()
        rollouts = batch.shard(d.rank, d.world)
        x, mask = rollouts.extras, rollouts.loss_mask  # mask (B, T): 1 on the tokens the policy generated

        # 2. recompute the pre-update ("proximal") policy's logprobs and the reference's; the
        #    truncated importance weight w = min(pi_prox / mu, is_cap) corrects for the stale
        #    behaviour policy mu whose logprobs the producer stored with the row; the critic's
        #    pre-update values
        x["proximal"] = trainer.per_token(lambda t: logprobs(policy, t), rollouts, cfg.token_budget, d)  # (B, T)
        if reference is not None:
            x["ref"] = trainer.per_token(lambda t: logprobs(reference, t), rollouts, cfg.token_budget, d)  # (B, T)
        x["is_weights"] = importance_weights(x["proximal"], rollouts.logprobs, cfg.is_cap)  # (B, T)
        metrics |= trainer.off_policy_metrics(rollouts, cfg, d)
        x["old_values"] = trainer.per_token(critic, rollouts, cfg.token_budget, d)  # (B, T) V(tokens[:t])

        # 3. advantages: GAE over the generated tokens (the reward on the last one), then
        #    whitened over the whole batch (every rank's generated tokens)
        adv, x["returns"] = gae(token_rewards(rollouts, x, cfg), x["old_values"], mask, cfg.gamma, cfg.lam)  # (B, T)
        if cfg.norm_adv:
            n, s, s2 = d.all_reduce(torch.stack([mask.sum(), (adv * mask).sum(), (adv ** 2 * mask).sum()]).double())
            mean = s / n
            std = (s2 / n - mean ** 2).clamp(min=0).sqrt()
            adv = ((adv - mean) / (std + 1e-8)).float() * mask
        x["advantages"] = adv  # (B, T)
        metrics |= trainer.token_means({"ppo/value_mean": (x["old_values"] * mask).sum(),
                                        "ppo/return_mean": (x["returns"] * mask).sum()}, mask.sum(), d)
        metrics["ppo/explained_variance"] = explained_variance(x["old_values"], x["returns"], mask, d)

        # 4. update_epochs passes of num_minibatches optimizer steps (policy and critic each),
        #    whole groups per minibatch (a row without a group is one); a minibatch runs as
        #    micro-batches of at most token_budget tokens whose gradients accumulate
        totals, grad_norms, critic_grad_norms = trainer.StepTotals(), [], []
        for _ in range(cfg.update_epochs):
            for rows in minibatches(len(rollouts), cfg.num_minibatches, run.state.generator, rollouts.group_index):
                mini = rollouts.select(rows)
                # losses divide by the minibatch's count on every rank (tokens or sequences), not a
                # micro-batch's: the micro-batches and ranks add up to the whole minibatch's loss
                norm = float(d.all_reduce(torch.tensor([normaliser(mini.loss_mask, cfg.loss_agg)])))
                optimizer.zero_grad(set_to_none=True)
                critic_optimizer.zero_grad(set_to_none=True)
                parts = trainer.synced_micro_batches(mini, cfg.token_budget, d)  # plumbing: same count per rank
                for i, (index, weight) in enumerate(parts):
                    distributed.gradient_sync(policy, i == len(parts) - 1)  # plumbing: one reduce-scatter
                    distributed.gradient_sync(critic, i == len(parts) - 1)
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
                    # + vf_coef times the value loss, clipped around the pre-update values
                    v_loss = value_loss(critic(mb.tokens), mx["old_values"], mx["returns"], m,  # critic: (b, t)
                                        clip=cfg.value_clip, agg=cfg.loss_agg, norm=norm)
                    sums["losses/value"] = v_loss.detach()
                    loss = loss + cfg.vf_coef * v_loss

                    (loss * weight * d.loss_scale).backward()  # loss_scale: FSDP averages over ranks
                    totals.add(sums, weight)
                totals.count(mini.loss_mask)
                grad_norms.append(distributed.clip_grad_norm(list(policy.parameters()), cfg.max_grad_norm))
                optimizer.step()
                critic_grad_norms.append(distributed.clip_grad_norm(list(critic.parameters()), cfg.max_grad_norm))
                critic_optimizer.step()
        metrics |= totals.means(cfg.update_epochs * cfg.num_minibatches, d)
        metrics["optim/grad_norm"] = float(np.mean(grad_norms))
        metrics["optim/critic_grad_norm"] = float(np.mean(critic_grad_norms))

        # 5. plumbing: commit the step's cut, publish version N+1, move the store's version
        #    forward, checkpoint, log
        run.finish_step(metrics)

    return run.finish("PPO")


def main(argv: list[str] | None = None) -> None:
    train(trainer.parse(PPOConfig, argv))
    distributed.close()


if __name__ == "__main__":
    main()
