"""Errors raised by the artifact store; each names the offending ref, blob or URL."""


class StoreError(Exception):
    """Base class: any failure of the artifact store that a user can act on."""


class ArtifactNotFound(StoreError, LookupError):
    """A ref, manifest id or file inside an artifact does not exist."""


class CorruptBlobError(StoreError):
    """A blob's bytes no longer hash to its address."""


class RefConflict(StoreError):
    """A compare-and-swap on a ref lost against a concurrent writer."""
