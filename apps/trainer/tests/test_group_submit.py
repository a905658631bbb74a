"""New prompt groups go to the trajectory server by their dataset rows, in one request: the run's
trajectory server holds the prompt table (``TrajectoryServerActor.load_prompts``, filled by the
driver), and the control process sends each group's row, member count and seed, and the
sampling parameters once."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.actors.group_submit import GroupSubmitter
from staleflow_trainer.actors.ts_actor import TrajectoryServerActor
from staleflow_trainer.config import load_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.data import EncodedPrompts, PromptRecord
from trajectory_server.client import InProcessTrajectoryClient
from trajectory_server.errors import InvalidRecord

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"
LONG = tuple(range(100, 400))  # 300 tokens: 1.2 KB if they travelled


def _prompts() -> EncodedPrompts:
    recs = [PromptRecord(index=i, prompt=f"q{i}", ground_truth=str(i), data_source="d")
            for i in range(3)]  # fmt: skip
    return EncodedPrompts(recs, [(5, 6), LONG, (9,)], eos_token_id=2)


async def test_groups_go_by_their_rows_and_get_the_prompts_from_the_table(
    tmp_path: Path,
) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    prompts = _prompts()
    ts = TrajectoryServerActor(token="t")
    assert await ts.load_prompts(prompts) == 3
    client = InProcessTrajectoryClient(ts._dispatcher, token="t")
    sub = GroupSubmitter(cfg, prompts.lengths())
    groups = [fx.GroupSpec(group_id="g4", row=1, members=4),
              fx.GroupSpec(group_id="g5", row=0, members=2)]  # fmt: skip
    await sub.submit(client, groups)
    sent = client.wire_bytes()["submit_groups"]
    assert sent["requests"] == 1, sent  # one request for both groups
    assert sent["sent"] < 200, sent  # the rows, not the prompt's 1.2 KB
    assert sent["received"] < 40, sent  # a count, not the members' ids
    store = ts.store
    for i in range(4):
        t = store.get(f"g4/{i}")
        assert t.prompt_token_ids.tolist() == list(LONG)
        assert t.metadata == {"index": 1, "ground_truth": "1", "data_source": "d",
                              "extra_info": {}}  # fmt: skip
        assert t.sampling.stop_token_ids == (2,)
        assert t.sampling.max_new_tokens == cfg.rollout.sampling.max_new_tokens
        # the seed group g4 always had (run seed 0: serial 5 times 64), + i
        assert t.sampling.seed == (cfg.run.seed * 1_000_003 + 5 * 64) % 2**31 + i
    assert store.get("g5/1").prompt_token_ids.tolist() == [5, 6]
    assert sub.seed("g5") != sub.seed("g4")
    # submitted again (a replacement control actor), with a new one: the old are left as
    # they are, the new one is added
    await sub.submit(client, [*groups, fx.GroupSpec(group_id="g6", row=2, members=1)])
    assert len(store) == 7 and store.get("g6/0").prompt_token_ids.tolist() == [9]


async def test_a_row_the_table_lacks_fails_loudly_and_submits_nothing(tmp_path: Path) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    ts = TrajectoryServerActor(token="t")
    await ts.load_prompts(_prompts())
    client = InProcessTrajectoryClient(ts._dispatcher, token="t")
    groups = [fx.GroupSpec(group_id="g4", row=1, members=4),
              fx.GroupSpec(group_id="g5", row=3, members=4)]  # fmt: skip
    with pytest.raises(InvalidRecord, match="no prompt under key 3"):
        await GroupSubmitter(cfg, _prompts().lengths()).submit(client, groups)
    assert len(ts.store) == 0


def test_the_control_process_gets_lengths_not_tokens() -> None:
    """What the control process is given of the prompts: each row's length and the
    end-of-sequence id, a few bytes a row pickled, not the tokens or the records."""
    import pickle

    prompts = _prompts()
    lengths = prompts.lengths()
    assert len(lengths) == 3 and lengths.eos_token_id == 2
    assert [lengths.length(r) for r in range(3)] == [prompts.length(r) for r in range(3)]
    assert [lengths.length(r) for r in range(3)] == [2, 300, 1]
    for bad in (-1, 3):
        with pytest.raises(IndexError, match=r"not in 0\.\.2"):
            lengths.length(bad)
    assert len(pickle.dumps(lengths)) < 200 < len(pickle.dumps(prompts))
    back = pickle.loads(pickle.dumps(lengths))
    assert [back.length(r) for r in range(3)] == [2, 300, 1] and back.eos_token_id == 2
