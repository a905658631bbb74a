"""A routed trajectory becomes an engine request with the store's sampling record itself: one
``SamplingParams`` from the store to the engine, never copied field by field."""

from __future__ import annotations

from engine_adapters import GenerateRequest, SamplingParams
from staleflow_trainer.actors.instance_store import generate_request
from trajectory_server import Trajectory, TrajectoryStore
from trajectory_server.client import InProcessTrajectoryClient


def test_the_request_carries_the_very_sampling_object() -> None:
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, max_new_tokens=16, stop_token_ids=(2,), seed=11
    )
    t = Trajectory(
        trajectory_id="g/0",
        group_id="g",
        prompt_token_ids=[5, 6, 7],
        sampling=sampling,
        v_traj=3,
        generated_token_ids=[8, 9],
        generated_logprobs=[-0.5, -0.25],
        generated_versions=[3, 4],
    )
    req = generate_request(t, 12)
    assert isinstance(req, GenerateRequest)
    assert req.sampling is t.sampling
    assert req.sampling is sampling
    assert req.prompt_token_ids == (5, 6, 7)
    assert (req.generated_token_ids, req.generated_versions) == ((8, 9), (3, 4))
    assert req.target_length == 12


async def test_a_routed_trajectory_hands_its_decoded_sampling_to_the_engine() -> None:
    """Over the wire codec the store's answer decodes to the engine's record, and the request
    takes that object as it is."""
    store = TrajectoryStore()
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(2,), seed=4)
    store.submit_group("g", [1, 2, 3], 2, sampling=sampling)
    client = InProcessTrajectoryClient(store)
    (t,) = await client.route("i0", ["g/1"], 0)
    req = generate_request(t, None)
    assert type(req.sampling) is SamplingParams
    assert req.sampling is t.sampling
    assert req.sampling == SamplingParams(max_new_tokens=8, stop_token_ids=(2,), seed=5)
