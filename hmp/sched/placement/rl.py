"""REINFORCE over the layer sequence: an LSTM policy places layers one by one.

The policy (trained from scratch for each problem, like HeterPS's scheduler) is an encoder-decoder:

* a bidirectional LSTM reads the static features of all layers (``features.static_features``), so
  the choice for layer ``i`` can depend on what comes after it;
* an ``LSTMCell`` decoder steps through the layers; its input at step ``i`` is the encoding of
  layer ``i`` and the dynamic features (previous choice, fractions so far), the same observation
  the gymnasium environment gives; a linear head gives logits over the ``R`` types.

Training: each iteration samples ``batch`` episodes at once, scores them with the cost model and
``cost_model.reward`` (the environment's reward), and takes an Adam step on
``-mean(advantage * log_prob) - entropy_coef * entropy``. The advantage is the reward minus a
moving-average baseline, divided by the batch's standard deviation (reward normalisation); the
entropy bonus decays linearly to zero so the policy explores first and commits later. The best
plan ever sampled (and the final greedy decode) is kept. Everything is seeded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from hmp.sched.placement import cost_model
from hmp.sched.placement.features import PrefixState, dynamic_dim, static_dim, static_features
from hmp.sched.placement.problem import PlacementProblem, Plan


class PolicyNet(nn.Module):
    """Encoder-decoder LSTM policy over a sequence of ``L`` layers with ``R`` resource types."""

    def __init__(self, n_resources: int, hidden: int = 64, stay_bias: float = 0.0) -> None:
        super().__init__()
        self.n_resources, self.hidden = n_resources, hidden
        # A learnable preference for keeping the previous layer's type: every stage needs its own
        # workers, so good plans have few stages; starting from i.i.d. choices wastes the early
        # samples on fragmented, infeasible plans.
        self.stay_bias = nn.Parameter(torch.tensor(float(stay_bias)))
        self.encoder = nn.LSTM(static_dim(n_resources), hidden, batch_first=True, bidirectional=True)
        self.decoder = nn.LSTMCell(2 * hidden + dynamic_dim(n_resources), hidden)
        self.head = nn.Linear(hidden, n_resources)

    def rollout(
        self,
        problem: PlacementProblem,
        static: torch.Tensor,
        batch: int,
        generator: torch.Generator | None = None,
        forced: torch.Tensor | None = None,
        greedy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``batch`` episodes.

        Args:
            static: ``[L, 3R + 3]`` float32 layer features.
            generator: drives sampling.
            forced: ``[k, L]`` int64, k <= batch: the first k episodes take these actions (to
                score known plans under the current policy); the rest sample.
            greedy: take the most likely type at each step instead of sampling.

        Returns:
            actions ``[batch, L]`` int64, summed log-probabilities ``[batch]``, summed entropies ``[batch]``.
        """
        R, L = self.n_resources, static.shape[0]
        k = 0 if forced is None else forced.shape[0]
        if k > batch:
            raise ValueError(f"{k} forced episodes do not fit in a batch of {batch}")
        enc = self.encoder(static[None])[0][0]  # [L, 2H]
        h = static.new_zeros(batch, self.hidden)
        c = static.new_zeros(batch, self.hidden)
        state = PrefixState(problem, batch)
        taken, logp, ent = [], static.new_zeros(batch), static.new_zeros(batch)
        for i in range(L):
            dyn = torch.from_numpy(state.features())
            x = torch.cat([enc[i].expand(batch, -1), dyn], dim=1)
            h, c = self.decoder(x, (h, c))
            logits = self.head(h) + self.stay_bias * dyn[:, :R]
            log_probs = torch.log_softmax(logits, dim=1)
            if greedy:
                a = log_probs.argmax(dim=1)
            elif k == batch:
                a = forced[:, i]
            else:
                a = torch.multinomial(log_probs.detach().exp(), 1, generator=generator)[:, 0]
                if k:
                    a = torch.cat([forced[:, i], a[k:]])
            logp = logp + log_probs.gather(1, a[:, None])[:, 0]
            ent = ent - (log_probs.exp() * log_probs).sum(dim=1)
            taken.append(a)
            state.push(a.numpy())
        return torch.stack(taken, dim=1), logp, ent


@dataclass
class RLPlanner:
    """REINFORCE with an LSTM policy; see the module docstring.

    Cost-model evaluations: ``iterations * batch`` at most (fewer when the best plan stops
    improving for ``patience`` iterations after the entropy bonus has decayed).
    """

    seed: int = 0
    iterations: int = 300
    batch: int = 64
    hidden: int = 64
    lr: float = 3e-3
    entropy_coef: float = 0.02
    entropy_decay_frac: float = 0.7
    baseline_decay: float = 0.9
    patience: int = 60
    stay_bias: float = 2.0
    elite: int = 4
    target_entropy: tuple[float, float] | None = None
    alpha_lr: float = 0.05
    penalty_margin: float = 1.0
    name: str = "rl"

    def train(self, problem: PlacementProblem) -> tuple[Plan, PolicyNet, list[float]]:
        """Train on ``problem``; return the best plan seen, the policy and the mean reward per iteration."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = PolicyNet(problem.n_resources, self.hidden, self.stay_bias)
        gen = torch.Generator().manual_seed(self.seed)
        opt = torch.optim.Adam(net.parameters(), lr=self.lr)
        log_alpha = torch.tensor(float(np.log(self.entropy_coef)), requires_grad=True)
        alpha_opt = torch.optim.Adam([log_alpha], lr=self.alpha_lr)
        max_ent = float(np.log(problem.n_resources))
        static = torch.from_numpy(static_features(problem))
        baseline: float | None = None
        scale: float | None = None
        penalty: float | None = None
        best: Plan | None = None
        best_it = 0
        elite: dict[tuple[int, ...], float] = {}  # best distinct plans seen -> reward
        history: list[float] = []
        decay_its = max(1, int(self.iterations * self.entropy_decay_frac))
        for it in range(self.iterations):
            forced = torch.tensor(list(elite), dtype=torch.int64) if elite else None
            actions, logp, ent = net.rollout(problem, static, self.batch, generator=gen, forced=forced)
            a_np = actions.numpy()
            k = 0 if forced is None else forced.shape[0]
            sc = cost_model.score(problem, a_np)
            if sc.feasible.any():
                # Adaptive penalty: just below the worst feasible plan seen, so that the cliff at
                # the feasibility boundary does not swamp the cost differences among feasible plans.
                worst = float(cost_model.reward(problem, sc)[sc.feasible].min())
                penalty = max(penalty if penalty is not None else 0.0, -worst + self.penalty_margin)
            r = cost_model.reward(problem, sc, penalty if penalty is not None else cost_model.INFEASIBLE_PENALTY)
            cand = cost_model.evaluate(problem, a_np[cost_model.best_index(sc)])
            if cost_model.is_better(cand, best):
                best, best_it = cand, it
            if self.elite:
                for j in np.argsort(-r[k:], kind="stable")[: self.elite]:
                    elite[tuple(int(x) for x in a_np[k + j])] = float(r[k + j])
                elite = dict(sorted(elite.items(), key=lambda kv: -kv[1])[: self.elite])
            mean_r = float(r[k:].mean())
            history.append(mean_r)
            baseline = mean_r if baseline is None else self.baseline_decay * baseline + (1 - self.baseline_decay) * mean_r
            std = float(r[k:].std())
            scale = max(std if scale is None else self.baseline_decay * scale + (1 - self.baseline_decay) * std, 1e-3)
            adv = torch.from_numpy((r - baseline) / scale).float()
            ent_per_layer = ent.mean() / problem.n_layers
            if self.target_entropy is not None:
                frac = min(1.0, it / decay_its)
                target = max_ent * (self.target_entropy[0] + (self.target_entropy[1] - self.target_entropy[0]) * frac)
                alpha_loss = log_alpha * (float(ent_per_layer.detach()) - target)
                alpha_opt.zero_grad(set_to_none=True)
                alpha_loss.backward()
                alpha_opt.step()
                coef = float(log_alpha.exp())
            else:
                coef = self.entropy_coef * max(0.0, 1.0 - it / decay_its)
            loss = -(adv * logp).mean() - coef * ent_per_layer
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            if it >= decay_its and it - best_it >= self.patience:
                break
        with torch.no_grad():
            greedy_actions, _, _ = net.rollout(problem, static, 1, greedy=True)
        cand = cost_model.evaluate(problem, greedy_actions[0].numpy())
        if cost_model.is_better(cand, best):
            best = cand
        return best, net, history

    def plan(self, problem: PlacementProblem) -> Plan:
        best, _, _ = self.train(problem)
        return replace(best, planner=self.name)
