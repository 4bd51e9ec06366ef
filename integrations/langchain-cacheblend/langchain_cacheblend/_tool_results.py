"""The documents a conversation's tool messages carry: what the chat model announces from tool results
(kept apart from :mod:`langchain_cacheblend.tools`, which needs the chat model)."""

from __future__ import annotations

from typing import Any, Sequence

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, ToolMessage


def tool_result_documents(messages: Sequence[BaseMessage]) -> list[Document]:
    """The documents tool messages carry as their ``artifact`` (a retriever tool's with
    ``response_format="content_and_artifact"``), in conversation order. Artifacts that are not
    documents (another tool's) are skipped."""
    documents: list[Document] = []
    for message in messages:
        if isinstance(message, ToolMessage):
            documents.extend(_documents_in(message.artifact))
    return documents


def _documents_in(artifact: Any) -> list[Document]:
    if isinstance(artifact, Document):
        return [artifact]
    if isinstance(artifact, (list, tuple)):
        return [item for item in artifact if isinstance(item, Document)]
    return []
