"""Adapters that put guarduq inside other frameworks (LangChain: ``guarduq.integrations.langchain``).

Each adapter imports its framework lazily, so ``import guarduq`` never needs it installed.
"""
