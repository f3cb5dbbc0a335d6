"""llama.cpp router's API: its model list, loads and unloads, and resumable streams."""
