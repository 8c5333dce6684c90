"""Model loading errors (a ValueError: the server maps them to a clear start-up error)."""


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message says why and what to do."""


class UnsupportedArchitectureError(ModelLoadError):
    pass


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    pass
