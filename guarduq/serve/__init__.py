"""``guarduq serve``: an OpenAI-compatible chat-completions server with guarduq's policies.

Top layer: it imports guard, policy and calibration; nothing in guarduq imports it.
Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from guarduq.serve.app import Settings, create_app

__all__ = ["Settings", "create_app"]
