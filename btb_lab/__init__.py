"""btb-lab: turn LLM-serving claims into falsifiable experiments and a hypothesis log."""

__version__ = "0.1.0"
__all__ = ["__version__"]
