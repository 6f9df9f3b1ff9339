"""One vLLM 0.32 instance of a prefill/decode pair on CPU: ``kvd bench vllm`` and tests/vllm.

Run as a process: ``python -m kvd.bench.vllm_engine prefill|decode CONFIG_JSON`` (vLLM must be
importable: ``pip install -e '.[vllm]'``).

- ``prefill``: a kv_producer ``LLM`` serving a ZMQ REP socket until told to quit: ``baseline``
  (plain greedy generation, the single-instance reference: a request without
  kv_transfer_params is an ordinary one) and ``prefill`` (max_tokens=1 with do_remote_decode,
  answered with the kv_transfer_params a decode instance needs).
- ``decode``: a kv_consumer ``LLM`` (its engine core in the same process) that asks a prefill
  server for the transfer params of its prompts and runs, in the order ``modes`` names them:
  ``batch`` (the prompts at once, plus a control request: other prompt tokens, the same last
  token, the first prompt's transferred KV), ``sequential`` (one after the other, each timed
  from prefill to last token) and ``load`` (running requests decode while others' KV lands,
  each step and each token timed); with ``timed``, the connector's figures for each run
  (``kvd.bench.vllm_connectors``). It writes tokens, logprobs and timings as JSON.

The model is a tiny Llama built from a fixed seed (``make_model``): with random weights a wrong
KV block changes the first decoded token, which vLLM's dummy weights (all alike) would hide.
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
STARTUP_S = 600
MAX_MODEL_LEN = 1024
"""The longest wait for an instance to start or a prefill to come back."""


def make_model(directory: Path, seed: int = 0, *, sliding_window: int = 0) -> Path:
    """A 2-layer Llama (4 heads, 2 KV heads, head_dim 64, vocab 4096), seeded random weights.

    With ``sliding_window`` (tokens) a hybrid model: layer 0 attends to that window only
    (``layer_types``, as Gemma 3 and gpt-oss name theirs), layer 1 to everything, so vLLM
    gives it two KV cache groups."""
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
    if sliding_window:
        config["layer_types"] = ["sliding_attention", "full_attention"]
        config["sliding_window"] = sliding_window
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


def make_tokenizer(directory: Path, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer of the model's vocabulary, trained here on seeded text, so that
    vLLM's OpenAI server and ``vllm bench serve`` take text prompts (``<unk> <s> </s>`` are ids
    0, 1, 2, the model's bos and eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiouy"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    corpus = [
        " ".join(rng.choices(words, k=rng.randint(8, 30))) + rng.choice(".,;?!")
        for _ in range(4000)
    ]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": MAX_MODEL_LEN,
            }
        )
    )
    return directory


MLA_HEADS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, QK_NOPE_HEAD_DIM, V_HEAD_DIM = 4, 512, 64, 32, 32
"""vLLM 0.32's CPU MLA kernels compile for one latent size only, kv_lora_rank 512 + rope 64
(``get_supported_head_sizes``: 576); the per-head dims are free, so they stay small."""


def make_mamba_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Nemotron-H, a Mamba-2 layer then an attention layer (as the real ones start),
    seeded random weights, the Llama's sizes: vLLM gives it a state group and an attention
    group on one shared cache, the Mamba state padded to the attention page's size. Its KV
    transfer needs ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` on both sides."""
    import torch
    import transformers

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        hybrid_override_pattern="M*",
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        attention_head_dim=HEAD_DIM,
        mamba_num_heads=8,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        expand=1,
        chunk_size=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = transformers.NemotronHConfig(**settings)
    torch.manual_seed(seed)
    model: Any = transformers.NemotronHForCausalLM(config)
    model.to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:  # spread logits: a wrong state or block shows at once
                parameter.normal_(0, 2.0 / math.sqrt(parameter.shape[-1]))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_head_sizes_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma 4 text model, seeded random weights, the Llama's sizes: its
    sliding-window layer (window 32) has head_dim 64, its full-attention layer 128, so vLLM
    gives their groups block sizes of their own over one memory. Untied, spread output weights
    and sharp attention: a wrong block changes the first token."""
    import torch
    import transformers

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        per_layer_config={"01": {"head_dim": 2 * HEAD_DIM}},
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
    )
    config = transformers.Gemma4TextConfig(**settings)
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() < 2:
                continue
            gain = 3.0 if "lm_head" in name else 2.0 if "q_proj" in name or "k_proj" in name else 1
            weight.normal_(0, gain / math.sqrt(weight.shape[-1]))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_mla_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V2 with MLA (no q LoRA, no MoE: every MLP dense), seeded random
    weights, the Llama's hidden size and vocabulary: its KV cache is one 576-element latent
    vector per token."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": MLA_HEADS,
        "num_key_value_heads": MLA_HEADS,
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        # transformers wants an int here; layers from first_k_dense_replace on would be MoE.
        "n_routed_experts": 4,
        "first_k_dense_replace": LAYERS,
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

    qk_head_dim = QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM
    state = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN, math.sqrt(HIDDEN))}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        # Sharp attention and spread logits, as in make_model: a wrong latent shows at once.
        state[p + "self_attn.q_proj.weight"] = weight(MLA_HEADS * qk_head_dim, HIDDEN, 2)
        state[p + "self_attn.kv_a_proj_with_mqa.weight"] = weight(
            KV_LORA_RANK + QK_ROPE_HEAD_DIM, HIDDEN, 2
        )
        state[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(KV_LORA_RANK)
        state[p + "self_attn.kv_b_proj.weight"] = weight(
            MLA_HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM), KV_LORA_RANK, 2
        )
        state[p + "self_attn.o_proj.weight"] = weight(HIDDEN, MLA_HEADS * V_HEAD_DIM, 1)
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


LEASE_S = 120
"""How long a prefill keeps blocks no decode pulled (the decode renews the lease while it waits
for them). Long enough for a decode on a machine busy with other engines; held blocks cost the
prefill instance only its idle step (``serve_prefill``)."""


def without_nixl_progress_thread() -> None:
    """vLLM's NIXL agents without NIXL's progress thread, which polls with no pause (NIXL's
    Python API starts it with no delay) and so keeps a core busy in every instance, holding
    blocks or not: two such threads are this 2-core machine. The engine progresses its agent
    in every step instead (``get_finished``), stock and kvd alike, as kvd's own agents do."""
    import functools

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    base_worker.nixl_agent_config = functools.partial(
        base_worker.nixl_agent_config, enable_prog_thread=False
    )


def quiet_tp_workers() -> None:
    """In each worker process vLLM spawns for a TP > 1 instance (this module is their main
    module, run again as ``__mp_main__``): the NIXL agent without its progress thread, as
    ``make_llm`` makes the in-process one, and vLLM's shared-memory message queue waiting on its
    socket at once instead of spinning for a second after each message (``SpinCondition``'s
    ``busy_loop_s``). An idle prefill steps its engine every ``PREFILL_IDLE_STEP_MS``, so that
    spin and the progress thread each kept a core busy per rank, more than this 2-core machine
    has: a TP 2 decode's second worker waited minutes for a core to start on."""
    import functools

    from vllm.distributed.device_communicators import shm_broadcast

    without_nixl_progress_thread()
    spin = shm_broadcast.SpinCondition
    spin.__init__ = functools.partialmethod(spin.__init__, busy_loop_s=0)


def make_llm(config: dict[str, Any]) -> Any:
    """An ``LLM`` whose engine core runs in this process. A decode instance times each
    ``LLMEngine.step()`` (schedule, forward, the connector's get_finished) from here, its
    connector's figures one collective_rpc away; a prefill instance steps its engine between
    requests (``PREFILL_IDLE_STEP_MS``), where vLLM's engine loop would step it with no pause
    while it holds blocks: a core per prefill instance, until a decode pulls them."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    without_nixl_progress_thread()

    transfer = KVTransferConfig(
        kv_connector=config["connector"],
        kv_connector_module_path=config.get("module"),
        kv_role=config["role"],
        engine_id=config["engine_id"],
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_lease_duration": LEASE_S, **config.get("extra", {})},
    )
    return LLM(
        model=config["model"],
        skip_tokenizer_init=True,
        load_format="safetensors",
        dtype=config.get("dtype", "float32"),
        kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
        block_size=config["block_size"],
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=config.get("max_num_seqs", 8),
        max_num_batched_tokens=1024,
        enforce_eager=True,
        compilation_config={"mode": 0},
        seed=0,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
        # At TP > 1 vLLM's CPU worker runs a process per rank ("mp"): NIXL registers each
        # rank's cache on its own, and a decode rank reads its heads from the prefill's ranks.
        tensor_parallel_size=config.get("tensor_parallel_size", 1),
        distributed_executor_backend="mp" if config.get("tensor_parallel_size", 1) > 1 else None,
        # vLLM picks the CPU backend; a config names one where it must be pinned (CPU_MLA
        # for a float32 MLA model on a CPU with AMX, where vLLM would pick AMX_MLA, bf16 only).
        attention_config={"backend": config["attention_backend"]}
        if config.get("attention_backend")
        else None,
    )


def sampling(
    max_tokens: int, transfer: dict[str, Any] | None = None, logprobs: int | None = 1
) -> Any:
    """Greedy; ``logprobs=None`` spares vLLM's logprob ranking where nothing reads it (a timed
    step should time the decode, not the ranking)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": transfer} if transfer is not None else None
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=logprobs,
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


PREFILL_IDLE_STEP_MS = 10
"""How often an idle prefill instance steps its engine (ms)."""


def serve_prefill(config: dict[str, Any]) -> None:
    import msgspec
    import zmq
    from vllm import TokensPrompt

    llm = make_llm(config)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
    sock.bind(config["endpoint"])
    print("READY", flush=True)
    while True:
        while not sock.poll(PREFILL_IDLE_STEP_MS):
            # Progresses NIXL (a decode's READ of held blocks needs it) and frees the blocks
            # whose READ notification came or whose lease ran out.
            llm.llm_engine.step()
        request = msgspec.msgpack.decode(sock.recv())
        if request["op"] == "quit":
            sock.send(msgspec.msgpack.encode({"ok": True}))
            return
        tokens = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        if request["op"] == "baseline":
            params = sampling(request["max_tokens"])
        else:  # no logprobs: nothing reads them
            params = sampling(1, REMOTE_DECODE, None)
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
    """The runs ``config["modes"]`` names, in order, in one decode instance."""
    llm = make_llm(config)
    server = _PrefillServer(config["prefill"])
    result: dict[str, Any] = {"startup_s": time.monotonic() - config["launched"]}
    if config.get("timed"):
        _warm_up(llm, server, config.get("max_num_seqs", 8))
    elif config.get("handshake_first"):
        _handshake(llm, server)
    for mode in config.get("modes", ["batch"]):
        if mode == "batch":
            result["decode"] = _batch(llm, server, config)
        elif mode == "sequential":
            result["sequential"] = _sequential(llm, server, config)
        elif mode == "load":
            result["load"] = _under_load(llm, server, config["load"])
        else:
            raise ValueError(f"mode: {mode!r} is not batch, sequential or load")
        if config.get("timed"):
            from kvd.bench.vllm_connectors import take_timings

            (result[mode + "_connector"],) = llm.collective_rpc(take_timings)
    Path(config["out"]).write_text(json.dumps(result))
    # As vLLM does at exit (main() ends with os._exit): the connector's shutdown writes its
    # last stats (kvd_stats_path), which its own thread otherwise rewrites only now and then.
    llm.llm_engine.engine_core.shutdown()


def _warm_up(llm: Any, server: _PrefillServer, most: int) -> None:
    """What a serving engine has long paid, before anything is timed; the timed connector's
    figures are dropped after.

    - Decode steps of every batch size from ``most`` down to 1: vLLM's CPU linear layers create
      a oneDNN matmul primitive for each new number of tokens in a step (1 to 1.5 ms for a
      step's five, ONEDNN_VERBOSE=profile_create), so a fresh engine's first step at each batch
      size is its longest. A timed run of 60 steps would rank stock and kvd by which batch
      sizes their schedules happened to reach first. Local prompts, no KV transfer.
    - One request read from the prefill instance: vLLM's NIXL handshake with a prefill engine
      runs in a thread of its own on the first request that reads from it, and held the polling
      of both connectors 2.4 to 4 ms (0.05 ms of it CPU) in the first timed steps.
    """
    from vllm import TokensPrompt

    # max_tokens 2..most+1: after the prefill step all ``most`` decode, then one fewer each step.
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts((8,) * most, seed=3)],
        [sampling(n, None, None) for n in range(2, most + 2)],
        use_tqdm=False,
    )
    (tokens,) = prompts((100,), seed=4)
    (params,) = server.transfer_params([tokens])
    llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)], [sampling(2, params, None)], use_tqdm=False
    )
    from kvd.bench.vllm_connectors import take_timings

    llm.collective_rpc(take_timings)


def _handshake(llm: Any, server: _PrefillServer) -> None:
    """One request read from the prefill instance, its tokens dropped: vLLM's NIXL handshake
    runs on the first request that reads from a prefill engine and waits 5 s (hard-coded) for
    its answer, which a busy 2-core machine missed while a TP 2 decode's workers were still
    attaching their caches to kvd; a failed handshake is tried again on the next request."""
    from vllm import TokensPrompt

    (tokens,) = prompts((40,), seed=5)
    (params,) = server.transfer_params([tokens])
    llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)], [sampling(1, params, None)], use_tqdm=False
    )


def _batch(llm: Any, server: _PrefillServer, config: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompts at once, plus the control request; with ``also_prefill`` (endpoints), the
    same requests again from each of those prefill servers, all in one batch (the results in
    that order, prompts and control per server)."""
    from vllm import TokensPrompt

    base = prompts(tuple(config.get("prompt_lengths", PROMPT_LENGTHS)))
    servers = [server, *(_PrefillServer(e) for e in config.get("also_prefill", []))]
    requests: list[list[int]] = []
    params = []
    for each in servers:
        transfers = each.transfer_params([*base, base[1]])
        requests += [*base, control_prompt(base[1])]
        params += [sampling(config["max_tokens"], dict(t)) for t in transfers]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False
    )
    return [summary(o) for o in outputs]


def _sequential(llm: Any, server: _PrefillServer, config: dict[str, Any]) -> dict[str, Any]:
    """The prompts one after the other, each timed from prefill to last token."""
    from vllm import TokensPrompt

    latencies = []
    outputs = []
    for tokens in prompts(tuple(config["prompt_lengths"])):
        started = time.perf_counter()
        (params,) = server.transfer_params([tokens])
        (output,) = llm.generate(
            [TokensPrompt(prompt_token_ids=tokens)],
            [sampling(config["max_tokens"], params, None)],
            use_tqdm=False,
        )
        latencies.append(time.perf_counter() - started)
        outputs.append(output)
    return {"decode": [summary(o) for o in outputs], "request_latency_s": latencies}


def _under_load(llm: Any, server: _PrefillServer, load: dict[str, Any]) -> dict[str, Any]:
    """Running requests decode while arrivals' KV lands, stepping the engine by hand.

    ``load``: ``running`` and ``arrivals`` (prompt token lists), ``running_tokens`` and
    ``arrival_tokens`` (tokens each decodes). Both sets are prefilled first (the prefill
    instance holds their KV); the running requests are added at once, and the arrivals one at
    a time while the running ones decode: arrival ``i`` when they have ``1 + i * step`` tokens,
    ``step`` spreading the arrivals over the first half of their decode, so every arrival's KV
    lands during it whatever the prefill instance's speed. Times are seconds from the start of
    the run: per request when it was added here and when each of its tokens came out of a step;
    per step its duration, the CPU time this process spent in it (all its threads) and whether
    it produced a token (ran a forward for some request).
    """
    from vllm import TokensPrompt

    engine = llm.llm_engine
    running_params = server.transfer_params(load["running"])
    arrival_params = server.transfer_params(load["arrivals"])
    started = time.perf_counter()
    requests: dict[str, dict[str, Any]] = {}
    by_engine_id: dict[str, dict[str, Any]] = {}

    def add(name: str, tokens: list[int], params: dict[str, Any], max_tokens: int) -> None:
        record = requests[name] = {"kind": name.partition("-")[0], "token_at": []}
        record["added_at"] = time.perf_counter() - started
        engine_id = engine.add_request(
            name, TokensPrompt(prompt_token_ids=tokens), sampling(max_tokens, params, None)
        )
        by_engine_id[name] = by_engine_id[engine_id] = record

    for i, (tokens, params) in enumerate(zip(load["running"], running_params, strict=True)):
        add(f"running-{i}", tokens, params, load["running_tokens"])
    running = list(requests.values())
    waiting = list(enumerate(zip(load["arrivals"], arrival_params, strict=True)))
    spacing = max(1, load["running_tokens"] // 2 // max(1, len(waiting)))
    step_s: list[float] = []
    step_cpu_s: list[float] = []
    step_produced: list[bool] = []
    while waiting or engine.has_unfinished_requests():
        decoded = min(len(r["token_at"]) for r in running)
        while waiting and decoded >= 1 + waiting[0][0] * spacing:
            i, (tokens, params) = waiting.pop(0)
            add(f"arrival-{i}", tokens, params, load["arrival_tokens"])
        step_started, cpu_started = time.perf_counter(), time.process_time()
        outputs = engine.step()
        stepped = time.perf_counter()
        step_s.append(stepped - step_started)
        step_cpu_s.append(time.process_time() - cpu_started)
        produced = False
        for output in outputs:
            record = by_engine_id[output.request_id]
            token_at = record["token_at"]
            while len(token_at) < len(output.outputs[0].token_ids):
                token_at.append(stepped - started)
                produced = True
            if output.finished:
                record["token_ids"] = list(output.outputs[0].token_ids)
        step_produced.append(produced)
    return {
        "requests": requests,
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "step_produced": step_produced,
    }


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
elif __name__ == "__mp_main__":
    quiet_tp_workers()
