"""Reward workers decode responses with the tokenizer's ``tokenizers`` backend where the driver
checked that it gives the text ``tokenizer.decode`` gives, and with ``transformers`` otherwise
(``staleflow_trainer.reward.decode``)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from staleflow_trainer.reward.decode import ResponseDecoder, _checked, portable_backend


def _byte_level_bpe(clean_up: bool = False, cls: Any = None) -> Any:
    """A small byte-level BPE tokenizer with a special token, as Qwen and Llama tokenizers
    are built (trained here on a few sentences: no model hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The answer is 42.", "So, 3 + 4 = 7 ; then (7 * 6) = 42 !", "Überprüfe: é, ß, 猫."]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|im_end|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(text * 20, trainer)
    return (cls or PreTrainedTokenizerFast)(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=clean_up,
    )


def _random_ids(vocab: int, n: int = 200, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(n)]


def test_the_backend_decodes_as_the_tokenizer_does(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    for tok in (AutoTokenizer.from_pretrained(str(tiny_model_dir)), _byte_level_bpe()):
        prompts = [tok("So, 3 + 4 = 7 <|im_end|> é", add_special_tokens=False)["input_ids"]]
        backend = portable_backend(tok, prompts)
        assert backend is not None
        dec = ResponseDecoder(backend=backend, tokenizer_path="unused")
        assert dec.portable
        # ids the check did not see (another seed), special tokens and split UTF-8 included
        for ids in [*prompts, *_random_ids(len(tok))]:
            assert dec.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def _word_piece(clean_up: bool) -> Any:
    """A WordPiece tokenizer (BERT's kind), whose space clean-up transformers does run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[SEP]", "so", ",", "3", "+", "=", "7", "."])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left to transformers
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=clean_up)  # fmt: skip


def test_a_tokenizer_whose_clean_up_runs_keeps_transformers(tiny_model_dir: Path) -> None:
    cleans = _word_piece(clean_up=True)
    assert cleans.decode([2, 3, 4]) != cleans.backend_tokenizer.decode([2, 3, 4])  # "so," / "so ,"
    assert portable_backend(cleans) is None
    assert portable_backend(_word_piece(clean_up=False)) is not None
    # transformers skips the clean-up for BPE models: the backend still decodes alike
    bpe = _byte_level_bpe(clean_up=True)
    backend = portable_backend(bpe)
    assert backend is not None
    dec = ResponseDecoder(backend=backend, tokenizer_path="unused")
    for ids in _random_ids(len(bpe)):
        assert dec.decode(ids) == bpe.decode(ids, skip_special_tokens=True)
    dec = ResponseDecoder(backend=None, tokenizer_path=str(tiny_model_dir))
    assert not dec.portable
    assert dec.decode([5, 6]) == dec._tokenizer.decode([5, 6], skip_special_tokens=True)


def test_a_tokenizer_class_that_rewrites_decoding_keeps_transformers() -> None:
    """A subclass with its own ``_decode`` (as some speech tokenizers merge repeated ids) is
    refused before any sample is decoded."""
    from transformers import PreTrainedTokenizerFast

    class Merges(PreTrainedTokenizerFast):
        def _decode(self, token_ids: Any, **kw: Any) -> str:
            ids = [t for i, t in enumerate(token_ids) if i == 0 or t != token_ids[i - 1]]
            return str(super()._decode(ids, **kw))

    assert portable_backend(_byte_level_bpe(cls=Merges)) is None
    slow = type("Slow", (), {"is_fast": False, "clean_up_tokenization_spaces": False})()
    assert portable_backend(slow) is None


def test_the_sample_check_finds_a_difference() -> None:
    """Past the class checks, any sample decoded differently keeps ``transformers`` (here a
    decode that rewrites the text, as a Python-side clean-up would)."""
    real = _byte_level_bpe()

    class Differs:
        backend_tokenizer = real.backend_tokenizer

        def __len__(self) -> int:
            return len(real)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            text = str(real.decode(ids, skip_special_tokens=skip_special_tokens))
            return text.replace(" !", "!")

    ids = real("then (7 * 6) = 42 !", add_special_tokens=False)["input_ids"]
    assert _checked(Differs(), [ids]) is None
    assert _checked(real, [ids]) is not None


def test_a_reward_worker_with_the_backend_imports_no_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    backend = portable_backend(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    assert backend is not None
    code = (
        "import sys\n"
        "from staleflow_trainer.actors.reward_actor import RewardActor\n"
        "a = RewardActor(fn='staleflow_trainer.reward.default:compute_score', retries=0,\n"
        "    timeout_s=1.0, tokenizer_path='unused', ts_address=('127.0.0.1', 1),\n"
        "    ts_token=None, decoder=sys.stdin.read())\n"
        "print(a._decoder.portable, repr(a._decoder.decode([5, 6, 7])),\n"
        "      'transformers' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=backend, capture_output=True,
                         text=True, check=True)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert "decodes_with=tokenizers" in out.stdout  # its start-up log line says so
    assert out.stdout.splitlines()[-1].split() == ["True", repr(tok.decode([5, 6, 7], skip_special_tokens=True)),
                                  "False", "False"]  # fmt: skip
