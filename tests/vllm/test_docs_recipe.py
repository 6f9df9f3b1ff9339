"""The vLLM commands of README.md and docs/ (the recipe, written once in the README and shown
by docs/vllm.md) as vLLM's own OpenAI server reads them: every flag accepted by its parser and
its pre-start checks, every environment variable one vLLM knows, and each
``--kv-transfer-config`` a connector vLLM can load. Skipped when vllm cannot be imported; the
servers themselves are not started (that is what tests/vllm/test_pd.py's pairs do)."""

from __future__ import annotations

import argparse
import importlib
import warnings

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from tests.doc_commands import Command, sh_commands, vllm_server_args

RECIPE = [c for c in sh_commands() if vllm_server_args(c.argv) is not None]


def _serve_args(command: Command) -> argparse.Namespace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the module's own deprecation notice
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_server_args(command.argv))
    validate_parsed_serve_args(args)
    return args


def test_the_recipe_starts_a_prefill_and_a_kvd_decode_on_cpu_and_on_gpu() -> None:
    roles = {(c.argv[0], _serve_args(c).kv_transfer_config.kv_connector) for c in RECIPE}
    assert roles == {
        ("python", "NixlConnector"),
        ("python", "KvdConnector"),
        ("vllm", "NixlConnector"),
        ("vllm", "KvdConnector"),
    }


@pytest.mark.parametrize("command", RECIPE, ids=str)
def test_vllms_server_takes_the_command_as_written(command: Command) -> None:
    import vllm.envs
    from vllm.config import KVTransferConfig

    args = _serve_args(command)
    assert (args.model_tag or args.model) == "MODEL"
    unknown = set(command.env) - set(vllm.envs.environment_variables)
    assert not unknown, f"{command}: vLLM reads no {sorted(unknown)}"
    config = args.kv_transfer_config
    assert isinstance(config, KVTransferConfig)
    if config.kv_connector == "KvdConnector":
        module = importlib.import_module(config.kv_connector_module_path)
        assert hasattr(module, "KvdConnector")
        assert config.kv_role == "kv_consumer"
        # A Failed from kvd (and nP > nD) is recomputed only under this policy.
        assert config.kv_load_failure_policy == "recompute"
    else:
        assert (config.kv_connector, config.kv_role) == ("NixlConnector", "kv_producer")
