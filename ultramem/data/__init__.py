"""Files shipped with the package: the GPT-NeoX tokenizer and the embedded default corpus."""
