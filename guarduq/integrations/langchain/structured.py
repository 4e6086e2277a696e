"""Schema-guided JSON decoding for ``GuardedChatModel.with_structured_output``.

Small local models (the default 135M one) rarely write valid JSON when only asked to. Here
guarduq writes the JSON's skeleton itself (braces, keys, quotes, commas) and lets the model
choose only the values: free text inside strings, digits for numbers, and for booleans, enums
and ``null``-or-value the candidate the model finds likeliest. The result always parses and
always has the schema's keys and types; *what* the values say is the model's.

The finished JSON text is then scored like any reply, by teacher forcing in guarduq's one
layout (``ended=True``), so the uncertainty of a JSON answer is that of the whole text the
model is shown to have produced, forced punctuation included.

Supported: objects (every property is written, in schema order), strings, integers, numbers,
booleans, null, ``enum``/``const``, arrays (up to :data:`MAX_ITEMS` items), ``anyOf``/``oneOf``
/ type lists (``null`` versus the first other branch), local ``$ref``. Anything else (an object
with only ``additionalProperties``, ``allOf``, patterns) is written as the closest of these
or rejected with an :class:`~guarduq.errors.InputError` naming the feature.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from guarduq import layout
from guarduq.errors import InputError
from guarduq.guard import Guard
from guarduq.layout import PromptLike
from guarduq.scoring.uncertainty import model_lock

MAX_ITEMS = 5  # arrays: at most this many items (the model chooses when to close before)
MIN_STRING_TOKENS = 4  # each free value may use at least this many tokens (max_tokens is shared out)
_DIGITS = re.compile(r"^[0-9]+$")


@dataclass
class StructuredReply:
    """The JSON text written for one request and whether any value hit its token cap."""

    text: str
    truncated: bool = False
    n_generated: int = 0


def instruction(schema: Mapping[str, Any]) -> str:
    """The system instruction that tells the model what the JSON is for."""
    return (
        "Answer with one JSON object that follows this JSON schema, and nothing else:\n"
        + json.dumps(schema, ensure_ascii=False)
    )


def with_instruction(prompt: list[dict[str, str]], schema: Mapping[str, Any]) -> list[dict[str, str]]:
    """``prompt`` with the schema instruction added to (or as) its system message."""
    text = instruction(schema)
    if prompt and prompt[0]["role"] == "system":
        return [{"role": "system", "content": f"{prompt[0]['content']}\n\n{text}"}, *prompt[1:]]
    return [{"role": "system", "content": text}, *prompt]


def count_values(schema: Mapping[str, Any], root: Mapping[str, Any] | None = None, depth: int = 0) -> int:
    """How many free values (strings, numbers) a JSON for ``schema`` has, roughly (for budgets)."""
    root = root or schema
    if depth > 20:
        return 1
    schema = _resolve(schema, root)
    kind = _kind(schema)
    if kind == "object":
        props = schema.get("properties") or {}
        return max(1, sum(count_values(s, root, depth + 1) for s in props.values()))
    if kind == "array":
        return count_values(schema.get("items") or {}, root, depth + 1)
    return 1


@dataclass
class JsonWriter:
    """Writes one JSON value for a schema, asking the model only for the values."""

    guard: Guard
    prompt: PromptLike
    max_new_tokens: int
    text: str = ""
    truncated: bool = False
    n_generated: int = 0
    _prompt_ids: list[int] = field(default_factory=list)
    _value_cap: int = MIN_STRING_TOKENS
    _special: set[int] = field(default_factory=set)
    _cache: Any = None
    _cache_name: str = "past_key_values"
    _last_logits_only: bool = False

    def write(self, schema: Mapping[str, Any]) -> StructuredReply:
        """The JSON text of one value of ``schema``."""
        return self.run(lambda w: w._value(schema, schema, 0), schema)

    def run(self, body: Any, budget_schema: Mapping[str, Any]) -> StructuredReply:
        """Run ``body(self)`` with the model locked in eval mode and no gradients."""
        tok = self.guard.tokenizer
        self._prompt_ids = layout.prompt_ids(tok, self.prompt)
        self._value_cap = max(MIN_STRING_TOKENS, self.max_new_tokens // count_values(budget_schema))
        self._special = set(getattr(tok, "all_special_ids", []))
        model = self.guard.model
        params = inspect.signature(model.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"  # transformers 5 / 4
        self._last_logits_only = "logits_to_keep" in params
        with model_lock(model), torch.no_grad():
            was_training = model.training
            model.eval()
            try:
                body(self)
            finally:
                model.train(was_training)
        return StructuredReply(self.text, self.truncated, self.n_generated)

    # -- the schema walk

    def _value(self, schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> None:
        if depth > 20:
            raise InputError("JSON schema nests deeper than 20 levels (a recursive $ref?)")
        schema = _resolve(schema, root)
        if "const" in schema:
            self.text += json.dumps(schema["const"], ensure_ascii=False)
            return
        if "enum" in schema:
            options = [json.dumps(v, ensure_ascii=False) for v in schema["enum"]]
            if not options:
                raise InputError("JSON schema has an empty enum")
            self.text += self._choose(options)
            return
        branches = _branches(schema)
        if branches is not None:
            self._either(branches, root, depth)
            return
        kind = _kind(schema)
        if kind == "object":
            self._object(schema, root, depth)
        elif kind == "array":
            self._array(schema, root, depth)
        elif kind == "string":
            self._string()
        elif kind in ("integer", "number"):
            self._number(integer=kind == "integer")
        elif kind == "boolean":
            self.text += self._choose(["true", "false"])
        elif kind == "null":
            self.text += "null"
        else:
            raise InputError(f"JSON schema type {kind!r} is not supported by structured output")

    def _object(self, schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> None:
        props = schema.get("properties") or {}
        self.text += "{"
        for i, (key, sub) in enumerate(props.items()):
            self.text += (", " if i else "") + json.dumps(str(key), ensure_ascii=False) + ": "
            self._value(sub, root, depth + 1)
        self.text += "}"

    def _array(self, schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> None:
        items = schema.get("items") or {}
        low = int(schema.get("minItems") or 0)
        high = min(int(schema.get("maxItems") or MAX_ITEMS), MAX_ITEMS)
        low = min(low, high)
        self.text += "["
        n = 0
        while n < high:
            if n >= low and self._choose(["]", ", " if n else _opening(items, root)]) == "]":
                break
            if n:
                self.text += ", "
            self._value(items, root, depth + 1)
            n += 1
        self.text += "]"

    def _either(self, branches: list[Mapping[str, Any]], root: Mapping[str, Any], depth: int) -> None:
        """``null`` or a value: the likelier opening decides; other unions take their first branch."""
        resolved = [_resolve(b, root) for b in branches]
        nulls = [b for b in resolved if _kind(b) == "null"]
        others = [b for b in resolved if _kind(b) != "null"]
        if not others:
            self.text += "null"
            return
        first = others[0]
        if nulls and self._choose(["null", _opening(first, root)]) == "null":
            self.text += "null"
            return
        self._value(first, root, depth + 1)

    # -- the model's part

    def _next_logits(self) -> torch.Tensor:
        """Logits after prompt + text; the prompt's KV cache is computed once and kept."""
        text_ids = self.guard.tokenizer(self.text, add_special_tokens=False)["input_ids"] if self.text else []
        n_prompt = len(self._prompt_ids)
        layout.check_fits(self.guard.model, n_prompt + len(text_ids) + 1)
        cache = self._cache
        if cache is not None and hasattr(cache, "crop") and hasattr(cache, "get_seq_length"):
            extra = int(cache.get_seq_length()) - n_prompt
            if extra > 0:
                cache.crop(-extra)  # back to the prompt alone (negative: tokens to drop)
        else:
            cache, text_ids = None, self._prompt_ids + text_ids
        if not text_ids:
            text_ids = self._prompt_ids[-1:]
            if cache is not None:
                cache.crop(-1)
        x = torch.tensor([text_ids], dtype=torch.long, device=self._device)
        kwargs = {self._cache_name: cache} if cache is not None else {}
        if self._last_logits_only:
            kwargs["logits_to_keep"] = 1  # the vocabulary projection of the last position only
        out = self.guard.model(input_ids=x, use_cache=True, **kwargs)
        self._cache = _cache_of(out)
        return out.logits[0, -1].float()

    def _step(self, token: int) -> torch.Tensor:
        x = torch.tensor([[token]], dtype=torch.long, device=self._device)
        out = self.guard.model(input_ids=x, **{self._cache_name: self._cache}, use_cache=True)
        self._cache = _cache_of(out)
        self.n_generated += 1
        return out.logits[0, -1].float()

    @property
    def _device(self) -> torch.device:
        return next(self.guard.model.parameters()).device

    def _choose(self, options: list[str]) -> str:
        """The option the model's next tokens follow (greedy walk of the options' token trie)."""
        tok = self.guard.tokenizer
        seqs = [tok(o, add_special_tokens=False)["input_ids"] for o in options]
        alive = [i for i, s in enumerate(seqs) if s]
        if not alive:
            return options[0]
        logits, pos = self._next_logits(), 0
        while True:
            done = [i for i in alive if len(seqs[i]) == pos]
            if done:
                return options[done[0]]
            allowed = sorted({seqs[i][pos] for i in alive})
            if len(alive) == 1 or len(allowed) == 1 and all(len(seqs[i]) == pos + 1 for i in alive):
                return options[alive[0]]
            best = allowed[int(torch.argmax(logits[allowed]))]
            alive = [i for i in alive if seqs[i][pos] == best]
            logits, pos = self._step(best), pos + 1

    def _string(self) -> None:
        """Free text until the model closes the string (an unescaped quote) or ends its turn."""
        self.text += '"'
        tok = self.guard.tokenizer
        logits, new = self._next_logits(), []
        content, closed = "", False
        for _ in range(self._value_cap):
            token = int(torch.argmax(logits))
            if token in self._special:
                closed = True
                break
            new.append(token)
            decoded = tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            end = _closing_quote(decoded)
            if end is not None:
                content, closed = decoded[:end], True
                break
            content = decoded
            logits = self._step(token)
        self.truncated |= not closed
        self.text += json.dumps(_unescape(content.rstrip("\ufffd")), ensure_ascii=False)[1:]

    def _number(self, *, integer: bool) -> None:
        """Digits while the model's likeliest next token is one (a leading minus, one point)."""
        first, digits, dot = number_tokens(self.guard.tokenizer)
        logits, text = self._next_logits(), ""
        for i in range(min(self._value_cap, 12)):
            if i == 0:  # a number must start: the likeliest digit or minus
                pool = first
            else:
                pool = digits + (dot if not integer and "." not in text and text[-1].isdigit() else [])
                if int(torch.argmax(logits)) not in set(pool):
                    break
            choice = pool[int(torch.argmax(logits[pool]))]
            text += self.guard.tokenizer.decode([choice])
            logits = self._step(choice)
        text = text.rstrip(".")
        self.text += text if text.strip("-") else "0"


_NUMBER_TOKENS: weakref.WeakKeyDictionary[Any, tuple[list[int], list[int], list[int]]] = weakref.WeakKeyDictionary()


def number_tokens(tok: Any) -> tuple[list[int], list[int], list[int]]:
    """(digits and minus, digits, decimal point) token ids of a tokenizer, found once."""
    try:
        return _NUMBER_TOKENS[tok]
    except (KeyError, TypeError):
        pass
    digits, minus, dot = [], [], []
    for t, s in enumerate(tok.batch_decode([[t] for t in range(len(tok))])):
        if _DIGITS.match(s):
            digits.append(t)
        elif s == "-":
            minus.append(t)
        elif s == ".":
            dot.append(t)
    if not digits:
        raise InputError("the tokenizer has no digit tokens; cannot write a JSON number")
    out = (digits + minus, digits, dot)
    with contextlib.suppress(TypeError):
        _NUMBER_TOKENS[tok] = out
    return out


def _cache_of(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


def _closing_quote(text: str) -> int | None:
    escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return i
    return None


def _unescape(content: str) -> str:
    """The string the model meant: its JSON escapes read, or its raw text if they do not parse."""
    try:
        return json.loads(f'"{content}"')
    except ValueError:
        return content


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(schema, Mapping):
        raise InputError(f"JSON schema node must be an object, got {type(schema).__name__}")
    ref = schema.get("$ref")
    if ref is None:
        return schema
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise InputError(f"JSON schema $ref {ref!r} is not supported (only local '#/...' references)")
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, Mapping) or part not in node:
            raise InputError(f"JSON schema $ref {ref!r} points nowhere")
        node = node[part]
    return _resolve(node, root)


def _branches(schema: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return list(schema[key])
    if "allOf" in schema:
        if len(schema["allOf"]) == 1:
            return list(schema["allOf"])
        raise InputError("JSON schema 'allOf' with several parts is not supported by structured output")
    kind = schema.get("type")
    if isinstance(kind, list):
        return [{**schema, "type": k} for k in kind]
    return None


def _kind(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return "string"  # an unconstrained value: text is always valid JSON for it


def _opening(schema: Mapping[str, Any], root: Mapping[str, Any]) -> str:
    """The first characters any value of ``schema`` starts with (to weigh against ``null``)."""
    schema = _resolve(schema, root)
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        return json.dumps(values[0], ensure_ascii=False)[:1] if values else '"'
    openings = {"object": "{", "array": "[", "boolean": "true", "null": "null", "integer": "0", "number": "0"}
    return openings.get(_kind(schema), '"')


@dataclass(frozen=True)
class WrittenCall:
    """A tool call written by schema-guided decoding, and its JSON text (what is scored)."""

    name: str
    args: dict[str, Any]
    text: str


def write_tool_call(
    guard: Guard, prompt: PromptLike, tools: list[dict[str, Any]], allowed: list[str], max_new_tokens: int
) -> WrittenCall:
    """``{"name": <one of allowed>, "arguments": {...}}``: the model picks the tool and fills it."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if not allowed:
        raise InputError("tool_choice forces a call but no tool is bound")
    writer = JsonWriter(guard, prompt, max_new_tokens)
    writer.text = '{"name": '
    chosen: dict[str, str] = {}

    def body(w: JsonWriter) -> None:
        name = json.loads(w._choose([json.dumps(n, ensure_ascii=False) for n in allowed]))
        chosen["name"] = name
        w.text += json.dumps(name, ensure_ascii=False) + ', "arguments": '
        w._value(params[name], params[name], 0)
        w.text += "}"

    reply = writer.run(body, params[allowed[0]])
    return WrittenCall(chosen["name"], json.loads(reply.text)["arguments"], reply.text)
