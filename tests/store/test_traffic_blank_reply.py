"""A blank reply that the review sample picks is recorded, text and all, and never fails.

A model that ends its turn at once gives an empty (or whitespace) reply; its token pieces cannot
be had (``layout.response_ids`` refuses blank text). ``Traffic.record`` used to ask for them
outside its error handling, so such a reply, when sampled with ``keep_text``, failed the request
(and, under ``guarduq serve``'s micro-batching, every request of its batch); found by
``benchmarks/store_load.py --quick``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from guarduq import layout
from guarduq.decider import Decider
from guarduq.guard import GuardedResponse, invalid_scores
from guarduq.models import ModelInfo
from guarduq.policy.schema import ReviewSettings
from guarduq.store import Store
from guarduq.traffic import Traffic
from tests.conftest import make_tokenizer


@pytest.mark.parametrize("text", ["", "  \n"])
def test_a_sampled_blank_reply_is_recorded_without_token_pieces(store: Store, text: str) -> None:
    tok = make_tokenizer()
    policy = SimpleNamespace(config=SimpleNamespace(review=ReviewSettings(keep_text=True, rate=1.0)), log_text=False,
                             name="p", version="1", sha256="a" * 64)
    pair = Decider(policy=policy)  # type: ignore[arg-type]
    traffic = Traffic(store)
    r = GuardedResponse(text=text, scores=invalid_scores("response is empty or whitespace", 2), ended=True,
                        prompt=[{"role": "user", "content": "hi"}], decided_by=pair.identity,
                        model=ModelInfo(name="tiny", fingerprint="f" * 32, source="object", n_params=2))

    def pieces() -> list[str]:  # what Guard._token_pieces does
        return [tok.decode([i]) for i in layout.response_ids(tok, r.text, ended=r.ended)]

    sample = traffic.record(r, pair, tokens=pieces)
    assert traffic.flush()
    assert sample is not None and sample.sampled and traffic.errors_ == 0
    item = store.item(r.request_id)
    assert item is not None
    assert item.reply.response == text and item.reply.prompt == r.prompt and item.reply.tokens is None
    assert (item.reply.policy, item.reply.policy_sha256) == ("p@1", "a" * 64)
