"""The wire to llama-server: the pooled upstream, its HTTP parsing, the relay and the C chunk pump."""
