"""Exceptions with messages that say what is wrong. Raised before any state is touched, so a bad
request loses nothing: caches and running requests are unchanged."""


class HypicError(Exception):
    """Base class for every error hypic raises on purpose."""


class ConfigError(HypicError, ValueError):
    """A configuration value is missing or invalid."""


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture or one of its layer types is not supported."""


class WeightsError(HypicError):
    """Weight files are missing, incomplete or do not match the config."""


class InvalidRequestError(HypicError, ValueError):
    """A prompt or sampling parameter is invalid (empty, too long, out-of-vocabulary ids, ...)."""


class WorkerError(HypicError):
    """A segment-parallel worker could not start or join (hypic/prefill/parallel.py). Once serving, a worker's
    failure is not an error: its segments are prefilled on rank 0."""
