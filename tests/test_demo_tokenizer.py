"""The demo tokenizers: the large byte-level BPE that fills Qwen3's 151,936 logits (for random-weight
benchmarks with text and structured outputs), and the small one the other tests use."""

import json

import pytest
from transformers import AutoTokenizer

from nanovllm.demo_models import (
    QWEN3_UNUSED_IDS,
    SPECIAL_TOKENS,
    write_large_tokenizer,
    write_tokenizer,
)

VOCAB_SIZE = 151936
REGULAR = VOCAB_SIZE - QWEN3_UNUSED_IDS  # 151,643 as Qwen3's

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    json.dumps(
        {
            "name": "Ada Lovelace",
            "email": "ada@example.com",
            "age": 36,
            "active": True,
            "score": -1.5e-3,
            "tags": ["math", "poetry"],
            "address": None,
        }
    ),
    json.dumps({"a": [1, {"b": 'c"d\\e'}], "ü": "中文字符", "emoji": "🙂"}, indent=2, ensure_ascii=False),
    "  leading spaces,\ttabs\t\tand\r\nCRLF\n\n\nnewlines   ",
    "Ünïcödé: 日本語のテキスト, русский текст, ελληνικά, עברית, 🚀🔥 \u200b zero-width",
    "\x00\x01 control bytes \x7f and a lone surrogate-free astral char 𝔘",
    "def f(x):\n    return {'k': x ** 2}  # code\n",
    "",
]


@pytest.fixture(scope="session")
def large_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("large_tokenizer"))
    write_large_tokenizer(path, VOCAB_SIZE)
    return path


@pytest.fixture(scope="session")
def large_tok(large_dir):
    return AutoTokenizer.from_pretrained(large_dir)


def test_large_tokenizer_fills_the_vocabulary_with_the_special_tokens_after(large_tok):
    assert len(large_tok) == REGULAR + len(SPECIAL_TOKENS) <= VOCAB_SIZE
    assert [large_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(
        range(REGULAR, REGULAR + len(SPECIAL_TOKENS))
    )
    assert large_tok.eos_token == "<|im_end|>" and large_tok.eos_token_id == REGULAR + 2
    assert large_tok.pad_token == "<|endoftext|>"
    vocab = large_tok.get_vocab()
    # JSON punctuation runs, words with and without a leading space ("Ġ"), indentation
    for token in ('{"', '":', '",', '"}', 'Ġ"', "Ġthe", "the", "name", "Ġtrue", "ĠĠĠ", ",Ċ"):
        assert token in vocab, token


def test_large_tokenizer_round_trips_text(large_tok):
    for text in TEXTS:
        ids = large_tok.encode(text, add_special_tokens=False)
        assert large_tok.decode(ids) == text
    record = TEXTS[1]
    assert len(large_tok.encode(record, add_special_tokens=False)) < len(record) / 2


def test_large_tokenizer_keeps_the_chat_template(large_tok):
    messages = [{"role": "user", "content": "Give me a JSON record."}]
    text = large_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nGive me a JSON record.<|im_end|>\n<|im_start|>assistant\n"
    ids = large_tok.encode(text, add_special_tokens=False)
    assert ids[0] == large_tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(large_tok.eos_token_id) == 1


def test_large_tokenizer_is_deterministic(tmp_path):
    """The same files on every build (checked on a smaller size, to stay fast)."""
    for name in ("a", "b"):
        write_large_tokenizer(str(tmp_path / name), 8192)
    a, b = ((tmp_path / name / "tokenizer.json").read_bytes() for name in ("a", "b"))
    assert a == b
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert len(tok) == 8192 - QWEN3_UNUSED_IDS + len(SPECIAL_TOKENS)
    assert all(tok.decode(tok.encode(t, add_special_tokens=False)) == t for t in TEXTS)


def test_large_tokenizer_refuses_sizes_it_cannot_fill(tmp_path):
    with pytest.raises(ValueError, match="regular_tokens"):
        write_large_tokenizer(str(tmp_path), 512)
    with pytest.raises(ValueError, match="regular_tokens"):
        write_large_tokenizer(str(tmp_path), 4096, regular_tokens=4095)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "active", "role", "tags"],
    "additionalProperties": False,
}


def test_xgrammar_compiles_a_json_schema_for_the_large_tokenizer(large_tok):
    xgr = pytest.importorskip("xgrammar")
    import torch

    info = xgr.TokenizerInfo.from_huggingface(large_tok, vocab_size=VOCAB_SIZE)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.vocab_size == VOCAB_SIZE and info.stop_token_ids == [large_tok.eos_token_id]
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(SCHEMA)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)

    def allowed() -> torch.Tensor:
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, VOCAB_SIZE)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return logits[0] == 0

    record = {"name": "Ada Lovelace", "age": 36, "active": True, "role": "admin", "tags": ["math", "x y"]}
    text = json.dumps(record)  # the separators xgrammar's JSON grammar takes by default
    first = allowed()
    assert first[large_tok.convert_tokens_to_ids('{"')] and first[large_tok.convert_tokens_to_ids("{")]
    assert not first[large_tok.convert_tokens_to_ids("Ġthe")] and not first[large_tok.eos_token_id]
    assert not first[REGULAR + 10 :].any()  # ids past the tokenizer's are never allowed
    for token in large_tok.encode(text, add_special_tokens=False):
        assert allowed()[token], large_tok.convert_ids_to_tokens(token)
        assert matcher.accept_token(token)
    assert allowed()[large_tok.eos_token_id]
    assert matcher.accept_token(large_tok.eos_token_id) and matcher.is_terminated()


def test_small_tokenizer_keeps_its_layout(tmp_path):
    """``write_tokenizer`` (the tests' tiny checkpoints): special tokens first, a few hundred tokens."""
    eos = write_tokenizer(str(tmp_path), 512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2] and eos == 2
    assert 256 + len(SPECIAL_TOKENS) < len(tok) <= 512
    assert tok.decode(tok.encode(TEXTS[0], add_special_tokens=False)) == TEXTS[0]
