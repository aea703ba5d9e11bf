"""What every HTTP front of ours shares, the replica's server and the router alike: OpenAI's error
bodies, tenants and their keys, the body limit, disconnects, and OpenAI's request and response
models (``protocol``). Nothing here imports the engine or torch (an import-linter contract), so
the router runs without them."""
