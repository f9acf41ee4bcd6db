"""Structured outputs: each distinct constraint compiled once by xgrammar (in the background,
while prompts are computed), one grammar matcher per constrained completion, advanced with its
tokens, and the token bitmask of a step's constrained rows filled on the host."""

import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.scheduling import ScheduledStep

_CACHE_SIZE = 256  # distinct constraints kept compiled
_JSON_WHITESPACE = "[ \\n\\r\\t]*"  # how xgrammar's JSON grammars print "any whitespace"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        raise ValueError("structured outputs need xgrammar: pip install xgrammar") from error
    return xgrammar


def choice_grammar(choice: list[str]) -> str:
    """An EBNF grammar whose only sentences are the strings of ``choice``."""
    quoted = ('"' + re.sub(r'(["\\])', r"\\\1", c) + '"' for c in choice)
    return "root ::= " + " | ".join(quoted)


def _json_with_whitespace(xgr, schema, pattern: str) -> str:
    """The EBNF of ``schema`` (any whitespace), each run of whitespace made to match ``pattern``."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True))
    if _JSON_WHITESPACE not in ebnf:
        raise ValueError("whitespace_pattern cannot be applied with this xgrammar version")
    rule = str(xgr.Grammar.from_regex(pattern))
    rule = re.sub(r"\broot(?=\b|_)", "json_whitespace", rule)
    return ebnf.replace(_JSON_WHITESPACE, "json_whitespace") + rule


def _spec(xgr, params: StructuredOutputsParams, compact_json: bool) -> tuple[str, str, bool]:
    """``(kind, text, any_whitespace)`` that xgrammar compiles: kind "json", "regex" or
    "grammar". Raises ``ValueError`` for a constraint xgrammar cannot read."""
    any_whitespace = not (params.disable_any_whitespace or compact_json)
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        try:
            if params.whitespace_pattern is not None:
                return "grammar", _json_with_whitespace(xgr, schema, params.whitespace_pattern), False
            text = json.dumps(schema)  # property order is the output order: kept
            xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"the JSON schema cannot be used: {error}") from None
        return "json", text, any_whitespace
    if params.regex is not None:
        try:
            xgr.Grammar.from_regex(params.regex)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"the regex cannot be used: {error}") from None
        return "regex", params.regex, False
    text = choice_grammar(params.choice) if params.choice is not None else params.grammar
    try:
        xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"the grammar cannot be used: {error}") from None
    return "grammar", text, False


class StructuredOutputs:
    """Owns the grammar matchers of the constrained completions being served (by sequence id).

    :meth:`compile` checks a constraint at once (``ValueError`` for a bad schema, regex or
    grammar) and compiles it for the tokenizer in a background thread, once per distinct
    constraint; a completion's matcher is made when its first token is due.
    """

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], compact_json: bool = False
    ):
        self.tokenizer = tokenizer
        self.compact_json = compact_json
        """Every JSON constraint without free whitespace (``structured_outputs_config``)."""
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.eos_token_ids = list(eos_token_ids)
        self.matchers: dict[int, GrammarMatcher] = {}
        """The live constrained completions' matchers, by sequence id."""
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._compiler = None
        self._pool: ThreadPoolExecutor | None = None
        self._batch = None

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params`` (a future); raises ``ValueError`` when it is bad."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (the folder has none)")
        key = (params.json if not isinstance(params.json, dict) else json.dumps(params.json),
               params.regex, tuple(params.choice or ()), params.grammar, params.json_object,
               params.disable_any_whitespace, params.whitespace_pattern)  # fmt: skip
        compiled = self._compiled.get(key)
        if compiled is not None and compiled.done() and compiled.exception() is not None:
            del self._compiled[key]
            raise ValueError(f"the constraint cannot be compiled: {compiled.exception()}")
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        spec = _spec(_xgrammar(), params, self.compact_json)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-grammar")
        compiled = self._pool.submit(self._compile, *spec)
        self._compiled[key] = compiled
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str, any_whitespace: bool):
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=8)
        if kind == "json":
            return self._compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        return self._compiler.compile_grammar(text)

    def track(self, seq_id: int, compiled: Future) -> None:
        self.matchers[seq_id] = GrammarMatcher(compiled)

    def bitmask(self, step: ScheduledStep, out: np.ndarray | None = None) -> np.ndarray:
        """The token bitmask of ``step.batch.structured_rows``, one int32 row each (bit ``t % 32``
        of word ``t // 32``: token ``t`` allowed), written into ``out`` when given; a row whose
        sequence has ended (its token will be dropped) allows every token."""
        rows = step.batch.structured_rows
        shape = (len(rows), self.num_words)
        bitmask = np.empty(shape, dtype=np.int32) if out is None else out
        if bitmask.shape != shape or bitmask.dtype != np.int32:
            raise ValueError(
                f"the bitmask buffer must be int32 of shape {shape}, got {bitmask.dtype} {bitmask.shape}"
            )
        matchers, indices = [], []
        for i, row in enumerate(rows):
            state = self.matchers.get(step.seqs[row].seq_id)
            if state is not None:
                matchers.append(state.matcher())
                indices.append(i)
            else:
                bitmask[i] = -1
        if matchers:
            if self._batch is None:
                self._batch = _xgrammar().BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        return bitmask

    def close(self) -> None:
        self.matchers.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class GrammarMatcher:
    """One completion's place in its grammar."""

    __slots__ = ("compiled", "_matcher")

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self._matcher = None

    def matcher(self):
        """xgrammar's matcher, made (waiting for the grammar's compilation) on first use."""
        if self._matcher is None:
            self._matcher = _xgrammar().GrammarMatcher(self.compiled.result())
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""
        return self.matcher().accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has taken its end (an EOS token)."""
        return self._matcher is not None and self._matcher.is_terminated()
