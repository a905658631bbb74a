"""The README's embedding snippet, run as written, cannot train on data staler than η.

The snippet (the first ``python`` block under "Embedding it in your RL loop") is executed
verbatim in a namespace that supplies what it leaves to the user — rollout instances, engines,
a result store, a prompt queue, a trainer — as a small simulated rollout/trainer loop in
virtual ticks. Each sample records the weights version its instance *really* held when
generation started; the trainer checks ``consumed buffer − that version ≤ η`` for every
sample it trains, whatever the training time. The other README examples run too.
"""

from __future__ import annotations

import random
import re
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from staleness_protocol import VersionNotPublished

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = 8


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def embedding_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Embedding it in your RL loop") :]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None
    return match.group(1)


class Prompt:
    def __init__(self, pid: str) -> None:
        self.id = pid


class World:
    """Everything the snippet expects from the embedding, in virtual ticks."""

    def __init__(self, train_ticks: int, seed: int, sync_to: str = "published_version") -> None:
        self.rng = random.Random(seed)
        self.tick = 0
        self.train_ticks = train_ticks
        self.sync_to = sync_to
        self.instances = [Instance(self, f"i{k}") for k in range(4)]
        self.queue: deque[Prompt] = deque()
        self.serial = 0
        self.done: list[tuple[int, str, Any]] = []  # (tick, trajectory id, output)
        self.stored: dict[str, Any] = {}
        self.training: tuple[int, int] | None = None  # (version trained, tick it lands)
        self.trained_staleness: list[int] = []
        self.steps = 0
        self.doomed: set[str] = set()

    # the names the snippet uses
    def add_one(self, replacing: Any = None) -> None:
        pid = f"q{self.serial}"
        self.serial += 1
        if self.rng.random() < 0.1:
            self.doomed.add(pid)  # DAPO: its rewards will all be equal
        self.queue.append(Prompt(pid))

    def discard(self, group_id: str) -> None:
        self.queue = deque(q for q in self.queue if q.id != group_id)

    def keep(self, tid: str, output: Any) -> None:
        self.stored[tid] = output

    def pop(self, tid: str) -> Any:
        return self.stored.pop(tid)

    def store_discard(self, tid: str) -> None:
        self.stored.pop(tid, None)

    def engines_abort(self, tid: str) -> None:
        for inst in self.instances:
            inst.running.pop(tid, None)

    def train(self, version: int, outputs: list[Any]) -> None:
        assert self.training is None
        self.trained_staleness += [version - o["weights"] for o in outputs]
        self.training = (version, self.tick + self.train_ticks)


class Instance:
    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.version = 0  # the weights it holds
        self.running: dict[str, dict[str, Any]] = {}

    def sync(self, version: int) -> None:
        self.version = version  # in-flight work keeps the V_traj it started with

    def generate(self, prompt: Prompt, sample: int) -> None:
        w = self.world
        length = w.rng.randint(2, 6) if w.rng.random() > 0.05 else w.rng.randint(15, 30)
        tid = f"{prompt.id}/{sample}"
        self.running[tid] = {"done": w.tick + length, "weights": self.version}


def run(world: World, ns: dict[str, Any]) -> None:
    p = ns["p"]
    for _ in range(5000):
        world.tick += 1
        # instances pull the newest weights when idle (must_sync is handled by route)
        for inst in world.instances:
            target = getattr(p, world.sync_to)
            if not inst.running and inst.version < target:
                inst.sync(target)
        while len(world.queue) < 200:  # the data loader keeps prompts queued
            world.add_one()
        pending = list(world.queue)
        world.queue.clear()
        for prompt in pending:
            if not ns["route"](prompt, world.instances):
                world.queue.append(prompt)
        ns["drain"]()
        for inst in world.instances:
            for tid, info in list(inst.running.items()):
                if info["done"] <= world.tick and inst.running.pop(tid, None) is not None:
                    gid = tid.rsplit("/", 1)[0]
                    ns["on_rewarded"](tid, info, gid in world.doomed)
                    ns["drain"]()
        if world.training is not None and world.training[1] <= world.tick:
            version = world.training[0] + 1
            world.training = None
            world.steps += 1
            ns["on_weights_pushed"](version)
        if world.training is None and world.steps + (p.next_buffer - p.published_version) < STEPS:
            ns["on_trainer_idle"]()
        ns["drain"]()
        if world.steps == STEPS:
            return
    raise AssertionError(f"only {world.steps} steps trained in 5000 ticks")


def namespace(world: World) -> dict[str, Any]:
    class Store:
        keep = staticmethod(world.keep)
        pop = staticmethod(world.pop)
        discard = staticmethod(world.store_discard)

    class Engines:
        abort = staticmethod(world.engines_abort)

    class Prompts:
        discard = staticmethod(world.discard)
        add_one = staticmethod(world.add_one)

    class Trainer:
        train = staticmethod(world.train)

    ns: dict[str, Any] = {
        "prompts": Prompts,
        "engines": Engines,
        "store": Store,
        "trainer": Trainer,
        "group_of": lambda tid: tid.rsplit("/", 1)[0],
    }
    exec(compile(embedding_snippet(), str(README), "exec"), ns)
    return ns


@pytest.mark.parametrize("train_ticks", [0, 1, 3, 10, 40])
def test_following_the_readme_never_trains_on_data_staler_than_eta(train_ticks: int) -> None:
    world = World(train_ticks=train_ticks, seed=train_ticks)
    ns = namespace(world)
    run(world, ns)
    p = ns["p"]
    eta = p.config.eta
    assert len(world.trained_staleness) == STEPS * p.config.batch_size * p.config.group_size
    assert max(world.trained_staleness) <= eta
    assert min(world.trained_staleness) >= 0
    # what the protocol reports is what really happened
    hist: dict[int, int] = {}
    for s in world.trained_staleness:
        hist[s] = hist.get(s, 0) + 1
    assert p.stats().staleness_histogram == hist
    assert ns["checkpoint"]()["protocol"]["next_buffer"] == STEPS


def test_syncing_to_the_version_being_trained_is_refused_loudly() -> None:
    """The trap of 0.1 (instances synced to the version the trainer is still producing) now
    fails at the first admission instead of silently adding one version of staleness."""
    world = World(train_ticks=5, seed=1, sync_to="next_buffer")
    ns = namespace(world)
    with pytest.raises(VersionNotPublished, match="not published yet"):
        run(world, ns)


def test_the_other_readme_examples_run() -> None:
    blocks = [b for b in python_blocks() if b != embedding_snippet()]
    ran = 0
    for block in blocks:
        if "StalenessProtocol(ProtocolConfig" in block or "import" not in block:
            continue  # the import line at the top of the API section
        exec(compile(block, str(README), "exec"), {})
        ran += 1
    assert ran >= 2  # UnboundedFifo and GcFifo
