"""Control-channel framing: typed msgpack records, schema version, token, size limits."""

from __future__ import annotations

import struct

import msgpack
import pytest

from param_server._wire import MAX_FRAME_BYTES, SCHEMA_VERSION, check_bind, decode, encode
from param_server.errors import ConfigError, ProtocolError


def _payload(frame: bytes) -> bytes:
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    return frame[4:]


def test_round_trip() -> None:
    body = {"receiver": "r", "names": ["a", "b"], "version": None}
    kind, got = decode(_payload(encode("pull_begin", body, "tok")), "tok")
    assert kind == "pull_begin" and got == body


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        ({"schema": SCHEMA_VERSION + 1, "kind": "status", "token": None, "body": {}}, "schema"),
        ({"schema": SCHEMA_VERSION, "kind": "nope", "token": None, "body": {}}, "kind"),
        ({"schema": SCHEMA_VERSION, "kind": "pull_end", "token": None, "body": {}}, "pull_id"),
        (
            {
                "schema": SCHEMA_VERSION,
                "kind": "pull_end",
                "token": None,
                "body": {"pull_id": "1", "failed_worker": None},
            },
            "pull_id",
        ),
        (
            {
                "schema": SCHEMA_VERSION,
                "kind": "pull_end",
                "token": None,
                "body": {"pull_id": True, "failed_worker": None},
            },
            "pull_id",
        ),
        (
            {"schema": SCHEMA_VERSION, "kind": "status", "token": None, "body": {"x": 1}},
            "x",
        ),
        (
            {
                "schema": SCHEMA_VERSION,
                "kind": "push_begin",
                "token": None,
                "body": {
                    "version": 1,
                    "rank": 0,
                    "world_size": 1,
                    "tensors": [["a", "float32", [2], "8"]],
                },
            },
            "tensors",
        ),
    ],
)
def test_bad_messages_name_the_field(msg: dict, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb(msg, use_bin_type=True), None)
    assert e.value.field == field


def test_garbage_and_non_map() -> None:
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(b"\xc1\xc1", None)
    with pytest.raises(ProtocolError, match="not a map"):
        decode(msgpack.packb([1, 2]), None)


def test_token_checked_on_every_message() -> None:
    frame = _payload(encode("status", {}, "right"))
    decode(frame, "right")
    with pytest.raises(ProtocolError) as e:
        decode(frame, "wrong")
    assert e.value.field == "token"
    with pytest.raises(ProtocolError):
        decode(_payload(encode("status", {}, None)), "right")


def test_oversized_rejected() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(
            "worker_hello",
            {"worker": "w", "agent": "a", "metadata": b"x" * MAX_FRAME_BYTES, "pid": 1},
            None,
        )


def test_bind_rules() -> None:
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)
    with pytest.raises(ConfigError) as e:
        check_bind("0.0.0.0", None)
    assert e.value.field == "host"
    check_bind("0.0.0.0", "secret")
