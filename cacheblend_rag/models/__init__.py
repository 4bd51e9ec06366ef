"""Model loading and layer-wise architecture adapters."""

from cacheblend_rag.models.adapters import DecoderAdapter, get_adapter, supported_architectures
from cacheblend_rag.models.fingerprint import model_fingerprint
from cacheblend_rag.models.loader import LoadedModel, default_gguf_path, load_model

__all__ = ["DecoderAdapter", "LoadedModel", "default_gguf_path", "get_adapter", "load_model",
           "model_fingerprint", "supported_architectures"]
