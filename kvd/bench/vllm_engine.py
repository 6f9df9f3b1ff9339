"""One vLLM 0.32 instance of a prefill/decode pair on CPU: ``kvd bench vllm`` and tests/vllm.

Run as a process: ``python -m kvd.bench.vllm_engine prefill|decode CONFIG_JSON`` (vLLM must be
importable: ``pip install -e '.[vllm]'``).

- ``prefill``: a kv_producer ``LLM`` serving a ZMQ REP socket until told to quit: ``baseline``
  (plain greedy generation, the single-instance reference: a request without
  kv_transfer_params is an ordinary one) and ``prefill`` (max_tokens=1 with do_remote_decode,
  answered with the kv_transfer_params a decode instance needs).
- ``decode``: a kv_consumer ``LLM`` that asks a prefill server for the transfer params of the
  prompts and decodes them, all at once (``batch``, plus a control request: other prompt
  tokens, the same last token, the first prompt's transferred KV) or one after the other
  (``sequential``, timing each request from prefill to last token), and writes tokens, logprobs
  and timings as JSON.

The model is a tiny Llama built from a fixed seed (``make_model``): with random weights a wrong
KV block changes the first decoded token, which vLLM's dummy weights (all alike) would hide.

``TimedNixlConnector`` is vLLM's own NIXL connector timing its inline post-process (for the
benchmark's "without kvd" figures).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 4096
PROMPT_LENGTHS = (40, 100, 300)


def make_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (4 heads, 2 KV heads, head_dim 64, vocab 4096), seeded random weights."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    g = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int, gain: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * gain / math.sqrt(cols)).contiguous()

    state = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN, math.sqrt(HIDDEN))}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        # Sharp attention and spread logits: a wrong block shows in the first token.
        state[p + "self_attn.q_proj.weight"] = weight(HEADS * HEAD_DIM, HIDDEN, 2)
        state[p + "self_attn.k_proj.weight"] = weight(KV_HEADS * HEAD_DIM, HIDDEN, 2)
        state[p + "self_attn.v_proj.weight"] = weight(KV_HEADS * HEAD_DIM, HIDDEN, 1)
        state[p + "self_attn.o_proj.weight"] = weight(HIDDEN, HEADS * HEAD_DIM, 1)
        state[p + "mlp.gate_proj.weight"] = weight(FFN, HIDDEN, 1)
        state[p + "mlp.up_proj.weight"] = weight(FFN, HIDDEN, 1)
        state[p + "mlp.down_proj.weight"] = weight(HIDDEN, FFN, 1)
        state[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        state[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    state["model.norm.weight"] = torch.ones(HIDDEN)
    state["lm_head.weight"] = weight(VOCAB, HIDDEN, 3)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def control_prompt(source: list[int]) -> list[int]:
    """Other tokens than ``source`` but its last one: decoded from ``source``'s transferred KV,
    it continues ``source``; decoded from its own tokens, something else."""
    rng = random.Random(123)
    tokens = [rng.randrange(3, VOCAB) for _ in source]
    tokens[-1] = source[-1]
    return tokens


def make_llm(config: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector=config["connector"],
        kv_connector_module_path=config.get("module"),
        kv_role=config["role"],
        engine_id=config["engine_id"],
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_lease_duration": 600, **config.get("extra", {})},
    )
    return LLM(
        model=config["model"],
        skip_tokenizer_init=True,
        load_format="safetensors",
        dtype=config.get("dtype", "float32"),
        block_size=config["block_size"],
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        enforce_eager=True,
        compilation_config={"mode": 0},
        seed=0,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    )


def sampling(max_tokens: int, transfer: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": transfer} if transfer is not None else None
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=1,
        detokenize=False,
        extra_args=extra,
    )


def summary(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    steps = zip(completion.token_ids, completion.logprobs or [], strict=False)
    return {
        "prompt_len": len(output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": [float(d[t].logprob) for t, d in steps],
        "kv_transfer_params": output.kv_transfer_params,
    }


REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def serve_prefill(config: dict[str, Any]) -> None:
    import msgspec
    import zmq
    from vllm import TokensPrompt

    llm = make_llm(config)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
    sock.bind(config["endpoint"])
    print("READY", flush=True)
    while True:
        request = msgspec.msgpack.decode(sock.recv())
        if request["op"] == "quit":
            sock.send(msgspec.msgpack.encode({"ok": True}))
            return
        tokens = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        if request["op"] == "baseline":
            params = sampling(request["max_tokens"])
        else:
            params = sampling(1, REMOTE_DECODE)
        outputs = llm.generate(tokens, params, use_tqdm=False)
        sock.send(msgspec.msgpack.encode([summary(o) for o in outputs]))


class _PrefillServer:
    def __init__(self, endpoint: str) -> None:
        import zmq

        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        self._sock.connect(endpoint)

    def transfer_params(self, batch: list[list[int]]) -> list[dict[str, Any]]:
        import msgspec

        self._sock.send(msgspec.msgpack.encode({"op": "prefill", "prompts": batch}))
        return [p["kv_transfer_params"] for p in msgspec.msgpack.decode(self._sock.recv())]


def decode(config: dict[str, Any]) -> None:
    from vllm import TokensPrompt

    llm = make_llm(config)
    server = _PrefillServer(config["prefill"])
    base = prompts(tuple(config.get("prompt_lengths", PROMPT_LENGTHS)))
    max_tokens = config["max_tokens"]
    result: dict[str, Any] = {"startup_s": time.monotonic() - config["launched"]}
    if config.get("mode", "batch") == "batch":
        transfers = server.transfer_params([*base, base[1]])
        requests = [*base, control_prompt(base[1])]
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in requests],
            [sampling(max_tokens, dict(t)) for t in transfers],
            use_tqdm=False,
        )
        result["decode"] = [summary(o) for o in outputs]
    else:
        latencies = []
        outputs = []
        for tokens in base:
            started = time.perf_counter()
            (params,) = server.transfer_params([tokens])
            (output,) = llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)],
                [sampling(max_tokens, params)],
                use_tqdm=False,
            )
            latencies.append(time.perf_counter() - started)
            outputs.append(output)
        result["decode"] = [summary(o) for o in outputs]
        result["request_latency_s"] = latencies
    Path(config["out"]).write_text(json.dumps(result))


def _timed_stock() -> type:
    """vLLM's NIXL connector, timing the post-process it runs inline (built on first use)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
        NixlPullConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    class TimedWorker(NixlPullConnectorWorker):
        def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
            super().__init__(vllm_config, engine_id, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            self._stats_path = extra.get("kvd_stats_path")
            self._post_process_s: list[float] = []
            self._requests = 0

        def get_transfer_results(self) -> Any:
            started = time.perf_counter()
            spent_before = sum(self._post_process_s)
            results = super().get_transfer_results()
            arrived = results.finished_recving - results.failed_recving
            if arrived and self._stats_path:
                self._requests += len(arrived)
                step = sum(self._post_process_s) - spent_before
                report = {
                    "requests": self._requests,
                    "post_process_s": self._post_process_s,
                    "step_s": time.perf_counter() - started,
                    "inline_per_step_s": step,
                }
                Path(self._stats_path).write_text(json.dumps(report))
            return results

        def post_process_device_kv_on_receive(self, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            super().post_process_device_kv_on_receive(*args, **kwargs)
            self._post_process_s.append(time.perf_counter() - started)

    class TimedNixlConnector(NixlPullConnector):
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
            if role == KVConnectorRole.SCHEDULER:
                self.connector_scheduler = NixlPullConnectorScheduler(
                    vllm_config, self.engine_id, kv_cache_config
                )
                self.connector_worker = None
            else:
                self.connector_scheduler = None
                self.connector_worker = TimedWorker(vllm_config, self.engine_id, kv_cache_config)

    return TimedNixlConnector


def __getattr__(name: str) -> Any:
    if name == "TimedNixlConnector":
        return _timed_stock()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    role, config_path = sys.argv[1], sys.argv[2]
    config = json.loads(Path(config_path).read_text())
    config["launched"] = time.monotonic()
    if role == "prefill":
        serve_prefill(config)
    else:
        decode(config)
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine processes may linger at exit; the parent reaps the group


if __name__ == "__main__":
    main()
