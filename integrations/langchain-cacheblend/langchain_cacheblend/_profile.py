"""The LangChain model profile of the model a chat model serves: what agents and middleware read off
``ChatCacheBlend.profile`` (context window, tools, structured output, inputs and outputs)."""

from __future__ import annotations

from langchain_core.language_models.model_profile import ModelProfile


def model_profile(name: str, context_window: int, reasoning_output: bool | None) -> ModelProfile:
    """Measured off the model, not a table: a local model is whatever folder or GGUF was given, a server's
    says its window (``/v1/models``). ``reasoning_output`` ``None``: not known (left out)."""
    profile = ModelProfile(
        name=name,
        open_weights=True,
        # Prompt and answer share the model's positions; the answer's room is what the prompt leaves.
        max_input_tokens=context_window,
        max_output_tokens=context_window,
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
        # Calls and schemas are decoded under a grammar (outlines-core), so they are native, not prompted.
        tool_calling=True,
        tool_choice=True,
        tool_call_streaming=True,
        structured_output=True,
        temperature=True,
    )
    if reasoning_output is not None:
        profile["reasoning_output"] = reasoning_output
    return profile


__all__ = ["model_profile"]
