"""bp_mech: backpropagation and the training mechanisms of LLMs, measured."""

__version__ = "0.1.0"
