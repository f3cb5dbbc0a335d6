"""The client dialects' routes: the one forward path (OpenAI, Anthropic, llama-server's own), Ollama's
listener, speech out, and what a request hears while its model loads."""
