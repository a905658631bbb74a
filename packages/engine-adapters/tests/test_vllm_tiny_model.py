"""The tiny Qwen2 builder and the checkpoint weight schema (no engine started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_adapters.errors import InvalidWeights
from engine_adapters.testing.tiny_model import make_tiny_qwen2
from engine_adapters.vllm import WeightSchema

pytestmark = pytest.mark.vllm

SMALL = {"vocab_size": 300, "hidden_size": 64, "num_layers": 1, "intermediate_size": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny"), **SMALL)


def test_weights_are_a_function_of_the_seed(tiny: Path, tmp_path: Path) -> None:
    again = load_file(str(make_tiny_qwen2(tmp_path / "again", **SMALL) / "model.safetensors"))
    other = load_file(
        str(make_tiny_qwen2(tmp_path / "other", seed=1, **SMALL) / "model.safetensors")
    )
    base = load_file(str(tiny / "model.safetensors"))
    assert base.keys() == again.keys() == other.keys()
    assert all(torch.equal(base[k], again[k]) for k in base)
    assert not all(torch.equal(base[k], other[k]) for k in base if base[k].dim() == 2)


def test_second_call_reuses_the_directory(tiny: Path) -> None:
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_qwen2(tiny, **SMALL) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp


def test_config_and_tokenizer(tiny: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (300, 64, 1)
    assert config.hidden_size // config.num_attention_heads >= 32
    tok = AutoTokenizer.from_pretrained(tiny)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) <= config.vocab_size
    ids = tok("12+34=46 the answer").input_ids
    assert tok.decode(ids) == "12+34=46 the answer"
    assert len(ids) < len("12+34=46 the answer")  # BPE merged something


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"hidden_size": 64, "num_heads": 4}, "head_dim"),
        ({"hidden_size": 96, "num_heads": 5}, "divisible"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_bad_sizes_are_named(tmp_path: Path, kwargs: dict[str, int], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        make_tiny_qwen2(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_schema_accepts_the_state_dict_and_names_every_problem(tiny: Path) -> None:
    schema = WeightSchema.from_model_dir(tiny)
    good = load_file(str(tiny / "model.safetensors"))
    names, tensors = schema.validate(good)
    assert names == sorted(good) and len(tensors) == len(good)
    first, second = sorted(good)[:2]
    bad = dict(good)
    del bad[first]
    bad["bogus.weight"] = torch.zeros(3)
    bad[second] = good[second][..., :-1]
    bad["model.norm.weight"] = [1.0, 2.0]
    with pytest.raises(InvalidWeights) as info:
        schema.validate(bad)
    err = info.value
    assert err.field == "named_tensors"
    assert err.missing == [first] and err.unexpected == ["bogus.weight"]
    assert len(err.mis_shaped) == 1 and second in err.mis_shaped[0]
    assert err.bad_type == ["model.norm.weight (list)"]
    for text in (first, "bogus.weight", second, "model.norm.weight"):
        assert text in str(err)


def test_tied_embeddings_make_lm_head_optional(tmp_path: Path) -> None:
    tied = make_tiny_qwen2(tmp_path / "tied", tie_word_embeddings=True, **SMALL)
    schema = WeightSchema.from_model_dir(tied)
    from transformers import Qwen2ForCausalLM

    state = Qwen2ForCausalLM.from_pretrained(str(tied)).state_dict()
    assert "lm_head.weight" in state and "lm_head.weight" not in schema.required
    names, _ = schema.validate(state)
    assert "lm_head.weight" in names
    state.pop("lm_head.weight")
    schema.validate(state)
