"""A new prompt group goes to the trajectory server by its dataset row: the run's trajectory
server holds the prompt table (``TrajectoryServerActor.load_prompts``, filled by the driver),
and the control process sends the row, the member count and the sampling parameters only."""

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


async def test_a_group_goes_by_its_row_and_gets_the_prompt_from_the_table(tmp_path: Path) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    prompts = _prompts()
    ts = TrajectoryServerActor(token="t")
    assert await ts.load_prompts(prompts) == 3
    client = InProcessTrajectoryClient(ts._dispatcher, token="t")
    await GroupSubmitter(cfg, prompts.lengths()).submit(
        client, fx.GroupSpec(group_id="g4", row=1, members=4)
    )
    sent = client.wire_bytes()["submit_group"]
    assert sent["sent"] < 300, sent  # the row, not the prompt's 1.2 KB
    assert sent["received"] < 40, sent  # the member count, not their ids
    store = ts.store
    for i in range(4):
        t = store.get(f"g4/{i}")
        assert t.prompt_token_ids.tolist() == list(LONG)
        assert t.metadata == {"index": 1, "ground_truth": "1", "data_source": "d",
                              "extra_info": {}}  # fmt: skip
        assert t.sampling.stop_token_ids == (2,)
    # submitted again (a replacement control actor): already there, nothing changes
    await GroupSubmitter(cfg, prompts.lengths()).submit(
        client, fx.GroupSpec(group_id="g4", row=1, members=4)
    )
    assert len(store) == 4


async def test_a_row_the_table_lacks_fails_loudly(tmp_path: Path) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    ts = TrajectoryServerActor(token="t")  # no prompts loaded
    client = InProcessTrajectoryClient(ts._dispatcher, token="t")
    with pytest.raises(InvalidRecord, match="no prompt under key 1"):
        await GroupSubmitter(cfg, _prompts().lengths()).submit(
            client, fx.GroupSpec(group_id="g4", row=1, members=4)
        )


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
