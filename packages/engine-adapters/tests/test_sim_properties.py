"""Property test: random command sequences against the sim core keep its invariants."""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_adapters import FinishReason, GenerateRequest, SamplingParams
from engine_adapters.sim import CostModel, SimConfig, SimEngineCore

CFG = SimConfig(
    cost=CostModel(k1=1e-6, k2=0.01, b=0.004, k3=1e-3, k4=0.002),
    max_running=4,
    kv_capacity_tokens=600,
    max_model_len=300,
    prefill_s_per_token=1e-4,
    prefill_s_per_token_position=1e-6,
    max_num_batched_tokens=40,  # prompts of up to 120 tokens prefill in chunks
    weight_load_constant_s=0.05,
)


class SimCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = SimEngineCore(CFG)
        self.now = 0.0
        self.next_id = 0
        self.held: dict[str, GenerateRequest] = {}
        self.outcomes: dict[str, list[FinishReason]] = {}
        self.tokens: dict[str, int] = {}

    def _collect(self, completions: list) -> None:  # type: ignore[type-arg]
        for c in completions:
            assert c.trajectory_id in self.held, f"{c.trajectory_id} reported twice or unknown"
            req = self.held.pop(c.trajectory_id)
            self.outcomes.setdefault(c.trajectory_id, []).append(c.finish_reason)
            r = c.to_result()
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == c.num_tokens
            assert r.token_ids[: len(req.generated_token_ids)] == req.generated_token_ids
            assert c.num_tokens <= req.sampling.max_new_tokens
            if c.finish_reason is FinishReason.STOP:
                assert r.token_ids[-1] == CFG.eos_token_id
            if c.finish_reason is FinishReason.LENGTH:
                assert c.num_tokens == min(
                    req.sampling.max_new_tokens,
                    len(req.generated_token_ids) + CFG.max_model_len - len(req.prompt_token_ids),
                )
            assert all(v <= self.core.version for v in r.versions)
            assert list(r.versions) == sorted(r.versions)

    @rule(
        prompt=st.integers(1, 120),
        length=st.integers(1, 250),
        max_new=st.integers(1, 250),
        dt=st.floats(0, 0.3),
    )
    def add(self, prompt: int, length: int, max_new: int, dt: float) -> None:
        self.now += dt
        tid = f"t{self.next_id}"
        self.next_id += 1
        req = GenerateRequest(
            trajectory_id=tid,
            prompt_token_ids=(20,) * prompt,
            sampling=SamplingParams(max_new_tokens=max_new, stop_token_ids=(CFG.eos_token_id,)),
            target_length=length,
        )
        self._collect(self.core.advance_to(self.now))
        self.core.add(req, self.now)
        self.held[tid] = req

    @precondition(lambda self: self.held)
    @rule(data=st.data(), dt=st.floats(0, 0.3))
    def interrupt_some(self, data: st.DataObject, dt: float) -> None:
        self.now += dt
        self._collect(self.core.advance_to(self.now))
        if not self.held:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        parts = self.core.interrupt(ids, self.now)
        assert [p.trajectory_id for p in parts] == ids
        self._collect(parts)

    @rule(dt=st.floats(0, 0.3))
    def interrupt_all(self, dt: float) -> None:
        self.now += dt
        self._collect(self.core.advance_to(self.now))
        parts = self.core.interrupt(None, self.now)
        assert sorted(p.trajectory_id for p in parts) == sorted(self.held)
        self._collect(parts)

    @precondition(lambda self: not self.core.loading)
    @rule(dt=st.floats(0, 0.3))
    def load(self, dt: float) -> None:
        self.now += dt
        self._collect(self.core.advance_to(self.now))
        if not self.core.loading:
            self.core.load_weights(self.core.version + 1, 1000, self.now)

    @rule(dt=st.floats(0, 2.0))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._collect(self.core.advance_to(self.now))

    @rule()
    def to_next_event(self) -> None:
        t = self.core.next_event_time()
        if t < math.inf:
            self.now = max(self.now, t)
            self._collect(self.core.advance_to(self.now))

    @invariant()
    def bounded_and_nothing_lost(self) -> None:
        core = self.core
        assert core.num_running <= CFG.max_running
        assert core.kv_used_tokens() <= CFG.kv_capacity_tokens
        assert core.num_running + core.num_waiting == len(self.held)
        for tid in self.held:
            assert core.holds(tid)
        assert all(len(v) == 1 for v in self.outcomes.values())

    @invariant()
    def snapshot_rows_match_each_trajectory(self) -> None:
        # the snapshot lists the running trajectories from columns kept beside the trajectory
        # records; peek reads each record: both must agree, in admission order
        rows = list(self.core.snapshot_rows(self.now).rows())
        assert len(rows) == self.core.num_running
        for tid, prompt, generated in rows:
            peeked = self.core.peek(tid, self.now)
            assert (prompt, generated) == (len(self.held[tid].prompt_token_ids), peeked.num_tokens)

    def teardown(self) -> None:
        # drain: everything still held must finish
        for _ in range(100_000):
            t = self.core.next_event_time()
            if t == math.inf:
                break
            self._collect(self.core.advance_to(t))
        assert not self.held


TestSimCoreProperties = SimCoreMachine.TestCase
TestSimCoreProperties.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
