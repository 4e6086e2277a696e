"""What counts as the same answer: SQuAD's normalisation and a loose word-level agreement.

Below every floor that compares answers: scoring's baselines (exact-match sampling), the SVE's
second opinion, and calibration's labels all read these two rules from here.
"""

from __future__ import annotations

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation) | {"‘", "’", "“", "”", "–", "—", "´"}


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, drop punctuation and articles, squeeze whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _answer_words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.casefold()).split()


def same_answer(answer: str, response: str) -> bool:
    """Loose agreement: after lower-casing and dropping punctuation, the shorter word sequence
    occurs contiguously in the longer one ("Paris" agrees with "The capital is Paris.")."""
    a, r = _answer_words(answer), _answer_words(response)
    if not a or not r:
        return False
    short, long = sorted((a, r), key=len)
    return any(long[i : i + len(short)] == short for i in range(len(long) - len(short) + 1))
