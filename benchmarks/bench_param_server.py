"""Param-server throughput: push/pull of a 1 GiB model in 64 tensors between two processes.

One storage worker process holds the weights; this process is the trainer (push) and the
rollout instance (pull). ``raw_nixl_gbps`` is a bare NIXL READ of the very same worker bytes
into a pre-registered buffer of this process, measured in the same run, so
``pull_efficiency = pull_gbps / raw_nixl_gbps`` isolates the service's overhead (planning,
control messages, checksum verification). Writes bench-results/param_server.json.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import xxhash

from param_server import ParamServer, ParamServerClient, ParamServerConfig
from param_server._nixl import Transport

GIB = 1 << 30
N_TENSORS = 64
REPEATS = 3


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn, repeats: int = REPEATS) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    torch.set_num_threads(1)
    per = GIB // N_TENSORS // 4
    model = {f"layer{i}.weight": torch.randn(per) for i in range(N_TENSORS)}
    nbytes = sum(t.numel() * t.element_size() for t in model.values())

    # memcpy reference (one thread, like a copy engine would not be here)
    dst = torch.empty(nbytes // 4)
    flat = torch.cat([t for t in model.values()])
    dst.copy_(flat)
    memcpy = _timed(lambda: dst.copy_(flat))
    crc = _timed(lambda: zlib.crc32(flat.numpy().view(np.uint8)), 1)
    xxh = _timed(lambda: xxhash.xxh3_64_intdigest(flat.numpy().view(np.uint8)), 1)
    del dst, flat
    gc.collect()

    cfg = ParamServerConfig(num_workers=1, replication=1, keep_versions=1, verify_on_push=True)
    with ParamServer(cfg) as ps:
        trainer = ParamServerClient(ps.address, name="bench-trainer")
        rollout = ParamServerClient(ps.address, name="bench-rollout")
        version = 0

        def push() -> None:
            nonlocal version
            version += 1
            trainer.push(version, model)

        push()  # warm-up: connection setup, first-touch of worker memory
        push_s = _timed(push)

        rollout.pull()  # warm-up
        pull_s = _timed(lambda: rollout.pull())
        pull_nv_s = _timed(lambda: rollout.pull(verify=False))

        # Bare NIXL READ of the same worker bytes between the same two processes.
        ticket = rollout._call(
            "pull_begin", {"receiver": "raw", "names": None, "version": None}, "pull_ticket"
        )
        raw = Transport("bench-raw")
        for agent, md in ticket["agents"].items():
            raw.ensure_remote(agent, md)
        rbuf = torch.zeros(nbytes, dtype=torch.uint8)
        reg = raw.register_tensors([rbuf])
        local, remote, off, agent = [], [], 0, ""
        for _n, _i, start, end, agent, addr, dev, _c in ticket["reads"]:
            local.append((rbuf.data_ptr() + off, end - start, 0))
            remote.append((addr, end - start, dev))
            off += end - start

        def raw_read() -> None:
            raw.wait([raw.post("READ", local, "DRAM", remote, agent)])

        raw_read()
        raw_s = _timed(raw_read)
        rollout._call("pull_end", {"pull_id": ticket["pull_id"], "failed_worker": None}, "ok")
        raw.deregister(reg)
        del rbuf
        v, got = rollout.pull()
        assert all(torch.equal(got[k], model[k]) for k in model), "pulled bytes differ"
        trainer.close()
        rollout.close()

    res = {
        "model_bytes": nbytes,
        "tensors": N_TENSORS,
        "repeats": REPEATS,
        "push_gbps": round(_gbps(nbytes, statistics.median(push_s)), 3),
        "pull_gbps": round(_gbps(nbytes, statistics.median(pull_s)), 3),
        "pull_noverify_gbps": round(_gbps(nbytes, statistics.median(pull_nv_s)), 3),
        "raw_nixl_gbps": round(_gbps(nbytes, statistics.median(raw_s)), 3),
        "memcpy_gbps": round(_gbps(nbytes, statistics.median(memcpy)), 3),
        "crc32_gbps": round(_gbps(nbytes, crc[0]), 3),
        "xxh3_gbps": round(_gbps(nbytes, xxh[0]), 3),
    }
    res["pull_efficiency"] = round(res["pull_gbps"] / res["raw_nixl_gbps"], 3)
    res["pull_noverify_efficiency"] = round(res["pull_noverify_gbps"] / res["raw_nixl_gbps"], 3)
    out = Path(__file__).resolve().parents[1] / "bench-results" / "param_server.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    for k, val in res.items():
        print(f"{k:26s} {val}")


if __name__ == "__main__":
    main()
