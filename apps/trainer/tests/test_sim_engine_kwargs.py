"""A sim engine's arguments carry the tokenizer's facts (vocabulary, special tokens, end of
sequence), read once per model for all instances, and read again when the tokenizer changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import transformers

from staleflow_trainer.config import load_config
from staleflow_trainer.runtime.prepare import engine_kwargs

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"


def test_instances_share_one_read_of_the_tokenizer(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", "rollout.num_instances=4"])
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    reads: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def counted(path: str, *a: object, **k: object) -> object:
        reads.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    configs = [engine_kwargs(cfg, i, model)["config"] for i in range(4)]
    assert len(reads) == 1
    for i, c in enumerate(configs):
        assert (c.vocab_size, c.eos_token_id) == (len(tok), tok.eos_token_id)
        assert c.num_special_tokens == max(1, len(tok.all_special_ids))
        assert c.seed == cfg.run.seed + i  # each instance its own
    # a tokenizer written again under the same path is read again
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text())
    engine_kwargs(cfg, 0, model)
    assert len(reads) == 2
