"""The HTTP APIs, one module each: inference, management, metrics (plus shared plumbing)."""
