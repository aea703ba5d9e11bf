"""Where base weights come from: Hugging Face checkpoint folders and GGUF files (converted once
into a checkpoint folder in the cache), and the base fingerprint adapters are checked against."""
