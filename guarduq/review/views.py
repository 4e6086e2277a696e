"""What the templates show, computed from store records: plain data, never markup.

Every string here reaches the page through Jinja's autoescaping; nothing is marked safe. The
answer's shading is a CSS class per probability band (no inline styles, which the page's CSP
forbids), with the probability in the tooltip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from guarduq.store.records import ReplyRecord

# Shading bands, from the lowest probability up: a token under 0.1 is the darkest red.
_BANDS = (0.1, 0.3, 0.5, 0.7, 0.9)
_SCORE_ORDER = ("risk", "epistemic", "aleatoric", "mean_token_prob", "min_token_prob", "mean_logprob",
                "mean_entropy", "n_tokens", "valid", "reason", "parameter_set", "n_params")
_SKIP = {"token_probs", "grad_profile", "timings"}


@dataclass(frozen=True)
class Token:
    text: str
    prob: float | None
    shade: int  # 0 (p >= 0.9, unshaded) .. 5 (p < 0.1); -1 when the probability is not finite
    end: bool = False  # the end-of-turn token (shown as a marker: its probability matters too)


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def shade(prob: float) -> int:
    if not math.isfinite(prob):
        return -1
    return sum(1 for b in _BANDS if prob < b)


def answer_tokens(reply: ReplyRecord) -> list[Token] | None:
    """The answer as shaded tokens, or None when the store kept no token pieces that fit.

    A reply that ended its turn was scored with the end-of-turn token appended (the README's
    token layout); when the pieces spell the reply plus one more, that last one is marked."""
    tokens, probs = reply.tokens, reply.token_probs
    if not tokens or probs is None or len(probs) < len(tokens):
        return None
    texts = [str(t) for t in tokens]
    end = reply.ended and len(texts) > 1 and "".join(texts[:-1]) == reply.response
    out = []
    for i, (text, p) in enumerate(zip(texts, probs, strict=False)):
        try:
            prob = float(p)
        except (TypeError, ValueError):
            prob = math.nan
        out.append(Token(text, prob if math.isfinite(prob) else None, shade(prob),
                         end=end and i == len(texts) - 1))
    return out


def conversation(prompt: str | list[dict[str, str]] | None) -> list[Message] | None:
    """The prompt as role boxes (a plain string is one user message); None when not kept."""
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return [Message("user", prompt)]
    out = []
    for m in prompt:
        if isinstance(m, dict):
            out.append(Message(str(m.get("role", "?"))[:40], _text(m.get("content"))))
        else:
            out.append(Message("?", _text(m)))
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def fmt(value: Any) -> str:
    """A number as the page prints it: 4 significant digits; NaN/None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "–" if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def score_rows(scores: dict[str, Any]) -> list[tuple[str, str]]:
    """The scores table: the usual fields first, then any others (lists and dicts left out)."""
    keys = [k for k in _SCORE_ORDER if k in scores]
    keys += sorted(k for k in scores if k not in keys and k not in _SKIP
                   and not isinstance(scores[k], list | dict | tuple))
    return [(k, fmt(scores[k])) for k in keys]


def opinion_rows(opinion: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not opinion:
        return []
    return [(str(k), fmt(v) if not isinstance(v, list | tuple) else ", ".join(fmt(x) for x in v))
            for k, v in opinion.items()]


def when(t: datetime | None) -> str:
    """A time as ``YYYY-MM-DD HH:MM:SS`` (UTC when the store says so)."""
    if t is None:
        return "–"
    suffix = " UTC" if t.tzinfo is not None and t.utcoffset() is not None and not t.utcoffset() else ""
    return t.strftime("%Y-%m-%d %H:%M:%S") + suffix
