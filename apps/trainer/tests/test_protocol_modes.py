"""The run's protocol from its config — bounded buffers, the GC FIFO or the unbounded FIFO —
and a resume whose config would run a checkpoint's protocol under other rules is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from staleflow_trainer.config import DEFAULT_STUCK_THRESHOLD, load_config, stuck_threshold
from staleflow_trainer.control.config import build_protocol as _build
from staleflow_trainer.control.config import check_resumable, core_config
from staleflow_trainer.errors import CheckpointError, ConfigError
from staleflow_trainer.sim.spec import with_policy
from staleness_protocol import StalenessProtocol, UnboundedConfig, UnboundedFifo, protocol_from_dict

UNBOUNDED = ["protocol.eta=unbounded", "coordinator.policy=all-vanilla"]


def build_protocol(cfg: Any) -> Any:
    return _build(core_config(cfg, rows=None).protocol)


def restore_protocol(data: dict[str, Any], cfg: Any) -> Any:
    p = protocol_from_dict(data)
    check_resumable(p, core_config(cfg, rows=None).protocol)
    return p


def test_int_eta_builds_the_bounded_protocol() -> None:
    cfg = load_config(
        None, ["protocol.eta=3", "protocol.batch_size=4", "protocol.stuck_threshold=0"]
    )
    p = build_protocol(cfg)
    assert isinstance(p, StalenessProtocol)
    assert p.config.eta == 3 and p.config.batch_size == 4


def test_unbounded_builds_the_fifo_with_the_inflight_cap() -> None:
    cfg = load_config(
        None, [*UNBOUNDED, "protocol.batch_size=4", "protocol.unbounded_inflight_batches=3"]
    )
    p = build_protocol(cfg)
    assert isinstance(p, UnboundedFifo)
    assert p.config.max_inflight_groups == 12 and p.config.eta is None
    assert p.config.batch_size == 4


def test_restore_round_trips_and_refuses_a_mode_change() -> None:
    bounded = load_config(
        None,
        [
            "protocol.eta=2",
            "protocol.batch_size=1",
            "protocol.group_size=1",
            "protocol.stuck_threshold=0",
        ],
    )
    unbounded = load_config(None, [*UNBOUNDED, "protocol.batch_size=1", "protocol.group_size=1"])
    for cfg in (bounded, unbounded):
        p = build_protocol(cfg)
        p.reserve("g", "g/0", 0)
        p.finish("g/0")
        data = json.loads(json.dumps(p.to_dict()))
        q = restore_protocol(data, cfg)
        assert type(q) is type(p) and q.to_dict() == p.to_dict()
    with pytest.raises(CheckpointError, match="unbounded"):
        restore_protocol(build_protocol(unbounded).to_dict(), bounded)
    with pytest.raises(CheckpointError, match="eta=2"):
        restore_protocol(build_protocol(bounded).to_dict(), unbounded)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("protocol.eta=3", "protocol.eta"),
        ("protocol.batch_size=6", "protocol.batch_size"),
        ("protocol.group_size=2", "protocol.group_size"),
        ("protocol.stuck_threshold=2", "protocol.stuck_threshold"),
    ],
)
def test_resume_refuses_a_changed_protocol_setting(change: str, key: str) -> None:
    """A changed η, B, n or stuck threshold is not silently ignored on resume: the error names
    the key, both values, and how to go on."""
    base = ["protocol.eta=2", "protocol.batch_size=4", "protocol.group_size=1",
            "protocol.stuck_threshold=0"]  # fmt: skip
    data = build_protocol(load_config(None, base)).to_dict()
    restore_protocol(data, load_config(None, base))  # unchanged: fine
    with pytest.raises(CheckpointError) as e:
        restore_protocol(data, load_config(None, [*base, change]))
    assert key in str(e.value) and "run.resume=never" in str(e.value)


def test_simulator_runs_unbounded_with_fifo_and_measured_staleness() -> None:
    """The simulator (the control core, sim engines, virtual time) in unbounded mode: every
    step consumes a full batch FIFO, nothing is lost, and staleness is measured past what
    η = 1 allows on the same workload — while the bounded run stays within its η."""
    from staleflow_trainer.control.checks import ledger_problems
    from staleflow_trainer.sim import Simulation, with_policy
    from staleflow_trainer.sim.testing import sim_config

    cfg = sim_config(
        steps=8, batch_size=4, group_size=4, total_gpus=4, rollout_gpus=2, train_gpus=2,
        max_running=32, kv_capacity_tokens=24_000, prompt_len=64, prompt_len_max=128,
        response_len_median=200, response_len_sigma=1.2, max_response_len=1024,
        trainer_time_a_s=0.2, trainer_time_b_s_per_token=2e-6, cycle_period_s=0.1,
        warmup_steps=1, unbounded_inflight_batches=4, eta="unbounded", policy="all-vanilla",
    )  # fmt: skip
    runs = {}
    for eta in (1, "unbounded"):
        sim = Simulation(with_policy(cfg, "all-vanilla", eta))
        sim.run()
        assert ledger_problems(sim.core) == []  # nothing lost or counted twice
        assert sim.core.ledger.counts()["consumed"] == 8 * 4 * 4
        assert [r["version"] for r in sim.rec.steps] == list(range(1, 9))
        runs[eta] = sim
    assert isinstance(runs["unbounded"].core.protocol, UnboundedFifo)
    assert max(runs[1].core.protocol.stats().staleness_histogram) <= 1
    assert max(runs["unbounded"].core.protocol.stats().staleness_histogram) > 1
    with pytest.raises(ConfigError) as e:
        with_policy(cfg, "staleflow", "unbounded")
    assert e.value.key == "coordinator.policy"


def test_coarse_async_drop_builds_the_gc_fifo_and_resumes_only_as_itself() -> None:
    """The strict-async FIFO baseline keeps η with GcFifo; its checkpoint does not resume as a
    buffer run with the same η, nor the reverse."""
    from staleness_protocol import GcFifo

    base = [
        "protocol.eta=2",
        "protocol.batch_size=4",
        "protocol.group_size=1",
        "protocol.stuck_threshold=0",
    ]
    drop = load_config(None, [*base, "coordinator.policy=coarse-async-drop"])
    p = build_protocol(drop)
    assert isinstance(p, GcFifo)
    assert p.config.eta == 2 and p.config.max_inflight_groups == 12
    data = json.loads(json.dumps(p.to_dict()))
    assert restore_protocol(data, drop).to_dict() == data
    buffers = load_config(None, [*base, "coordinator.policy=coarse-async"])
    with pytest.raises(CheckpointError, match="gc-fifo"):
        restore_protocol(data, buffers)
    with pytest.raises(CheckpointError, match="buffers"):
        restore_protocol(build_protocol(buffers).to_dict(), drop)
    with pytest.raises(ConfigError):
        load_config(None, ["protocol.eta=unbounded", "coordinator.policy=coarse-async-drop"])


def test_verl_async_builds_a_fifo_without_eta_whose_window_eta_sets() -> None:
    """verl-async keeps no η: an integer protocol.eta sizes its window (the coordinator's
    ``verl_staleness_threshold`` unless the config sets one), the FIFO's own cap sits above
    what that window admits, and spare buffer slots are refused, naming the field."""
    from rollout_coordinator import Coordinator

    base = ["protocol.eta=2", "protocol.batch_size=4", "coordinator.policy=verl-async"]
    cc = core_config(load_config(None, base), rows=None)
    p = _build(cc.protocol)
    assert type(p) is UnboundedFifo and p.config.eta is None
    assert p.config.max_inflight_groups == (2 + 2) * 4
    assert cc.coordinator.verl_staleness_threshold == 2.0
    Coordinator(cc.coordinator, p)  # the coordinator accepts the pair
    own = core_config(
        load_config(None, [*base, "coordinator.verl_staleness_threshold=0.5"]), rows=None
    )
    assert own.coordinator.verl_staleness_threshold == 0.5
    assert own.protocol.max_inflight_groups == (0 + 2) * 4
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "protocol.batch_redundancy=1"])
    assert e.value.key == "protocol.batch_redundancy"
    with pytest.raises(ConfigError):
        load_config(None, ["protocol.eta=unbounded", "coordinator.policy=verl-async"])


def test_verl_async_resume_names_the_keys_that_size_its_window() -> None:
    """A changed η changes verl-async's FIFO cap: the refusal names the keys a user sets, and a
    checkpoint of the earlier dropping model (a GcFifo) is refused with the reason."""
    from staleness_protocol import GcFifo, GcFifoConfig

    base = ["protocol.batch_size=4", "protocol.group_size=1", "coordinator.policy=verl-async"]
    two = load_config(None, [*base, "protocol.eta=2"])
    data = build_protocol(two).to_dict()
    assert restore_protocol(data, two).to_dict() == data
    with pytest.raises(CheckpointError, match=r"coordinator\.verl_staleness_threshold"):
        restore_protocol(data, load_config(None, [*base, "protocol.eta=3"]))
    old = GcFifo(GcFifoConfig(batch_size=4, group_size=1, eta=2, max_inflight_groups=12))
    with pytest.raises(CheckpointError, match="cannot be resumed by this version") as e:
        restore_protocol(old.to_dict(), two)
    assert "no eta, at most 16 groups in flight" in str(e.value)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["coordinator.verl_staleness_threshold=65"], "coordinator.verl_staleness_threshold"),
        (
            [
                "protocol.eta=1",
                "protocol.batch_size=4096",
                "protocol.group_size=4",
                "coordinator.verl_staleness_threshold=63",
            ],
            "coordinator.verl_staleness_threshold",
        ),
        (["trainer.dynamic_sampling=true"], "trainer.dynamic_sampling"),
    ],
)
def test_verl_async_window_is_checked_like_the_buffers(extra: list[str], key: str) -> None:
    """Its window is bounded as η is (at most 64, and what it admits ahead of training at
    most 2^20 trajectories), and dynamic sampling, which could starve the window, is refused;
    each error names the key."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["coordinator.policy=verl-async", *extra])
    assert e.value.key == key


def test_the_stuck_threshold_applies_over_buffers_and_is_refused_over_a_fifo() -> None:
    """Null is 4 (below batch_size) where per-version buffers can wait for stragglers and off
    over a FIFO; a threshold above 0 over a FIFO would change nothing, so it is refused by
    name."""
    assert stuck_threshold(load_config(None, [])) == DEFAULT_STUCK_THRESHOLD
    assert stuck_threshold(load_config(None, ["protocol.stuck_threshold=2"])) == 2
    assert stuck_threshold(load_config(None, ["protocol.stuck_threshold=0"])) == 0
    fifos = [
        ["coordinator.policy=coarse-async-drop"],
        ["coordinator.policy=verl-async"],
        ["coordinator.policy=all-vanilla", "protocol.eta=unbounded"],
    ]
    for fifo in fifos:
        assert stuck_threshold(load_config(None, fifo)) == 0
        assert stuck_threshold(load_config(None, [*fifo, "protocol.stuck_threshold=0"])) == 0
        with pytest.raises(ConfigError) as e:
            load_config(None, [*fifo, "protocol.stuck_threshold=2"])
        assert e.value.key == "protocol.stuck_threshold" and "0 or null" in str(e.value.allowed)
    # a buffer lacking all of its batch_size groups is empty, not stuck: null stays below it
    for batch, want in ((5, 4), (4, 3), (2, 1), (1, 0)):
        small = load_config(None, [f"protocol.batch_size={batch}", "trainer.mini_batches=1"])
        assert stuck_threshold(small) == want
        assert core_config(small, rows=8).protocol.stuck_threshold == (want or None)
    with pytest.raises(ConfigError) as e:  # the package's own rule, named by the app's key
        load_config(None, ["protocol.batch_size=4", "protocol.stuck_threshold=4"])
    assert e.value.key == "protocol.stuck_threshold" and "batch_size (4)" in str(e.value.allowed)
    # the core runs what the config says: buffers with 4, a FIFO with none
    assert core_config(load_config(None, []), rows=8).protocol.stuck_threshold == 4
    drop = core_config(load_config(None, fifos[0]), rows=8).protocol
    assert not hasattr(drop, "stuck_threshold") or drop.stuck_threshold is None


def test_the_stuck_wait_is_refused_where_nothing_is_resolved() -> None:
    """Null waits 5 s where stuck resolution is on; a wait set where the run resolves no stuck
    buffer (threshold 0, or a FIFO) would change nothing, so it is refused by name; compare and
    plan leave it out of the runs of such policies."""
    assert core_config(load_config(None, []), rows=8).stuck_after_s == 5.0
    cfg = load_config(None, ["protocol.stuck_after_s=0.5"])
    assert core_config(cfg, rows=8).stuck_after_s == 0.5
    for off in (["protocol.stuck_threshold=0"], ["coordinator.policy=verl-async"]):
        with pytest.raises(ConfigError) as e:
            load_config(None, [*off, "protocol.stuck_after_s=0.5"])
        assert e.value.key == "protocol.stuck_after_s" and "null" in str(e.value.allowed)
    assert with_policy(cfg, "coarse-async").protocol.stuck_after_s is None
    assert with_policy(cfg, "all-vanilla").protocol.stuck_after_s == 0.5


def test_a_strategy_setting_the_policy_does_not_read_is_refused() -> None:
    """Each policy's strategies declare what they read (``Policy.reads``): a setting none of
    them reads is refused naming the policies that do; ``with_policy`` (compare, plan) leaves
    such settings out of the runs of policies that do not read them."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["coordinator.policy=all-vanilla", "coordinator.theta=0.5"])
    assert e.value.key == "coordinator.theta"
    assert "'staleflow'" in str(e.value) and "'all-vanilla'" in str(e.value.allowed)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["coordinator.verl_staleness_threshold=2"])
    assert e.value.key == "coordinator.verl_staleness_threshold" and "verl-async" in str(e.value)
    load_config(None, ["coordinator.policy=all-vanilla", "coordinator.route_kv_limit=0.8"])
    cfg = load_config(None, ["coordinator.theta=0.5", "coordinator.route_kv_limit=0.8"])
    even = with_policy(cfg, "all-vanilla").coordinator
    assert even.theta is None and even.route_kv_limit == 0.8
    assert with_policy(cfg, "vanilla-sync").coordinator.theta == 0.5


def test_the_fifo_admission_limit_is_for_eta_unbounded_only() -> None:
    """``protocol.unbounded_inflight_batches`` sizes the unbounded FIFO's admission (null: 2
    batches); buffers admit by themselves, so with an integer eta it is refused by name."""
    fifo = core_config(load_config(None, UNBOUNDED), rows=8).protocol
    assert isinstance(fifo, UnboundedConfig) and fifo.max_inflight_groups == 2 * 8
    three = load_config(None, [*UNBOUNDED, "protocol.unbounded_inflight_batches=3"])
    assert core_config(three, rows=8).protocol.max_inflight_groups == 3 * 8
    with pytest.raises(ConfigError) as e:
        load_config(None, ["protocol.eta=2", "protocol.unbounded_inflight_batches=3"])
    assert e.value.key == "protocol.unbounded_inflight_batches"
    assert with_policy(three, "all-vanilla", 2).protocol.unbounded_inflight_batches is None
