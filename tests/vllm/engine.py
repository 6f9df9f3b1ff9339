"""One vLLM 0.32 instance of a prefill/decode pair, on CPU, for kvd's vLLM tests.

Run as a process: ``python -m tests.vllm.engine prefill|decode CONFIG_JSON``.

- ``prefill``: a kv_producer ``LLM`` that serves requests on a ZMQ REP socket until told to
  quit: ``baseline`` (plain greedy generation: the single-instance reference; a request without
  kv_transfer_params is an ordinary request), ``prefill`` (max_tokens=1 with do_remote_decode,
  answering with the kv_transfer_params the decode side needs).
- ``decode``: a kv_consumer ``LLM`` that asks a prefill server for the transfer params of the
  prompts, decodes them (plus a control request: other prompt tokens, the same last token, the
  first prompt's transferred KV) and writes tokens, logprobs and timings as JSON.

A tiny Llama built from a fixed seed (``make_model``): with random weights a wrong KV block
changes the very first decoded token, which vLLM's dummy weights would hide.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 4096
MAX_TOKENS = 16
PROMPT_LENGTHS = (40, 100, 300)


def make_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (4 heads, 2 KV heads, head_dim 64) with seeded random weights."""
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

    def weight(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    state = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN, scale=1.0)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        # Sharp attention and spread logits: a wrong block shows in the first token.
        state[p + "self_attn.q_proj.weight"] = weight(
            HEADS * HEAD_DIM, HIDDEN, scale=2 / math.sqrt(HIDDEN)
        )
        state[p + "self_attn.k_proj.weight"] = weight(
            KV_HEADS * HEAD_DIM, HIDDEN, scale=2 / math.sqrt(HIDDEN)
        )
        state[p + "self_attn.v_proj.weight"] = weight(
            KV_HEADS * HEAD_DIM, HIDDEN, scale=1 / math.sqrt(HIDDEN)
        )
        state[p + "self_attn.o_proj.weight"] = weight(
            HIDDEN, HEADS * HEAD_DIM, scale=1 / math.sqrt(HEADS * HEAD_DIM)
        )
        state[p + "mlp.gate_proj.weight"] = weight(FFN, HIDDEN, scale=1 / math.sqrt(HIDDEN))
        state[p + "mlp.up_proj.weight"] = weight(FFN, HIDDEN, scale=1 / math.sqrt(HIDDEN))
        state[p + "mlp.down_proj.weight"] = weight(HIDDEN, FFN, scale=1 / math.sqrt(FFN))
        state[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        state[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    state["model.norm.weight"] = torch.ones(HIDDEN)
    state["lm_head.weight"] = weight(VOCAB, HIDDEN, scale=3 / math.sqrt(HIDDEN))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def control_prompt(source: list[int]) -> list[int]:
    """Other tokens than ``source`` but its last one: decoded from ``source``'s transferred KV,
    it continues ``source``; decoded from its own tokens, something else."""
    import random

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
    logprobs = [
        float(d[t].logprob)
        for t, d in zip(completion.token_ids, completion.logprobs or [], strict=False)
    ]
    return {
        "prompt_len": len(output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": logprobs,
        "kv_transfer_params": output.kv_transfer_params,
    }


def serve_prefill(config: dict[str, Any]) -> None:
    import msgspec
    import zmq
    from vllm import TokensPrompt

    llm = make_llm(config)
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(config["endpoint"])
    print("READY", flush=True)
    while True:
        request = msgspec.msgpack.decode(sock.recv())
        op = request["op"]
        if op == "quit":
            sock.send(msgspec.msgpack.encode({"ok": True}))
            break
        tokens = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        if op == "baseline":
            outputs = llm.generate(tokens, sampling(request["max_tokens"]), use_tqdm=False)
        else:
            remote = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            outputs = llm.generate(tokens, sampling(1, remote), use_tqdm=False)
        sock.send(msgspec.msgpack.encode([summary(o) for o in outputs]))


def decode(config: dict[str, Any]) -> None:
    import msgspec
    import zmq
    from vllm import TokensPrompt

    llm = make_llm(config)
    ready = time.monotonic()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.connect(config["prefill"])
    base = prompts()
    sock.send(msgspec.msgpack.encode({"op": "prefill", "prompts": [*base, base[1]]}))
    prefilled = msgspec.msgpack.decode(sock.recv())
    requests = [*base, control_prompt(base[1])]
    params = [p["kv_transfer_params"] for p in prefilled]
    started = time.monotonic()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in requests],
        [sampling(MAX_TOKENS, dict(t)) for t in params],
        use_tqdm=False,
    )
    finished = time.monotonic()
    result = {
        "decode": [summary(o) for o in outputs],
        "startup_s": ready - config["launched"],
        "decode_s": finished - started,
    }
    Path(config["out"]).write_text(json.dumps(result))


def main() -> None:
    role, config_path = sys.argv[1], sys.argv[2]
    config = json.loads(Path(config_path).read_text())
    config["launched"] = time.monotonic()
    if role == "prefill":
        serve_prefill(config)
    else:
        decode(config)
    # vLLM's engine processes may outlive a normal exit; the pair is done here.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
