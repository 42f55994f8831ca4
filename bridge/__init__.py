"""scan-bridge server: transports, dispatcher, timing, sessions; `python -m bridge` serves."""

__version__ = "0.1.0"
