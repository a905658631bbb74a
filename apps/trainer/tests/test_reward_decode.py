"""Reward workers decode responses with the tokenizer's ``tokenizers`` backend where the driver
checked that it gives the text ``tokenizer.decode`` gives, and with ``transformers`` otherwise
(``staleflow_trainer.reward.decode``)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from staleflow_trainer.reward.decode import ResponseDecoder, portable_backend


def _byte_level_bpe(clean_up: bool = False) -> Any:
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
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
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


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers(tiny_model_dir: Path) -> None:
    assert portable_backend(_byte_level_bpe(clean_up=True)) is None
    dec = ResponseDecoder(backend=None, tokenizer_path=str(tiny_model_dir))
    assert not dec.portable
    assert dec.decode([5, 6]) == dec._tokenizer.decode([5, 6], skip_special_tokens=True)


def test_any_difference_found_by_the_check_keeps_transformers() -> None:
    """A tokenizer whose decode does more than its backend (here it appends to the text, as a
    Python-side clean-up would) fails the check."""
    real = _byte_level_bpe()

    class Differs:
        is_fast = True
        clean_up_tokenization_spaces = False
        backend_tokenizer = real.backend_tokenizer

        def __len__(self) -> int:
            return len(real)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            text = str(real.decode(ids, skip_special_tokens=skip_special_tokens))
            return text.replace(" !", "!")

    ids = real("then (7 * 6) = 42 !", add_special_tokens=False)["input_ids"]
    assert portable_backend(Differs(), [ids]) is None
    assert portable_backend(real, [ids]) is not None
    slow = type("Slow", (), {"is_fast": False, "clean_up_tokenization_spaces": False})()
    assert portable_backend(slow) is None


def test_a_reward_worker_with_the_backend_imports_no_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    backend = portable_backend(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    assert backend is not None
    code = (
        "import sys\n"
        "from staleflow_trainer.actors.reward_actor import RewardActor\n"
        "from staleflow_trainer.reward.decode import ResponseDecoder\n"
        "d = ResponseDecoder(backend=sys.stdin.read(), tokenizer_path='unused')\n"
        "print(repr(d.decode([5, 6, 7])), 'transformers' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=backend, capture_output=True,
                         text=True, check=True)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert out.stdout.split() == [repr(tok.decode([5, 6, 7], skip_special_tokens=True)),
                                  "False", "False"]  # fmt: skip
