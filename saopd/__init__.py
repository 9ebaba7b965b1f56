"""saopd: spurious-signal-aware on-policy distillation (SA-OPD) and its baselines."""

__version__ = "0.1.0"
