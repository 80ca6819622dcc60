"""UltraMem: Ultra-Sparse Memory Network as a Hugging Face Transformers model."""
