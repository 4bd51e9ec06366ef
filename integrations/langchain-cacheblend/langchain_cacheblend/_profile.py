"""The LangChain model profile of the model an engine serves: what agents and middleware read off
``ChatCacheBlend.profile`` (context window, tools, structured output, inputs and outputs)."""

from __future__ import annotations

from langchain_core.language_models.model_profile import ModelProfile

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.serving.thinking import thinks


def model_profile(engine: CacheBlendEngine) -> ModelProfile:
    """Measured off the loaded model, not a table: a local model is whatever folder or GGUF was given."""
    return ModelProfile(
        name=engine.model_name,
        open_weights=True,
        # Prompt and answer share the model's positions; the answer's room is what the prompt leaves.
        max_input_tokens=engine.context_window,
        max_output_tokens=engine.context_window,
        text_inputs=True,
        image_inputs=False,
        image_url_inputs=False,
        pdf_inputs=False,
        audio_inputs=False,
        video_inputs=False,
        text_outputs=True,
        image_outputs=False,
        audio_outputs=False,
        video_outputs=False,
        reasoning_output=thinks(engine.tokenizer),
        # Calls and schemas are decoded under a grammar (outlines-core), so they are native, not prompted.
        tool_calling=True,
        tool_choice=True,
        tool_call_streaming=True,
        structured_output=True,
        temperature=True,
    )


__all__ = ["model_profile"]
