"""bench.py's structured-output workload: the JSON schema every constrained request follows, and
the check of what the constrained completions hold (not timed)."""

import json
import os
from collections import Counter

# An extraction record, as a structured-output request would ask for it.
JSON_SCHEMA = {
    "title": "CustomerTicket",
    "type": "object",
    "properties": {
        "customer_name": {"type": "string"},
        "email": {"type": "string"},
        "product": {"type": "string"},
        "order_id": {"type": "integer"},
        "is_refund_requested": {"type": "boolean"},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "issues": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": [
        "customer_name",
        "email",
        "product",
        "order_id",
        "is_refund_requested",
        "sentiment",
        "issues",
        "summary",
    ],
    "additionalProperties": False,
}


def check_json_outputs(path: str, results: list[tuple[str | None, list[int]]]) -> str:
    """A line on the constrained completions (not timed): finish reasons, how many completions
    xgrammar's matcher accepts token by token, and (with jsonschema installed) how many finished
    ones parse as records of ``JSON_SCHEMA``."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    reasons = Counter(str(reason) for reason, _ in results)
    line = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
    with open(os.path.join(path, "config.json")) as f:
        vocab_size = json.load(f).get("vocab_size")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(JSON_SCHEMA)  # vLLM's: any whitespace
    followed = 0
    for _, ids in results:
        matcher = xgr.GrammarMatcher(compiled)
        followed += all(matcher.accept_token(t) for t in ids)
    line += f"; {followed}/{len(results)} completions follow the schema token by token (xgrammar)"
    try:
        import jsonschema
    except ImportError:
        return line + "; jsonschema not installed, records not parsed"
    finished = [ids for reason, ids in results if reason == "stop"]
    valid = 0
    for ids in finished:
        try:
            jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), JSON_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return line + f"; {valid}/{len(finished)} stopped completions are records of the schema (jsonschema)"
