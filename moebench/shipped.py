"""Where the shipped profiles are: suites/, runners/ and gates/ (one copy each, at the checkout's top level).

In a checkout they are read where they lie. A wheel (`pip install .`) carries the same files as
package data, mapped by pyproject.toml's [tool.setuptools.package-dir] to `moebench/profiles/<folder>/`
inside the installed package, so an installed moebench finds them without a checkout. The checkout
comes first: a working tree is what its user edits.
"""
from __future__ import annotations

from pathlib import Path

SHIPPED_FOLDERS = ("suites", "runners", "gates")
PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT = PACKAGE_DIR.parent               # a checkout holds pyproject.toml beside the package
INSTALLED_PROFILES = PACKAGE_DIR / "profiles"


def is_checkout() -> bool:
    """Whether this moebench runs from a source tree (its shipped folders at the top level)."""
    return (CHECKOUT / "pyproject.toml").is_file()


def shipped_dir(folder: str) -> Path:
    """The shipped `folder` ("suites", "runners" or "gates"): the checkout's, else the installed copy."""
    if folder not in SHIPPED_FOLDERS:
        raise ValueError(f"{folder!r} is not a shipped folder; expected one of {', '.join(SHIPPED_FOLDERS)}")
    return CHECKOUT / folder if is_checkout() else INSTALLED_PROFILES / folder


def is_installed_profile(path: Path) -> bool:
    """Whether `path` is one of the profiles inside the installed package (no checkout around it: its
    relative paths, such as models/zoo/..., can only mean the working directory)."""
    return INSTALLED_PROFILES in path.resolve().parents
