"""Param-server throughput: push/pull of a 1 GiB model in 64 tensors between two processes.

One storage worker process holds the weights; this process is the trainer (push) and the
rollout instance (pull). ``raw_nixl_gbps`` is a bare NIXL READ of the very same worker bytes
into a pre-registered buffer of this process, measured in the same run and interleaved with the
pulls (this machine is shared, so interleaving keeps the ratio fair), so
``pull_efficiency = pull_gbps / raw_nixl_gbps`` isolates the service's overhead: plan, control
messages and checksum verification. Writes bench-results/param_server.json. ``--smoke`` moves
16 MiB in 8 tensors, twice (the test suite runs it).

    .venv/bin/python benchmarks/bench_param_server.py [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from param_server import ParamServer, ParamServerClient, ParamServerConfig
from param_server._nixl import Transport

GIB = 1 << 30
N_TENSORS = 64
REPEATS = 5


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _host_rates(model: dict[str, torch.Tensor], repeats: int) -> dict[str, list[float]]:
    flat = torch.cat(list(model.values()))
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    view = flat.numpy().view("uint8")
    out = {
        "memcpy": [_time(lambda: dst.copy_(flat)) for _ in range(repeats)],
        "crc32": [_time(lambda: zlib.crc32(view))],
        "xxh3": [_time(lambda: xxhash.xxh3_64_intdigest(view)) for _ in range(repeats)],
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="16 MiB in 8 tensors, 2 repeats")
    ap.add_argument("--out", default=None, help="default: bench-results/param_server.json")
    a = ap.parse_args(argv)
    size, n_tensors, repeats = (16 << 20, 8, 2) if a.smoke else (GIB, N_TENSORS, REPEATS)
    torch.set_num_threads(1)
    per = size // n_tensors // 4
    model = {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    host = _host_rates(model, repeats)
    gc.collect()

    cfg = ParamServerConfig(num_workers=1, replication=1, keep_versions=1, verify_on_push=True)
    times: dict[str, list[float]] = {"raw": [], "pull": [], "pull_noverify": [], "push": []}
    with (
        ParamServer(cfg) as ps,
        ParamServerClient(ps.address, name="bench-trainer") as trainer,
        ParamServerClient(ps.address, name="bench-rollout") as rollout,
    ):
        # Warm-up: connections, first touch of worker regions (two, as keep_versions=1 holds
        # one version while the next is staged) and of the client's pull buffer.
        trainer.push(1, model)
        trainer.push(2, model)
        version = 2
        rollout.pull()

        # Bare NIXL READ of the same worker bytes between the same two processes.
        ticket = rollout._call(
            "pull_begin", {"receiver": "raw", "names": None, "version": None}, "pull_ticket"
        )
        raw = Transport("bench-raw")
        for name, md in ticket["agents"].items():
            raw.ensure_remote(name, md)
        rbuf = torch.ones(nbytes, dtype=torch.uint8)
        reg = raw.register_tensors([rbuf])
        local, remote, off = [], [], 0
        (worker_agent,) = ticket["agents"]
        for _n, _i, start, end, _agent, addr, dev, _c in ticket["reads"]:
            local.append((rbuf.data_ptr() + off, end - start, 0))
            remote.append((addr, end - start, dev))
            off += end - start

        def raw_read() -> None:
            raw.wait([raw.post("READ", local, "DRAM", remote, worker_agent)])

        raw_read()
        for _ in range(repeats):
            times["raw"].append(_time(raw_read))
            times["pull"].append(_time(rollout.pull))
            times["pull_noverify"].append(_time(lambda: rollout.pull(verify=False)))
        rollout._call("pull_end", {"pull_id": ticket["pull_id"], "failed_worker": None}, "ok")
        raw.deregister(reg)
        del rbuf

        for _ in range(repeats):
            version += 1
            times["push"].append(_time(lambda v=version: trainer.push(v, model)))
        got_version, got = rollout.pull()
        assert got_version == version
        assert all(torch.equal(got[k], model[k]) for k in model), "pulled bytes differ"

    res: dict[str, float | int] = {
        "model_bytes": nbytes,
        "tensors": n_tensors,
        "repeats": repeats,
        "smoke": a.smoke,
        "push_gbps": _gbps(nbytes, times["push"]),
        "pull_gbps": _gbps(nbytes, times["pull"]),
        "pull_noverify_gbps": _gbps(nbytes, times["pull_noverify"]),
        "raw_nixl_gbps": _gbps(nbytes, times["raw"]),
        "memcpy_gbps": _gbps(nbytes, host["memcpy"]),
        "crc32_gbps": _gbps(nbytes, host["crc32"]),
        "xxh3_gbps": _gbps(nbytes, host["xxh3"]),
    }
    res["pull_efficiency"] = round(float(res["pull_gbps"]) / float(res["raw_nixl_gbps"]), 3)
    res["pull_noverify_efficiency"] = round(
        float(res["pull_noverify_gbps"]) / float(res["raw_nixl_gbps"]), 3
    )
    default = Path(__file__).resolve().parents[1] / "bench-results" / "param_server.json"
    out = Path(a.out) if a.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    for k, val in res.items():
        print(f"{k:26s} {val}")
    return res


if __name__ == "__main__":
    main()
