"""REINFORCE over the layer sequence: an LSTM policy places layers one by one.

The policy, trained from scratch for each problem like HeterPS's scheduler, is a bidirectional
LSTM encoder over the layers' features and an ``LSTMCell`` decoder that picks each layer's
resource type; it is trained with REINFORCE on the cost model's reward, with elite replay, a
greedy warm start and a local-search polish, all within the sampling baselines' ``budget`` of
cost-model evaluations. The policy and its training are in docs/placement.md, "Planners".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from hmp.ema import ema
from hmp.placement import cost_model, local_search
from hmp.placement.baselines import DEFAULT_BUDGET, GreedyPlanner
from hmp.placement.features import PrefixState, dynamic_dim, static_dim, static_features
from hmp.placement.problem import PlacementProblem, Plan
from hmp.placement.profiler import torch_threads


class PolicyNet(nn.Module):
    """Encoder-decoder LSTM policy over a sequence of ``L`` layers with ``R`` resource types."""

    def __init__(self, n_resources: int, hidden: int = 32, stay_bias: float = 0.0) -> None:
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
            static: ``[L, 4R + 3]`` float32 layer features.
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


@dataclass(frozen=True)
class TrainResult:
    """What :meth:`RLPlanner.train` found.

    Attributes:
        plan: the best plan (after the local-search polish when enabled).
        sampled: the best plan the policy sampled or decoded (before the polish).
        policy: the trained policy.
        history: mean episode reward per iteration.
        evaluations: cost-model evaluations spent, warm start and polish included.
    """

    plan: Plan
    sampled: Plan
    policy: PolicyNet
    history: list[float]
    evaluations: int


@dataclass
class RLPlanner:
    """REINFORCE with an LSTM policy; see the module docstring.

    Cost-model evaluations: at most ``budget`` in all (the sampling planners' default budget):
    ``batch`` per iteration, plus the warm start and the polish; training stops early when the
    best plan has not improved for ``patience`` iterations after the entropy bonus has decayed.
    """

    seed: int = 0
    budget: int = DEFAULT_BUDGET
    iterations: int = 150
    batch: int = 64
    hidden: int = 32
    lr: float = 5e-3
    entropy_coef: float = 0.02
    entropy_decay_frac: float = 0.7
    baseline_decay: float = 0.9
    patience: int = 40
    stay_bias: float = 2.0
    elite: int = 4
    penalty_margin: float = 1.0
    warm_start: bool = True
    polish_budget: int = 4000
    threads: int | None = None  # None: the process's own setting (daemons set it once, at start)
    name: str = "rl"

    def plan(self, problem: PlacementProblem) -> Plan:
        return replace(self.train(problem).plan, planner=self.name)

    def train(self, problem: PlacementProblem) -> TrainResult:
        """Train on ``problem``; return the best plan, the policy and the training record."""
        # One intra-op thread: the tensors are tiny, and on a shared machine a second thread turns
        # every op into a wait for a busy core (docs/placement.md, "Planners").
        with torch_threads(self.threads):
            return self._train(problem)

    def _warm_start(self, problem: PlacementProblem) -> tuple[dict[tuple[int, ...], float], int]:
        """Elite plans to start from: the homogeneous plans and the greedy plan.

        They join every batch as forced episodes (see :meth:`PolicyNet.rollout`), so the policy
        is pulled towards them from the first iteration and its samples explore around them.
        """
        plans = [p.assignment for p in cost_model.homogeneous_plans(problem)]
        plans.append(GreedyPlanner().plan(problem).assignment)
        uniq = list(dict.fromkeys(plans))
        r = cost_model.reward(problem, cost_model.score(problem, np.array(uniq)))
        order = np.argsort(-r, kind="stable")[: self.elite]
        spent = problem.n_resources * (problem.n_layers + 1)
        return {uniq[j]: float(r[j]) for j in order}, spent

    def _train(self, problem: PlacementProblem) -> TrainResult:
        if self.batch <= self.elite:
            raise ValueError(f"batch ({self.batch}) must exceed elite ({self.elite})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = PolicyNet(problem.n_resources, self.hidden, self.stay_bias)
        gen = torch.Generator().manual_seed(self.seed)
        opt = torch.optim.Adam(net.parameters(), lr=self.lr)
        static = torch.from_numpy(static_features(problem))
        baseline: float | None = None
        scale: float | None = None
        penalty: float | None = None
        elite: dict[tuple[int, ...], float] = {}  # best distinct plans seen -> reward
        spent = 0
        if self.warm_start and self.elite:
            elite, spent = self._warm_start(problem)
        best: Plan | None = None
        if elite:
            best = cost_model.evaluate(problem, next(iter(elite)))
        best_it = 0
        history: list[float] = []
        polish = self.polish_budget if self.polish_budget > 0 else 0
        decay_its = max(1, int(self.iterations * self.entropy_decay_frac))
        for it in range(self.iterations):
            if spent + self.batch > self.budget - polish:
                break
            forced = torch.tensor(list(elite), dtype=torch.int64) if elite else None
            actions, logp, ent = net.rollout(problem, static, self.batch, generator=gen, forced=forced)
            spent += self.batch
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
            baseline = ema(baseline, mean_r, self.baseline_decay)
            scale = max(ema(scale, float(r[k:].std()), self.baseline_decay), 1e-3)
            adv = torch.from_numpy((r - baseline) / scale).float()
            coef = self.entropy_coef * max(0.0, 1.0 - it / decay_its)
            loss = -(adv * logp).mean() - coef * ent.mean() / problem.n_layers
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            if it >= decay_its and it - best_it >= self.patience:
                break
        with torch.no_grad():
            greedy_actions, _, _ = net.rollout(problem, static, 1, greedy=True)
        spent += 1
        cand = cost_model.evaluate(problem, greedy_actions[0].numpy())
        if best is None or cost_model.is_better(cand, best):
            best = cand
        sampled = best
        if polish:
            polished, used = local_search.improve(problem, best.assignment, budget=min(polish, self.budget - spent))
            spent += used
            cand = cost_model.evaluate(problem, polished)
            if cost_model.is_better(cand, best):
                best = cand
        return TrainResult(best, sampled, net, history, spent)
