"""PPO against an expstore table: rollouts read once each (FIFO, or a stream), a critic
with GAE over generated tokens, the decoupled clipped surrogate with truncated importance
weights, a clipped value loss, versioned weight publishing.

    python -m expstore_rl.ppo --target 127.0.0.1:50051 --table rollouts --batch-size 128
    torchrun --nproc-per-node 2 -m expstore_rl.ppo ...       # FSDP2 over 2 processes

The critic is the policy's transformer with a scalar head (initialised from the starting
policy, head at 0); values[:, t] = V(tokens[:t]), the state in which token t is chosen.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from . import distributed, trainer
from .advantages import gae
from .losses import kl, value_loss
from .metrics import MetricsLog, plot
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
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = distributed.init()
    policy, version = trainer.initial_policy(cfg)
    critic = Critic(copy.deepcopy(policy.base_model), policy.config.hidden_size).train()
    policy, critic = distributed.shard(policy, d), distributed.shard(critic, d)
    optimizer = trainer.make_optimizer(policy, cfg.lr, cfg.weight_decay)
    critic_optimizer = trainer.make_optimizer(critic, cfg.critic_lr, 0.0)
    pairs = {"policy": (policy, optimizer), "critic": (critic, critic_optimizer)}
    if source is None:
        source = trainer.StoreSource(cfg, d, cfg.batch_size)
        if d.main:
            trainer.create_table(source.client, cfg, cfg.batch_size, None)
    state = trainer.start(cfg, pairs, policy, version, source, d)
    reference = trainer.reference_model(cfg, state, d)
    log = MetricsLog(cfg.out, d.main)
    t_start = time.perf_counter()

    while state.step < cfg.steps:
        t0 = time.perf_counter()
        # 1. the next trajectories of the stream (rank 0), the same batch on every rank
        sampled = source.next(state.step + 1)
        metrics = trainer.rollout_metrics(sampled.rollouts, state.version, sampled.seconds)
        rollouts = sampled.rollouts.shard(d.rank, d.world)
        x, mask = rollouts.extras, rollouts.loss_mask

        # 2. proximal and reference logprobs, truncated IS weights, pre-update values
        metrics |= trainer.off_policy_extras(rollouts, policy, reference, cfg, d)
        x["old_values"] = trainer.score(critic, rollouts, cfg, d, lambda m, tokens: m(tokens))

        # 3. GAE over generated tokens, then whitening over the whole batch
        adv, x["returns"] = gae(token_rewards(rollouts, x, cfg), x["old_values"], mask, cfg.gamma, cfg.lam)
        if cfg.norm_adv:
            n, s, s2 = d.all_reduce(torch.stack([mask.sum(), (adv * mask).sum(), (adv ** 2 * mask).sum()]).double())
            mean = s / n
            std = (s2 / n - mean ** 2).clamp(min=0).sqrt()
            adv = ((adv - mean) / (std + 1e-8)).float() * mask
        x["advantages"] = adv
        metrics |= trainer.token_means({"ppo/value_mean": (x["old_values"] * mask).sum(),
                                        "ppo/return_mean": (x["returns"] * mask).sum()}, mask.sum(), d)
        metrics["ppo/explained_variance"] = explained_variance(x["old_values"], x["returns"], mask, d)

        # 4. clipped surrogate + clipped value loss, micro-batched, clipped grads per model
        def objective(mb, norm):
            loss, sums = trainer.policy_terms(policy, mb, cfg, norm)
            v_loss = value_loss(critic(mb.tokens), mb.extras["old_values"], mb.extras["returns"], mb.loss_mask,
                                clip=cfg.value_clip, agg=cfg.loss_agg, norm=norm)
            sums["losses/value"] = v_loss.detach()
            return loss + cfg.vf_coef * v_loss, sums

        metrics |= trainer.optimise(rollouts, objective, [policy, critic], [optimizer, critic_optimizer],
                                    cfg, d, state.generator)
        metrics["optim/critic_grad_norm"] = metrics.pop("optim/grad_norm_1")

        # 5. commit the step's cut, publish the new version, move the store's version
        #    forward, checkpoint, log
        trainer.finish_step(cfg, policy, pairs, state, source, sampled, metrics, t0, t_start, log, d)

    if d.main and log.path.exists():
        plot(log.path, log.path.with_suffix(".png"), "PPO")
    return state


def main(argv: list[str] | None = None) -> None:
    train(trainer.parse(PPOConfig, argv))
    distributed.close()


if __name__ == "__main__":
    main()
