"""The package version, one place for it (the stored files and manifests name the version that wrote them)."""

__version__ = "0.1.0"
