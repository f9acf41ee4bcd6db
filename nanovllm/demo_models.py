"""Model folders for demos and benchmarks, made on the spot (no download, runtime dependencies only).

A config-only folder runs with ``load_format="dummy"`` (random weights); a small tokenizer
can be added so that string prompts work, or one whose vocabulary fills a Qwen3 shape's logits
(``write_large_tokenizer``: text, chat and structured outputs on a real-sized vocabulary).
"""

import json
import os

from nanovllm.models.registry import ARCHITECTURES

SHAPES = {
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}
_CORPUS = (
    "Hello, Nano-vLLM. The quick brown fox jumps over the lazy dog. Paged attention stores keys "
    "and values in fixed-size blocks. Continuous batching keeps the GPU busy. Prefix caching "
    "reuses blocks that hold the same tokens. list all prime numbers within 100. introduce yourself"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_config(
    path: str,
    shape: str = "qwen3-0.6b",
    architecture: str | None = None,
    dtype: str = "bfloat16",
    **overrides,
) -> dict:
    """Write a ``config.json`` of a named shape (for ``load_format="dummy"``); returns it. The
    architecture defaults to the shape's own (Qwen3 dense unless it names one)."""
    shape_cfg = dict(SHAPES[shape])
    architecture = architecture or shape_cfg.get("architecture", "Qwen3ForCausalLM")
    shape_cfg.pop("architecture", None)
    cfg = dict(
        shape_cfg,
        architectures=[architecture],
        model_type=ARCHITECTURES[architecture].model_type,
        dtype=dtype,
        torch_dtype=dtype,
        hidden_act="silu",
        eos_token_id=2,
        bos_token_id=1,
    )
    cfg.update(overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


def write_tokenizer(path: str, vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens and save it; returns
    its EOS id ("<|im_end|>"). Its corpus is a few sentences, so it has a few hundred tokens
    whatever ``vocab_size`` asks: :func:`write_large_tokenizer` fills a large vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return _save_tokenizer(tok, path)


def _save_tokenizer(tok, path: str) -> int:
    """Save a ``tokenizers.Tokenizer`` as a Hugging Face fast tokenizer with the ChatML template;
    returns its EOS id ("<|im_end|>")."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
    return fast.eos_token_id


# Qwen2/Qwen3's pre-tokenizer split: letter runs with one leading non-letter (" word", '"key'),
# single digits, punctuation runs with an optional leading space ('{"', '":', ' "'), whitespace.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3: 151,936 logits, of which 151,643 regular tokens; the rest are special or unused.
QWEN3_UNUSED_IDS = 151936 - 151643
_ENGLISH = """the of and to a in is it you that he was for on are with as I his they be at one have
this from or had by not word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number sound no most people
my over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small end put
home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build
self earth father head stand own page should country found answer school grow study still learn
plant cover food sun four between state keep eye never last let thought city tree cross farm
hard start might story saw far sea draw left late run while press close night real life few north
open seem together next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room
friend began idea fish mountain stop once base hear horse cut sure watch color face wood main
enough plain girl usual young ready above ever red list though feel talk bird soon body dog family
direct pose leave song measure door product black short numeral class wind question happen
complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel toward
war lay against pattern slow center love person money serve appear road map rain rule govern pull
cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan
figure star box noun field rest correct able pound done beauty drive stood contain front teach
week final gave green quick develop ocean warm free minute strong special mind behind clear tail
produce fact street inch multiply nothing course stay wheel full force blue object decide surface
deep moon island foot system busy test record boat common gold possible plane stead dry wonder
laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill
east paint language among id key value type string integer boolean null false none true array
object items properties required email phone address city country status active created updated
user users data result results error message code config model token tokens request response
json schema field fields date time price amount total count index text title description summary
category tags label score version source target input output content role assistant system""".split()
_ONSETS = (
    "b c d f g h j k l m n p qu r s t v w y z bl br ch cl cr dr fl fr gl gr kn ph pl pr sc sch "
    "scr sh sk sl sm sn sp spl spr st str sw th thr tr tw wh wr"
).split()
_NUCLEI = "a e i o u y a e i o ai au ay ea ee ei eu ie oa oi oo ou ow ue".split()
_CODAS = [
    ""
] * 6 + "b ck ct d ft g k l ld lk ll lt m mp n nd ng nk nt p r rd rk rm rn rt s sk ss st t th x".split()
_SUFFIXES = "s ed ing er ers ly tion tions ment ness able al ous ive ity ize ist ism ful less est".split()
_CYRILLIC = "ба ва га да жа за ка ла ма на па ра са та фа ха ца ча ша ин ов ен ст ко но ро то ре ни".split()
_ACCENTED = "é è ê à â ç ô û ü ö ä ß ñ í ó ú ø å".split()
_CODE = (
    "def __init__(self, config):\n        super().__init__()\n        self.config = config\n",
    "    for i in range(len(items)):\n        if items[i] is None:\n            continue\n",
    "import numpy as np\nimport torch\nfrom typing import List, Optional\n\n",
    '    return {"status": "ok", "data": result}\n',
    "const value = await fetch(url).then((r) => r.json());\n",
    "if (x != null && x.length > 0) { return x[0]; }\n",
    "SELECT id, name FROM users WHERE active = 1;\n",
    '<div class="container"><p>Hello, world!</p></div>\n',
)


def write_large_tokenizer(path: str, vocab_size: int = 151936, regular_tokens: int | None = None) -> int:
    """Build a byte-level BPE tokenizer whose vocabulary fills a large model's logits, and save
    it (same special tokens, ChatML template and EOS "<|im_end|>" as :func:`write_tokenizer`);
    returns its EOS id.

    Trained on a generated corpus (English words, English-like made-up words with Zipf counts,
    a little Cyrillic, accented and CJK text, JSON records compact and indented, code), with
    Qwen3's pre-tokenizer split, so that its tokens look like a real vocabulary's: words with
    and without a leading space, JSON punctuation runs ('{"', '":', '",'), whitespace runs,
    partial UTF-8 byte sequences. ``regular_tokens`` (default ``vocab_size`` less Qwen3's 293
    special and unused ids: 151,643 for 151,936) come first, the special tokens after them.
    Deterministic; about 8 s for Qwen3's size on two CPU cores.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    regular = vocab_size - QWEN3_UNUSED_IDS if regular_tokens is None else regular_tokens
    if not 1024 <= regular <= vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"regular_tokens={regular} must be in [1024, vocab_size - {len(SPECIAL_TOKENS)}] "
            f"(vocab_size={vocab_size}); write_tokenizer makes small tokenizers"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=regular, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_large_corpus(regular), trainer)
    if tok.get_vocab_size() != regular:
        raise RuntimeError(f"the generated corpus gave {tok.get_vocab_size()} tokens, not {regular}")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return _save_tokenizer(tok, path)


def _large_corpus(regular: int) -> list[str]:
    """Text whose BPE training gives at least ``regular`` tokens, the same on every call."""
    import random

    rng = random.Random(0)

    def made_up_word() -> str:
        syllables = rng.choice((1, 2, 2, 2, 3, 3, 4))
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables)
        )
        return word + rng.choice(_SUFFIXES) if rng.random() < 0.2 else word

    def foreign_word() -> str:
        kind = rng.random()
        if kind < 0.4:  # CJK: runs of characters without spaces, from a Zipf-ish subset of the block
            return "".join(chr(0x4E00 + int(rng.paretovariate(0.6)) % 8000) for _ in range(rng.randint(1, 4)))
        if kind < 0.7:
            return "".join(rng.choice(_CYRILLIC) for _ in range(rng.randint(1, 4)))
        word = list(made_up_word())
        word[rng.randrange(len(word))] = rng.choice(_ACCENTED)
        return "".join(word)

    made_up = [made_up_word() if i % 6 else foreign_word() for i in range(regular)]
    lexicon = list(dict.fromkeys(_ENGLISH + made_up))
    # each word a Zipf count of times, with a leading space; frequent ones also capitalized and bare
    texts = []
    for rank, word in enumerate(lexicon):
        count = max(1, 3000 // (rank + 1))
        texts.append((" " + word) * count)
        if rank < 5000:
            texts.append("\n".join([word.capitalize(), word] * max(1, count // 4)))
    head = lexicon[:3000]
    for _ in range(3000):  # sentences with punctuation and numbers
        words = rng.choices(head, k=rng.randint(5, 25))
        words[0] = words[0].capitalize()
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
        texts.append(" ".join(words) + rng.choice((".", ".", ",", "?", "!", ":", ";")) + "\n")
    keys = _ENGLISH[-80:]
    for _ in range(2000):  # JSON records, compact and indented
        record = {}
        for key in rng.sample(keys, rng.randint(2, 8)):
            kind = rng.random()
            if kind < 0.35:
                record[key] = " ".join(rng.choices(head, k=rng.randint(1, 4)))
            elif kind < 0.55:
                record[key] = rng.randint(-1000, 10**6)
            elif kind < 0.65:
                record[key] = round(rng.uniform(-100, 100), rng.randint(1, 4))
            elif kind < 0.75:
                record[key] = rng.choice((True, False, None))
            elif kind < 0.9:
                record[key] = rng.choices(head, k=rng.randint(0, 4))
            else:
                record[key] = {k: rng.choice(head) for k in rng.sample(keys, 2)}
        texts.append(json.dumps(record, ensure_ascii=False, indent=rng.choice((None, None, 2, 4))) + "\n")
    texts.extend(_CODE * 50)
    return texts


def write_demo_model(path: str) -> str:
    """A small Qwen3-shaped folder with a tokenizer, to run with ``load_format="dummy"``."""
    eos = write_tokenizer(path, 512)
    write_config(
        path,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=eos,
        dtype="float32",
    )
    return path
