"""Model code and checkpoint sources: HF folders, GGUF files (converted once), the default model."""
