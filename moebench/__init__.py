"""moebench: benchmark and evaluation harness for compressed Mixture-of-Experts runtimes."""

__version__ = "0.1.0"
