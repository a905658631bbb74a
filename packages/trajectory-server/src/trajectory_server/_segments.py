"""Merging engine output into a trajectory: the segment rules (sans-IO).

Output comes back as a :class:`Segment` covering tokens ``[start, end)`` of the response. It
must not leave a gap, any overlap with what the store holds must match exactly (so a duplicated
or reordered message is rejected rather than silently doubling tokens), no new token may be at
a version below ``v_traj``, and the total must stay within ``max_new_tokens``.
"""

from __future__ import annotations

import attrs

from trajectory_server._records import Segment, Trajectory
from trajectory_server.errors import InvalidRecord, SegmentMismatch, StaleVersion


def extend(t: Trajectory, seg: Segment, *, final: bool) -> Trajectory:
    """``t`` with the new tokens of ``seg`` appended; raises without changing anything if
    ``seg`` breaks a segment rule (``final``: it is the completion of ``t``)."""
    tid = t.trajectory_id
    held = t.generated_len
    if seg.start > held:
        raise SegmentMismatch(
            f"output for {tid!r} starts at token {seg.start} but the store holds {held}; "
            "a segment is missing",
            trajectory_id=tid,
            start=seg.start,
            held=held,
        )
    overlap = min(held, seg.end) - seg.start
    if overlap > 0 and (
        seg.token_ids[:overlap] != t.generated_token_ids[seg.start : seg.start + overlap]
        or seg.logprobs[:overlap] != t.generated_logprobs[seg.start : seg.start + overlap]
        or seg.versions[:overlap] != t.generated_versions[seg.start : seg.start + overlap]
    ):
        raise SegmentMismatch(
            f"output for {tid!r} overlaps tokens [{seg.start}, {seg.start + overlap}) the "
            "store holds, with different values",
            trajectory_id=tid,
            start=seg.start,
            held=held,
        )
    if seg.end < held:
        raise SegmentMismatch(
            f"output for {tid!r} ends at token {seg.end} but the store already holds {held}; "
            "an engine reports everything generated so far",
            trajectory_id=tid,
            start=seg.start,
            held=held,
        )
    new = held - seg.start
    new_versions = seg.versions[new:]
    assert t.v_traj is not None  # running implies routed
    low = new_versions.min()
    if low is not None and low < t.v_traj:
        raise StaleVersion(
            f"output for {tid!r} has a token at version {low} < v_traj={t.v_traj}",
            trajectory_id=tid,
            v_traj=t.v_traj,
            version=low,
        )
    total = seg.end
    limit = t.sampling.max_new_tokens
    if total > limit or (not final and total == limit):
        raise InvalidRecord(
            f"output for {tid!r} brings it to {total} generated tokens; max_new_tokens is "
            f"{limit}" + ("" if total > limit else ": report it with finish(), reason 'length'"),
            field="token_ids",
            trajectory_id=tid,
        )
    if not new_versions:
        return t
    return attrs.evolve(
        t,
        generated_token_ids=t.generated_token_ids + seg.token_ids[new:],
        generated_logprobs=t.generated_logprobs + seg.logprobs[new:],
        generated_versions=t.generated_versions + new_versions,
    )
