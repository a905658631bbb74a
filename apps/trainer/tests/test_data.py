from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.data import (
    DataCursor,
    check_prompt_lengths,
    load_dataset,
    load_records,
    toy_accuracy,
    toy_records,
    toy_score,
)
from staleflow_trainer.errors import CheckpointError, DataError

ROWS = [
    {
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "reward_model": {"ground_truth": "4", "style": "rule"},
        "data_source": "gsm8k",
        "extra_info": {"split": "train"},
    },
    {"prompt": "What is 3*3?", "ground_truth": 9},
]


def _jsonl(tmp_path: Path, rows: list, name: str = "d.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_jsonl_verl_columns(tmp_path: Path) -> None:
    recs = load_dataset(_jsonl(tmp_path, ROWS))
    assert [r.index for r in recs] == [0, 1]
    assert recs[0].is_chat and recs[0].chat_messages()[0]["content"] == "What is 2+2?"
    assert recs[0].ground_truth == "4" and recs[0].data_source == "gsm8k"
    assert recs[0].extra_info == {"split": "train"}
    assert recs[1].prompt == "What is 3*3?" and recs[1].ground_truth == "9"
    assert recs[1].data_source == "unknown"


def test_parquet(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "data_source": "x"},
                {"prompt": "2+2=", "reward_model": {"ground_truth": "4"}, "data_source": "x"},
            ]
        ),
        p,
    )
    recs = load_dataset(p)
    assert [r.ground_truth for r in recs] == ["2", "4"]


def test_custom_keys(tmp_path: Path) -> None:
    p = _jsonl(tmp_path, [{"question": "q?", "answer": "a"}])
    recs = load_dataset(p, prompt_key="question", answer_key="answer")
    assert recs[0].prompt == "q?" and recs[0].ground_truth == "a"


@pytest.mark.parametrize(
    ("rows", "field", "row"),
    [
        ([{"text": "x", "ground_truth": "1"}], "prompt", 0),
        ([ROWS[1], {"prompt": "   ", "ground_truth": "1"}], "prompt", 1),
        ([{"prompt": [], "ground_truth": "1"}], "prompt", 0),
        ([{"prompt": [{"role": "user"}], "ground_truth": "1"}], "prompt", 0),
        ([{"prompt": 5, "ground_truth": "1"}], "prompt", 0),
        ([{"prompt": "p"}], "reward_model.ground_truth", 0),
        ([{"prompt": "p", "ground_truth": "1", "extra_info": [1]}], "extra_info", 0),
    ],
)
def test_bad_rows_name_row_and_field(tmp_path: Path, rows: list, field: str, row: int) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(_jsonl(tmp_path, rows))
    assert info.value.field == field
    assert info.value.row == row
    assert f"row {row}" in str(info.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported extension"):
        load_dataset(tmp_path / "d.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "ground_truth": "1"}\n{not json\n')
    with pytest.raises(DataError, match="line 2"):
        load_dataset(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_dataset(empty)


def test_prompt_longer_than_context() -> None:
    recs = toy_records("add", size=3, seed=0)
    check_prompt_lengths(recs, [4, 4, 4], max_prompt_len=4)
    with pytest.raises(DataError) as info:
        check_prompt_lengths(recs, [4, 9, 4], max_prompt_len=4)
    assert info.value.row == 1


def test_cursor_is_seeded_and_covers_each_epoch() -> None:
    a, b = DataCursor(10, seed=3), DataCursor(10, seed=3)
    first = a.take(10)
    assert sorted(first) == list(range(10))
    assert first == b.take(10)
    assert first != DataCursor(10, seed=4).take(10)
    second = a.take(10)
    assert sorted(second) == list(range(10)) and second != first  # reshuffled per epoch
    assert a.epoch == 1 and a.served == 20
    assert DataCursor(5, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_cursor_resume_is_exact_across_epochs() -> None:
    ref = DataCursor(7, seed=1)
    expected = ref.take(30)
    c = DataCursor(7, seed=1)
    got = c.take(12)
    state = c.state_dict()
    resumed = DataCursor(7, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives JSON
    got += resumed.take(18)
    assert got == expected


def test_cursor_rejects_mismatched_state() -> None:
    state = DataCursor(7, seed=1).state_dict()
    with pytest.raises(CheckpointError, match="num_records"):
        DataCursor(8, seed=1).load_state_dict(state)
    with pytest.raises(CheckpointError, match="seed"):
        DataCursor(7, seed=2).load_state_dict(state)
    c = DataCursor(7, seed=1)
    c.take(3)
    with pytest.raises(CheckpointError):
        c.load_state_dict({**state, "position": 99})
    assert c.position == 3  # unchanged


def test_toy_task_and_score() -> None:
    recs = toy_records("add", size=50, seed=0)
    assert len(recs) == 50 and all(r.data_source == "toy_add" for r in recs)
    for r in recs:
        a, b = r.prompt[0], r.prompt[2]
        assert r.prompt == f"{a}+{b}=" and int(r.ground_truth) == int(a) + int(b) <= 9
    assert toy_records("add", size=50, seed=0) == recs
    assert toy_score("7", "7") == 1.0 and toy_score(" 7=", "7") == 1.0
    assert toy_score("6", "7") == pytest.approx(0.1)
    assert toy_score("77", "7") == 0.0 and toy_score("+7", "7") == 0.0
    assert toy_accuracy("6", "7") == 0.0 and toy_accuracy("7", "7") == 1.0
    assert {r.ground_truth for r in toy_records("add_mod10", size=200)} == set("0123456789")
    with pytest.raises(DataError):
        toy_records("mul", size=1)


def test_load_records_from_config(tmp_path: Path) -> None:
    cfg = load_config(None, ["data.toy_size=12"])
    assert len(load_records(cfg)) == 12
    p = _jsonl(tmp_path, ROWS)
    assert len(load_records(load_config(None, [f"data.path={p}"]))) == 2


def test_encode_prompts_with_char_tokenizer() -> None:
    from staleflow_trainer.data import encode_prompts
    from staleflow_trainer.tiny_model import make_char_tokenizer

    tok = make_char_tokenizer()
    recs = toy_records("add", size=4, seed=0)
    ids = encode_prompts(recs, tok, max_prompt_len=4)
    assert all(len(x) == 4 for x in ids)
    assert tok.decode(list(ids[0])) == recs[0].prompt
    with pytest.raises(DataError) as info:
        encode_prompts(recs, tok, max_prompt_len=3)
    assert info.value.row == 0 and "max_prompt_len=3" in str(info.value)
    with pytest.raises(DataError) as named:
        encode_prompts(recs, tok, max_prompt_len=3, source="data/train.jsonl")
    assert named.value.path == "data/train.jsonl"
    assert str(named.value).startswith("data/train.jsonl: row 0: prompt has 4 tokens")
    with pytest.raises(DataError, match="chat template"):
        encode_prompts(recs, tok, max_prompt_len=8, apply_chat_template=True)


def test_preflight_names_the_file_of_an_over_long_prompt(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The check the driver runs before anything starts: the error names the dataset file."""
    from staleflow_trainer.runtime.prepare import preflight

    p = _jsonl(tmp_path, [{"prompt": "1+1=", "ground_truth": "2"},
                          {"prompt": "1+" * 100, "ground_truth": "1"}])  # fmt: skip
    cfg = load_config(None, [f"data.path={p}", "data.max_prompt_len=16"])
    with pytest.raises(DataError) as info:
        preflight(cfg, tiny_model_dir)
    assert info.value.path == str(p) and info.value.row == 1
    assert str(info.value).startswith(f"{p}: row 1: prompt has")


def test_preflight_hands_on_the_prompts_as_the_engines_see_them(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """What the driver checked is what the control process submits: each row's record, its
    token ids (the tokenizer's, no special tokens added) and the end-of-sequence id."""
    from transformers import AutoTokenizer

    from staleflow_trainer.runtime.prepare import preflight

    p = _jsonl(tmp_path, [{"prompt": "1+1=", "ground_truth": "2"},
                          {"prompt": "12+3=", "ground_truth": "15"}])  # fmt: skip
    cfg = load_config(None, [f"data.path={p}", "data.max_prompt_len=16"])
    prompts, _ = preflight(cfg, tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert len(prompts) == 2
    assert [r.ground_truth for r in prompts.records] == ["2", "15"]
    for row, text in enumerate(["1+1=", "12+3="]):
        assert prompts.ids(row) == tuple(tok(text, add_special_tokens=False)["input_ids"])
    assert prompts.eos_token_id == tok.eos_token_id
    # it travels to the control process pickled (through Ray's object store)
    assert pickle.loads(pickle.dumps(prompts)) == prompts


def test_encoded_prompts_refuse_records_and_ids_that_do_not_line_up() -> None:
    from staleflow_trainer.data import EncodedPrompts, PromptRecord

    rec = PromptRecord(index=0, prompt="1+1=", ground_truth="2")
    with pytest.raises(ValueError, match="1 records but 2 encoded prompts"):
        EncodedPrompts([rec], [(1,), (2,)])


def test_the_control_process_loads_no_tokenizer(tmp_path: Path) -> None:
    """The control process takes the prompts the driver encoded: its shell starts and knows
    the rows and their lengths without importing ``transformers`` or ``torch`` (seconds at
    start-up)."""
    code = f"""
import asyncio, sys
from trajectory_server.client import TrajectoryClient
from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.config import load_config
from staleflow_trainer.data import EncodedPrompts, PromptRecord

async def connect(*a, **k):
    return object()

TrajectoryClient.connect = connect
cfg = load_config(None, ["run_dir={tmp_path}"])
rec = PromptRecord(index=0, prompt="1+1=", ground_truth="2")
io = ShellIO(cfg, prompts=EncodedPrompts([rec], [(5, 6, 7)], 2).lengths(), ts_address=("127.0.0.1", 1),
             ts_token="t", rollouts={{}}, trainer=None, rewards=[], reward_spec={{}})
asyncio.run(io.start())
print(io.rows, io.prompt_len(0), "transformers" in sys.modules,
      "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "3", "False", "False"]
