"""Command-line tools: one module per command, wired together in main.py."""
