"""The exl3tools error tree.

Every error a user can cause derives from ``Exl3Error`` and from the stdlib base that fits
(so callers can catch ``FileNotFoundError``/``ValueError``). ``exl3tools.cli._errors`` maps
each class to one line of output and an exit code; nothing else decides exit codes.
"""

from __future__ import annotations


class Exl3Error(Exception):
    """Base of every error exl3tools raises on purpose."""


class UsageError(Exl3Error, ValueError):
    """The command was called wrongly (bad combination of options, bad value)."""


class NotFoundError(Exl3Error, FileNotFoundError):
    """A path the user named does not exist."""


class NotACheckpointError(Exl3Error, ValueError):
    """A directory that is not a safetensors checkpoint (no config.json or no tensors)."""


class CheckpointError(Exl3Error, ValueError):
    """The checkpoint is there but broken: bad header, bad index, missing tensor, bad shape..."""


class HeaderError(CheckpointError):
    """A safetensors header is hostile or corrupt."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor that must exist does not."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NotExl3Error(CheckpointError):
    """The checkpoint is valid safetensors but not an EXL3 quant."""


class UnsupportedArchitectureError(Exl3Error, ValueError):
    """An architecture exl3tools does not know."""


class IncompatibleSliceError(Exl3Error, ValueError):
    """A tensor cannot be cut the way the plan asks (e.g. n=1000 into 4 x 128-channel slices)."""


class OutputExistsError(Exl3Error, FileExistsError):
    """Refusing to overwrite an existing, complete output."""


class IncompleteOutputError(Exl3Error, ValueError):
    """An output directory that was never finished (no manifest) or was tampered with."""


class VerifyError(Exl3Error, ValueError):
    """Sliced output does not reassemble to its source."""


class DoesNotFitError(Exl3Error, ValueError):
    """The model (weights, scratch and the KV cache asked for) does not fit in the GPU memory given."""


class RuntimeFailure(Exl3Error, RuntimeError):
    """The runtime failed (e.g. a tensor-parallel peer died)."""


class RevisionChangedError(Exl3Error, ValueError):
    """A Hub repo's revision (or one of its files) changed between planning and fetching."""


class TransferError(Exl3Error, ConnectionError):
    """Fetching from the Hub failed (after retries), or the server answered something unusable."""
