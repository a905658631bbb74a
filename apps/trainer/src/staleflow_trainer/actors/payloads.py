"""Plain-dict messages between the actors (no custom objects cross a process boundary).

Each ``*_to_dict`` builds a dict of str / int / float / list values; each ``*_from_dict`` rebuilds
the typed, validated record on the receiving side, so a malformed message fails at the edge with
the field named (the records validate themselves).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine_adapters import (
    EngineSnapshot,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from rollout_coordinator import InstanceSnapshot, QueuedTrajectory, RunningEntry
from trajectory_server import Completion, QueueEntry, Segment, Trajectory


def request_from_trajectory(t: Trajectory) -> dict[str, Any]:
    """A trajectory-server payload → the dict a rollout actor turns into a GenerateRequest."""
    s = t.sampling
    return {
        "trajectory_id": t.trajectory_id,
        "prompt_token_ids": list(t.prompt_token_ids),
        "generated_token_ids": list(t.generated_token_ids),
        "generated_logprobs": list(t.generated_logprobs),
        "generated_versions": list(t.generated_versions),
        "sampling": {
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "max_new_tokens": int(s.max_new_tokens),
            "stop_token_ids": list(s.stop_token_ids),
            "seed": s.seed,
        },
        "target_length": t.target_length,
    }


def request_from_dict(d: Mapping[str, Any]) -> GenerateRequest:
    return GenerateRequest(
        trajectory_id=str(d["trajectory_id"]),
        prompt_token_ids=d["prompt_token_ids"],
        sampling=SamplingParams(**d["sampling"]),
        generated_token_ids=d.get("generated_token_ids", ()),
        generated_logprobs=d.get("generated_logprobs", ()),
        generated_versions=d.get("generated_versions", ()),
        target_length=d.get("target_length"),
    )


def result_to_dict(r: GenerateResult) -> dict[str, Any]:
    return {
        "trajectory_id": r.trajectory_id,
        "token_ids": list(r.token_ids),
        "logprobs": list(r.logprobs),
        "versions": list(r.versions),
        "finish_reason": r.finish_reason.value,
    }


def result_from_dict(d: Mapping[str, Any]) -> GenerateResult:
    return GenerateResult(
        trajectory_id=str(d["trajectory_id"]),
        token_ids=d["token_ids"],
        logprobs=d["logprobs"],
        versions=d["versions"],
        finish_reason=FinishReason(d["finish_reason"]),
    )


def segment_of(r: GenerateResult) -> Segment:
    """The whole response so far as a trajectory-server segment (``start=0``: the store checks
    that the overlap with what it holds matches exactly)."""
    return Segment(
        trajectory_id=r.trajectory_id,
        start=0,
        token_ids=list(r.token_ids),
        logprobs=list(r.logprobs),
        versions=list(r.versions),
    )


def completion_of(r: GenerateResult, *, finish_reason: str | None = None) -> Completion:
    return Completion(
        trajectory_id=r.trajectory_id,
        start=0,
        token_ids=list(r.token_ids),
        logprobs=list(r.logprobs),
        versions=list(r.versions),
        finish_reason=finish_reason or r.finish_reason.value,
    )


def snapshot_to_dict(s: EngineSnapshot) -> dict[str, Any]:
    return {
        "instance_id": s.instance_id,
        "seq": s.seq,
        "time_s": s.time_s,
        "version": s.version,
        "running": [[r.trajectory_id, r.prompt_tokens, r.generated_tokens] for r in s.running],
        "waiting": s.waiting,
        "kv_used_tokens": s.kv_used_tokens,
        "kv_capacity_tokens": s.kv_capacity_tokens,
        "throughput_tokens_per_s": s.throughput_tokens_per_s,
    }


def instance_snapshot(d: Mapping[str, Any], *, time_s: float) -> InstanceSnapshot:
    """An engine snapshot dict as the coordinator's record, stamped with the coordinator's clock.

    Engines keep their own clocks (sim engines even a virtual one); the control loop requests a
    snapshot only after every command it issued earlier was delivered, so the time it hands the
    snapshot to the coordinator is a correct (conservative) "taken no earlier than" stamp.
    """
    return InstanceSnapshot(
        instance_id=str(d["instance_id"]),
        seq=int(d["seq"]),
        time_s=time_s,
        version=int(d["version"]),
        running=tuple(
            RunningEntry(trajectory_id=str(t), prompt_tokens=int(p), generated_tokens=int(g))
            for t, p, g in d["running"]
        ),
        waiting=int(d["waiting"]),
        kv_used_tokens=min(int(d["kv_used_tokens"]), int(d["kv_capacity_tokens"])),
        kv_capacity_tokens=int(d["kv_capacity_tokens"]),
        throughput_tokens_per_s=float(d["throughput_tokens_per_s"]),
    )


def queued(e: QueueEntry) -> QueuedTrajectory:
    return QueuedTrajectory(
        trajectory_id=e.trajectory_id,
        group_id=e.group_id,
        v_traj=e.v_traj,
        prompt_len=e.prompt_len,
        generated_len=e.generated_len,
    )
