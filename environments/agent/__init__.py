"""What the agent loop (`environments/agent_loop.py`) works with: its tools, message helpers,
scripted policies (the oracles), the inference servers it talks to, and the records it keeps."""
