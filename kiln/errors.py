"""Errors a user can act on. The CLI prints their message and exits non-zero, no traceback."""


class KilnError(ValueError):
    """A user mistake or bad input: the message names the file, key or tensor at fault."""


class ConfigError(KilnError):
    """A config.json or run config that cannot be used as written."""


class WeightsError(KilnError):
    """A weights file that is missing, unreadable, or does not fit the model."""


class NonFiniteError(KilnError):
    """Training stopped on a non-finite loss or gradient (train.non_finite = "fail"); `kiln train` exits 3."""
