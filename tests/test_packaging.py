"""pyproject.toml reads without setuptools deprecation warnings (the license is an SPDX
expression, not the deprecated table)."""

from __future__ import annotations

import warnings
from pathlib import Path

import setuptools

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_has_an_spdx_license_and_no_deprecation_warning() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    with warnings.catch_warnings():
        warnings.simplefilter("error", setuptools.SetuptoolsDeprecationWarning)
        config = read_configuration(REPO / "pyproject.toml")
    assert config["project"]["license"] == "Apache-2.0"
