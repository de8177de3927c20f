"""The decoder-only Llama the trainer ranks build and train.

torchtitan's approach (one small model file that the parallelisms are written
against) with Hugging Face's module and parameter names and its numerics, op for op
(RMSNorm in fp32, ``rotate_half`` RoPE, SDPA causal with GQA): a checkpoint, an
export and HF's loaders see the same state dict, and ``stages.hf.view`` wraps the
same tensors as a ``transformers`` model where lm-eval needs one. A rank never
imports ``transformers`` for it (seconds of start-up per process).

Only dense Llama with default RoPE, no biases: what the presets and the exports of
this backend are. A Hugging Face folder with anything else is refused with a code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stages.errors import ErrorCode, ItoError
from stages.presets import ModelPreset

# Hugging Face's LlamaConfig defaults, so a preset model equals HF's model of it.
RMS_NORM_EPS = 1e-6
INIT_STD = 0.02


@dataclass
class LlamaArgs:
    """The shape a model is built with (``rope_theta`` changes at a phase boundary)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    rms_norm_eps: float = RMS_NORM_EPS
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    pad_token_id: int | None = None  # HF's embedding padding_idx: no gradient, zero init

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, preset: ModelPreset) -> LlamaArgs:
        if preset.num_experts:
            raise ValueError(f"preset {preset.name} is MoE; only dense Llama is buildable here")
        shape = {f.name for f in fields(cls)} & set(type(preset).model_fields)
        return cls(**preset.model_dump(include=shape))

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaArgs:
        """The args of an HF ``config.json``; what this model cannot be is refused."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        unsupported = [
            what
            for what, bad in (
                (f"model_type {config.get('model_type')!r}", config.get("model_type") != "llama"),
                (f"rope_type {kind!r}", kind != "default"),
                ("attention_bias", bool(config.get("attention_bias"))),
                ("mlp_bias", bool(config.get("mlp_bias"))),
                (f"hidden_act {config.get('hidden_act')!r}", config.get("hidden_act") != "silu"),
            )
            if bad
        ]
        if unsupported:
            raise ItoError(
                ErrorCode.post_training_model_invalid,
                f"the model folder is not a dense default-RoPE Llama: {', '.join(unsupported)}",
            )
        heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            max_position_embeddings=int(config["max_position_embeddings"]),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rms_norm_eps=float(config.get("rms_norm_eps", RMS_NORM_EPS)),
            head_dim=int(config.get("head_dim") or 0),
            pad_token_id=config.get("pad_token_id"),
        )

    def hf_dict(self) -> dict[str, Any]:
        """The ``LlamaConfig`` keyword arguments of this shape."""
        d = asdict(self)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        return d


class LMOutput(NamedTuple):
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin of the positions (fp32 angles, cast to the activations' dtype)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = nn.Buffer(self._inv_freq(theta), persistent=False)

    def _inv_freq(self, theta: float) -> torch.Tensor:
        d = self.head_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))

    def set_theta(self, theta: float) -> None:
        """In place: every pipeline chunk that holds this module sees the new base."""
        self.inv_freq.copy_(self._inv_freq(theta))

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, heads, s, d = x.shape
    return x[:, :, None].expand(b, heads, n_rep, s, d).reshape(b, heads * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.head_dim = d
        self.scaling = d**-0.5
        self.q_proj = nn.Linear(h, args.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, args.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, args.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(args.num_attention_heads * d, h, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        shape = (*lead, -1, self.head_dim)  # -1: the heads this rank holds under TP
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        n_rep = q.shape[1] // k.shape[1]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, scale=self.scaling, is_causal=q.shape[2] > 1, enable_gqa=n_rep > 1
            )
        else:  # HF repeats the kv heads once there is a mask
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, scale=self.scaling
            )
        projected: torch.Tensor = self.o_proj(
            out.transpose(1, 2).contiguous().reshape(*lead, -1).contiguous()
        )
        return projected


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks. ``gradient_checkpointing`` and
    ``_gradient_checkpointing_func`` are HF's names for per-layer recompute
    (``apply_activation_checkpointing`` in ``stages.trainer.parallel.activation_checkpointing``
    sets them)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,  # HF's signature
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        assert position_embeddings is not None
        h: torch.Tensor = hidden_states + self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


def _padding_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """The causal-and-not-padding boolean mask of a (batch, seq) 0/1 mask; None when
    nothing is padded (SDPA then runs causal, as HF's sdpa path skips the mask)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


class LlamaBody(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope_theta)


class Llama(nn.Module):
    """``model.{embed_tokens,layers.<i>,norm}`` and ``lm_head``: HF's names. Forward
    returns ``LMOutput`` (``.logits``, as HF's output has)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.config = args
        self.model = LlamaBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """HF's initialisation: N(0, 0.02) linears and embedding, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
        pad = self.config.pad_token_id
        if pad is not None:
            with torch.no_grad():
                self.model.embed_tokens.weight[pad].zero_()
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> LMOutput:
        body = self.model
        h = body.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = body.rotary_emb(h, position_ids=position_ids)
        mask = _padding_mask(attention_mask, h.shape[1])
        for layer in body.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=pe)
        return LMOutput(self.lm_head(body.norm(h)))


def load_hf_folder(path: str | Path) -> Llama:
    """The model of a local HF folder (``config.json`` and safetensors or
    ``pytorch_model*.bin`` weights, sharded or not), in fp32 master weights whatever
    dtype it was saved in."""
    folder = Path(path)
    args = LlamaArgs.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Llama(args)
    state = _read_weights(folder)
    expected = set(model.state_dict())
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ItoError(
            ErrorCode.post_training_model_invalid,
            f"the weights of {folder.name} do not fit its config: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}",
        )
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(args.head_dim, args.rope_theta)
    return model


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        from safetensors.torch import load_file

        return {k: v for f in safetensors for k, v in load_file(str(f)).items()}
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ItoError(ErrorCode.post_training_model_invalid, f"{folder.name} holds no weights")
    return {k: v for f in bins for k, v in torch.load(f, weights_only=True).items()}
