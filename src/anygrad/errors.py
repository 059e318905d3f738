"""Errors a user can cause. The CLI prints their message and exits non-zero, never a traceback."""


class AnygradError(Exception):
    """Base class: the message names the file/node/op/option at fault and what to do."""


class ModelError(AnygradError):
    """A model file is corrupt, unreadable or uses something anygrad cannot run."""


class UnsupportedOpError(ModelError):
    """The graph holds op types that have no registry entry (all of them are listed)."""


class ShapeError(AnygradError):
    """Shapes do not fit together (names the node and the shapes)."""


class DeviceError(AnygradError):
    """No adapter, a lost device, or out of device memory."""


class DataError(AnygradError):
    """A dataset is missing, corrupt, or cannot be downloaded."""


class ConfigError(AnygradError):
    """An option or config value is invalid."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message for a one-line report; its type's name when the
    message is empty (a bare `raise SomeError()` must not turn the report itself into a crash)."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__
