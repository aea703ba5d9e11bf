"""The Llama-family decoder the engine runs: config, layers, paged attention and the model."""
