"""A small LangChain chatbot whose every answer carries guarduq's uncertainty scores.

    prompt | GuardedChatModel | StrOutputParser

Runs offline with the default model (SmolLM2-135M-Instruct, installed by ``make setup``):

    python examples/langchain_chatbot.py --ask "What is the capital of France?"
    python examples/langchain_chatbot.py --stream            # chat on stdin, tokens as they come
    python examples/langchain_chatbot.py --policy policies/default.yaml --ask "Who won in 1903?"

With ``--policy`` the policy decides what the user sees: an uncertain answer is replaced by the
policy's message (and, when streaming, is checked before any of it is shown).
The parser turns the reply into a string, so the scores are read back from a callback handler,
which reuses the model's own scores (it does not score the reply a second time).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Iterator

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import Runnable

from guarduq import Guard
from guarduq.integrations.langchain import GuardedChatModel, GuardRecord, GuardUQCallbackHandler
from guarduq.models import DEFAULT_MODEL

SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."


def build_chain(model: GuardedChatModel) -> Runnable:
    """The chatbot: system prompt and history, the guarded model, a string parser."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), MessagesPlaceholder("history"), ("user", "{question}")]
    )
    return prompt | model | StrOutputParser()


def ask(chain: Runnable, question: str, history: list[BaseMessage], handler: GuardUQCallbackHandler,
        stream: bool = False) -> Iterator[str | GuardRecord]:
    """Yield the answer (in pieces when streaming), then guarduq's record of it."""
    run_id = uuid.uuid4()
    config = {"callbacks": [handler], "run_id": run_id}
    inputs = {"question": question, "history": history}
    if stream:
        yield from chain.stream(inputs, config=config)
    else:
        yield chain.invoke(inputs, config=config)
    (record,) = handler.get(run_id)
    yield record


def describe(record: GuardRecord) -> str:
    s = record.scores
    if s is None:
        return f"[guarduq] not scored: {record.error}"
    line = (f"[guarduq] epistemic={s.epistemic:.3g} aleatoric={s.aleatoric:.3f} "
            f"mean_token_prob={s.mean_token_prob:.3f} tokens={s.n_tokens}")
    if record.risk is not None:
        line += f" risk={record.risk:.2f}"
    if record.decision is not None:
        line += f" decision={record.decision['action']} ({record.decision['rule']})"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model spec (default: %(default)s)")
    parser.add_argument("--policy", help="a guarduq policy YAML file (default: scores only)")
    parser.add_argument("--ask", action="append", default=[], help="a question (repeatable); else read stdin")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    model = GuardedChatModel(guard=Guard(args.model, policy=args.policy), max_tokens=args.max_tokens)
    chain = build_chain(model)
    handler = GuardUQCallbackHandler(model.guard)
    questions = args.ask or (line.strip() for line in sys.stdin if line.strip())
    history: list[BaseMessage] = []
    for question in questions:
        print(f"you> {question}")
        print("bot> ", end="", flush=True)
        answer = ""
        for item in ask(chain, question, history, handler, stream=args.stream):
            if isinstance(item, GuardRecord):
                print(f"\n{describe(item)}")
            else:
                answer += item
                print(item, end="", flush=True)
        history += [HumanMessage(question), AIMessage(answer)]
    return 0


if __name__ == "__main__":
    sys.exit(main())
