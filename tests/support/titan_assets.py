"""What TorchTitan reads from disk, made here so nothing is downloaded: a word-level Hugging Face tokenizer
(`tokenizers`, with the tokenizer_config.json TorchTitan takes BOS and EOS from) and a small text dataset in the
layout of TorchTitan's own `c4_test` (a folder of JSON lines with a "text" field, read by `datasets`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = 200  # the debug model's vocabulary is 2048: every id fits


def write_tokenizer(folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json for words w0..w{WORDS-1} plus <unk>, <s> and </s>."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(WORDS)])}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def documents(count: int, words: int, seed: int = 0) -> list[str]:
    """`count` texts of `words` words each: with BOS and EOS a text is words + 2 tokens, so at seq_len = words + 1
    TorchTitan packs each text into exactly one sample (its inputs drop the last token, its labels the first)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(WORDS)}" for _ in range(words)) for _ in range(count)]


def write_dataset(folder: Path, texts: list[str]) -> Path:
    """`texts` as folder/data.json, one {"text": ...} per line, the way TorchTitan's c4_test is stored."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder
