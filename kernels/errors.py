"""Exceptions raised by the kernels API.

They carry the offending argument, what was expected and what came, so a caller (the bridge)
can turn them into structured replies without parsing messages.
"""


class KernelInputError(ValueError):
    """An argument of `selective_scan` / `selective_state_update` has the wrong shape, dtype,
    device or value."""

    def __init__(self, field: str, expected: str, got: str):
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {got}")


class ShapeMismatch(KernelInputError):
    """A tensor's shape disagrees with what the other arguments imply."""


class BackendUnavailable(RuntimeError):
    """A backend cannot run here (not built, no device, missing package). Carries the reason."""


class UnknownBackend(KernelInputError):
    """`backend=` names no backend this build knows."""
