"""What the agent-client tests share: fast greedy settings, and langchain's chat model on the
server."""

from __future__ import annotations

from typing import Any

import pytest

FAST = {"temperature": 0, "max_tokens": 40}


def langchain_chat_model(base_url: str) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model="default", base_url=base_url, api_key="unused", max_retries=0, **FAST
    )
