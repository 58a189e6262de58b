"""The layer profiler and the placement config: real timings on tiny models, and clear errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from hmp.errors import ConfigError
from hmp.models import click_model, deep_mlp
from hmp.placement import cost_model
from hmp.placement.problem import NOT_MEASURED
from hmp.placement.profiler import example_input, measure_layers, problem_from_config, split_layers
from hmp.placement.registry import make_planner
from hmp.placement.spec import parse_spec

pytestmark = pytest.mark.timeout(60)


def config(**overrides) -> dict:
    cfg = {
        "resources": [
            {"name": "cpu", "price_per_hour": 0.1, "count": 4, "device": "cpu"},
            {"name": "gpu", "price_per_hour": 2.5, "count": 2, "measured": False, "overhead_s": 1e-5,
             "speed_scale": {"dense": 20, "sparse": 0.5, "elementwise": 4}},
        ],
        "bandwidth_bytes_per_s": 1e9,
        "samples": 1e6,
        "min_throughput": 100.0,
        "batch_size": 4,
        "reps": 3,
        "warmup": 1,
        "num_threads": 1,
    }
    cfg.update(overrides)
    return cfg


def test_split_layers_kinds_of_the_shipped_models():
    assert [(x.name, x.kind) for x in split_layers(click_model())] == [
        ("0:FieldEmbedding", "sparse"), ("1:Linear", "dense"), ("2:ReLU", "elementwise"),
        ("3:Linear", "dense"), ("4:ReLU", "elementwise"), ("5:Linear", "dense"),
    ]
    kinds = [x.kind for x in split_layers(deep_mlp(depth=2))]
    assert kinds == ["dense", "elementwise", "dense", "elementwise", "dense"]
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.Tanh()), nn.Linear(3, 1))
    assert [x.name for x in split_layers(nested)] == ["0:Linear", "1:Tanh", "2:Linear"]


def test_profile_tiny_model_times_and_boundary_bytes():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    threads = torch.get_num_threads()
    p = problem_from_config(config(), model, name="tiny")
    assert torch.get_num_threads() == threads  # num_threads applies while profiling only
    assert [layer.out_bytes for layer in p.layers] == [4 * 16 * 4, 4 * 16 * 4, 4 * 4 * 4]  # batch x width x float32
    assert [layer.param_bytes for layer in p.layers] == [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]
    assert [layer.kind for layer in p.layers] == ["dense", "elementwise", "dense"]
    for layer in p.layers:
        assert 0 < layer.time_s["cpu"] < 1.0
        scale = {"dense": 20, "elementwise": 4}[layer.kind]
        assert layer.time_s["gpu"] == pytest.approx(layer.time_s["cpu"] / scale + 1e-5)
    assert p.resources[0].measured and not p.resources[1].measured
    assert p.resources[1].provenance.startswith(NOT_MEASURED)
    plan = make_planner("bruteforce").plan(p)
    assert plan == cost_model.evaluate(p, plan.assignment)


def test_profile_click_model_embedding_output_bytes():
    model = click_model(fields=4, buckets=50, dim=8, hidden=(16,))
    p = problem_from_config(config(batch_size=32), model)
    assert p.layers[0].kind == "sparse" and p.layers[0].out_bytes == 32 * 4 * 8 * 4
    assert p.layers[0].param_bytes == 4 * 50 * 8 * 4
    assert p.layers[0].time_s["gpu"] == pytest.approx(p.layers[0].time_s["cpu"] / 0.5 + 1e-5)


def test_measure_layers_uses_real_activations_and_positive_medians():
    layers = split_layers(nn.Sequential(nn.Linear(3, 5), nn.Sigmoid()))
    x = example_input(nn.Sequential(nn.Linear(3, 5)), batch_size=7)
    timings = measure_layers(layers, x, "cpu", reps=2, warmup=0)
    assert [t.out_bytes for t in timings] == [7 * 5 * 4, 7 * 5 * 4]
    assert all(t.time_s > 0 for t in timings)


def test_times_measured_elsewhere_come_from_config():
    cfg = config()
    cfg["resources"].append({"name": "tpu", "price_per_hour": 4.0, "count": 1, "measured": False, "times_s": [1e-3, 2e-4, 5e-4]})
    p = problem_from_config(cfg, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    assert [layer.time_s["tpu"] for layer in p.layers] == [1e-3, 2e-4, 5e-4]
    assert p.resources[2].provenance == f"{NOT_MEASURED} (times from config)"
    cfg["resources"][2]["times_s"] = [1e-3]
    with pytest.raises(ValueError, match="times_s has 1 figures, the model has 3 layers"):
        problem_from_config(cfg, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


def test_counts_override_the_config():
    spec = parse_spec(config(), counts={"cpu": 9, "gpu": 0})
    assert [r.count for r in spec.resources] == [9, 0]
    cfg = config()
    for r in cfg["resources"]:
        del r["count"]
    assert [r.count for r in parse_spec(cfg, counts={"cpu": 1, "gpu": 1}).resources] == [1, 1]


def _broken(mutate) -> dict:
    cfg = config()
    mutate(cfg)
    return cfg


BAD = [
    ("placement.resources[0].price_per_hour", lambda c: c["resources"][0].pop("price_per_hour")),
    ("placement.resources[1].count", lambda c: c["resources"][1].update(count=-1)),
    ("placement.resources[1].speed_scale", lambda c: c["resources"][1].pop("speed_scale")),
    ("placement.resources[1].speed_scale.conv", lambda c: c["resources"][1].update(speed_scale={"conv": 2.0})),
    ("placement.resources[1].speed_scale.dense", lambda c: c["resources"][1].update(speed_scale={"dense": 0})),
    ("placement.resources[0].colour", lambda c: c["resources"][0].update(colour="red")),
    ("placement.resources[1].name", lambda c: c["resources"][1].update(name="cpu")),
    ("placement.resources[0].measured", lambda c: c["resources"][0].update(measured="yes")),
    ("placement.resources", lambda c: c.update(resources=[])),
    ("placement.resources", lambda c: c["resources"][0].update(measured=False, speed_scale=1.0)),
    ("placement.min_throughput", lambda c: c.update(min_throughput=0)),
    ("placement.batch_size", lambda c: c.update(batch_size=2.5)),
    ("placement.bandwidth_bytes_per_s", lambda c: c.pop("bandwidth_bytes_per_s")),
    ("placement.reps", lambda c: c.update(reps=0)),
    ("placement.message_overhead_s", lambda c: c.update(message_overhead_s=-1e-4)),
    ("placement.micro_batches", lambda c: c.update(micro_batches=0)),
    ("placement.micro_batches", lambda c: c.update(micro_batches=3)),  # batch_size 4 is not a multiple of 3
    ("placement.bandwith", lambda c: c.update(bandwith=1e9)),
]


@pytest.mark.parametrize("key,mutate", BAD, ids=[k for k, _ in BAD])
def test_bad_config_names_the_key(key, mutate):
    with pytest.raises(ValueError, match=re.escape(f"key '{key}'")) as err:
        parse_spec(_broken(mutate))
    assert not isinstance(err.value, ConfigError)
    with pytest.raises(ConfigError) as err:
        parse_spec(_broken(mutate), path="job.toml")
    assert err.value.path == "job.toml" and err.value.key == key


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_measuring_an_absent_device_is_a_clear_error():
    cfg = config()
    cfg["resources"][1].update(measured=True, device="cuda")
    with pytest.raises(ConfigError, match="not available here") as err:
        parse_spec(cfg, path="job.toml")
    assert err.value.key == "placement.resources[1].measured"
    cfg["resources"][1].update(measured="auto")  # auto: scaled here, measured on a GPU machine
    assert not parse_spec(cfg).resources[1].measured


def test_runtime_keys_are_ignored():
    spec = parse_spec(config(enabled=True, planner="rl", micro_batches=4, min_gain=0.1, join_wait_s=1.0, use_spare_workers=True, profile_repeats=2))
    assert spec.reps == 3  # "reps" wins over the runtime's "profile_repeats"
    assert spec.micro_batches == 4  # read: one message each way per micro-batch per boundary
    assert parse_spec({k: v for k, v in config(profile_repeats=2).items() if k != "reps"}).reps == 2


def test_profile_rejects_a_batch_of_the_wrong_size():
    model = nn.Sequential(nn.Linear(8, 2))
    with pytest.raises(ValueError, match="batch_size is 4"):
        problem_from_config(config(), model, torch.randn(5, 8))


def test_message_overhead_reaches_the_problem():
    """The link's per-message overhead (default: the figure measured on this runtime) and the micro-batches reach
    the problem; a cut's cost is 2 * out_bytes / bandwidth + 2 * micro_batches * overhead."""
    from hmp.placement.spec import DEFAULT_MESSAGE_OVERHEAD_S

    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    p = problem_from_config(config(), model)
    assert (p.message_overhead_s, p.messages_per_batch) == (DEFAULT_MESSAGE_OVERHEAD_S, 1)
    p = problem_from_config(config(message_overhead_s=1e-4, micro_batches=2), model)
    assert p.boundary_s[0] == pytest.approx(2 * 4 * 6 * 4 / 1e9 + 2 * 2 * 1e-4)
    assert cost_model.evaluate(p, [0, 1, 1]).stages[0].transfer_s == pytest.approx(p.boundary_s[0])
