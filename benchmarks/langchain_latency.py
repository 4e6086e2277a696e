"""Latency the LangChain integration adds per call, on SmolLM2-135M-Instruct (CPU, one run).

Three arms run the same chain, ``prompt | chat model | StrOutputParser``, on the same questions
with greedy decoding, so every arm produces the same replies:

* ``bare``: a plain chat model (transformers ``generate``, no guarduq anywhere);
* ``callback``: the bare chain plus ``GuardUQCallbackHandler``, which scores each reply with the
  same local model by teacher forcing (one forward + one backward pass);
* ``guarded``: ``GuardedChatModel`` (generation and scoring in one model).

The scoring time inside each call (guarduq's own ``score_s``) is reported too, since on a busy
machine the whole-call times are noisy.

The arms are interleaved question by question (rotating their order), so a slower moment of a
shared CPU hits them alike. Reported: per-call median and mean seconds per arm, the added
seconds per call and the ratio callback/bare and guarded/bare, all measured in this run.

    .venv/bin/python benchmarks/langchain_latency.py            # 8 questions, 32 new tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

import torch
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.prompts import ChatPromptTemplate
from pydantic import ConfigDict
from tqdm.auto import tqdm

from guarduq import Guard, layout
from guarduq.integrations.langchain import (
    GuardedChatModel,
    GuardUQCallbackHandler,
    to_chat_messages,
)
from guarduq.models import DEFAULT_MODEL

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name a primary colour.",
    "What is 7 times 8?",
    "Which planet is known as the red planet?",
    "What language is spoken in Brazil?",
    "What is the largest ocean on Earth?",
    "Who painted the Mona Lisa?",
    "What gas do plants take in?",
    "How many days are in a leap year?",
]


class PlainChat(BaseChatModel):
    """The baseline: the same model through ``generate`` with no guarduq in the loop."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    model: Any
    tokenizer: Any
    max_new_tokens: int

    @property
    def _llm_type(self) -> str:
        return "plain-hf"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        ids = layout.prompt_ids(self.tokenizer, to_chat_messages(messages))
        stops = layout.stop_token_ids(self.tokenizer)
        x = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=self.max_new_tokens,
                do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
            )
        new = out[0, len(ids):].tolist()
        ended = bool(new) and new[-1] in stops
        text = self.tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        info = {"finish_reason": "stop" if ended else "length"}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text), generation_info=info)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--n", type=int, default=8, help=f"questions per arm (max {len(QUESTIONS)})")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = QUESTIONS[: max(1, min(args.n, len(QUESTIONS)))]

    guard = Guard(args.model, max_new_tokens=args.max_new_tokens)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer briefly."), ("user", "{q}")])
    bare = prompt | PlainChat(model=guard.model, tokenizer=guard.tokenizer, max_new_tokens=args.max_new_tokens) | StrOutputParser()
    guarded = prompt | GuardedChatModel(guard=guard) | StrOutputParser()
    handler = GuardUQCallbackHandler(guard)  # on the guarded arm it only reads the model's own scores
    score_s: dict[str, list[float]] = {"callback": [], "guarded": []}

    def with_handler(chain: Any, name: str, q: str) -> str:
        run_id = uuid.uuid4()
        out = chain.invoke({"q": q}, config={"callbacks": [handler], "run_id": run_id})
        (record,) = handler.get(run_id)
        score_s[name].append(record.payload["timings"]["score_s"])
        return out

    arms = {
        "bare": lambda q: bare.invoke({"q": q}),
        "callback": lambda q: with_handler(bare, "callback", q),
        "guarded": lambda q: with_handler(guarded, "guarded", q),
    }
    for run in arms.values():  # warm-up: first-call allocations and lazy imports
        run(questions[0])
    for v in score_s.values():
        v.clear()

    times: dict[str, list[float]] = {name: [] for name in arms}
    replies: dict[str, list[str]] = {name: [] for name in arms}
    names = list(arms)
    for i, q in enumerate(tqdm(questions, desc="questions", file=sys.stderr)):
        for name in names[i % 3:] + names[: i % 3]:  # rotate the order
            t0 = time.perf_counter()
            replies[name].append(arms[name](q))
            times[name].append(time.perf_counter() - t0)
    if not replies["bare"] == replies["callback"] == replies["guarded"]:
        print("warning: the arms produced different replies; the comparison is not like for like")

    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    n_tokens = statistics.fmean(len(guard.tokenizer(r)["input_ids"]) for r in replies["bare"])
    result = {
        "model": guard.info.name, "n_calls_per_arm": len(questions), "max_new_tokens": args.max_new_tokens,
        "mean_reply_tokens": round(n_tokens, 1), "median_s": med, "mean_s": mean,
        "callback_added_s_median": med["callback"] - med["bare"],
        "callback_ratio_median": med["callback"] / med["bare"],
        "guarded_added_s_median": med["guarded"] - med["bare"],
        "guarded_ratio_median": med["guarded"] / med["bare"],
        "scoring_s_median": {k: statistics.median(v) for k, v in score_s.items()},
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{guard.info.name}: {len(questions)} calls per arm, replies of {n_tokens:.1f} tokens on average "
          f"(max {args.max_new_tokens}), torch threads {torch.get_num_threads()}")
    print(f"{'arm':<10}{'median s':>10}{'mean s':>10}{'vs bare':>10}")
    for name in names:
        print(f"{name:<10}{med[name]:>10.3f}{mean[name]:>10.3f}{med[name] / med['bare']:>9.2f}x")
    print("of which scoring (one forward + backward), median s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in result["scoring_s_median"].items()))
    print(f"callback adds {result['callback_added_s_median']:.3f} s per call (median), "
          f"ratio {result['callback_ratio_median']:.2f}x; GuardedChatModel ratio {result['guarded_ratio_median']:.2f}x")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
