"""Checkpoint sources: Hugging Face safetensors folders (safetensors.py), GGUF files converted into
such folders once (gguf.py), the default model (default_model.py), and random weights (`dummy`)."""

from models.loader.safetensors import checkpoint_files, load_model

__all__ = ["checkpoint_files", "load_model"]
