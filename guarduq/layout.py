"""One token layout for every score: ``prompt ids | response ids [| end-of-turn id]``.

* The prompt is rendered with the tokenizer's chat template (``add_generation_prompt=True``)
  when it has one; otherwise its plain tokens are used (base models, few-shot prompts).
* The response is tokenized on its own (no special tokens) and, when the model ended its turn,
  followed by the chat template's end-of-turn token (``<|im_end|>`` for SmolLM2), or EOS for a
  model without a template. A reply cut by ``max_new_tokens`` did not end its turn.

Generation, teacher-forced scoring, baselines and the SVE second opinion all call these functions,
so ``guard.score(prompt, r.text)`` reproduces ``r = guard.generate(prompt)`` exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from guarduq.errors import ContextLengthError, InputError

Messages = Sequence[Mapping[str, str]]
PromptLike = str | Messages

_ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Encoded:
    """``input_ids`` of shape [1, L]; the response occupies positions ``response_start``..L-1."""

    input_ids: torch.Tensor
    response_start: int

    @property
    def n_response_tokens(self) -> int:
        return int(self.input_ids.shape[1]) - self.response_start


def validate_prompt(prompt: Any) -> PromptLike:
    """A non-blank string or a non-empty list of ``{"role", "content"}`` messages."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("prompt is empty or whitespace")
        return _encodable(prompt, "prompt")
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        if not prompt:
            raise InputError("chat messages list is empty")
        for i, m in enumerate(prompt):
            if not isinstance(m, Mapping) or set(m) - {"role", "content"} or "content" not in m:
                raise InputError(f"message {i} must be a mapping with 'role' and 'content'")
            if not isinstance(m.get("role"), str) or m["role"] not in _ROLES:
                raise InputError(f"message {i} has unknown role {m.get('role')!r}")
            if not isinstance(m["content"], str):
                raise InputError(f"message {i} content must be a string")
            _encodable(m["content"], f"message {i} content")
        if not any(str(m["content"]).strip() for m in prompt):
            raise InputError("chat messages have no content")
        return prompt
    raise InputError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def validate_response(response: Any) -> str:
    if not isinstance(response, str):
        raise InputError(f"response must be a string, got {type(response).__name__}")
    if not response.strip():
        raise InputError("response is empty or whitespace")
    return _encodable(response, "response")


def _encodable(text: str, what: str) -> str:
    """Refuse text that has no UTF-8 form (a lone surrogate, e.g. from a broken JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} is not valid Unicode: lone surrogate at character {exc.start}") from None
    return text


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def as_messages(prompt: PromptLike) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def prompt_ids(tokenizer: Any, prompt: PromptLike) -> list[int]:
    """Token ids of the prompt, chat-templated when the tokenizer has a template."""
    prompt = validate_prompt(prompt)
    if has_chat_template(tokenizer):
        out = tokenizer.apply_chat_template(
            as_messages(prompt), add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(i) for i in ids]
    if not isinstance(prompt, str):
        # No template: join message contents, the only faithful rendering we have.
        prompt = "\n".join(m["content"] for m in prompt)
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that closes an assistant turn (from the chat template), else EOS."""
    eot = _eot_from_template(tokenizer)
    if eot is None:
        eot = tokenizer.eos_token_id
    if eot is None:
        raise InputError("tokenizer has neither a chat template end-of-turn token nor an EOS token")
    return int(eot)


def _eot_from_template(tokenizer: Any) -> int | None:
    if not has_chat_template(tokenizer):
        return None
    marker = "GUARDUQMARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    except Exception:  # templates are user-provided jinja; any failure means "no usable template"
        return None
    tail = text[text.rfind(marker) + len(marker) :]
    if not tail:
        return None
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []))
    if ids and ids[0] in special:
        return int(ids[0])
    return None


def response_ids(tokenizer: Any, response: str, *, ended: bool) -> list[int]:
    ids = [int(i) for i in tokenizer(validate_response(response), add_special_tokens=False)["input_ids"]]
    if not ids:
        raise InputError("response has no tokens")
    return ids + [end_of_turn_id(tokenizer)] if ended else ids


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end generation: end-of-turn plus EOS."""
    ids = [end_of_turn_id(tokenizer)]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def context_length(model: Any) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_fits(model: Any, n_tokens: int) -> None:
    limit = context_length(model)
    if limit is not None and n_tokens > limit:
        raise ContextLengthError(
            f"prompt + response is {n_tokens} tokens, longer than the model's context of {limit}"
        )


def encode(tokenizer: Any, model: Any, prompt: PromptLike, response: str, *, ended: bool = True) -> Encoded:
    """The scored sequence for (prompt, response) in guarduq's one layout."""
    p = prompt_ids(tokenizer, prompt)
    r = response_ids(tokenizer, response, ended=ended)
    check_fits(model, len(p) + len(r))
    return Encoded(input_ids=torch.tensor([p + r], dtype=torch.long), response_start=len(p))


def as_pairs(pairs: Any) -> list[tuple[Any, Any]]:
    """``(prompt, response)`` pairs from any iterable; anything else is an ``InputError``."""
    if isinstance(pairs, str | bytes | dict) or not isinstance(pairs, Iterable):
        raise InputError(f"pairs must be an iterable of (prompt, response), got {type(pairs).__name__}")
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InputError(f"pair {i} must be a (prompt, response) pair, got {type(pair).__name__}")
        out.append((pair[0], pair[1]))
    return out


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds, so that the pieces join to ``decode(ids)`` exactly.

    Decoding tokens one by one does not give that: a byte-level tokenizer splits a character
    across tokens (each decoded alone is a replacement character) and some tokenizers add
    spaces between separately decoded tokens. So each piece is the growth of the decoded prefix;
    a token that ends inside a character adds nothing until the character is complete.
    """
    pieces: list[str] = []
    done = ""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(list(ids[:i]), clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd") and i < len(ids):
            pieces.append("")
            continue
        pieces.append(text[len(done):] if text.startswith(done) else text)
        done = text
    return pieces
