"""astrai's version, written here only: setup.py reads this file (without importing astrai), the
package exports it as ``astrai.__version__``, and a release is the git tag ``v<version>``
(CHANGELOG.md). A built wheel adds the torch and CUDA it was built for as a local version,
e.g. ``0.2.0+torch2.13cpu`` (``importlib.metadata.version("astrai")``)."""

__version__ = "0.2.0"
