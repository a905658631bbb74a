"""A snapshot codec link for the snapshot-delta tests: one instance's ``SnapshotEncoder`` and the
control side's ``SnapshotDecoder``, hand-built engine snapshots, and what a consumer reads of
one (to compare the decoded snapshot with the engine's)."""

from __future__ import annotations

from typing import Any

from engine_adapters import EngineSnapshot, RunningTrajectory, SnapshotDecoder, SnapshotEncoder


def view(s: EngineSnapshot) -> tuple[Any, ...]:
    """Everything a consumer reads; ``running`` as a mapping (its order carries no meaning).
    Not ``seq``: the receiver numbers the snapshots it rebuilds itself."""
    running = {r.trajectory_id: (r.prompt_tokens, r.generated_tokens) for r in s.running}
    return (s.instance_id, s.version, running, s.waiting, s.kv_used_tokens,
            s.kv_capacity_tokens, s.throughput_tokens_per_s, s.decode_steps)  # fmt: skip


def snap(running: dict[str, tuple[int, int]], *, steps: int, seq: int = 1) -> EngineSnapshot:
    """Taken at ``time_s = seq``: one poll a second."""
    return EngineSnapshot(
        instance_id="i0",
        seq=seq,
        time_s=float(seq),
        version=0,
        running=tuple(
            RunningTrajectory(trajectory_id=t, prompt_tokens=p, generated_tokens=g)
            for t, (p, g) in running.items()
        ),
        waiting=0,
        kv_used_tokens=0,
        kv_capacity_tokens=1000,
        throughput_tokens_per_s=0.0,
        decode_steps=steps,
    )


def F(d: Any) -> dict[str, Any]:
    """A delta's fields by name (they travel as numbers)."""
    return SnapshotDecoder.fields(d)


class Link:
    """One instance's encoder and the control side's decoder; each request carries what the
    decoder's ``request()`` says (an acknowledgement or a call for a full snapshot)."""

    def __init__(self) -> None:
        self.enc = SnapshotEncoder()
        self.dec = SnapshotDecoder("i0")
        self.added = 0

    def send(self, s: EngineSnapshot, ended: set[str] | None = None) -> dict[str, Any] | None:
        d = self.enc.encode(s, **self.dec.request(), ended=ended or set())
        self.added += sum(len(g) - 3 for g in F(d).get("add", ())) if d else 0
        return d

    def poll(self, s: EngineSnapshot, ended: set[str] | None = None) -> EngineSnapshot | None:
        return self.dec.decode(self.send(s, ended), time_s=s.time_s, ended=ended or set())
