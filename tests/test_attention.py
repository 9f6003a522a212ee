"""Streamed == the plain eager PEFT loop with the models' default SDPA attention and grouped-query heads.

Eager, transformers skips the attention mask when it can (no padding, one sequence per row) and SDPA
runs ``is_causal=True`` with ``enable_gqa``; under torch.compile it cannot read the mask's values and
builds it, so SDPA runs another kernel and the compiled step parts from the eager one by a few ulps
from seq ~40 on. ``poros_fx.attention`` keeps eager's choice (see its docstring). Two independent
runs each (fresh models, same seeds), compared with ``torch.equal``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

import poros_fx
from poros_fx import attention
from poros_fx.exactness.parity import SURFACES, compare, format_diffs, train
from poros_fx.models.tiny import attention_batches, tiny_lora_model

EQUAL = {s: 0.0 for s in SURFACES}


def batches(seq: int, mode: str, count: int = 4) -> list[dict[str, torch.Tensor]]:
    return attention_batches(count, seq=seq, mode=mode)


def run(data: list[dict], *, compiled: bool, dtype: torch.dtype = torch.float32, nf4: bool = False,
        family: str = "llama", plain_sdpa: bool = False) -> Any:
    torch._dynamo.reset()
    model = tiny_lora_model(family, layers=2, dropout=0.1, seed=0, dtype=dtype, nf4=nf4)
    step_model = model
    if compiled:
        poros_fx.prepare(model, device="cpu")
        if plain_sdpa:  # what a prepared model did before poros_fx.attention
            model.config._attn_implementation = "sdpa"
        step_model = torch.compile(model, backend="poros")
    return train(model, step_model, data, accumulate=2)


@pytest.mark.parametrize("seq,mode,dtype,nf4", [
    (64, "none", torch.float32, False),
    (64, "ones", torch.float32, False),
    (64, "pad", torch.float32, False),
    (64, "packed", torch.float32, False),
    (64, "ones", torch.bfloat16, True),
    (512, "ones", torch.float32, False),
    (512, "pad", torch.bfloat16, True),
    (2048, "none", torch.float32, False),
], ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, bool) else ("nf4" if v else "-"))
def test_streamed_equals_eager_with_sdpa_and_gqa(seq, mode, dtype, nf4):
    data = batches(seq, mode, count=2 if seq >= 512 else 4)
    diffs = compare(run(data, compiled=True, dtype=dtype, nf4=nf4), run(data, compiled=False, dtype=dtype, nf4=nf4))
    assert diffs == EQUAL, format_diffs(f"streamed vs eager, seq {seq} {mode}", diffs)


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_other_families(family):
    """Qwen2 (one of the families whose config names mask kinds per layer) and Phi-3 (q, k, v sliced
    out of one fused projection, so their gradients come back in another layout)."""
    data = batches(64, "ones")
    diffs = compare(run(data, compiled=True, family=family), run(data, compiled=False, family=family))
    assert diffs == EQUAL, format_diffs(f"streamed vs eager, {family}", diffs)


@pytest.mark.parametrize("family,config", [
    ("qwen2", dict(hidden=42, heads=3, kv_heads=1)),
    # Gemma 4's full layers with keys equal to values and one KV head (the 31B's full-layer layout, small)
    ("gemma4_text", dict(hidden=64, heads=4, kv_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1)),
], ids=["qwen2-one-kv-head", "gemma4-k-eq-v-one-global-kv-head"])
def test_one_key_value_head(family, config):
    """A dimension of one (one KV head) has no stride of its own: both attention branches must still hand
    their key/value gradients over in one layout, or the region cannot be traced (torch.cond's check)."""
    data = attention_batches(2, seq=13, mode="ones", vocab=97)
    runs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        model = tiny_lora_model(family, layers=2, dropout=0.1, seed=0, vocab=97, **config)
        step_model = model
        if compiled:
            poros_fx.prepare(model, device="cpu")
            step_model = torch.compile(model, backend="poros")
        runs.append(train(model, step_model, data))
    diffs = compare(*runs)
    assert diffs == EQUAL, format_diffs(f"streamed vs eager, {family} with one KV head", diffs)


def test_plain_sdpa_under_compile_is_not_equal():
    """The test above can fail: with transformers' own ``sdpa`` under torch.compile (the mask built, a
    masked kernel) the same recipe parts from the eager loop."""
    data = batches(64, "ones")
    diffs = compare(run(data, compiled=True, plain_sdpa=True), run(data, compiled=False))
    assert diffs["weights"] > 0.0, format_diffs("plain sdpa under compile vs eager", diffs)


def test_prepare_switches_sdpa_and_unprepare_restores_it():
    model = tiny_lora_model("llama", layers=1, dropout=0.0)
    eager_attn = tiny_lora_model("llama", layers=1, dropout=0.0, attn="eager")
    poros_fx.prepare(model, device="cpu")
    poros_fx.prepare(eager_attn, device="cpu")
    assert model.config._attn_implementation == attention.NAME
    assert eager_attn.config._attn_implementation == "eager"  # eager attention already matches: untouched
    ids = torch.randint(0, 256, (1, 48))
    with torch.no_grad():  # eager use of a prepared model: transformers' own mask and kernel
        prepared = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    poros_fx.unprepare(model)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(prepared, model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits)


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int, seq: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.rows = []
        for i in range(count):
            ids = torch.randint(0, 256, (seq,), generator=g)
            mask = torch.ones_like(ids)
            if i % 3 == 2:  # some rows padded, as a collator would leave them
                mask[-7:] = 0
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def test_poros_trainer_equals_trainer_with_sdpa(tmp_path):
    """PorosTrainer == transformers.Trainer at seq 64 with attention masks (some rows padded), Llama
    GQA with the default SDPA: the per-step log and the adapter."""
    from poros_fx.hf import PorosTrainer

    def fit(cls: type[transformers.Trainer]) -> tuple[list, dict]:
        torch._dynamo.reset()
        model = tiny_lora_model("llama", layers=2, dropout=0.1)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / cls.__name__), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, seed=1, report_to=[],
            use_cpu=True, disable_tqdm=True, save_strategy="no")
        trainer = cls(model=model, args=args, train_dataset=Rows(12, 64))
        trainer.train()
        log = [{k: h[k] for k in ("loss", "grad_norm")} for h in trainer.state.log_history if "loss" in h]
        return log, {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    poros_log, poros_weights = fit(PorosTrainer)
    plain_log, plain_weights = fit(transformers.Trainer)
    assert poros_log == plain_log
    assert poros_weights.keys() == plain_weights.keys()
    assert all(torch.equal(poros_weights[n], plain_weights[n]) for n in plain_weights)


def test_packed_sequences_are_read_off_one_diagonal_and_give_the_mask_transformers_builds():
    """Under compile a step without padding gets each token's sequence number ([batch, length]) instead of
    the [batch, 1, length, length] mask; the masked branch builds the mask from them, equal to the one
    transformers composes from the position ids."""
    from transformers.masking_utils import (and_masks, causal_mask_function, find_packed_sequence_indices,
                                            or_masks, packed_sequence_mask_function,
                                            remap_positions_for_packed_sequence, sdpa_mask)

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 1, 2, 0, 1, 2, 3, 4]])
    for rows in ([0, 1, 2], [1], [1, 1]):
        pos = positions[rows]
        packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        assert torch.equal(packed, find_packed_sequence_indices(positions)[rows])
        composed = and_masks(remap_positions_for_packed_sequence(causal_mask_function, pos),
                             packed_sequence_mask_function(packed))
        expected = sdpa_mask(batch_size=len(rows), q_length=9, kv_length=9, mask_function=composed,
                             allow_is_causal_skip=False)
        segments, one_sequence = attention._sequence_indices(composed, len(rows), 9, "cpu")
        assert torch.equal(attention._mask_of_sequences(segments), expected)
        assert bool(one_sequence) == (rows in ([1], [1, 1]))
    with pytest.raises(RuntimeError, match="bidirectional"):
        attention._sequence_indices(or_masks(composed, lambda b, h, q, kv: kv == q + 1), 1, 9, "cpu")


def test_a_call_without_position_ids_or_mask_traces_no_cond():
    """A step that passes neither position ids nor a padding mask has one sequence per row, as eager
    sees it: its region calls the ``is_causal`` kernel with no ``torch.cond``; packed position ids
    (sequences eager can only tell from their values) keep the cond."""
    from poros_fx.handles import get_store

    def conds(mode: str) -> int:
        torch._dynamo.reset()
        model = tiny_lora_model("llama", layers=1, dropout=0.0, seed=0)
        poros_fx.prepare(model, device="cpu")
        torch.compile(model, backend="poros")(**attention_batches(1, seq=16, mode=mode)[0]).loss.backward()
        (region,) = get_store(model).regions.regions
        return sum(n.target is torch.ops.higher_order.cond for n in region.forward.graph.nodes)

    assert conds("none") == 0
    assert conds("packed") == 1
