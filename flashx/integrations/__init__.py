"""flashx inside other frameworks: ``flashx.integrations.transformers`` (Hugging Face transformers)."""
