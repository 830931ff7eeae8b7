"""unbroken: a relay that keeps AI coding agent sessions alive when LLM providers fail."""

__version__ = "0.1.0"
