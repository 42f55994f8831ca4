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


class DtypeNotAllowed(KernelInputError):
    """A tensor's dtype is not one its argument takes. `allowed` and `dtype` are the torch
    dtypes themselves, for a caller that names dtypes its own way (the bridge: by wire codes);
    `kind` says what the allowed ones are ("a floating dtype")."""

    def __init__(self, field: str, kind: str, allowed: tuple, dtype):
        self.kind = kind
        self.allowed = allowed
        self.dtype = dtype
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        super().__init__(field, f"{kind} ({names})", str(dtype))


class ShapeMismatch(KernelInputError):
    """A tensor's shape disagrees with what the other arguments imply."""


class BackendUnavailable(RuntimeError):
    """A backend cannot run here (not built, no device, missing package). Carries the reason."""


class UnknownBackend(KernelInputError):
    """`backend=` names no backend this build knows."""
