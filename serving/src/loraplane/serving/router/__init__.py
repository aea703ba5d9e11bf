"""The adapter-affinity router: one OpenAI endpoint in front of many serving replicas."""
