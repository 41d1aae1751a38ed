"""Tiny Hugging Face models built from configs (random weights, nothing downloaded), and a
training loop that runs one of them on a device in a given execution mode.

Each family exercises what real scripts hit: tied embeddings and a 50257 vocabulary
(GPT-2), GQA, RoPE, RMSNorm and a right-padded batch with -100 labels (Llama), sliding
windows shorter than the sequence (Mistral), padding masks and token types (BERT),
encoder-decoder with relative position buckets and gated GELU (T5), patches (ViT),
BatchNorm (ResNet) and top-k routing with an auxiliary loss (Qwen3-MoE).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

STEPS = 20
LR = 1e-3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(vocab: int, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=_gen(seed))


def _right_padded(vocab: int, batch: int = 2, seq: int = 12, pad: int = 4) -> dict:
    ids = _ids(vocab, batch, seq)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - pad:] = 0
    ids[1, seq - pad:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids(50257, 2, 16)
    return GPT2LMHeadModel, cfg, {"input_ids": ids, "labels": ids}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM, cfg, _right_padded(128)


def llama_unaligned():
    """Issue #28's drift case: hidden, intermediate and vocabulary sizes off every tile, grouped-query
    attention over one key/value head, a pad token and a padded batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1003, hidden_size=60, intermediate_size=161, num_hidden_layers=2,
                      num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM, cfg, _right_padded(1003)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        sliding_window=4)
    ids = _ids(128, 2, 12)
    return MistralForCausalLM, cfg, {"input_ids": ids, "labels": ids}


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = _right_padded(128)
    token_types = torch.zeros_like(batch["input_ids"])
    token_types[:, 6:] = 1
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "token_type_ids": token_types, "labels": torch.tensor([0, 2])}
    return BertForSequenceClassification, cfg, inputs


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    batch = _right_padded(128)
    labels = _ids(128, 2, 8, seed=2)
    labels[1, 6:] = -100
    return T5ForConditionalGeneration, cfg, {"input_ids": batch["input_ids"],
                                             "attention_mask": batch["attention_mask"], "labels": labels}


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=10,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pixels = torch.randn(4, 3, 16, 16, generator=_gen(3))
    return ViTForImageClassification, cfg, {"pixel_values": pixels, "labels": torch.tensor([1, 5, 7, 2])}


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=10)
    pixels = torch.randn(4, 3, 32, 32, generator=_gen(3))
    return ResNetForImageClassification, cfg, {"pixel_values": pixels, "labels": torch.tensor([1, 5, 7, 2])}


def qwen3_moe(experts: str = "grouped_mm"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(experts_implementation=experts, vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64, decoder_sparse_step=1,
                         output_router_logits=True, router_aux_loss_coef=0.01)
    return Qwen3MoeForCausalLM, cfg, _right_padded(128)


def qwen3_moe_loop():
    """The experts as transformers' "eager" loop: tokens picked per expert with `torch.where(mask)`,
    a data-dependent shape."""
    return qwen3_moe("eager")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable
    attention: bool = True  # has attention: trained with both "sdpa" and "eager"
    attentions: tuple[str, ...] = ("sdpa", "eager")
    batchnorm: bool = False  # running statistics: compared at 1e-4, not 1e-5


FAMILIES = {f.name: f for f in [
    Family("gpt2", gpt2), Family("llama", llama), Family("llama_unaligned", llama_unaligned), Family("mistral", mistral),
    Family("bert", bert),
    Family("t5", t5), Family("vit", vit), Family("resnet", resnet, attention=False, batchnorm=True),
    Family("qwen3_moe", qwen3_moe),
    # The expert loop is about routing, not attention (qwen3_moe covers both attentions).
    Family("qwen3_moe_loop", qwen3_moe_loop, attentions=("eager",)),
]}

MODES = ("eager", "fused", "compiled")
# Compiled steps with no change to the script (TPU_AGENT_COMPILE_STEPS=1): the model's forward and backward,
# and the optimizer's update, as programs.
STEPS_MODE = "steps"


def build(family: str, attn: str | None, device: str):
    """The model (seeded), its optimizer and its batch on `device`."""
    cls, cfg, inputs = FAMILIES[family].build()
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(cfg)
    if attn is not None:
        assert model.config._attn_implementation == attn, model.config._attn_implementation
    model.train()
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, optimizer, {k: v.to(device) for k, v in inputs.items()}


def execution_mode(mode: str, device: str):
    if device != "tpu" or mode != "fused":
        return contextlib.nullcontext()
    return torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)


@contextlib.contextmanager
def _compiled_steps(mode: str, device: str):
    """Compiled steps on for the loop; yields, once it ends, what each program did."""
    programs: dict = {}
    if device != "tpu" or mode != STEPS_MODE:
        yield programs
        return
    from tpu_agent.backend.compiled import auto_compile

    found = len(auto_compile.STATE.modules), len(auto_compile.STATE.optimizers)
    auto_compile.compile_steps(True)
    try:
        yield programs
    finally:
        auto_compile.compile_steps(False)
        modules = auto_compile.STATE.modules[found[0]:]
        optimizers = auto_compile.STATE.optimizers[found[1]:]
        programs["module_replays"] = [m.replays for m in modules]
        programs["module_reasons"] = [m.reason_not_compiled for m in modules]
        programs["optimizer_replays"] = [o.replays for o in optimizers]
        programs["optimizer_reasons"] = [o.reason_not_replayed for o in optimizers]


def train(family: str, attn: str | None, device: str, mode: str = "eager", steps: int = STEPS,
          times: list | None = None, compiled: dict | None = None) -> list[float]:
    """Per-step losses of `steps` AdamW steps (each step's wall time appended to `times`; in
    compiled mode, `compiled` gets how many calls replayed the step's one program)."""
    model, optimizer, inputs = build(family, attn, device)

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    if mode == "compiled":
        step = torch.compile(step)
    losses = []
    with execution_mode(mode, device), _compiled_steps(mode, device) as programs:
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step(inputs).item())
            if times is not None:
                times.append(time.perf_counter() - t0)
    if compiled is not None and mode == STEPS_MODE:
        compiled.update(programs)
    if compiled is not None and mode == "compiled":
        target = getattr(step, "_target", step)  # torch.compile(fn) picks its backend on the first call
        compiled["replays"] = getattr(target, "replays", 0)
        compiled["reason_not_replayed"] = getattr(target, "reason_not_replayed", None)
    return losses
