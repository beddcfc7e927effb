"""Files shipped with the package (fitted coefficients, bundled traces); see ATTRIBUTION.md here."""

from importlib import resources
from pathlib import Path


def data_path(name: str) -> Path:
    """Path of a file shipped in `oserve.data`."""
    return Path(str(resources.files(__package__).joinpath(name)))
