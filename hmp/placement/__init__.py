"""HeterPS-style placement: profile a model's layers, then plan which resource type runs each.

Modules: ``problem`` (the data), ``cost_model`` (what a plan costs), ``spec`` (config mapping ->
validated settings), ``profiler`` (measure layers -> problem), ``env`` (gymnasium environment),
``features`` (observations), ``rl`` (REINFORCE + LSTM planner), ``baselines`` (brute force, greedy,
random search, genetic), ``synthetic`` (seeded random problems), ``registry`` (the entry points the
runtime calls: ``profile``, ``problem_from_config``, ``make_planner``, ``replan``). See
docs/placement.md. Import the submodules directly; this package imports nothing so that the cheap
parts (problem, cost model) do not pull in torch.
"""
